"""A bounded, order-preserving parallel map: at most ``window`` items are in flight, so
memory stays proportional to the window, not to the input."""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def ordered_map(fn: Callable, items: Iterable, workers: int | None = None, window: int | None = None) -> Iterator:
    workers = workers or default_workers()
    if workers <= 1:
        for it in items:
            yield fn(it)
        return
    window = window or 2 * workers
    with ThreadPoolExecutor(workers, thread_name_prefix="nemo-dcr") as pool:
        pending = deque()
        try:
            for it in items:
                pending.append(pool.submit(fn, it))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()
