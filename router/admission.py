"""Admission at the router: a bounded queue in front of the workers, a fast 429 past it.

A decode (or mixed) worker runs at most `max_running` requests at once (it reports the figure in
its load); the requests it has beyond that wait in its queue (decode: the prealloc queue, with
their rooms kept alive at prefill). The router's view of one worker's queue is what it has on
the worker, or what the worker last reported when that is more (other routers' requests), past
that ceiling; every request passes one decode or mixed worker, so their queues added up are the
cluster's queue. While that sum is at `max_queued_requests` (default: QUEUE_PER_SLOT per
running slot of the workers in rotation), a new request is refused at once with 429 and a
Retry-After: the seconds the queue ahead needs at the rate requests have been finishing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from pdserve.router.errors import Overloaded
from pdserve.router.registry import Registry

QUEUE_PER_SLOT = 4  # default bound: queued requests per running slot of the decode side
RATE_WINDOW_S = 10.0  # completions counted over this window for Retry-After
RETRY_AFTER_MAX_S = 60
RETRY_AFTER_UNKNOWN_S = 5  # nothing finished in the window yet (a burst on an idle cluster)


class QueueGate:
    def __init__(self, limit: int | None, registry: Registry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.configured_limit = limit
        self.registry = registry
        self._clock = clock
        self._finished: deque[float] = deque()

    def limit(self) -> int | None:
        """The bound on queued requests; None (no bound) while no worker says its capacity."""
        if self.configured_limit is not None:
            return self.configured_limit
        slots = self.registry.running_slots()
        return QUEUE_PER_SLOT * slots if slots else None

    def admit(self) -> None:
        """Raise Overloaded when the queue is full; otherwise the request may go on."""
        limit = self.limit()
        if limit is None:
            return
        queued = self.registry.queued_requests()
        if queued >= limit:
            raise Overloaded(
                f"server overloaded: {queued} requests queued (bound {limit}, "
                f"--max-queued-requests); retry later", retry_after_s=self.retry_after_s(queued))

    def finished(self) -> None:
        """An admitted request ended (any outcome): it counts toward the completion rate."""
        now = self._clock()
        self._finished.append(now)
        self._expire(now)

    def retry_after_s(self, queued: int) -> int:
        now = self._clock()
        self._expire(now)
        if not self._finished:
            return RETRY_AFTER_UNKNOWN_S
        rate = len(self._finished) / RATE_WINDOW_S
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(queued / rate)))

    def _expire(self, now: float) -> None:
        while self._finished and now - self._finished[0] > RATE_WINDOW_S:
            self._finished.popleft()
