"""Host pauses that stall a serving process's hot thread, and what keeps them short.

- The GIL. A worker runs its scheduler thread (which must launch each GPU step as the last one
  ends) beside the event loop that streams tokens over gRPC. A thread that wants the GIL waits
  up to `sys.getswitchinterval()` (5 ms by default) for a thread running Python to let it go,
  which is most of a decode step. `--switch-interval-ms` (default SWITCH_INTERVAL_MS) bounds that
  wait.
- The cyclic garbage collector. A full collection walks every tracked object: the model's
  modules, the tokenizer and whatever start-up left, tens of milliseconds in one pause.
  `settle_heap()` after start-up moves all of that into the permanent generation
  (`gc.freeze()`), so later collections walk only what serving allocated since.
"""

from __future__ import annotations

import gc
import sys

SWITCH_INTERVAL_MS = 0.5


def set_switch_interval(ms: float) -> None:
    if not ms > 0:
        raise ValueError(f"switch_interval_ms: must be > 0, got {ms}")
    sys.setswitchinterval(ms / 1000.0)


def settle_heap() -> None:
    """Collect once, then freeze what survives: start-up's objects are never walked again."""
    gc.collect()
    gc.freeze()
