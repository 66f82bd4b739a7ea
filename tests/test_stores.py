"""The storage layer (nemo_dcr.stores) against a local directory and a real S3 HTTP server
(moto, see stores_fixtures.py). Fault injection for the retry tests uses botocore's
``before-send`` event: the request never reaches the network and the client sees the error
it would see from a dropped connection or a throttling server."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dcr_testing.s3 import make_s3_store
from nemo_dcr.errors import DcrError
from nemo_dcr.stores import (
    LocalStore,
    NotFound,
    PreconditionFailed,
    S3Store,
    Store,
    StoreError,
    open_store,
)

MiB = 1 << 20


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


# -- basic operations ---------------------------------------------------------------------


def test_bytes_roundtrip_and_overwrite(store: Store):
    assert isinstance(store, Store)
    blob = _data(100_000)
    store.put("a/b/c.bin", blob)
    assert store.get("a/b/c.bin") == blob
    assert store.size("a/b/c.bin") == len(blob)
    assert store.exists("a/b/c.bin")
    assert not store.exists("a/b")
    store.put("a/b/c.bin", b"short")
    assert store.get("a/b/c.bin") == b"short"
    store.put("empty", b"")
    assert store.get("empty") == b"" and store.size("empty") == 0
    store.put("ba", bytearray(b"xy"))
    store.put("mv", memoryview(b"zz"))
    assert store.get("ba") == b"xy" and store.get("mv") == b"zz"
    with pytest.raises(StoreError, match="bytes-like"):
        store.put("s", "a str")  # type: ignore[arg-type]
    data, tag = store.get_with_tag("a/b/c.bin")
    assert data == b"short" and isinstance(tag, str) and tag
    assert store.url.startswith(("file:///", "s3://"))


def test_large_file_roundtrip(store: Store, tmp_path):
    blob = _data(20 * MiB + 12345, seed=1)
    src = tmp_path / "src.bin"
    src.write_bytes(blob)
    store.put_file("big/file.bin", src)
    assert store.size("big/file.bin") == len(blob)
    out = tmp_path / "out" / "file.bin"
    store.get_to_file("big/file.bin", out)
    assert out.read_bytes() == blob
    assert _leftovers(out.parent) == []
    store.put("big/bytes.bin", blob)  # large bytes take the multipart path too
    assert store.get("big/bytes.bin") == blob
    if isinstance(store, S3Store):
        # really multipart: the ETag of a multipart upload is "<md5>-<parts>"
        for key in ("big/file.bin", "big/bytes.bin"):
            _, etag = store.get_with_tag(key)
            assert etag.strip('"').endswith("-3"), etag


def test_get_to_file_missing_leaves_destination(store: Store, tmp_path):
    dest = tmp_path / "dest.bin"
    dest.write_bytes(b"old content")
    with pytest.raises(NotFound):
        store.get_to_file("missing", dest)
    assert dest.read_bytes() == b"old content"
    assert _leftovers(tmp_path) == []


def test_get_to_file_failure_midway_is_atomic(store: Store, tmp_path, monkeypatch):
    blob = _data(3 * MiB, seed=2)
    store.put("obj", blob)
    dest = tmp_path / "dest.bin"
    dest.write_bytes(b"old content")
    if isinstance(store, S3Store):
        from botocore.exceptions import ConnectionClosedError

        def fail(request, **kw):
            raise ConnectionClosedError(endpoint_url=request.url)

        store.client.meta.events.register("before-send.s3.GetObject", fail)
        try:
            with pytest.raises(StoreError, match="after 4 attempt"):
                store.get_to_file("obj", dest)
        finally:
            store.client.meta.events.unregister("before-send.s3.GetObject", fail)
    else:
        import nemo_dcr.stores.local as local_mod

        def copy_half_then_fail(fin, fout, length=0):
            fout.write(fin.read(len(blob) // 2))
            raise OSError(5, "simulated I/O error")

        monkeypatch.setattr(local_mod.shutil, "copyfileobj", copy_half_then_fail)
        with pytest.raises(StoreError, match="simulated I/O error"):
            store.get_to_file("obj", dest)
        monkeypatch.undo()
    assert dest.read_bytes() == b"old content"
    assert _leftovers(tmp_path) == []
    store.get_to_file("obj", dest)
    assert dest.read_bytes() == blob


def test_not_found(store: Store, tmp_path):
    for call in (lambda: store.get("nope"), lambda: store.size("nope"),
                 lambda: store.get_with_tag("nope/deeper"),
                 lambda: store.get_to_file("nope", tmp_path / "x")):
        with pytest.raises(NotFound) as ei:
            call()
        assert isinstance(ei.value, StoreError) and isinstance(ei.value, DcrError)
        assert "nope" in str(ei.value)
    assert not store.exists("nope")
    assert store.list() == []


def test_list_prefixes_sorted(store: Store):
    keys = ["z", "a/2", "a/10", "a/1/x", "ab/c", "b/c/d/e", "a/1/y"]
    for k in keys:
        store.put(k, k.encode())
    assert store.list() == sorted(keys)
    assert store.list("a/") == ["a/1/x", "a/1/y", "a/10", "a/2"]
    assert store.list("a") == ["a/1/x", "a/1/y", "a/10", "a/2", "ab/c"]
    assert store.list("a/1") == ["a/1/x", "a/1/y", "a/10"]
    assert store.list("a/1/") == ["a/1/x", "a/1/y"]
    assert store.list("b/c/d/e") == ["b/c/d/e"]
    assert store.list("q") == [] and store.list("q/r/") == []
    for bad in ("/a", "../a", "a//b", ".hidden"):
        with pytest.raises(StoreError):
            store.list(bad)


def test_list_skips_temps_and_locks(tmp_path):
    st = LocalStore(tmp_path / "s")
    st.put("k/v", b"1")
    st.put_if_absent("k/w", b"2")
    _, tag = st.get_with_tag("k/w")
    st.put_if_match("k/w", b"3", tag)
    # debris a crashed writer could leave: hidden temps at any level
    (tmp_path / "s" / "k" / ".v.tmp-deadbeef").write_bytes(b"partial")
    (tmp_path / "s" / ".x.tmp-1").write_bytes(b"partial")
    (tmp_path / "s" / ".hidden-dir").mkdir()
    (tmp_path / "s" / ".hidden-dir" / "f").write_bytes(b"")
    assert os.path.isdir(tmp_path / "s" / ".locks")
    assert st.list() == ["k/v", "k/w"]
    assert st.list("k/") == ["k/v", "k/w"]
    assert _leftovers(tmp_path / "s" / "k") == [".v.tmp-deadbeef"]  # ours left none


def test_delete_idempotent(store: Store):
    store.put("d/x", b"1")
    store.put("d/y", b"2")
    store.delete("d/x")
    store.delete("d/x")
    store.delete("never/existed")
    assert not store.exists("d/x")
    assert store.list() == ["d/y"]
    store.put_if_absent("d/x", b"again")  # a deleted key can be created again
    assert store.get("d/x") == b"again"


def test_local_key_directory_collision(tmp_path):
    st = LocalStore(tmp_path / "s")
    st.put("a/b", b"1")
    with pytest.raises(StoreError, match="collides"):
        st.put("a", b"2")
    with pytest.raises(StoreError, match="collides"):
        st.put_if_absent("a", b"2")
    with pytest.raises(StoreError, match="collides"):
        st.put("a/b/c", b"2")
    st.delete("a")  # no object 'a': nothing to do
    assert st.get("a/b") == b"1"
    st.delete("a/b")  # prunes the now empty directory 'a'
    st.put("a", b"2")
    assert st.list() == ["a"]


def test_local_put_delete_same_directory_concurrently(tmp_path):
    # delete() prunes empty directories; a put creating the same directory at that moment
    # must not fail (regression: makedirs saw EEXIST for a directory pruned right after)
    st = LocalStore(tmp_path / "s")
    errors = []

    def churn(i):
        try:
            for n in range(150):
                st.put(f"d/sub/k{i}", b"%d" % n)
                st.delete(f"d/sub/k{i}")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert st.list() == []


# -- conditional writes -------------------------------------------------------------------


def test_put_if_absent_and_put_if_match_semantics(store: Store):
    store.put_if_absent("m", b"first")
    with pytest.raises(PreconditionFailed) as ei:
        store.put_if_absent("m", b"second")
    assert isinstance(ei.value, StoreError)
    assert store.get("m") == b"first"

    data, tag = store.get_with_tag("m")
    new_tag = store.put_if_match("m", b"v2", tag)
    assert store.get_with_tag("m") == (b"v2", new_tag)
    with pytest.raises(PreconditionFailed):
        store.put_if_match("m", b"v3", tag)  # stale tag
    assert store.get("m") == b"v2"
    store.put("m", b"v4")  # a plain put changes the tag too
    with pytest.raises(PreconditionFailed):
        store.put_if_match("m", b"v5", new_tag)
    with pytest.raises(PreconditionFailed):
        store.put_if_match("never", b"x", new_tag)  # missing object
    assert not store.exists("never")
    with pytest.raises(StoreError, match="put_if_absent") as ei:
        store.put_if_match("m", b"x", None)  # type: ignore[arg-type]
    assert not isinstance(ei.value, PreconditionFailed)
    assert store.get("m") == b"v4"


N_THREADS = 8


def test_put_if_absent_race_threads(store: Store):
    barrier = threading.Barrier(N_THREADS)
    winners, losers, errors = [], [], []
    payload = {i: f"writer {i} ".encode() * 5000 for i in range(N_THREADS)}

    def race(i):
        barrier.wait()
        try:
            store.put_if_absent("race/claim", payload[i])
            winners.append(i)
        except PreconditionFailed:
            losers.append(i)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(winners) == 1 and len(losers) == N_THREADS - 1
    assert store.get("race/claim") == payload[winners[0]]


def _cas_increment(store: Store, key: str, times: int) -> int:
    conflicts = 0
    for _ in range(times):
        while True:
            data, tag = store.get_with_tag(key)
            try:
                store.put_if_match(key, str(int(data) + 1).encode(), tag)
                break
            except PreconditionFailed:
                conflicts += 1
    return conflicts


def test_put_if_match_counter_race_threads(store: Store):
    store.put_if_absent("counter", b"0")
    per_thread = 5
    barrier = threading.Barrier(N_THREADS)
    conflicts, errors = [], []

    def work():
        barrier.wait()
        try:
            conflicts.append(_cas_increment(store, "counter", per_thread))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # no lost update (sum(conflicts) > 0 in practice: the increments really raced)
    assert int(store.get("counter")) == N_THREADS * per_thread


_CHILD = textwrap.dedent("""
    import sys, types
    # Import nemo_dcr.stores without nemo_dcr/__init__.py, which imports torch (over a second
    # per process); the stores need only nemo_dcr.errors.
    pkg = types.ModuleType("nemo_dcr")
    pkg.__path__ = [sys.argv[4]]
    sys.modules["nemo_dcr"] = pkg
    from nemo_dcr.stores import open_store, PreconditionFailed
    url, me, times = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    st = open_store(url)
    print("READY", flush=True)
    sys.stdin.readline()  # start barrier
    try:
        st.put_if_absent("claim", b"process %d " % me * 4096)
        won = True
    except PreconditionFailed:
        won = False
    for _ in range(times):
        while True:
            data, tag = st.get_with_tag("counter")
            try:
                st.put_if_match("counter", str(int(data) + 1).encode(), tag)
                break
            except PreconditionFailed:
                pass
    print("WON" if won else "LOST", flush=True)
""")


def test_conditional_writes_race_processes(store: Store):
    n_proc, times = 4, 10
    store.put_if_absent("counter", b"0")
    env = dict(os.environ)
    if isinstance(store, S3Store):
        env["NEMO_DCR_S3_ENDPOINT"] = store.endpoint_url
    import nemo_dcr
    pkg_dir = os.path.dirname(nemo_dcr.__file__)
    procs = [subprocess.Popen(
        [sys.executable, "-c", _CHILD, store.url, str(i), str(times), pkg_dir],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    ) for i in range(n_proc)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READY"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [p.communicate(timeout=60)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * n_proc
    assert sorted(results) == ["LOST"] * (n_proc - 1) + ["WON"]
    winner = results.index("WON")
    assert store.get("claim") == b"process %d " % winner * 4096
    assert int(store.get("counter")) == n_proc * times


# -- keys and URLs ------------------------------------------------------------------------


BAD_KEYS = ["", "/abs", "a/../b", "..", "a/./b", ".", "a//b", "a/", "a/.hidden", ".locks/x",
            "a\\b", "nul\x00", 5, None]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_invalid_keys_rejected(store: Store, key, tmp_path):
    ops = [lambda: store.get(key), lambda: store.put(key, b"x"),
           lambda: store.put_if_absent(key, b"x"), lambda: store.put_if_match(key, b"x", "t"),
           lambda: store.exists(key), lambda: store.size(key), lambda: store.delete(key),
           lambda: store.get_with_tag(key), lambda: store.get_to_file(key, tmp_path / "o")]
    for op in ops:
        with pytest.raises(StoreError, match="invalid key"):
            op()
    assert store.list() == []


def test_open_store_local(tmp_path, monkeypatch):
    st = open_store(f"file://{tmp_path}/a")
    assert isinstance(st, LocalStore) and st.root == str(tmp_path / "a")
    assert st.url == f"file://{tmp_path}/a"
    st.put("k", b"v")
    assert open_store(str(tmp_path / "a")).get("k") == b"v"  # absolute path
    assert open_store(tmp_path / "a").get("k") == b"v"  # PathLike
    assert open_store("file://localhost" + str(tmp_path / "a")).get("k") == b"v"
    monkeypatch.chdir(tmp_path)
    rel = open_store("a")  # relative path
    assert isinstance(rel, LocalStore) and rel.get("k") == b"v"
    assert open_store("odd:name").root == str(tmp_path / "odd:name")  # no '://': a path
    assert open_store(st) is st


@pytest.mark.parametrize("url, match", [
    ("gs://bucket/x", "unknown scheme 'gs'"),
    ("ftp://host/x", "unknown scheme 'ftp'"),
    ("http://host/x?a=1", "no query"),
    ("http://host/../x", "bad path"),
    ("file://remotehost/x", "not a host"),
    ("s3://", "expected s3://bucket"),
    ("s3:///prefix", "expected s3://bucket"),
    ("", "invalid store URL"),
])
def test_open_store_bad_urls(url, match):
    with pytest.raises(StoreError, match=match):
        open_store(url)


def test_open_store_s3(moto_s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)
    st = open_store(f"s3://{moto_s3.bucket}/open/store/")
    assert isinstance(st, S3Store)
    assert (st.bucket, st.prefix, st.url) == (moto_s3.bucket, "open/store",
                                              f"s3://{moto_s3.bucket}/open/store")
    assert st.endpoint_url == moto_s3.endpoint_url
    st.put("k", b"v")
    # NEMO_DCR_S3_ENDPOINT wins over AWS_ENDPOINT_URL; endpoint_url= wins over both
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("NEMO_DCR_S3_ENDPOINT", moto_s3.endpoint_url)
    assert open_store(f"s3://{moto_s3.bucket}/open/store").get("k") == b"v"
    monkeypatch.setenv("NEMO_DCR_S3_ENDPOINT", "http://127.0.0.1:9")
    st2 = open_store(f"s3://{moto_s3.bucket}/open", endpoint_url=moto_s3.endpoint_url)
    assert st2.list() == ["store/k"]
    whole = open_store(f"s3://{moto_s3.bucket}", endpoint_url=moto_s3.endpoint_url)
    assert whole.prefix == "" and "open/store/k" in whole.list("open/")


def test_s3_missing_bucket(moto_s3):
    st = S3Store("no-such-bucket-here", endpoint_url=moto_s3.endpoint_url, retries=0)
    with pytest.raises(StoreError, match="bucket 'no-such-bucket-here' does not exist"):
        st.put("k", b"v")


# -- retries and fault injection (S3) -----------------------------------------------------


class _Faults:
    """A before-send hook failing the first ``n`` requests (forever if n is None)."""

    def __init__(self, n, kind="closed"):
        self.n, self.kind, self.calls = n, kind, 0
        self.lock = threading.Lock()

    def __call__(self, request, **kwargs):
        with self.lock:
            self.calls += 1
            fail = self.n is None or self.calls <= self.n
        if not fail:
            return None
        if self.kind == "closed":
            from botocore.exceptions import ConnectionClosedError
            raise ConnectionClosedError(endpoint_url=request.url)
        from botocore.awsrequest import AWSResponse

        class _Raw:
            def stream(self, **kw):
                yield (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                       b"<Message>Please reduce your request rate.</Message></Error>")

        return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _Raw())


def _hooked(st: S3Store, op: str, hook):
    st.client.meta.events.register(f"before-send.s3.{op}", hook)
    return hook


@pytest.mark.parametrize("kind", ["closed", "503"])
def test_s3_transient_faults_are_retried(moto_s3, request, kind):
    st = make_s3_store(moto_s3, request, max_attempts=1, retries=3)
    put = _hooked(st, "PutObject", _Faults(2, kind))
    get = _hooked(st, "GetObject", _Faults(2, kind))
    st.put("k", b"payload")
    assert st.get("k") == b"payload"
    assert (put.calls, get.calls) == (3, 3)


def test_s3_botocore_retries_too(moto_s3, request):
    # botocore's own standard-mode retry handles a dropped connection within one attempt of
    # ours (its backoff is up to 1 s here, hence a single fault)
    st = make_s3_store(moto_s3, request, max_attempts=3, retries=0)
    hook = _hooked(st, "PutObject", _Faults(1))
    st.put("k", b"v")
    assert hook.calls == 2 and st.get("k") == b"v"


@pytest.mark.parametrize("kind", ["closed", "503"])
def test_s3_permanent_failure_is_bounded(moto_s3, request, kind):
    st = make_s3_store(moto_s3, request, max_attempts=1, retries=3, backoff_base=0.01)
    hook = _hooked(st, "PutObject", _Faults(None, kind))
    t0 = time.monotonic()
    with pytest.raises(StoreError) as ei:
        st.put("k", b"v")
    assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert "S3 put s3://" in msg and "/k failed after 4 attempt(s)" in msg
    assert ("ConnectionClosedError" if kind == "closed" else "SlowDown") in msg
    assert hook.calls == 4
    assert not isinstance(ei.value, (NotFound, PreconditionFailed))


def test_s3_unreachable_endpoint(moto_s3):
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    st = S3Store(moto_s3.bucket, "x", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1,
                 retries=2, backoff_base=0.01, connect_timeout=2)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"failed after 3 attempt\(s\).*EndpointConnectionError"):
        st.get("k")
    assert time.monotonic() - t0 < 10


class _LandThenDrop:
    """Deliver the first request to the server, then pretend the connection dropped before
    the response came: the write happened, but the client does not know."""

    def __init__(self):
        self.calls = 0

    def __call__(self, request, **kwargs):
        self.calls += 1
        if self.calls > 1:
            return None
        from botocore.exceptions import ConnectionClosedError
        from botocore.httpsession import URLLib3Session
        response = URLLib3Session().send(request)
        assert response.status_code == 200
        raise ConnectionClosedError(endpoint_url=request.url)


def test_s3_ambiguous_conditional_writes_resolved(moto_s3, request):
    st = make_s3_store(moto_s3, request, max_attempts=1, retries=3)
    hook = _hooked(st, "PutObject", _LandThenDrop())
    st.put_if_absent("claim", b"mine")  # retry sees 412 against our own write: success
    assert hook.calls == 2 and st.get("claim") == b"mine"

    st.client.meta.events.unregister("before-send.s3.PutObject", hook)
    st.put("c", b"1")
    _, tag = st.get_with_tag("c")
    hook = _hooked(st, "PutObject", _LandThenDrop())
    new_tag = st.put_if_match("c", b"2", tag)
    assert hook.calls == 2 and st.get_with_tag("c") == (b"2", new_tag)

    # someone else's object is not mistaken for ours
    st.client.meta.events.unregister("before-send.s3.PutObject", hook)
    st.put("other", b"theirs")
    _hooked(st, "PutObject", _Faults(1))
    with pytest.raises(PreconditionFailed):
        st.put_if_absent("other", b"mine")
    assert st.get("other") == b"theirs"
