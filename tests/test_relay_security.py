"""A relay lets in only who holds its token, never shows the token, and serves nothing outside
its namespace, whatever the request path says. Real relay processes on 127.0.0.1; raw requests
go over a plain socket so that no client library normalises the path first."""
import socket

import pytest

from dcr_testing.relay import RelayProc, model, raw_get
from nemo_dcr.stores import HttpStore, StoreError, open_store
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher

pytest.importorskip("aiohttp")

TOKEN = "s3cr3t-Token-7f9c2a"


def test_token_required_refused_and_never_shown(tmp_path, monkeypatch):
    store = open_store(tmp_path / "store")
    Publisher(store).publish(model())
    (tmp_path / "token").write_text(TOKEN + "\n")
    r = RelayProc(store.url, "--token-file", tmp_path / "token")
    try:
        part = [k for k in store.list("versions/") if k.endswith(".dcr")][0]
        errors = []
        for s in (HttpStore(r.url, token=""), HttpStore(r.url, token=TOKEN[:-1] + "X")):
            for op in (lambda s: s.get(part), lambda s: s.get_with_tag("HEAD"), lambda s: s.list(),
                       lambda s: s.stats(), lambda s: s.size(part)):
                with pytest.raises(StoreError, match="refused the request \\(401\\)") as e:
                    op(s)
                errors.append(str(e.value))
        assert raw_get(r.port, f"/{part}", [f"Authorization: Basic {TOKEN}"])[0] == 401
        status, body = raw_get(r.port, f"/{part}", [f"Authorization: Bearer {TOKEN}x"])
        assert status == 401 and TOKEN.encode() not in body
        assert HttpStore(r.url, token=TOKEN).get(part) == store.get(part)
        monkeypatch.setenv("NEMO_DCR_RELAY_TOKEN_FILE", str(tmp_path / "token"))
        f = Follower(open_store(r.url), {k: v.clone().zero_() for k, v in model().items()})
        assert f.sync().version == 0
        assert TOKEN not in repr(open_store(r.url)) and TOKEN not in open_store(r.url).url
        assert not any(TOKEN in m for m in errors)
    finally:
        r.stop()
    assert r.proc.returncode == 0
    assert TOKEN not in r.output()


def test_a_token_file_that_cannot_be_read_is_an_error_that_names_only_the_file(tmp_path, capsys):
    from nemo_dcr.cli.main import main
    (tmp_path / "token").write_text(f"{TOKEN} second-word\n")
    assert main(["relay", "--listen", "127.0.0.1:0", "--upstream", str(tmp_path / "s"),
                 "--token-file", str(tmp_path / "token")]) == 1
    err = capsys.readouterr().err
    assert "token file" in err and TOKEN not in err
    assert main(["relay", "--listen", "127.0.0.1:0", "--upstream", str(tmp_path / "s"),
                 "--token-file", str(tmp_path / "missing")]) == 1
    assert "cannot read the token file" in capsys.readouterr().err


def test_nothing_outside_the_namespace_is_served(tmp_path):
    secret = b"SECRET-outside-the-store"
    (tmp_path / "secret.txt").write_bytes(secret)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "run1").mkdir()
    (tmp_path / "store" / "run1" / "ok").write_bytes(b"fine")
    (tmp_path / "store" / ".locks").mkdir()
    (tmp_path / "store" / ".locks" / "000.lock").write_bytes(secret)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "ok").write_bytes(secret)
    store = open_store(tmp_path / "store")
    Publisher(store).publish(model())
    r = RelayProc(str(tmp_path / "store"), "--prefix", "ns")
    try:
        assert raw_get(r.port, "/ns/HEAD") == (200, store.get("HEAD"))
        assert raw_get(r.port, "/ns/run1/ok")[0] == 404  # in the store, but not of its layout: not forwarded
        bad = [
            "/ns/../secret.txt", "/ns/run1/../../secret.txt", "/ns/%2e%2e/secret.txt",
            "/ns/%2E%2E/%2e%2e/secret.txt", "/ns/run1/..%2f..%2fsecret.txt", "/ns/..%5csecret.txt",
            "/ns/%2fetc%2fpasswd", "/ns//etc/passwd", "/ns/run1//ok", "/ns/.locks/000.lock",
            "/ns/%2elocks/000.lock", "/ns/run1/%00ok", "/ns/run1/ok%0a", "/ns/%c0%ae%c0%ae/secret.txt",
            "/ns/./run1/ok", "/ns/run1/./ok", "/../other/ok", "/%2e%2e/other/ok", "/ns%2f..%2fother/ok",
            "/other/ok", "/ns", "/ns/", "/ns/.list/../x", "/ns/HEAD/../../secret.txt",
        ]
        for path in bad:
            status, body = raw_get(r.port, path)
            assert status in (400, 404), (path, status, body)
            assert secret not in body, path
        status, body = raw_get(r.port, "/ns/.list?prefix=../")
        assert status == 400 and secret not in body
        assert HttpStore(r.url).list() == [k for k in store.list() if k == "HEAD" or k.startswith("versions/")]
        assert "run1/ok" in store.list()
        assert HttpStore(r.url).stats()["refused"] >= len(bad)
        for method in ("PUT", "POST", "DELETE"):  # a relay serves reads only
            with socket.create_connection(("127.0.0.1", r.port), timeout=30) as s:
                s.sendall(f"{method} /ns/run1/ok HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                          "Connection: close\r\n\r\n2".encode())
                assert s.recv(100).split(b" ")[1] == b"405"
        assert (tmp_path / "store" / "run1" / "ok").read_bytes() == b"fine"
    finally:
        r.stop()
