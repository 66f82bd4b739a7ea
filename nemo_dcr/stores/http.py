"""The read side of a store, served over HTTP by a relay (``nemo-dcr relay``).

    >>> store = open_store("http://relay-7:8470/run1")     # a relay, or a relay of a relay
    >>> Follower(store, model_tensors).sync()

Read-only: every write raises :class:`StoreError` (publish to the store itself). The protocol,
under the URL's path ``P`` (``""`` or ``/prefix``):

* ``GET P/<key>`` the object (``Range: bytes=N-`` gives it from offset N: 206); ``HEAD P/<key>``
  its size. 404: no such object.
* ``GET P/HEAD?newer_than=V&wait=S``: long poll. The relay answers as soon as the head pointer
  names a version newer than V, or after S seconds with the head as it is then.
* ``GET P/.list?prefix=...``: ``{"keys": [...]}``; ``GET P/.stats``: the relay's counters.
  (Keys never have a component starting with '.', so these names cannot clash with a key.)
* A receiver that reports its version (:meth:`HttpStore.report`, which a Follower calls) sends
  ``X-Nemo-Dcr-Receiver: <name>`` and ``X-Nemo-Dcr-Version: <v>`` (``none``: no version yet)
  with each HEAD read; the relay shows each receiver's version and lag (``/metrics``, ``.stats``).
* With a token configured, every request carries ``Authorization: Bearer <token>``; the token is
  ``token=``, else ``$NEMO_DCR_RELAY_TOKEN``, else the contents of ``$NEMO_DCR_RELAY_TOKEN_FILE``.
  It never appears in a message or a ``repr``.

Failures to reach the relay (refused, reset, timed out, a 5xx, a body cut short) raise
:class:`StoreUnavailable`, which :class:`~nemo_dcr.stores.fallback.FallbackStore` answers by
going on to the next source (an ancestor relay or the store itself).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import threading
import uuid
from collections.abc import Iterator
from typing import NoReturn
from urllib.parse import quote, urlencode, urlsplit

from nemo_dcr.util.writeback import Writeback

from .base import NotFound, Store, StoreError, check_key, check_prefix

__all__ = ["HttpStore", "ReadOnlyStore", "StoreUnavailable", "wait_head", "write_stream_to_file",
           "TOKEN_ENV", "TOKEN_FILE_ENV", "HEAD_PATH", "LIST_PATH", "STATS_PATH", "RECEIVER_HEADER",
           "VERSION_HEADER", "check_receiver_name"]

TOKEN_ENV = "NEMO_DCR_RELAY_TOKEN"
TOKEN_FILE_ENV = "NEMO_DCR_RELAY_TOKEN_FILE"
HEAD_PATH = "HEAD"        # the head pointer's key, and its long-poll endpoint
LIST_PATH = ".list"
STATS_PATH = ".stats"
CHUNK = 1 << 20
RECEIVER_HEADER = "X-Nemo-Dcr-Receiver"
VERSION_HEADER = "X-Nemo-Dcr-Version"
_RECEIVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}")


def check_receiver_name(name) -> str:
    """A receiver's name as it is reported to relays: 1 to 128 letters, digits and ``._:@/+-``."""
    if not isinstance(name, str) or not _RECEIVER_NAME.fullmatch(name):
        raise StoreError(f"receiver name {name!r}: 1 to 128 letters, digits and ._:@/+- (starting with a letter "
                         "or digit)")
    return name


class StoreUnavailable(StoreError):
    """The source could not be reached or failed mid-way; another source may serve the read."""


def read_token_file(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped; a regular file: a FIFO
    would block). Errors name the file only."""
    from nemo_dcr.util.keyfiles import KeyFileError, read_key_file
    try:
        token = read_key_file(path, "token").strip()
    except KeyFileError as e:
        raise StoreError(str(e)) from None
    if not token or any(c.isspace() for c in token):
        raise StoreError(f"the token file {path} must hold one token (no whitespace inside)")
    return token


def _token_from_env() -> str | None:
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    if os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(os.environ[TOKEN_FILE_ENV])
    return None


def write_stream_to_file(size: int, chunks: Iterator[bytes], path: str | os.PathLike) -> None:
    """Write a streamed object to ``path`` atomically: a hidden temporary file next to it,
    fsync'ed and renamed into place only when all ``size`` bytes arrived."""
    dest = os.path.abspath(os.fspath(path))
    d, base = os.path.split(dest)
    tmp = os.path.join(d, f".{base}.tmp-{uuid.uuid4().hex}")
    try:
        os.makedirs(d, exist_ok=True)
        n = 0
        with open(tmp, "xb") as f:
            wb = Writeback(f.fileno())  # the disk writes as the bytes come: fsync waits for the last few MB
            for b in chunks:
                f.write(b)
                n += len(b)
                wb.wrote(len(b))
            if n != size:
                raise StoreError(f"get_to_file -> {dest}: got {n} of {size} bytes")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except OSError as e:
        raise StoreError(f"get_to_file -> {dest} failed: {e}") from e
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
        try:
            os.unlink(tmp)
        except OSError:
            pass


def wait_head(store: Store, newer_than: int | None, wait: float,
              last: tuple[bytes, str] | None = None) -> tuple[bytes, str] | None:
    """The head pointer ``(bytes, tag)``, or None when there is none. A store that can long-poll
    (a relay) answers as soon as a version newer than ``newer_than`` is committed, or after
    ``wait`` seconds; any other store answers at once (the caller polls). ``last``: the pair
    this caller read before; while HEAD still has its tag the read is conditional (headers
    only, no body) and ``last`` itself is returned."""
    fn = getattr(store, "wait_head", None)
    if fn is not None:
        return fn(newer_than, wait, last)
    return read_head_since(store, last)


def read_head_since(store: Store, last: tuple[bytes, str] | None) -> tuple[bytes, str] | None:
    """HEAD's ``(bytes, tag)`` now, or None when there is none; ``last`` (the pair read before)
    when it is unchanged, found by a conditional read."""
    try:
        if last is None:
            return store.get_with_tag(HEAD_PATH)
        r = store.get_if_changed(HEAD_PATH, last[1])
    except NotFound:
        return None
    return last if r is None else r


class ReadOnlyStore(Store):
    """The read side of a store: reads built on :meth:`get_stream`, writes refused with
    :meth:`_read_only`'s error."""

    def get(self, key: str) -> bytes:
        size, chunks = self.get_stream(key)
        buf = bytearray()
        for b in chunks:
            buf += b
        return bytes(buf)

    def get_to_file(self, key: str, path: str | os.PathLike) -> None:
        write_stream_to_file(*self.get_stream(key), path)

    def _read_only(self, op: str, key: str) -> NoReturn:
        raise StoreError(f"{op}({key!r}): {self.url} is read-only")

    def put(self, key: str, data: bytes) -> None:
        self._read_only("put", key)

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        self._read_only("put_file", key)

    def open_writer(self, key: str) -> NoReturn:
        self._read_only("open_writer", key)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._read_only("put_if_absent", key)

    def put_if_match(self, key: str, data: bytes, tag: str) -> str:
        self._read_only("put_if_match", key)

    def delete(self, key: str) -> None:
        self._read_only("delete", key)


class HttpStore(ReadOnlyStore):
    """A relay's read side over HTTP(S). ``timeout``: seconds without a byte before a request
    counts as failed (a long poll waits that much longer than it asked the relay to)."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0,
                 connect_timeout: float = 5.0):
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise StoreError(f"invalid store URL {url!r}: expected http://host:port[/prefix]")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise StoreError(f"invalid store URL {url!r}: no query, fragment or user:password "
                             f"(give a bearer token with ${TOKEN_ENV} or ${TOKEN_FILE_ENV})")
        prefix = parts.path.strip("/")
        if prefix:
            try:
                check_key(prefix)
            except StoreError as e:
                raise StoreError(f"invalid store URL {url!r}: bad path: {e}") from None
        try:
            port = parts.port
        except ValueError as e:
            raise StoreError(f"invalid store URL {url!r}: {e}") from None
        self._https = parts.scheme.lower() == "https"
        self._host = parts.hostname
        self._port = port or (443 if self._https else 80)
        self._base = "/" + quote(prefix, safe="/") if prefix else ""
        self.url = f"{parts.scheme.lower()}://{parts.netloc}{'/' + prefix if prefix else ''}"
        self._token = token if token is not None else _token_from_env()
        self.timeout, self.connect_timeout = float(timeout), float(connect_timeout)
        self._pool: list = []
        self._lock = threading.Lock()
        self._report: dict = {}  # the headers a HEAD read carries (report())

    # -- connections -----------------------------------------------------------------------

    def _new_conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.connect_timeout)

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._pool:
                return self._pool.pop(), True
        return self._new_conn(), False

    def _give(self, conn) -> None:
        with self._lock:
            if len(self._pool) < 16:
                self._pool.append(conn)
                return
        conn.close()

    def _headers(self, extra: dict | None = None) -> dict:
        h = {"User-Agent": "nemo-dcr"}
        if self._token:
            h["Authorization"] = f"Bearer {self._token}"
        h.update(extra or {})
        return h

    def _open(self, method: str, path: str, what: str, headers: dict | None = None,
              timeout: float | None = None):
        """Send a request, return ``(conn, response)`` with a 2xx (or 416) status; map
        everything else to a StoreError. A kept-alive connection the server closed meanwhile is
        retried once on a fresh one."""
        for attempt in range(2):
            conn, reused = self._take()
            try:
                if conn.sock is None:
                    conn.connect()  # with connect_timeout; reads get self.timeout below
                conn.sock.settimeout(self.timeout if timeout is None else timeout)
                conn.request(method, path, headers=self._headers(headers))
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                conn.close()
                if reused and attempt == 0:
                    continue
                raise StoreUnavailable(f"{what}: {self.url} dropped the connection ({type(e).__name__})") from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise StoreUnavailable(f"{what}: cannot reach {self.url}: "
                                       f"{getattr(e, 'strerror', None) or type(e).__name__}") from None
            if 200 <= resp.status < 300 or resp.status in (304, 416):  # 304: asked If-None-Match
                return conn, resp
            try:
                body = resp.read(4096) if method != "HEAD" else b""
            except (OSError, http.client.HTTPException):
                body = b""
            conn.close()
            msg = body.decode("utf-8", "replace").strip()[:300]
            if resp.status == 404:
                raise NotFound(what, self.url)
            if resp.status in (401, 403):
                raise StoreError(f"{what}: {self.url} refused the request ({resp.status}): "
                                 f"{'the bearer token is wrong' if self._token else 'it needs a bearer token'}"
                                 f" (set ${TOKEN_ENV} or ${TOKEN_FILE_ENV})")
            if 400 <= resp.status < 500:
                raise StoreError(f"{what}: {self.url} refused the request ({resp.status}): {msg}")
            raise StoreUnavailable(f"{what}: {self.url} failed ({resp.status}): {msg}")
        raise AssertionError("unreachable")

    def _path(self, key: str) -> str:
        return f"{self._base}/{quote(check_key(key), safe='/')}"

    def _small(self, method: str, path: str, what: str, timeout: float | None = None, headers: dict | None = None):
        conn, resp = self._open(method, path, what, headers, timeout=timeout)
        try:
            body = resp.read()  # also for HEAD: marks the response done so the connection can be reused
            length = resp.getheader("Content-Length")
            if method != "HEAD" and length is not None and len(body) != int(length):
                raise StoreUnavailable(f"{what}: {self.url} sent {len(body)} of {length} bytes")
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise StoreUnavailable(f"{what}: {self.url} broke off the answer ({type(e).__name__})") from None
        except BaseException:
            conn.close()
            raise
        self._give(conn)
        return resp, body

    # -- reads -----------------------------------------------------------------------------

    def get_stream(self, key: str, offset: int = 0) -> tuple[int, Iterator[bytes]]:
        offset = max(0, int(offset))
        conn, resp = self._open("GET", self._path(key), key,
                                {"Range": f"bytes={offset}-"} if offset else None)
        try:
            if resp.status == 416:  # the offset is at (or past) the end
                total = int((resp.getheader("Content-Range") or "*/0").rsplit("/", 1)[1])
                resp.read()
                self._give(conn)
                return total, iter(())
            length = int(resp.getheader("Content-Length"))
            if resp.status == 206:
                total = int(resp.getheader("Content-Range").rsplit("/", 1)[1])
                skip = 0
            else:
                total, skip = length, offset
        except (TypeError, ValueError, IndexError):
            conn.close()
            raise StoreUnavailable(f"{key}: {self.url} sent no usable Content-Length/Range") from None

        def chunks() -> Iterator[bytes]:
            got, done = 0, False
            try:
                while got < length:
                    try:  # read1: pass on what arrived, do not wait for a whole chunk
                        b = resp.read1(min(CHUNK, length - got))
                    except (OSError, http.client.HTTPException) as e:
                        raise StoreUnavailable(f"{key}: {self.url} broke off after {got} of {length} "
                                               f"bytes ({type(e).__name__})") from None
                    if not b:
                        raise StoreUnavailable(f"{key}: {self.url} closed the connection after "
                                               f"{got} of {length} bytes")
                    got += len(b)
                    drop = min(len(b), max(0, skip - (got - len(b))))
                    if drop < len(b):
                        yield b[drop:] if drop else b
                resp.read()  # b"": marks the response finished, so the connection can be reused
                done = True
            finally:
                self._give(conn) if done else conn.close()

        return total, chunks()

    def report(self, receiver: str, version: int | None) -> None:
        self._report = {RECEIVER_HEADER: check_receiver_name(receiver),
                        VERSION_HEADER: "none" if version is None else str(int(version))}

    def get_with_tag(self, key: str) -> tuple[bytes, str]:
        resp, body = self._small("GET", self._path(key), key, headers=self._report if key == HEAD_PATH else None)
        return self._pair(resp, body)

    @staticmethod
    def _pair(resp, body: bytes) -> tuple[bytes, str]:
        """``(bytes, tag)`` of an answer: the server's ETag, or the bytes' SHA-256 without one."""
        return body, resp.getheader("ETag") or hashlib.sha256(body).hexdigest()

    def get_if_changed(self, key: str, tag: str) -> tuple[bytes, str] | None:
        headers = {**(self._report if key == HEAD_PATH else {}), "If-None-Match": tag}
        resp, body = self._small("GET", self._path(key), key, headers=headers)
        return self._unless_same(resp, body, tag)

    @staticmethod
    def _unless_same(resp, body: bytes, tag: str) -> tuple[bytes, str] | None:
        if resp.status == 304:
            return None
        pair = HttpStore._pair(resp, body)
        return None if pair[1] == tag else pair  # a server that ignores If-None-Match

    def size(self, key: str) -> int:
        resp, _ = self._small("HEAD", self._path(key), key)
        try:
            return int(resp.getheader("Content-Length"))
        except (TypeError, ValueError):
            raise StoreUnavailable(f"{key}: {self.url} sent no Content-Length") from None

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        _, body = self._small("GET", f"{self._base}/{LIST_PATH}?{urlencode({'prefix': prefix})}",
                              f"list({prefix!r})")
        try:
            keys = json.loads(body)["keys"]
            return sorted(check_key(k) for k in keys if k.startswith(prefix))
        except (ValueError, KeyError, TypeError, StoreError):
            raise StoreUnavailable(f"list({prefix!r}): {self.url} sent a malformed listing") from None

    def wait_head(self, newer_than: int | None, wait: float,
                  last: tuple[bytes, str] | None = None) -> tuple[bytes, str] | None:
        """Long poll: the head pointer as soon as it names a version newer than ``newer_than``
        (None: any), or after ``wait`` seconds as it is then; None when the store has none.
        ``last``: returned itself when the answer would be the same bytes (a 304)."""
        q = {"wait": f"{max(0.0, float(wait)):g}"}
        if newer_than is not None:
            q["newer_than"] = str(int(newer_than))
        headers = dict(self._report)
        if last is not None:
            headers["If-None-Match"] = last[1]
        try:
            resp, body = self._small("GET", f"{self._base}/{HEAD_PATH}?{urlencode(q)}", HEAD_PATH,
                                     timeout=self.timeout + float(wait), headers=headers)
        except NotFound:
            return None
        if last is None:
            return self._pair(resp, body)
        r = self._unless_same(resp, body, last[1])
        return last if r is None else r

    def stats(self) -> dict:
        """The relay's counters (upstream fetches per key, cache hits, ...)."""
        _, body = self._small("GET", f"{self._base}/{STATS_PATH}", "stats")
        return json.loads(body)

    def _read_only(self, op: str, key: str) -> NoReturn:
        raise StoreError(f"{op}({key!r}): {self.url} is a relay, which serves a store's read side "
                         "only; publish to the store itself (a directory or s3://)")
