"""The worker process that every role shares: its gRPC server, router registration, the
scheduler thread, request validation and the typed events between scheduler and servicer.
prefill/ and decode/ plug their schedulers and servicers into it."""
