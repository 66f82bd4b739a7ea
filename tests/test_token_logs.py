"""Bearer tokens never appear in logs, error messages or reprs (issue 14, Security), on either side
of a relay and at DEBUG level: two real relay processes (a child whose token for its parent is
wrong) with every logger at DEBUG (a sitecustomize on their path), and a client whose logs are
captured at DEBUG too."""
import logging
import traceback

import pytest

from dcr_testing.relay import RelayProc, model
from nemo_dcr.errors import DcrError
from nemo_dcr.stores import HttpStore, LocalStore, open_store
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher

pytest.importorskip("aiohttp")

ROOT_TOKEN = "root-Tok3n-a1b2c3d4e5"
CHILD_TOKEN = "child-Tok3n-f6a7b8c9d0"
WRONG = "wrong-Tok3n-123456789"
TOKENS = (ROOT_TOKEN, CHILD_TOKEN, WRONG)


def clean(text: str, where: str) -> None:
    for t in TOKENS:
        assert t not in text, f"{where} shows a token"
        assert t[:12] not in text, f"{where} shows part of a token"


def test_tokens_never_appear_in_logs_messages_or_reprs(tmp_path, caplog):
    store = LocalStore(tmp_path / "s")
    Publisher(store, signer=None).publish(model())
    for name, t in (("root", ROOT_TOKEN), ("child", CHILD_TOKEN), ("wrong", WRONG)):
        (tmp_path / name).write_text(t + "\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import logging\nlogging.basicConfig(level=logging.DEBUG)\n")
    import os
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    root = RelayProc(store.url, "--token-file", tmp_path / "root", env=env)
    child = RelayProc(root.url, "--token-file", tmp_path / "child", "--upstream-token-file", tmp_path / "wrong",
                      "--poll-interval", "0.05", env=env)
    caplog.set_level(logging.DEBUG)
    messages = []
    try:
        part = [k for k in store.list("versions/") if k.endswith(".dcr")][0]
        good = HttpStore(child.url, token=CHILD_TOKEN)
        for op in (lambda: good.get(part), lambda: good.get_with_tag("HEAD"), lambda: good.wait_head(None, 0.3),
                   lambda: good.list("versions/")):
            with pytest.raises(DcrError) as ei:  # the child cannot get past its parent: wrong token
                op()
            messages.append(str(ei.value))
            messages.append("".join(traceback.format_exception(ei.value)))
        assert any("401" in m or "bearer token" in m for m in messages), messages
        for token in ("", WRONG, CHILD_TOKEN[:-1]):
            bad = HttpStore(child.url, token=token)
            with pytest.raises(DcrError) as ei:
                Follower(bad, {k: v.clone().zero_() for k, v in model().items()}, verifier=None).sync()
            messages += [str(ei.value), repr(ei.value), "".join(traceback.format_exception(ei.value)), repr(bad),
                         bad.url]
        both = open_store([child.url, root.url], token=CHILD_TOKEN)
        messages.append(repr(both))
        # the root itself, with its token, works: the logs below include successful requests too
        assert HttpStore(root.url, token=ROOT_TOKEN).get(part) == store.get(part)
    finally:
        child.stop()
        root.stop()
    assert "DEBUG" in root.output() + child.output()  # the processes did log at DEBUG
    assert "upstream" in child.output()  # and the child did log its parent's refusals
    clean(root.output(), "the root relay's output")
    clean(child.output(), "the child relay's output")
    clean(caplog.text, "the client's log")
    for m in messages:
        clean(m, f"message {m[:80]!r}")


@pytest.mark.parametrize("debug", [False, True])
def test_a_malformed_authorization_header_is_never_logged(tmp_path, debug):
    """aiohttp logs a request it cannot parse with the raw header line in its traceback: a control
    character after the real token (or a near miss of it) put the token in the relay's log."""
    import os
    import socket

    from dcr_testing.relay import raw_get
    store = LocalStore(tmp_path / "s")
    Publisher(store, signer=None).publish(model())
    (tmp_path / "root").write_text(ROOT_TOKEN + "\n")
    env = {}
    if debug:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text("import logging\nlogging.basicConfig(level=logging.DEBUG)\n")
        env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = RelayProc(store.url, "--token-file", tmp_path / "root", env=env)
    near = ROOT_TOKEN[:-1] + ("X" if ROOT_TOKEN[-1] != "X" else "Y")
    try:
        for tok in (ROOT_TOKEN, near):
            for tail in ("\x01", "\x00", "\x7f", "\x0b x", "\x1b[0m", "\x08"):
                for header in (f"Authorization: Bearer {tok}{tail}", f"authorization:Bearer {tail}{tok}",
                               f"Authorization: {tok}{tail}", f"X-Token: {tok}{tail}"):
                    with socket.create_connection(("127.0.0.1", r.port), timeout=30) as s:
                        s.sendall(f"GET /HEAD HTTP/1.1\r\nHost: x\r\n{header}\r\nConnection: close\r\n\r\n"
                                  .encode("latin-1"))
                        answer = b""
                        while chunk := s.recv(65536):
                            answer += chunk
                    assert answer.split(b" ", 2)[1] == b"400", answer[:200]
        assert raw_get(r.port, "/HEAD", [f"Authorization: Bearer {ROOT_TOKEN}"]) == (200, store.get("HEAD"))
    finally:
        r.stop()
    out = r.output()
    for t in (ROOT_TOKEN, near):
        assert t not in out and t[:12] not in out, out[-3000:]
    assert "Traceback" not in out
    assert "malformed request" in out  # the refusals were logged, as one line each
