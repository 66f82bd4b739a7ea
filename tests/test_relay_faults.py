"""Relay faults with real relay processes: a relay killed mid-object, a parent relay dying under
a child relay, a corrupt object in the store. A relay is made to stop mid-object with the
fault-injection variable NEMO_DCR_RELAY_FAULT_STALL_AFTER (it sends that many bytes of each
.dcr object, says so on stderr, then hangs as a frozen machine would) and is then SIGKILLed."""
import threading

import pytest

from dcr_testing import assert_state, zeros_like
from dcr_testing.relay import RelayProc, model, train_step, wait_until
from nemo_dcr.stores import FallbackStore, HttpStore, open_store
from nemo_dcr.sync.follower import CorruptObjectError, Follower
from nemo_dcr.sync.publisher import Publisher

pytest.importorskip("aiohttp")

STALL = {"NEMO_DCR_RELAY_FAULT_STALL_AFTER": "65536"}


def _parts(store):
    return [k for k in store.list("versions/") if k.endswith(".dcr")]


def test_relay_killed_mid_version_child_falls_back_to_the_store_and_a_restarted_relay_rejoins(tmp_path):
    store = open_store(tmp_path / "store")
    state = model(n=1 << 18)  # a 512 KB keyframe: the relay stops after 64 KB of it
    pub = Publisher(store)
    pub.publish(state)
    r = RelayProc(store.url, env=STALL)
    child = FallbackStore([HttpStore(r.url), store], retry_after=0)
    f = Follower(child, zeros_like(state))
    out = {}
    t = threading.Thread(target=lambda: out.update(res=f.sync()))
    t.start()
    m = r.wait_line(r"stalled (\S+) at byte (\d+)")
    assert m.group(1) == _parts(store)[0] and int(m.group(2)) == 65536
    assert t.is_alive()  # the child holds 64 KB of the keyframe and waits for more
    r.kill()
    t.join(60)
    assert not t.is_alive() and out["res"].version == 0
    assert_state(f.tensors, state)

    # the relay comes back on its port: the child reads through it again
    r2 = RelayProc(store.url, listen=f"127.0.0.1:{r.port}")
    try:
        train_step(state, 1)
        pub.publish(state)
        assert f.sync().version == 1
        assert_state(f.tensors, state)
        fetched = HttpStore(r2.url).stats()["upstream_fetches_by_key"]
        assert any(k.startswith("versions/000000000001/") and k.endswith(".dcr") for k in fetched)
    finally:
        r2.stop()


def test_child_relay_streams_while_its_parent_sends_and_finishes_from_the_store_when_the_parent_dies(tmp_path):
    """store -> A -> B -> child: B passes A's bytes on while they arrive (cut-through); A freezes
    and is killed mid-object; B resumes the object from the store and the child gets it whole."""
    store = open_store(tmp_path / "store")
    state = model(n=1 << 18)
    Publisher(store).publish(state)
    part = _parts(store)[0]
    data = store.get(part)
    a = RelayProc(store.url, env=STALL)
    b = RelayProc([a.url, store.url])
    try:
        got, out = bytearray(), {}

        def child():
            size, chunks = HttpStore(b.url).get_stream(part)
            out["size"] = size
            for c in chunks:
                got.extend(c)

        t = threading.Thread(target=child)
        t.start()
        a.wait_line("stalled")
        wait_until(lambda: len(got) == 65536, "the child to hold what A has sent")
        sb = HttpStore(b.url).stats()
        assert sb["cache_entries"] == 0 and t.is_alive()  # B does not have the object yet
        a.kill()
        t.join(60)
        assert not t.is_alive() and out["size"] == len(data) and bytes(got) == data
        # B files the object in its cache after it sent the last byte (verified first): wait for it
        wait_until(lambda: HttpStore(b.url).stats()["cache_entries"] >= 1, "B to keep the verified object")
        sb = HttpStore(b.url).stats()
        assert sb["upstream_fetches_by_key"][part] == 1  # resumed, not fetched again
        assert sb["bad_objects"] == 0  # verified and kept
        assert HttpStore(b.url).get(part) == data  # from B's cache now: A is gone
    finally:
        b.stop()
        a.stop()


def test_relay_never_keeps_a_corrupt_object(tmp_path):
    """An object whose bytes do not match its manifest is passed on (the child rejects it) but not
    kept: every request fetches it again, so once the store is repaired the children recover."""
    store = open_store(tmp_path / "store")
    state = model()
    Publisher(store).publish(state)
    part = _parts(store)[0]
    good = store.get(part)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x40
    path = tmp_path / "store" / part
    path.write_bytes(bytes(bad))
    r = RelayProc(store.url)
    try:
        s = HttpStore(r.url)
        f = Follower(s, zeros_like(state), retries=1, backoff=0)
        with pytest.raises(CorruptObjectError):
            f.sync()
        # the relay checks a download against its manifest after the last byte went out: the
        # child may have rejected the second copy before the relay counted it (bounded wait)
        wait_until(lambda: s.stats()["bad_objects"] >= 2, "the relay to check the second copy")
        st = s.stats()
        assert st["upstream_fetches_by_key"][part] == 2 and st["bad_objects"] == 2
        assert st["cache_entries"] == 0  # nothing (the manifest came with HEAD: format 3)
        path.write_bytes(good)
        assert f.sync().version == 0
        assert_state(f.tensors, state)
        wait_until(lambda: s.stats()["cache_entries"] >= 1, "the relay to keep the repaired copy")
        st = s.stats()
        assert st["upstream_fetches_by_key"][part] == 3 and st["cache_entries"] == 1
    finally:
        r.stop()
