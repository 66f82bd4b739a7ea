"""Relay defects of issue 22, each against real relay processes: a cache directory the relay did
not make is never cleared; malformed requests get 4xx, never a 500 or a traceback; only the
store's own key space is forwarded upstream."""
import subprocess
import sys

import pytest

from dcr_testing.relay import RelayProc, model
from nemo_dcr.stores import HttpStore, open_store
from nemo_dcr.sync.publisher import Publisher

pytest.importorskip("aiohttp")


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
        assert any((cache / "objects").iterdir())  # the manifest and the part were kept
        # one relay per directory: a second one would clear the first one's files
        p = subprocess.run(_relay_cmd(store.url, cache), capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "in use by another relay" in p.stderr, p.stderr
        assert HttpStore(r.url).stats()["cache_entries"] == 2 and any((cache / "objects").iterdir())
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
