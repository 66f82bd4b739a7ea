"""Objects fetched once from the upstream, passed on while they arrive, kept once verified.

Each object the relay does not hold is downloaded by one :class:`Fetch` into a file under the
cache's temporary directory; every request for it, the first and any that arrive while it is
in flight, reads that file as it grows (cut-through), so N children cost one upstream fetch
(coalescing). When the download ends, its size and checksum are compared with what the object's
manifest (``versions/<v>/<id>/manifest.json``, fetched the same way, and kept only when the
store's recorded identity vouches for it: :mod:`nemo_dcr.transport.vouch`) declares: a match goes
into the cache, anything else is dropped, so the next request fetches it afresh. Children check every
object themselves: a relay is never trusted for correctness, only for speed.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from nemo_dcr.errors import DcrError
from nemo_dcr.stores import checksums
from nemo_dcr.stores.base import NotFound, Store
from nemo_dcr.sync.versions import Manifest
from nemo_dcr.transport.cache import ObjectCache
from nemo_dcr.transport.vouch import Identities
from nemo_dcr.transport.workers import Workers

__all__ = ["Fetch", "Fetcher", "Reader"]

log = logging.getLogger("nemo_dcr.relay")

_VERSIONED = re.compile(r"^versions/(\d+)/([^/]+)/([^/]+)$")
_MAX_MANIFEST = 64 << 20


class Fetch:
    """One upstream download in flight. Updated on the event loop only."""

    def __init__(self, key: str, path: str, algo: str):
        self.key, self.path = key, path
        self.algo = algo                  # the checksum hashed while the bytes arrive
        self.size: int | None = None   # the object's size, once the upstream said it
        self.written = 0                  # bytes in the file so far
        self.done = False
        self.error: BaseException | None = None
        self.checksum: str | None = None
        self._changed = asyncio.Event()
        self.decided = asyncio.Event()  # set once the download is kept or dropped

    def update(self, *, size=None, written=None, done=False, error=None, checksum=None) -> None:
        if size is not None:
            self.size = size
        if written is not None:
            self.written = written
        if checksum is not None:
            self.checksum = checksum
        self.done = self.done or done
        if error is not None:
            self.error = error
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def changed(self) -> None:
        await self._changed.wait()


class Reader:
    """An open handle on an object: from the cache (``fetch`` None, ``size`` known) or on a
    download in flight. Opened at once so that a later rename or unlink does not matter."""

    def __init__(self, fd: int, size: int | None, fetch: Fetch | None):
        self.fd, self._size, self.fetch = fd, size, fetch

    @property
    def size(self) -> int | None:
        return self._size if self.fetch is None else self.fetch.size

    def available(self) -> int:
        if self.fetch is not None:
            return self.fetch.written
        assert self._size is not None, "a reader on a cached object is opened with its size"
        return self._size

    async def wait_size(self) -> int:
        """The object's size; raises the upstream's error (NotFound, ...) if it failed first."""
        f = self.fetch
        while f is not None and f.size is None:
            if f.error is not None:
                raise f.error
            await f.changed()
        size = self.size
        assert size is not None, "a cached object's size is known; a download's once the loop above ends"
        return size

    def close(self) -> None:
        os.close(self.fd)


class Fetcher:
    def __init__(self, upstream: Store, cache: ObjectCache, workers: Workers, stats: dict,
                 verifier=None, refresh_head: Callable[[], Awaitable] | None = None,
                 observe: Callable[[float], None] | None = None):
        """``verifier``: a Verifier, when only signed manifests may be kept; ``refresh_head``:
        read the upstream's HEAD now (the reader passes each HEAD it reads to ``ids``);
        ``observe``: called with the seconds each successful download took."""
        self.upstream, self.cache, self.workers, self.stats = upstream, cache, workers, stats
        self.observe = observe
        self.ids = Identities(verifier, on_withdraw=self.withdraw)
        self.refresh_head = refresh_head
        self._inflight: dict = {}
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        self._algo = "blake3"  # the checksum of the parts of the last manifest remembered

    async def open(self, key: str) -> Reader:
        """A reader on ``key``: the cached copy, the download in flight, or a new download. A
        download that has ended but is not yet checked against its manifest is waited out, not
        joined: a child retrying a corrupt object the moment it saw the last byte would get
        those same bytes again, and a good one is in the cache by then."""
        f = self._inflight.get(key)
        if f is not None and (f.done or f.error is not None or (f.size is not None and f.written >= f.size)):
            await f.decided.wait()
        e = self.cache.lookup(key)
        if e is not None:
            try:
                fd = os.open(e.path, os.O_RDONLY)
            except OSError:
                self.cache.discard(key)
            else:
                self.stats["cache_hits"] += 1
                return Reader(fd, e.size, None)
        f = self._inflight.get(key)
        if f is not None:
            self.stats["coalesced"] += 1
        else:
            f = Fetch(key, self.cache.temp_path(), self._algo_for(key))
            open(f.path, "wb").close()  # exists before any reader opens it
            self._inflight[key] = f
            self._count_fetch(key)
            asyncio.get_running_loop().create_task(self._run(f))
        return Reader(os.open(f.path, os.O_RDONLY), None, f)

    def _count_fetch(self, key: str) -> None:
        self.stats["upstream_fetches"] += 1
        by_key = self.stats["upstream_fetches_by_key"]
        if key in by_key or len(by_key) < 10000:
            by_key[key] = by_key.get(key, 0) + 1

    def _download(self, f: Fetch, loop) -> None:
        """On a worker thread: stream the object into ``f.path``, reporting progress."""
        size, chunks = self.upstream.get_stream(f.key)
        loop.call_soon_threadsafe(lambda: f.update(size=size))
        h, n = checksums.new(f.algo), 0
        try:
            with open(f.path, "r+b") as out:
                for b in chunks:
                    out.write(b)
                    out.flush()  # readers read through the page cache what is flushed
                    n += len(b)
                    # the readers are told before the bytes are hashed: the hash is wanted only at
                    # the end, and between the bytes and a child it delayed every piece (a part's
                    # piece of ~0.5 MB by ~0.08 ms with BLAKE3, ~0.3 ms with SHA-256 on this VM)
                    loop.call_soon_threadsafe(lambda n=n: f.update(written=n))
                    h.update(b)
        finally:
            close = getattr(chunks, "close", None)  # a generator holds a connection or file;
            if close is not None:                   # Store.get_stream's default is a plain iterator
                close()
        if n != size:
            raise DcrError(f"{f.key}: the upstream sent {n} of {size} bytes")
        loop.call_soon_threadsafe(lambda: f.update(checksum=h.hexdigest(), done=True))

    async def _run(self, f: Fetch) -> None:
        loop = asyncio.get_running_loop()
        kept = False
        t0 = time.perf_counter()
        try:
            try:
                await self.workers.run(self._download, f, loop)
                if self.observe is not None:
                    self.observe(time.perf_counter() - t0)
            except NotFound as e:
                f.update(error=e)
                return
            except Exception as e:
                self.stats["upstream_errors"] += 1
                log.warning("relay: fetching %s from the upstream failed: %s", f.key, e)
                f.update(error=e)
                return
            await asyncio.sleep(0)  # let the done/checksum update queued by the thread land
            kept = await self._keep(f)
        finally:
            if self._inflight.get(f.key) is f:
                del self._inflight[f.key]
            if not kept:
                try:
                    os.unlink(f.path)
                except OSError:
                    pass
            f.decided.set()

    async def _keep(self, f: Fetch) -> bool:
        """Cache ``f`` if it is what a vouched manifest declares (a manifest: if it is the one the
        store's recorded identity vouches for, :mod:`nemo_dcr.transport.vouch`)."""
        m = _VERSIONED.match(f.key)
        if m is None:
            return False  # not a versioned object: nothing to check it against; pass it through
        version = int(m.group(1))
        if f.size is None:  # set by the download's first update, before done
            raise DcrError(f"{f.key}: finished without a size")
        if m.group(3) == "manifest.json":
            if f.size > _MAX_MANIFEST:
                return False
            with open(f.path, "rb") as fh:
                data = fh.read()
            try:
                await self._vouched(Manifest.from_bytes(data, f.key))
            except DcrError as e:
                self.stats["bad_objects"] += 1
                log.warning("relay: %s not cached: %s", f.key, e)
                return False
            return self.cache.admit(f.key, f.path, f.size, version)
        mkey = f"versions/{m.group(1)}/{m.group(2)}/manifest.json"
        if mkey not in self._manifests and self.refresh_head is not None:
            # a part read before the relay saw its version's HEAD (a follower's guess, sent beside
            # its HEAD read: sync/speculate.py): that HEAD, read now (with the child's own read),
            # carries the manifest, which then need not be fetched on its own
            try:
                await self.refresh_head()
            except Exception as e:  # the manifest is fetched as before
                log.info("relay: reading the upstream's HEAD for %s failed: %s", mkey, e)
        try:
            manifest = await self.manifest(mkey)
        except Exception as e:  # no vouched manifest (yet, or any more): serve, but do not keep
            log.info("relay: no vouched manifest to check %s against (%s); not cached", f.key, e)
            return False
        part = next((p for p in list(manifest.parts) + list(manifest.keyframe_parts)
                     if p.key == f.key), None)
        if part is not None and part.algo != f.algo and part.size == f.size:
            # hashed as the relay guessed (the last manifest's algorithm, before this one was
            # known): once more, from the file, with the one its manifest names
            f.algo, f.checksum = part.algo, await self.workers.run(checksums.of_file, part.algo, f.path)
        if part is None or part.size != f.size or part.checksum != f.checksum:
            self.stats["bad_objects"] += 1
            log.warning("relay: %s does not match its manifest (%s bytes, %s %s...); "
                        "not cached, the next request fetches it again", f.key, f.size, f.algo,
                        (f.checksum or "")[:16])
            return False
        if not self.ids.vouches(manifest):  # withdrawn while the manifest was awaited
            return False
        return self.cache.admit(f.key, f.path, f.size, version)

    async def _vouched(self, m: Manifest) -> Manifest:
        """``m`` if the store's recorded identity vouches for it (remembered then); else
        :class:`DcrError` saying why. A manifest no HEAD seen so far records (a child read HEAD
        elsewhere) is checked again after a fresh read of the upstream's HEAD."""
        why = self.ids.vouch(m)
        if why is not None and self.ids.expected(m.key) is None and self.refresh_head is not None:
            try:
                await self.refresh_head()
            except Exception as e:  # the upstream's HEAD cannot be read: nothing vouches
                log.info("relay: reading the upstream's HEAD to vouch for %s failed: %s", m.key, e)
            why = self.ids.vouch(m)
        if why is not None:
            raise DcrError(f"not vouched for by the store's recorded identity: {why}")
        self._remember(m)
        return m

    def observe_head(self, head) -> None:
        """A HEAD read from the upstream (``ids`` records what it vouches for). The manifest a
        format-3 HEAD carries is remembered once vouched for, as if fetched: its version's parts
        are checked against it without a fetch of the manifest object (one upstream round trip
        fewer per version, and a forged manifest object is never needed)."""
        self.ids.observe_head(head)
        try:
            m = head.newest_manifest
        except DcrError:
            return  # (a HEAD is parsed with the manifest it carries: not reached)
        if m is not None and self.ids.vouch(m) is None:
            self._remember(m)

    def withdraw(self, manifest_key: str) -> None:
        """The manifest ``manifest_key`` is no longer vouched for: drop its version's objects
        (cached, and the parsed manifest)."""
        self._manifests.pop(manifest_key, None)
        directory = manifest_key.rsplit("/", 1)[0] + "/"
        self.stats["withdrawn_objects"] = self.stats.get("withdrawn_objects", 0) + \
            self.cache.discard_prefix(directory)

    def _algo_for(self, key: str) -> str:
        """The checksum ``key``'s manifest names for it, where that manifest is known; else the
        last remembered manifest's (a part is usually asked for after the HEAD naming it)."""
        m = _VERSIONED.match(key)
        known = self._manifests.get(f"versions/{m.group(1)}/{m.group(2)}/manifest.json") if m else None
        for p in (*known.parts, *known.keyframe_parts) if known is not None else ():
            if p.key == key:
                return p.algo
        return self._algo

    def _remember(self, m: Manifest) -> None:
        parts = (*m.parts, *m.keyframe_parts)
        if parts:
            self._algo = parts[0].algo
        self._manifests[m.key] = m
        self._manifests.move_to_end(m.key)
        while len(self._manifests) > 256:
            self._manifests.popitem(last=False)

    async def manifest(self, key: str) -> Manifest:
        """The parsed manifest ``key``, fetched (coalesced and cached) like any object, and
        vouched for (else :class:`DcrError`)."""
        m = self._manifests.get(key)
        if m is not None and self.ids.vouches(m):
            return m
        r = await self.open(key)
        try:
            size = await r.wait_size()
            if size > _MAX_MANIFEST:
                raise DcrError(f"{key}: {size} bytes is too large for a manifest")
            while r.available() < size:
                f = r.fetch
                assert f is not None, "a cached object is whole: only a download can be short"
                if f.error is not None:
                    raise f.error
                await f.changed()
            data = os.pread(r.fd, size, 0)
        finally:
            r.close()
        return await self._vouched(Manifest.from_bytes(data, key))
