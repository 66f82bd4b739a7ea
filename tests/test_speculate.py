"""A follower one version behind asks for that version's parts beside its HEAD read (issue 25,
round trips): the publisher reserves, in each manifest, the publish id of the version after it
and names that version's first objects; the follower reads there while HEAD is read, so its
parts come one round trip after it asked, not two. On a local directory and on a real S3 server
over HTTP. A guess that misses costs nothing but its reads, and what is read so is checked like
anything else."""
from __future__ import annotations

import threading

import pytest
import torch

from nemo_dcr.stores.passthrough import PassThroughStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.speculate import MAX_NAMES, NEXT_META, predicted
from nemo_dcr.sync.versions import HEAD_KEY, Manifest, version_dir


def model(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {f"layers.{i}.w": torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(6)}


def stepped(state: dict, seed: int) -> dict:
    """About 2 % of each tensor's elements changed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        v = v.clone()
        flat = v.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 50]
        flat[idx] = (flat[idx].float() + 0.5).to(v.dtype)
        out[k] = v
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in b)


class HeadAfterParts(PassThroughStore):
    """HEAD is answered only once ``n`` part reads were opened (or after ``wait`` seconds): it
    records whether the parts were asked for before HEAD answered. ``corrupt_first``: the first
    read of each part returns its bytes with one flipped (a fault on the wire)."""

    def __init__(self, inner, n: int, wait: float = 5.0, corrupt_first: bool = False):
        super().__init__(inner)
        self.n, self.wait, self.corrupt_first = n, wait, corrupt_first
        self.parts_asked = threading.Event()
        self.head_waited: list[bool] = []
        self.reads: list[str] = []
        self._lock = threading.Lock()

    def _head(self) -> None:
        self.head_waited.append(self.parts_asked.wait(self.wait))

    def get_with_tag(self, key):
        if key == HEAD_KEY:
            self._head()
        return super().get_with_tag(key)

    def get_if_changed(self, key, tag):
        if key == HEAD_KEY:
            self._head()
        return super().get_if_changed(key, tag)

    def get_stream(self, key, offset=0):
        with self._lock:
            first = key not in self.reads
            self.reads.append(key)
            if sum(k.endswith(".dcr") for k in self.reads) >= self.n:
                self.parts_asked.set()
        size, chunks = super().get_stream(key, offset)
        if not (self.corrupt_first and first and key.endswith(".dcr")):
            return size, chunks

        def flipped():
            data = bytearray(b"".join(chunks))
            data[len(data) // 2] ^= 0x10
            yield bytes(data)
        return size, flipped()


@pytest.mark.parametrize("stream", [True, False])
def test_parts_are_asked_for_beside_the_head_read(store, stream):
    pub = Publisher(store, part_bytes=16 << 10, delta_part_bytes=16 << 10)
    v0, v1 = model(0), stepped(model(0), 1)
    m0 = pub.publish(v0).manifest
    h = m0.meta[NEXT_META]
    assert len(h["parts"]) == len(m0.keyframe_parts) > 1  # the first delta splits as the keyframe did
    m1 = pub.publish(v1).manifest
    assert m1.publish_id == h["publish_id"]  # the version after it is where the hint said
    assert [p.key for p in m1.parts] == predicted(m0, MAX_NAMES)

    # from a keyframe nothing tells how large the next delta's parts are: the first one alone,
    # which the pacing starts at once in any case
    recv = {k: v.clone() for k, v in v0.items()}
    spy = HeadAfterParts(store, n=1)
    res = Follower(spy, recv, manifest=m0, verify_initial=False, stream=stream, prefetch=len(m1.parts)).sync()
    assert res.version == 1 and same(recv, v1) and res.speculated == 1 and spy.head_waited == [True]

    # from a delta: as many as the pacing would start at once (these small parts: all of them)
    v2 = stepped(v1, 2)
    m2 = pub.publish(v2).manifest
    spy = HeadAfterParts(store, n=len(m2.parts))
    f = Follower(spy, recv, manifest=m1, verify_initial=False, stream=stream, prefetch=len(m2.parts))
    res = f.sync()
    assert res.version == 2 and same(recv, v2)
    assert res.speculated == len(m2.parts)
    assert spy.head_waited == [True]  # every part was asked for before HEAD answered
    assert sorted(k for k in spy.reads if k.endswith(".dcr")) == sorted(p.key for p in m2.parts)  # each read once

    # and so on from version to version, each one's manifest naming the next
    v3 = stepped(v2, 3)
    m3 = pub.publish(v3).manifest
    spy.parts_asked.clear()
    spy.reads.clear()
    spy.n = len(m3.parts)
    res = f.sync()
    assert res.version == 3 and same(recv, v3) and res.speculated == len(m3.parts)
    assert spy.head_waited[-1] is True


def test_a_guess_that_misses_costs_only_its_reads(tmp_path):
    pub = Publisher(str(tmp_path / "s"), part_bytes=16 << 10, delta_part_bytes=16 << 10)
    v0, v1, v2 = model(0), stepped(model(0), 1), stepped(stepped(model(0), 1), 2)
    pub.publish(v0)
    recv = {k: v.clone() for k, v in v0.items()}
    f = Follower(str(tmp_path / "s"), recv, version=0, verify_initial=False)

    res = f.sync()  # nothing new: HEAD names the version held
    assert res.version == 0 and not res.updated and res.speculated == 0

    # another publisher (a restarted trainer) does not know the reservation: a fresh id
    other = Publisher(str(tmp_path / "s"), part_bytes=16 << 10, delta_part_bytes=16 << 10)
    m1 = other.publish(v1).manifest
    assert m1.publish_id != f.manifest.meta[NEXT_META]["publish_id"]
    res = f.sync()
    assert res.version == 1 and same(recv, v1) and res.speculated == 0

    # two versions at once: the first one's parts were guessed right, the second one's are read after
    other.publish(v2)
    other.publish(stepped(v2, 3))
    res = f.sync()
    assert res.version == 3 and same(recv, stepped(v2, 3)) and res.speculated > 0
    assert res.path == "deltas 2..3"


def test_what_is_read_beside_head_is_checked(tmp_path):
    """The guessed reads come back damaged: each part's sha256 refuses them, and the follower
    reads them again (as any failed download), ending bit-exact."""
    pub = Publisher(str(tmp_path / "s"), part_bytes=16 << 10, delta_part_bytes=16 << 10)
    v0, v1 = model(0), stepped(model(0), 1)
    pub.publish(v0)
    m1 = pub.publish(v1).manifest
    v2 = stepped(v1, 2)
    m2 = pub.publish(v2).manifest
    recv = {k: v.clone() for k, v in v1.items()}
    spy = HeadAfterParts(Publisher(str(tmp_path / "s")).store, n=len(m2.parts), corrupt_first=True)
    f = Follower(spy, recv, manifest=m1, verify_initial=False, prefetch=len(m2.parts), backoff=0.0)
    res = f.sync()
    assert res.version == 2 and same(recv, v2)
    assert res.speculated == len(m2.parts) and spy.head_waited == [True]
    assert all(spy.reads.count(p.key) == 2 for p in m2.parts)  # the damaged read, then a good one


def test_not_guessed_when_switched_off(tmp_path):
    pub = Publisher(str(tmp_path / "s"), part_bytes=16 << 10, delta_part_bytes=16 << 10)
    v0, v1 = model(0), stepped(model(0), 1)
    m0 = pub.publish(v0).manifest
    pub.publish(v1)
    spy = HeadAfterParts(Publisher(str(tmp_path / "s")).store, n=1, wait=0.0)
    recv = {k: v.clone() for k, v in v0.items()}
    res = Follower(spy, recv, manifest=m0, verify_initial=False, speculate=False).sync()
    assert res.version == 1 and same(recv, v1) and res.speculated == 0
    assert spy.head_waited == [False]  # HEAD answered before any part was asked for


def test_through_a_relay_guesses_go_on_and_misses_stay_there(tmp_path):
    """Through a real relay process: the guesses for a committed version go on to the upstream
    (one round trip); a guess the upstream did not have is answered by the relay itself the next
    times, until HEAD names its version, so children polling with nothing new do not cross the
    slow link once each (transport/guesses.py)."""
    pytest.importorskip("aiohttp")
    from dcr_testing.relay import RelayProc
    from nemo_dcr.stores import HttpStore

    store_dir = tmp_path / "store"
    pub = Publisher(str(store_dir), part_bytes=16 << 10, delta_part_bytes=16 << 10)
    v0, v1 = model(0), stepped(model(0), 1)
    m0 = pub.publish(v0).manifest
    m1 = pub.publish(v1).manifest
    # a miss is remembered for the relay's poll interval: long here, so that the test does not
    # depend on how fast the machine is
    relay = RelayProc(str(store_dir), "--poll-interval", "120")
    try:
        recv = {k: v.clone() for k, v in v0.items()}
        f = Follower(relay.url, recv, manifest=m0, verify_initial=False, prefetch=len(m1.parts))
        res = f.sync()
        assert res.version == 1 and same(recv, v1) and res.speculated == 1  # from a keyframe: the first part
        fetched = HttpStore(relay.url).stats()["upstream_fetches_by_key"]
        assert all(fetched.get(p.key) == 1 for p in m1.parts), fetched  # each part fetched once

        guessed = [k for k in predicted(m1, MAX_NAMES)]
        children = [Follower(relay.url, {k: v.clone() for k, v in v1.items()}, manifest=m1, verify_initial=False,
                             prefetch=len(guessed)) for _ in range(3)]
        for c in children:
            for _ in range(2):
                r = c.sync()  # nothing new
                assert r.version == 1 and not r.updated and r.speculated == 0
        st = HttpStore(relay.url).stats()
        # the first guess of each key went on (a miss), the other five children's syncs' did not
        assert st["guesses_answered"] == 5 * len(guessed), st
        assert all(st["upstream_fetches_by_key"].get(k) == 1 for k in guessed), st  # once each upstream

        # then the version is published: HEAD names it, and the remembered misses no longer hold
        v2 = stepped(v1, 2)
        m2 = pub.publish(v2).manifest
        assert [p.key for p in m2.parts] == guessed
        r = children[0].sync()
        assert r.version == 2 and same(children[0].tensors, v2)
        assert r.speculated == len(guessed)
    finally:
        relay.stop()


def test_the_hint_is_the_publishers_own(tmp_path):
    pub = Publisher(str(tmp_path / "s"))
    with pytest.raises(ValueError, match=NEXT_META):
        pub.publish(model(0), meta={NEXT_META: "mine"})
    assert pub.version is None and not (tmp_path / "s" / HEAD_KEY).exists()  # refused before any write
    # a malformed hint (a damaged or foreign manifest) is no guess, not an error
    m = pub.publish(model(0), meta={"run": "x"}).manifest
    assert m.meta["run"] == "x"
    for bad in ("x", {"publish_id": "../../etc", "parts": ["part-00000.dcr"]},
                {"publish_id": "ok", "parts": ["../manifest.json", 3]}):
        d = m.stored()
        d.pop("checksum")
        d["meta"] = {NEXT_META: bad}
        forged = Manifest(**{**d, "parts": [], "keyframe_parts": m.keyframe_parts})
        assert predicted(forged, MAX_NAMES) == []
    ok = predicted(m, 1)
    assert ok == [f"{version_dir(1, m.meta[NEXT_META]['publish_id'])}/part-00000.dcr"]


def test_as_many_at_once_as_the_pacing_would_start(tmp_path):
    """The reads sent beside HEAD are those the downloads' pacing would start at once: the next
    while the ones before it have at most a window (a BDP) to come, the held delta's part sizes
    taken for the next one's."""
    pub = Publisher(str(tmp_path / "s"), part_bytes=16 << 10, delta_part_bytes=16 << 10)
    pub.publish(model(0))
    m1 = pub.publish(stepped(model(0), 1)).manifest
    sizes = [p.size for p in m1.parts]
    assert len(sizes) >= 3
    keys = predicted(m1, MAX_NAMES)
    assert len(keys) == len(sizes)
    assert predicted(m1, MAX_NAMES, window=float("inf")) == keys
    assert predicted(m1, MAX_NAMES, window=0) == keys[:1]  # a bandwidth-bound link: one after the other
    assert predicted(m1, MAX_NAMES, window=sizes[0] + sizes[1]) == keys[:3]
    assert predicted(m1, 2, window=float("inf")) == keys[:2]  # never more than the follower's prefetch


def test_a_relay_remembers_a_miss_for_its_poll_interval():
    from nemo_dcr.transport.guesses import Misses

    now = [0.0]
    m = Misses(0.5, cap=2, clock=lambda: now[0])
    m.missed("versions/000000000002/a/part-00000.dcr")
    assert m.recent("versions/000000000002/a/part-00000.dcr")
    now[0] = 0.6
    assert not m.recent("versions/000000000002/a/part-00000.dcr")  # asked upstream again after the interval
    for k in ("a", "b", "c"):
        m.missed(k)
    assert not m.recent("a") and m.recent("b") and m.recent("c")  # at most cap kept, the oldest dropped
    m.found("c")
    assert not m.recent("c")
