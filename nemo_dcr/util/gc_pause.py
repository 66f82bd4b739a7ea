"""Python's cyclic garbage collector held off while a sync, a publish, a diff or an apply runs.

A full (generation 2) collection walks every object the interpreter tracks: with torch imported
that is ~170K objects before the model's own, ~50-120 ms on the machines measured, holding the
GIL (every worker stops). Such a collection comes once the objects that survived since the last
one reach a quarter of the rest, and a delta of thousands of tensors makes that many (its
header's entries, their chunks' tables, the plans): syncing 4096 tensors of 32K BF16 met one to
three of them, 15-20 % of its time, and none of it found garbage to free (docs/results.md,
twenty-second turn). What these calls make is freed by reference counting as they go; the
collector is not needed for it.

``paused()`` disables the collector while any such call runs in the process, and enables it
again when the last one returns, only if it was enabled when the first began. Meanwhile cycles
of garbage (the caller's other threads' too) wait, and are collected after, as usual.
``NEMO_DCR_PAUSE_GC=0`` leaves the collector alone.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

_lock = threading.Lock()
_depth = 0  # calls inside ``paused`` now, in every thread
_was_enabled = False  # the collector's state when the first of them began

F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    global _depth, _was_enabled
    if os.environ.get("NEMO_DCR_PAUSE_GC", "1") == "0":
        yield
        return
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def pausing(fn: F) -> F:
    """``fn`` run inside ``paused()``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with paused():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
