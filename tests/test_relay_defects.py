"""Relay defects of issue 22, each against real relay processes: a cache directory the relay did
not make is never cleared; malformed requests get 4xx, never a 500 or a traceback; only the
store's own key space is forwarded upstream."""
import socket
import struct
import subprocess
import sys

import pytest

from dcr_testing.relay import RelayProc, model, raw_get, wait_until
from nemo_dcr.stores import HttpStore, open_store
from nemo_dcr.sync.publisher import Publisher

pytest.importorskip("aiohttp")

STALL = {"NEMO_DCR_RELAY_FAULT_STALL_AFTER": "65536"}


def _relay_cmd(upstream, cache_dir):
    return [sys.executable, "-m", "nemo_dcr", "relay", "--listen", "127.0.0.1:0", "--upstream", str(upstream),
            "--cache-dir", str(cache_dir)]


def _published(tmp_path):
    store = open_store(tmp_path / "store")
    Publisher(store).publish(model())
    return store


def test_a_cache_dir_the_relay_did_not_make_is_refused_and_left_alone(tmp_path):
    """``--cache-dir $HOME`` used to remove ``$HOME/tmp`` and ``$HOME/objects`` recursively."""
    store = _published(tmp_path)
    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    (home / "tmp" / "notes.txt").write_text("mine")
    (home / "objects").mkdir()
    (home / "objects" / "thesis.tex").write_text("mine too")
    before = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    # refused at start-up (a relay that started would serve until killed: the timeout is the failure)
    p = subprocess.run(_relay_cmd(store.url, home), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "not empty and was not made by a relay" in p.stderr and "nothing was removed" in p.stderr
    assert "Traceback" not in p.stderr
    assert sorted(str(q.relative_to(home)) for q in home.rglob("*")) == before
    assert (home / "tmp" / "notes.txt").read_text() == "mine"
    assert (home / "objects" / "thesis.tex").read_text() == "mine too"


def test_the_relay_owns_a_new_or_empty_cache_dir_and_clears_only_its_own_files(tmp_path):
    from nemo_dcr.transport.cache import MARKER
    store = _published(tmp_path)
    part = [k for k in store.list("versions/") if k.endswith(".dcr")][0]
    cache = tmp_path / "cache"
    cache.mkdir()  # empty: adopted
    r = RelayProc(store.url, "--cache-dir", cache)
    try:
        assert HttpStore(r.url).get(part) == store.get(part)
        assert (cache / MARKER).is_file()
        # kept once checked against the manifest (the one HEAD carries, read then), after the
        # last byte went out
        wait_until(lambda: HttpStore(r.url).stats()["cache_entries"] == 1, "the relay to keep the part")
        assert len(list((cache / "objects").iterdir())) == 1  # the part
        # one relay per directory: a second one would clear the first one's files
        p = subprocess.run(_relay_cmd(store.url, cache), capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "in use by another relay" in p.stderr, p.stderr
        assert HttpStore(r.url).stats()["cache_entries"] == 1 and any((cache / "objects").iterdir())
    finally:
        r.stop()
    (cache / "keep.txt").write_text("a user's file beside the relay's")
    stale = cache / "objects" / "left-by-the-last-run"
    stale.write_bytes(b"x")
    r = RelayProc(store.url, "--cache-dir", cache)  # its own directory: restarts, clearing its files only
    try:
        assert not stale.exists() and HttpStore(r.url).stats()["cache_entries"] == 0
        assert (cache / "keep.txt").read_text() == "a user's file beside the relay's"
    finally:
        r.stop()
    new = tmp_path / "new" / "cache"  # made by the relay
    r = RelayProc(store.url, "--cache-dir", new)
    try:
        assert (new / MARKER).is_file()
    finally:
        r.stop()


def test_malformed_requests_get_4xx_not_500_and_nothing_unknown_is_forwarded(tmp_path):
    """``Range: bytes=0-<5000 digits>`` was a 500 with a traceback, a path of 3000 components a
    502 (the upstream was asked for it), and any path (``/metrics``, ``/ckpt/a.bin``) was
    forwarded upstream as an object fetch."""
    store = _published(tmp_path)
    store.put("ckpt/a.bin", b"not a store object")
    head = store.get("HEAD")
    part = [k for k in store.list("versions/") if k.endswith(".dcr")][0]
    data = store.get(part)
    r = RelayProc(store.url)
    try:
        huge = "9" * 5000
        assert raw_get(r.port, f"/{part}", [f"Range: bytes=0-{huge}"]) == (206, data)  # to the end (RFC 9110)
        assert raw_get(r.port, f"/{part}", [f"Range: bytes=10-{huge}"]) == (206, data[10:])
        assert raw_get(r.port, f"/{part}", [f"Range: bytes={huge}-"])[0] == 416
        assert raw_get(r.port, f"/{part}", [f"Range: bytes={huge}-{huge}"])[0] in (400, 416)  # aiohttp: too long
        assert raw_get(r.port, "/" + "/".join(["a"] * 3000))[0] == 414
        unknown = ["/metrics/x", "/ckpt/a.bin", "/a/b/c", "/versions", "/versions/x",
                   "/versions/000000000000/p1/other.bin", "/versions/000000000000/p1/part-00000.dcr.bak",
                   "/HEAD/x", "/" + "/".join(["a"] * 300)]
        for path in unknown:
            status, body = raw_get(r.port, path)
            assert status == 404 and b"not a key of a nemo-dcr store" in body, (path, status, body)
        status, body = raw_get(r.port, "/metrics")
        assert b"not found: metrics" not in body  # the relay's own endpoint, not an upstream object
        assert raw_get(r.port, "/HEAD") == (200, head)  # still serving
        st = HttpStore(r.url).stats()
        # the part alone: its manifest came with HEAD, read to check it
        assert set(st["upstream_fetches_by_key"]) == {part}, st
        assert st["upstream_errors"] == 0
    finally:
        r.stop()
    out = r.output()
    assert "Traceback" not in out and "Error handling request" not in out, out[-3000:]


def test_a_child_that_went_away_while_the_upstream_failed_is_no_error(tmp_path):
    """B streams an object from A while A sends; the child disconnects; A dies: B's handler
    raised AttributeError (the closed request has no transport left to cut)."""
    store = open_store(tmp_path / "store")
    Publisher(store).publish(model(n=1 << 18))  # a 512 KB keyframe: A stops after 64 KB of it
    part = [k for k in store.list("versions/") if k.endswith(".dcr")][0]
    a = RelayProc(store.url, env=STALL)
    b = RelayProc(a.url)
    try:
        with socket.create_connection(("127.0.0.1", b.port), timeout=30) as s:
            s.sendall(f"GET /{part} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            got = b""
            while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < 65536:
                chunk = s.recv(65536)
                assert chunk, "B closed the connection"
                got += chunk
            a.wait_line("stalled")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset, at once
        sb = HttpStore(b.url)
        sb.stats()  # a round trip after the reset: B has seen it
        a.kill()
        wait_until(lambda: sb.stats()["upstream_errors"] >= 1, "B to see its upstream fail")
        assert sb.stats()["requests"] >= 3  # B still answers
    finally:
        b.stop()
        a.stop()
    out = b.output()
    assert "AttributeError" not in out and "Traceback" not in out, out[-3000:]
