"""How a serving process sets up the interpreter: the start-up heap out of the garbage collector, and
a short GIL switch interval.

The heap. A serving step allocates many short-lived objects (outputs, chunks, lists of ids), so
CPython's cyclic collector runs often, and each of its full passes walks every tracked object in
the process: the millions torch, transformers and the model's modules made at start-up, none of
which will ever be garbage. Freezing the heap once start-up is over (`gc.freeze`, after a
collection) moves those objects to a permanent generation the collector skips, so its passes only
see what serving made (as vLLM's engine and API server do). Frozen objects that become cyclic
garbage are not collected until the heap is thawed, so the front ends thaw it when they shut down:
a benchmark or a test that runs engines one after another in one process then gets each engine's
memory back at its next collection.

The switch interval. A serving process runs several Python threads that hand work to each other
every step: the event loop and the thread that receives the engine's outputs, the engine thread and
the workers that fill structured-output masks. A thread that wants the GIL while another runs Python
waits for the holder to block, or for the switch interval (5 ms by default), so each hand-over can
cost up to 5 ms, longer than a decode step. SERVING_SWITCH_INTERVAL_S bounds that wait; the
interval in effect before is put back at shutdown.
"""

from __future__ import annotations

import gc
import sys

SERVING_SWITCH_INTERVAL_S = 0.0002

_previous_switch_interval: float | None = None


def tune_for_serving() -> None:
    """Collect what start-up left as garbage and freeze the rest; shorten the GIL switch interval."""
    global _previous_switch_interval
    gc.collect()
    gc.freeze()
    if _previous_switch_interval is None:
        _previous_switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(SERVING_SWITCH_INTERVAL_S)


def restore_after_serving() -> None:
    """Put the frozen objects back under the collector (an engine is gone: what it held may be garbage
    now) and the switch interval back to what it was."""
    global _previous_switch_interval
    gc.unfreeze()
    if _previous_switch_interval is not None:
        sys.setswitchinterval(_previous_switch_interval)
        _previous_switch_interval = None
