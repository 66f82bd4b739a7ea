"""``nemo-dcr relay``: an HTTP server for the read side of a store, with a cache, fetching each
object once from its upstream (a store or another relay) for any number of children.

    nemo-dcr relay --listen 0.0.0.0:8470 --upstream s3://bucket/run1 --cache-dir /var/cache/dcr
    nemo-dcr relay --listen 0.0.0.0:8470 --upstream http://relay-a:8470 --upstream s3://bucket/run1

Children open ``http://relay:8470`` (``open_store``), or a list of URLs to fall back along. The
protocol is in :mod:`nemo_dcr.stores.http`; see docs/design.md "Relay tree".
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from nemo_dcr.errors import DcrError
from nemo_dcr.metrics import RelayMetrics
from nemo_dcr.metrics import available as metrics_available
from nemo_dcr.stores.base import NotFound, Store, StoreError, check_key, check_prefix
from nemo_dcr.stores.http import HEAD_PATH, RECEIVER_HEADER, VERSION_HEADER
from nemo_dcr.sync.versions import is_store_key, key_version
from nemo_dcr.transport.cache import ObjectCache
from nemo_dcr.transport.fetch import Fetcher
from nemo_dcr.transport.guesses import Misses
from nemo_dcr.transport.head import HeadWatcher
from nemo_dcr.transport.keys import BadPath, parse_path
from nemo_dcr.transport.receivers import Receivers
from nemo_dcr.transport.redact import redacting
from nemo_dcr.transport.workers import Workers

__all__ = ["Relay", "serve", "parse_listen"]

log = logging.getLogger("nemo_dcr.relay")

CHUNK = 1 << 20
MAX_WAIT = 60.0
HEALTH_TIMEOUT = 10.0  # seconds a /healthz probe waits for the upstream's HEAD
PRUNE_DELAY = 5.0  # seconds after a new version before the upstream's versions are listed (see _new_version)
# Fault injection for tests: stop sending every .dcr object after this many bytes (the relay
# then hangs, as a relay whose machine froze would, until it is killed).
STALL_ENV = "NEMO_DCR_RELAY_FAULT_STALL_AFTER"
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_DIGITS = 19  # a byte position of more digits is past the end of any object
_VERSION_DIR = re.compile(r"^versions/(\d+)/")


def _aiohttp():
    try:
        from aiohttp import web
    except ImportError:
        raise StoreError('the relay needs aiohttp: pip install "nemo-dcr[relay]"') from None
    return web


def _tags(header: str | None) -> list[str]:
    """The entity tags an ``If-None-Match`` header lists (weak ones compared as strong: a
    relay's tags are its upstream's, each naming exact bytes)."""
    if not header:
        return []
    return [t.strip().removeprefix("W/") for t in header.split(",") if t.strip()]


def byte_range(header: str | None, size: int):
    """``Range: bytes=FIRST-[LAST]`` of an object of ``size`` bytes -> ``(start, end)``
    inclusive; None: no (usable) range, the whole object; False: unsatisfiable (416). A LAST past
    the end means "to the end" (RFC 9110 14.1.1), however many digits it has."""
    m = _RANGE.match(header.strip()) if header else None
    if m is None:
        return None
    first, last = m.group(1), m.group(2)
    if len(first) > _DIGITS or int(first) >= size:
        return False
    start, end = int(first), size - 1
    if last and len(last) <= _DIGITS:
        end = min(end, int(last))
    return (start, end) if start <= end else False


def parse_listen(text: str) -> tuple:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise StoreError(f"--listen {text!r}: expected HOST:PORT (PORT 0 picks a free one)")
    return host.strip("[]"), int(port)


class Relay:
    def __init__(self, upstream: Store, *, cache_dir: str, cache_max_bytes: int = 8 << 30,
                 token: str | None = None, mount: str = "", poll_interval: float = 0.5,
                 upstream_wait: float = 20.0, workers: int = 16, stall_after: int | None = None,
                 verifier=None, prune_delay: float = PRUNE_DELAY):
        """``verifier``: a :class:`~nemo_dcr.sync.signing.Verifier`: keep only manifests (and
        their parts) signed by a trusted key, vouched for by a HEAD signed by one. Children
        verify for themselves either way; this decides what the relay keeps. ``prune_delay``:
        seconds after a new version before the relay lists the upstream's versions to drop the
        cached ones retention removed (versions that come meanwhile share that one listing)."""
        self.upstream, self.mount = upstream, mount.strip("/")
        if self.mount:
            check_key(self.mount)
        self._token = token.encode() if token else None
        self.stall_after = stall_after
        self.stats: dict[str, Any] = {  # counters, and upstream_fetches_by_key: {key: count}
            "requests": 0, "refused": 0, "served_bytes": 0, "cache_hits": 0, "coalesced": 0,
            "upstream_fetches": 0, "upstream_fetches_by_key": {}, "upstream_errors": 0,
            "bad_objects": 0, "upstream_head_reads": 0, "upstream_head_polls": 0, "head_waits": 0,
            "head_not_modified": 0, "guesses_answered": 0,
            "evicted_old_versions": 0, "withdrawn_objects": 0, "upstream_lists": 0,
        }
        self.receivers = Receivers()
        self.metrics = RelayMetrics(self._stats) if metrics_available() else None  # else /metrics: 501
        self.cache = ObjectCache(cache_dir, cache_max_bytes)
        self.workers = Workers(workers, "relay-fetch")
        self.fetcher = Fetcher(upstream, self.cache, self.workers, self.stats, verifier=verifier,
                               refresh_head=lambda: self.heads.fresh(),
                               observe=self.metrics.fetch_seconds.observe if self.metrics else None)
        self.heads = HeadWatcher(upstream, self.workers, self.stats, poll_interval=poll_interval,
                                 upstream_wait=upstream_wait, on_new_version=self._new_version,
                                 on_head=self.fetcher.observe_head,
                                 observe=self.metrics.head_read_seconds.observe if self.metrics else None)
        self._pruning = False
        self.prune_delay = max(0.0, float(prune_delay))
        # reads of versions not yet committed (followers' guesses) the upstream did not have
        self.misses = Misses(poll_interval)

    def close(self) -> None:
        """Release the cache directory (after the server stopped)."""
        self.cache.close()

    # -- application -----------------------------------------------------------------------

    def app(self):
        web = _aiohttp()

        @web.middleware
        async def guard(request, handler):
            return await self._guard(request, handler)

        app = web.Application(middlewares=[guard])
        app.router.add_route("*", "/{tail:.*}", self._handle)  # the guard answers every request

        async def on_startup(_):
            self.heads.start()

        async def on_shutdown(_):  # before open requests are waited for: end the long polls
            await self.heads.stop()

        app.on_startup.append(on_startup)
        app.on_shutdown.append(on_shutdown)
        return app

    def _error(self, status: int, message: str):
        web = _aiohttp()
        return web.Response(status=status, text=message + "\n",
                            headers={"Cache-Control": "no-store"})

    async def _guard(self, request, handler):
        self.stats["requests"] += 1
        if request.raw_path.split("?", 1)[0] == "/healthz" and request.method in ("GET", "HEAD"):
            return await self._healthz()  # for probes, without the token: it tells nothing else
        if self._token is not None:
            got = request.headers.get("Authorization", "")
            ok = got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode(), self._token)
            if not ok:
                self.stats["refused"] += 1
                # never echo what was sent: it may be a near-miss of the real token
                resp = self._error(401, "a valid bearer token is required" if got else
                                   "this relay requires a bearer token (Authorization: Bearer ...)")
                resp.headers["WWW-Authenticate"] = 'Bearer realm="nemo-dcr"'
                return resp
        if request.method not in ("GET", "HEAD"):
            return self._error(405, "a relay serves reads only (GET, HEAD)")
        # every path comes here, not only what the router's pattern matches (".*" stops at a
        # newline): _handle validates it itself
        return await self._handle(request)

    async def _handle(self, request):
        try:
            what, key = parse_path(request.raw_path, self.mount)
        except BadPath as e:
            self.stats["refused"] += 1
            return self._error(e.status, f"refused: {e}")
        try:
            if what == "stats":
                return self._json(self._stats())
            if what == "metrics":
                return self._metrics()
            if what == "healthz":
                return await self._healthz()
            if what == "list":
                prefix = request.query.get("prefix", "")
                try:
                    check_prefix(prefix)
                except StoreError as e:
                    self.stats["refused"] += 1
                    return self._error(400, f"refused: {e}")
                keys = await self.workers.run(self.upstream.list, prefix)
                return self._json({"keys": [k for k in keys if is_store_key(k)]})  # the store's own only
            if key == HEAD_PATH:
                return await self._head(request)
            if request.method == "HEAD":
                return await self._size(key)
            return await self._object(request, key)
        except NotFound:
            return self._error(404, f"not found: {key}" if key else "not found")
        except (DcrError, OSError) as e:  # the upstream failed, or sent less than it announced
            return self._error(502, f"upstream failed: {e}")

    async def _healthz(self):
        """200 when the upstream's HEAD can be read now (a read shared with concurrent requests),
        503 when it cannot: a probe takes a relay that lost its upstream out of service."""
        try:
            st = await asyncio.wait_for(self.heads.fresh(), HEALTH_TIMEOUT)
        except Exception as e:  # why goes to the relay's log, not to an unauthenticated probe
            log.warning("relay: /healthz: the upstream's HEAD cannot be read: %s",
                        e if str(e) else type(e).__name__)
            return self._error(503, "unhealthy: the upstream cannot be read")
        v = st.version if st is not None else None
        return self._error(200, f"ok: upstream head version {v if v is not None else 'none'}")

    def _metrics(self):
        web = _aiohttp()
        if self.metrics is None:
            return self._error(501, 'metrics need prometheus_client: pip install "nemo-dcr[relay]"')
        body, ctype = self.metrics.render()
        resp = web.Response(body=body, headers={"Cache-Control": "no-store"})
        resp.headers["Content-Type"] = ctype
        return resp

    def _json(self, obj):
        web = _aiohttp()
        return web.Response(body=json.dumps(obj).encode(), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    def _stats(self) -> dict:
        s = dict(self.stats)
        s["upstream_fetches_by_key"] = dict(self.stats["upstream_fetches_by_key"])
        s.update(cache_bytes=self.cache.bytes, cache_entries=len(self.cache),
                 cache_max_bytes=self.cache.max_bytes, cache_evicted=self.cache.evicted,
                 head_waiters=self.heads.waiters, head_version=self._head_version(),
                 receivers=self.receivers.snapshot(self._head_version()))
        return s

    def _head_version(self) -> int | None:
        return self.heads.current.version if self.heads.current else None

    # -- HEAD ------------------------------------------------------------------------------

    async def _head(self, request):
        web = _aiohttp()
        self.receivers.report(request.headers.get(RECEIVER_HEADER), request.headers.get(VERSION_HEADER),
                              request.remote)
        q = request.query
        try:
            newer_than = int(q["newer_than"]) if "newer_than" in q else None
            wait = min(MAX_WAIT, max(0.0, float(q.get("wait", 0))))
        except ValueError:
            return self._error(400, "refused: newer_than must be an integer and wait a number")
        if "newer_than" in q or "wait" in q:
            st = await self.heads.wait_newer(newer_than, wait)
        else:
            st = await self.heads.fresh()
        if st is None:
            raise NotFound(HEAD_PATH)
        if st.tag in _tags(request.headers.get("If-None-Match")):
            # the child holds these bytes: a poll of an unchanged HEAD costs headers, not the
            # manifest HEAD carries (RFC 9110 13.1.2)
            self.stats["head_not_modified"] += 1
            return web.Response(status=304, headers={"ETag": st.tag, "Cache-Control": "no-store"})
        return web.Response(body=st.data, headers={"ETag": st.tag, "Cache-Control": "no-store",
                                                   "Content-Type": "application/json"})

    # -- objects ---------------------------------------------------------------------------

    async def _size(self, key: str):
        web = _aiohttp()
        e = self.cache.lookup(key)
        size = e.size if e is not None else await self.workers.run(self.upstream.size, key)
        return web.Response(headers={"Content-Length": str(size), "Accept-Ranges": "bytes"})

    async def _object(self, request, key: str):
        web = _aiohttp()
        v = key_version(key)[0]
        if v is not None and self.misses.recent(key):
            # a guess the upstream did not have moments ago: asked again only once HEAD names
            # its version (guesses.py)
            st = await self.heads.fresh()
            named = st.version if st is not None else None
            if named is None or named < v:
                self.stats["guesses_answered"] += 1
                raise NotFound(key)
        r = await self.fetcher.open(key)
        try:
            try:
                size = await r.wait_size()
            except NotFound:
                known = self._head_version()
                if v is not None and (known is None or v > known):
                    self.misses.missed(key)
                raise
            self.misses.found(key)
            rng = byte_range(request.headers.get("Range"), size)
            if rng is False:
                return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
            start, end = rng if rng else (0, size - 1)
            resp = web.StreamResponse(status=206 if rng else 200)
            resp.content_length = end + 1 - start
            resp.headers["Accept-Ranges"] = "bytes"
            resp.headers["Content-Type"] = "application/octet-stream"
            if rng:
                resp.headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            try:
                await self._send(request, resp, r, key, start, end)
            except ConnectionError:  # the child went away: there is no one to answer
                pass
            return resp
        finally:
            r.close()

    async def _send(self, request, resp, r, key: str, start: int, end: int) -> None:
        await resp.prepare(request)
        pos = start
        while pos <= end:
            if self.stall_after is not None and key.endswith(".dcr") and pos >= self.stall_after:
                print(f"relay: fault injection: stalled {key} at byte {pos}", file=sys.stderr, flush=True)
                await asyncio.Event().wait()
            avail = r.available()
            if pos < avail:
                n = min(CHUNK, avail - pos, end + 1 - pos)
                if self.stall_after is not None and key.endswith(".dcr") and pos < self.stall_after:
                    n = min(n, self.stall_after - pos)
                data = os.pread(r.fd, n, pos)
                await resp.write(data)
                pos += len(data)
                self.stats["served_bytes"] += len(data)
            else:
                f = r.fetch
                assert f is not None, "a cached object is whole: only a download can be behind pos"
                if f.error is not None:
                    # cut the response short: the child sees fewer bytes than announced and
                    # goes on to its next source from where it got (a child that went away
                    # meanwhile has no connection left to cut)
                    if request.transport is not None:
                        request.transport.close()
                    return
                await f.changed()
        await resp.write_eof()

    # -- bounds ----------------------------------------------------------------------------

    def _new_version(self, version: int) -> None:
        """A newer head: drop cached versions older than the oldest the upstream still lists
        (retention removed them; no child can need them). Not at once: ``prune_delay`` seconds
        later. A new version is when every child downloads it, and the listing (a request across
        the slow link, and boto3 parsing an entry per object: ~40 % of a relay's Python CPU per
        version, ~4 ms, following the reload benchmark's 45M-element model at 1 %) competed with
        them for the cores; old versions can wait, and versions that come meanwhile share the
        one listing."""
        if self._pruning:
            return
        self._pruning = True

        async def prune():
            try:
                await asyncio.sleep(self.prune_delay)
                self.stats["upstream_lists"] += 1
                keys = await self.workers.run(self.upstream.list, "versions/")
                listed = {int(m.group(1)) for m in map(_VERSION_DIR.match, keys) if m}
                if listed:
                    n = self.cache.evict_older_than(min(listed))
                    self.stats["evicted_old_versions"] += n
            except Exception as e:
                log.info("relay: listing the upstream's versions failed: %s", e)
            finally:
                self._pruning = False

        asyncio.get_running_loop().create_task(prune())


async def serve(upstream: Store, listen: str, *, cache_dir: str | None = None,
                token: str | None = None, ready=None, secrets: Sequence[str] = (), **kwargs) -> None:
    """Run a relay until SIGTERM/SIGINT. ``ready(url)`` is called once it listens. No log line
    written meanwhile holds ``token``, ``secrets`` (e.g. the token for a parent relay) or any
    request's credentials (:mod:`nemo_dcr.transport.redact`)."""
    with redacting([token or "", *secrets]):
        await _serve(upstream, listen, cache_dir=cache_dir, token=token, ready=ready, **kwargs)


async def _serve(upstream: Store, listen: str, *, cache_dir: str | None, token: str | None, ready,
                 **kwargs) -> None:
    web = _aiohttp()
    host, port = parse_listen(listen)
    own_dir = cache_dir is None
    if cache_dir is None:
        cache_dir = tempfile.mkdtemp(prefix="nemo-dcr-relay-")
    stall = os.environ.get(STALL_ENV)
    relay = Relay(upstream, cache_dir=cache_dir, token=token,
                  stall_after=int(stall) if stall else None, **kwargs)
    runner = web.AppRunner(relay.app(), access_log=None, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            raise StoreError(f"cannot listen on {listen}: {e.strerror or e}") from None
        addr = runner.addresses[0]
        h = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
        url = f"http://{h}:{addr[1]}" + (f"/{relay.mount}" if relay.mount else "")
        if ready is not None:
            ready(url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
        relay.close()
        if own_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
