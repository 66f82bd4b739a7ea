"""The head pointer at a relay: never served stale, and long polls that end the moment a newer
version is committed.

* A plain ``GET HEAD`` is answered by a read of the upstream that *started after the request
  arrived* (concurrent requests share one such read), so it is as fresh as asking the store.
* ``GET HEAD?newer_than=V&wait=S`` parks the request; one poller per relay watches the upstream
  while anyone is parked: an upstream relay is long-polled in turn (so a whole tree learns of a
  version as soon as the root does), a plain store is read every ``poll_interval`` seconds. A
  thousand parked children cost the store one read per interval, not a thousand.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nemo_dcr.errors import DcrError
from nemo_dcr.stores.base import Store
from nemo_dcr.stores.http import read_head_since, wait_head
from nemo_dcr.sync.versions import Head
from nemo_dcr.transport.workers import Workers

__all__ = ["HeadWatcher", "HeadState"]

log = logging.getLogger("nemo_dcr.relay")


@dataclass(frozen=True)
class HeadState:
    data: bytes
    tag: str
    head: Head | None = field(default=None, compare=False)  # None if the bytes do not parse

    @property
    def version(self) -> int | None:
        return self.head.version if self.head is not None else None

    def newer_than(self, v: int | None) -> bool:
        return v is None or (self.version is not None and self.version > v)


def _parse(res) -> HeadState | None:
    if res is None:
        return None
    data, tag = res
    try:
        head: Head | None = Head.from_bytes(data)
    except (DcrError, AttributeError):
        head = None
    return HeadState(data, tag, head)


class HeadWatcher:
    def __init__(self, upstream: Store, workers: Workers, stats: dict, *, poll_interval: float = 0.5,
                 upstream_wait: float = 20.0, on_new_version: Callable[[int], None] | None = None,
                 on_head: Callable[[Head], None] | None = None, observe: Callable[[float], None] | None = None):
        """``on_head``: called with each HEAD read from the upstream that differs from the last
        (what it records vouches for the manifests the relay keeps); ``on_new_version`` when its
        version changed; ``observe`` with the seconds each plain HEAD read of the upstream took."""
        self.upstream, self.workers, self.stats = upstream, workers, stats
        self.poll_interval, self.upstream_wait = float(poll_interval), float(upstream_wait)
        self.on_new_version, self.on_head, self.observe = on_new_version, on_head, observe
        self.current: HeadState | None = None
        self.waiters = 0
        self._read_task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._wanted = asyncio.Event()  # set while someone is parked
        self._poller: asyncio.Task | None = None
        self._poll_workers = Workers(1, "relay-head-poll")
        self._closing = False

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        """Stop watching, and answer every parked request now (with the head as last seen)."""
        self._closing = True
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):
                pass

    def _observe(self, st: HeadState | None) -> None:
        old = self.current
        if st == old:
            return
        self.current = st
        if st is not None and st.head is not None and self.on_head is not None:
            self.on_head(st.head)
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()
        if st is not None and st.version is not None and self.on_new_version is not None and \
                (old is None or old.version != st.version):
            self.on_new_version(st.version)

    def _read(self):
        self.stats["upstream_head_reads"] += 1
        t0 = time.perf_counter()
        st = self.current
        try:  # conditional: an unchanged HEAD crosses the upstream link as headers only
            return read_head_since(self.upstream, (st.data, st.tag) if st is not None else None)
        finally:
            if self.observe is not None:
                self.observe(time.perf_counter() - t0)

    async def _read_now(self) -> HeadState | None:
        try:
            st = _parse(await self.workers.run(self._read))
            self._observe(st)
            return st
        finally:
            if self._read_task is asyncio.current_task():
                self._read_task = None

    async def fresh(self) -> HeadState | None:
        """The head as the upstream holds it now: from a read that started after this call."""
        old = self._read_task
        if old is not None:
            await asyncio.wait([old])  # it may have started before we were asked: not fresh
        if self._read_task is None or self._read_task is old:
            self._read_task = asyncio.get_running_loop().create_task(self._read_now())
        return await asyncio.shield(self._read_task)

    async def wait_newer(self, newer_than: int | None, wait: float) -> HeadState | None:
        """The head once it names a version newer than ``newer_than``, or after ``wait``
        seconds the newest seen."""
        deadline = time.monotonic() + max(0.0, wait)
        st = await self.fresh()
        if st is not None and st.newer_than(newer_than):
            return st
        self.waiters += 1
        self._wanted.set()
        self.stats["head_waits"] += 1
        try:
            while (st is None or not st.newer_than(newer_than)) and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                ev = self._changed
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except asyncio.TimeoutError:
                    break
                st = self.current
        finally:
            self.waiters -= 1
            if self.waiters == 0:
                self._wanted.clear()
        return self.current if self.current is not None else st

    async def _poll(self) -> None:
        """While anyone is parked: long-poll an upstream relay, or read a plain store every
        ``poll_interval`` seconds."""
        failures = 0
        while True:
            await self._wanted.wait()
            t0 = time.monotonic()
            before = self.current
            try:
                v = before.version if before is not None else None
                last = (before.data, before.tag) if before is not None else None
                self.stats["upstream_head_polls"] += 1
                self._observe(_parse(await self._poll_workers.run(
                    wait_head, self.upstream, v, self.upstream_wait, last)))
                failures = 0
            except Exception as e:
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    log.warning("relay: watching the upstream's HEAD failed (%d time(s)): %s", failures, e)
            if self.current == before:
                await asyncio.sleep(max(0.0, self.poll_interval - (time.monotonic() - t0)))
