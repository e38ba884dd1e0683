#!/bin/sh
# preStop hook of the worker pods: start the drain at once and hold the pod's termination until
# the worker has finished it.
#
# The worker is tini's child (tini is PID 1 and forwards signals). On SIGTERM the worker stops
# taking requests (its gRPC health turns NOT_SERVING and its next heartbeat tells the router it
# is draining), finishes what it holds (up to --drain-timeout), deregisters from the router and
# exits 0; the container stops and this hook ends with it. terminationGracePeriodSeconds bounds
# the whole wait, so it must exceed twice --drain-timeout (requests, then KV transfers).
kill -TERM 1
while kill -0 1 2>/dev/null; do
  sleep 1
done
