"""The garbage collector's view of a serving process: what start-up made is frozen out of it.

A serving step allocates many short-lived objects (outputs, chunks, lists of ids), so CPython's
cyclic collector runs often, and each of its full passes walks every tracked object in the
process: the millions torch, transformers and the model's modules made at start-up, none of which
will ever be garbage. Freezing the heap once start-up is over (`gc.freeze`, after a collection)
moves those objects to a permanent generation the collector skips, so its passes only see what
serving made (as vLLM's engine and API server do). Objects made later are collected as usual.

Frozen objects that become cyclic garbage are not collected until the heap is thawed, so the front
ends thaw it when they shut down: a benchmark or a test that runs engines one after another in one
process then gets each engine's memory back at its next collection.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left as garbage, then keep every surviving object out of later collections."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Put the frozen objects back under the collector (an engine is gone: what it held may be garbage now)."""
    gc.unfreeze()
