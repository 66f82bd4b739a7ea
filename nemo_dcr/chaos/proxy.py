"""A fault-injecting HTTP proxy (aiohttp) in front of the S3 server: what a flaky object store
or network does to requests, decided per request from the harness's seeded RNG.

* ``error``: 500 InternalError; ``throttle``: 503 SlowDown (both S3's XML, so boto retries them)
* ``delay``: objects served late (seconds, for ``.dcr`` objects and manifests)
* ``corrupt`` / ``truncate``: a ``.dcr`` body with one byte flipped / cut off mid-way with the
  full Content-Length announced (a broken connection)
* ``stale_head``: an older HEAD seen earlier is served again (out-of-order delivery)
* ``replay``: a ``.dcr`` request answered with the previous ``.dcr`` body served (a duplicate
  delivery of another object)

The proxy runs an event loop in a thread of the harness process; ``set(...)`` changes the faults
between steps.
"""
from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter

_DROP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
_S3_ERR = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>chaos</Message>'
           '<RequestId>chaos</RequestId></Error>')


class FaultProxy:
    def __init__(self, upstream_port: int, seed: int = 0):
        self.upstream = f"http://127.0.0.1:{upstream_port}"
        self.rng = random.Random(seed)
        self.faults: dict = {}
        self.counts: Counter = Counter()  # faults actually injected, by kind
        self._heads: dict = {}            # path -> [(body, etag)] seen, oldest first
        self._last_dcr = None
        self._lock = threading.Lock()
        self.port = None
        self._ready = threading.Event()
        threading.Thread(target=self._run, name="chaos-proxy", daemon=True).start()
        self._ready.wait(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, **faults) -> None:
        with self._lock:
            self.faults = {k: v for k, v in faults.items() if v}

    def clear(self) -> None:
        self.set()

    def forget(self) -> None:
        """A new run: old HEADs and bodies belong to another store history."""
        with self._lock:
            self._heads.clear()
            self._last_dcr = None

    def _roll(self, kind: str) -> bool:
        with self._lock:
            p = self.faults.get(kind, 0)
            hit = p > 0 and self.rng.random() < p
            if hit:
                self.counts[kind] += 1
            return hit

    def _run(self):
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        holder: dict = {}  # the client session, made inside the loop

        async def handle(request: web.Request):
            path = request.path
            is_dcr = path.endswith(".dcr")
            is_head_obj = path.endswith("/HEAD")
            if self._roll("error"):
                return web.Response(status=500, text=_S3_ERR.format(code="InternalError"),
                                    content_type="application/xml")
            if self._roll("throttle"):
                return web.Response(status=503, text=_S3_ERR.format(code="SlowDown"), content_type="application/xml")
            if (is_dcr or path.endswith("manifest.json")) and request.method == "GET":
                d = self.faults.get("delay", 0)
                if d and self._roll("delay"):
                    await asyncio.sleep(d)
            body = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
            try:
                async with holder["session"].request(request.method, self.upstream + request.path_qs, headers=headers,
                                           data=body if body else None, allow_redirects=False) as r:
                    data = await r.read()
                    status, rh = r.status, {k: v for k, v in r.headers.items() if k.lower() not in _DROP}
                    length = r.headers.get("Content-Length")
            except Exception:
                return web.Response(status=502, text=_S3_ERR.format(code="BadGateway"), content_type="application/xml")
            if request.method == "GET" and status == 200:
                if is_head_obj:
                    with self._lock:
                        seen = self._heads.setdefault(path, [])
                        if not seen or seen[-1][0] != data:
                            seen.append((data, rh.get("ETag")))
                        older = seen[:-1]
                    if older and self._roll("stale_head"):
                        data, etag = self.rng.choice(older)
                        if etag:
                            rh["ETag"] = etag
                elif is_dcr:
                    prev, self._last_dcr = self._last_dcr, data
                    if prev is not None and prev != data and self._roll("replay"):
                        data = prev
                    elif data and self._roll("corrupt"):
                        i = self.rng.randrange(len(data))
                        data = data[:i] + bytes([data[i] ^ (1 << self.rng.randrange(8))]) + data[i + 1:]
                    elif len(data) > 1 and self._roll("truncate"):
                        resp = web.StreamResponse(status=200, headers=rh)
                        resp.content_length = len(data)
                        await resp.prepare(request)
                        await resp.write(data[: len(data) // 2])
                        if request.transport is not None:
                            request.transport.close()  # the connection breaks mid-body
                        return resp
            if request.method == "HEAD":
                resp = web.StreamResponse(status=status, headers=rh)
                if length is not None:
                    resp.content_length = int(length)
                await resp.prepare(request)
                await resp.write_eof()
                return resp
            return web.Response(status=status, headers=rh, body=data)

        async def main():
            holder["session"] = ClientSession(timeout=ClientTimeout(total=60), connector=TCPConnector(limit=64),
                                    auto_decompress=False)
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            server = site._server
            assert server is not None and hasattr(server, "sockets")
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await asyncio.Event().wait()

        asyncio.new_event_loop().run_until_complete(main())
