"""A bounded, order-preserving parallel map: at most ``window`` items are in flight, so
memory stays proportional to the window, not to the input.

The thread pools are shared, one per worker count, and live for the process: ``diff`` and
``apply`` call this once per tensor, and a pool per call cost more than the work on models of
many small tensors. A call made from inside a pool thread runs inline (no nested waits).

``standing`` is the other kind of thread a sync needs: tasks that wait (a download, a part
applied as its bytes arrive), on threads kept for the process and reused."""
from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_PREFIX = "nemo-dcr"
_pools: dict[int, ThreadPoolExecutor] = {}
_pid = os.getpid()  # a forked child has the pool objects but not their threads: it makes its own
_lock = threading.Lock()
_standing: ThreadPoolExecutor | None = None
#: the most threads ``standing`` keeps. Its tasks wait on each other (a sync's part loops on its
#: downloads), so each needs a thread of its own: a sync takes up to ``2 * prefetch`` (8 by
#: default), and this leaves room for hundreds of syncs and publishes at once in one process
#: (threads are started only as tasks need them; before, each sync started its own, unbounded)
STANDING_MAX = 4096


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def stream_workers() -> int:
    """Workers for a stream of short jobs that give the GIL up between their steps (an apply's
    chunks: a C decode of ~1 ms, and around it the calls that still give it up): one more than
    ``default_workers`` where that is every core. Taking the GIL back waits for whichever thread
    holds it and for a core: on 2 cores a 45M BF16 delta's chunks, 23 ms of CPU, spent ~39 ms on
    two workers, and a third runs while one waits (that local sync, interleaved: median 18.8 ms
    against 23.4 with two; docs/results.md, eighteenth turn). Past 8 cores the pools leave cores
    free already."""
    cores = os.cpu_count() or 1
    return default_workers() + 1 if cores <= 8 else default_workers()


def _forked() -> None:
    """Under ``_lock``: in a forked child, forget the parent's pools (their threads are not here)."""
    global _pid, _standing
    if os.getpid() != _pid:
        _pools.clear()
        _standing = None
        _pid = os.getpid()


def _pool(workers: int) -> ThreadPoolExecutor:
    with _lock:
        _forked()
        p = _pools.get(workers)
        if p is None:
            p = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix=_PREFIX)
        return p


def _inline(workers: int) -> bool:
    """Run on the calling thread: one worker, or a pool thread already (a pool thread waiting on
    a job queued behind it could wait forever)."""
    return workers <= 1 or threading.current_thread().name.startswith(_PREFIX)


def in_jobs(items: Iterable, size: Callable[[Any], int], most: int) -> Iterator[list]:
    """Consecutive ``items`` in lists whose ``size`` adds up to at most ``most`` (an item larger
    than that a list of its own): jobs of many small items, where a job per item cost the pool's
    hand-off (and a GIL hand-off) per item."""
    job: list = []
    total = 0
    for it in items:
        n = size(it)
        if job and total + n > most:
            yield job
            job, total = [], 0
        job.append(it)
        total += n
    if job:
        yield job


def ordered_map(fn: Callable, items: Iterable, workers: int | None = None, window: int | None = None,
                light: Callable[[Any], bool] | None = None) -> Iterator:
    """``fn(item)`` for each of ``items``, results in order, on ``workers`` threads with at most
    ``window`` items in flight. ``light(item)`` true: where nothing before the item is still out,
    it is run on the calling thread, at once; behind a job still running it goes to a worker as
    any other (so nothing waits on the calling thread while ``items`` blocks for the next item:
    a segment of an object still arriving). For jobs that are mostly Python (a chunk of a few
    thousand elements: its C calls are microseconds, the calls around them a hundred or more):
    two threads only pass the GIL back and forth over them, each hand-off moving the
    interpreter's state to the other core, and a stream of such jobs on two workers took 1.5x its
    time on one (a delta of 4096 tensors of 32K BF16; docs/results.md, twenty-second turn)."""
    workers = workers or default_workers()
    if _inline(workers):
        for it in items:
            yield fn(it)
        return
    window = window or 2 * workers
    pool = _pool(workers)
    pending: deque[Future] = deque()
    try:
        for it in items:
            if light is not None and not pending and light(it):
                yield fn(it)  # its turn: nothing before it is out
                continue
            pending.append(pool.submit(fn, it))
            if len(pending) >= window:
                yield pending.popleft().result()
            while pending and pending[0].done():  # handed out as they finish: the stream is often empty
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        for f in pending:  # nothing of this call may still run when it returns
            if not f.cancelled():
                try:
                    f.result()
                except BaseException:
                    pass


def background(fn: Callable, workers: int | None = None) -> Future:
    """``fn()`` on the shared pool beside an ``ordered_map`` of the same ``workers``, outside its
    ordered window: a long job first in an ordered stream holds back every result behind it,
    and with them the window, so the other workers idled until it was done. Run inline (a
    completed future) where ``ordered_map`` runs inline (``_inline``)."""
    workers = workers or default_workers()
    if _inline(workers):
        f: Future = Future()
        try:
            f.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            f.set_exception(e)
        return f
    return _pool(workers).submit(fn)


def standing(fn: Callable, *args) -> Future:
    """``fn(*args)`` on a thread of the process's standing pool: an idle one if there is one, a
    new one if not (up to ``STANDING_MAX``). For tasks that wait on I/O or on each other (a
    sync's downloads, and the parts it applies while they arrive), which ``ordered_map``'s
    pools, sized to the cores, would serialise. A sync started its own threads for them, and
    on a busy 2-core machine each start waited ~1 ms for the new thread to run: ~7 ms before a
    local delta sync's first chunk (issue 25). Its threads are not named like the pools', so an
    ``ordered_map`` called from one uses the pools."""
    global _standing
    with _lock:
        _forked()
        if _standing is None:
            _standing = ThreadPoolExecutor(STANDING_MAX, thread_name_prefix="dcr-standing")
        pool = _standing
    return pool.submit(fn, *args)


def ordered_ahead(fn: Callable, items: Iterable, cost: Callable, budget: int, most: int) -> Generator:
    """``fn(item)`` for each of ``items``, handed out in order, each run on a ``standing`` thread
    (so that its own ``ordered_map`` calls use the pools) while the ones before it are still
    out: up to ``most`` jobs at once, whose ``cost(item)`` (the memory a job holds, say) adds up
    to at most ``budget`` together with the result the caller holds. Where nothing is out or
    held, one job starts at any cost. For a stream of jobs each too small to keep the pools busy
    on its own: a checkpoint's one-chunk tensors, each checked and applied while the ones before
    it are written."""
    it = iter(items)
    pending: deque = deque()
    held = 0  # the costs of the jobs out and of the result the caller holds
    waiting: tuple | None = None  # (item, cost): taken from ``items``, not started (over budget)

    def fill() -> None:
        nonlocal held, waiting
        while len(pending) < most:
            if waiting is None:
                item = next(it, _END)
                if item is _END:
                    return
                waiting = (item, cost(item))
            if held and held + waiting[1] > budget:
                return
            pending.append((standing(fn, waiting[0]), waiting[1]))
            held += waiting[1]
            waiting = None

    try:
        while True:
            fill()
            if not pending:
                return
            f, c = pending[0]
            r = f.result()
            pending.popleft()
            fill()  # the next jobs start while the caller uses this result (it counts until then)
            yield r
            held -= c
    finally:
        for f, _ in pending:
            f.cancel()
        for f, _ in pending:  # nothing of this call may still run when it returns
            if not f.cancelled():
                try:
                    f.result()
                except BaseException:
                    pass


_END = object()
