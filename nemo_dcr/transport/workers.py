"""Blocking store calls from the event loop, on daemon threads: a relay that is told to stop
does not wait for a long poll or a download from a dead upstream to time out."""
from __future__ import annotations

import asyncio
import queue
import threading

__all__ = ["Workers"]


class Workers:
    def __init__(self, n: int, name: str):
        self._q: queue.Queue = queue.Queue()
        for i in range(max(1, n)):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def _work(self) -> None:
        while True:
            loop, fut, fn, args = self._q.get()
            try:
                out, err = fn(*args), None
            except BaseException as e:  # handed to the awaiting coroutine
                out, err = None, e
            try:
                loop.call_soon_threadsafe(_settle, fut, out, err)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def run(self, fn, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((loop, fut, fn, args))
        return fut


def _settle(fut: asyncio.Future, out, err) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(out)
