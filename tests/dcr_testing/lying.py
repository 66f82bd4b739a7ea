"""A lying parent on the plain-HTTP link between two relays: it passes every request on to a real
relay and its answer back, except that the bodies of the keys in ``forged`` are replaced (a
manifest re-sealed with its own checksum, a HEAD naming it). What a compromised parent relay,
or anyone on an unencrypted link, could do."""
from __future__ import annotations

import hashlib
import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from nemo_dcr.transport.relay import byte_range

_PASS = ("Content-Type", "Content-Range", "Accept-Ranges", "ETag", "Cache-Control")


class LyingParent:
    def __init__(self, upstream_url: str):
        u = urlsplit(upstream_url)
        self.host, self.port_up = u.hostname, u.port
        self.forged: dict[str, bytes] = {}   # key -> the body served instead
        self.served: dict[str, int] = {}     # key -> forged bodies served
        self._lock = threading.Lock()
        parent = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                parent._answer(self, "GET")

            def do_HEAD(self):
                parent._answer(self, "HEAD")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _answer(self, h: BaseHTTPRequestHandler, method: str) -> None:
        key = h.path.split("?", 1)[0].lstrip("/")
        with self._lock:
            fake = self.forged.get(key)
            if fake is not None:
                self.served[key] = self.served.get(key, 0) + 1
        headers = {k: v for k, v in h.headers.items() if k.lower() in ("range", "authorization")}
        conn = http.client.HTTPConnection(self.host, self.port_up, timeout=120)
        try:
            conn.request(method, h.path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            status, got = resp.status, {k: resp.getheader(k) for k in _PASS if resp.getheader(k)}
        finally:
            conn.close()
        if fake is not None and status in (200, 206):
            rng = byte_range(h.headers.get("Range"), len(fake))
            start, end = rng if rng else (0, len(fake) - 1)
            body, status = fake[start:end + 1], 206 if rng else 200
            got.pop("Content-Range", None)
            if rng:
                got["Content-Range"] = f"bytes {start}-{end}/{len(fake)}"
            got["ETag"] = hashlib.sha256(fake).hexdigest()
            length = len(body) if method == "GET" else len(fake)
        else:
            length = len(body) if method == "GET" else int(resp.getheader("Content-Length") or 0)
        h.send_response(status)
        for k, v in got.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(length))
        h.end_headers()
        if method == "GET":
            h.wfile.write(body)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
