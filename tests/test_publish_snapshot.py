"""The publisher's host snapshot (its private copy of the last published state) follows each
committed version by the changes the diff found, instead of a copy of the model per version
(``sync/publisher.py``, ``_Changes``). It must stay a private copy holding exactly what was
published (NaN payloads, -0.0, strided and sharded tensors included), and a failed publish must
leave it the base of the next delta."""
from __future__ import annotations

import pytest
import torch

from dcr_testing import assert_state, zeros_like
from nemo_dcr import Follower, Publisher, ShardSpec
from nemo_dcr.errors import CommitConflict, PublishError
from nemo_dcr.stores.local import LocalStore
from nemo_dcr.sync import publisher as publisher_mod


def _states(n=3, seed=0):
    """``n`` versions: a bf16 matrix with special values, a strided fp32 view, an int64 counter."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 40, generator=g).to(torch.bfloat16)
    w.view(torch.int16).view(-1)[:4] = torch.tensor([0x7FC1, -0x8000, 0x0001, 0x7F80], dtype=torch.int16)
    big = torch.randn(50, 64, generator=g)
    out = [{"w": w, "b": big[:, ::2], "step": torch.zeros(3, dtype=torch.int64)}]
    for i in range(1, n):
        s = {k: v.clone() for k, v in out[-1].items()}
        s["w"].view(-1)[i::53] = torch.randn(s["w"].numel() // 53 + (1 if i < s["w"].numel() % 53 else 0),
                                             generator=g).to(torch.bfloat16)
        s["w"].view(torch.int16).view(-1)[4 + i] = 0x7FC0 + i  # a NaN payload
        s["b"][i, 3] = -0.0
        s["step"] += 1
        s["b"] = torch.cat([s["b"], s["b"]], 1)[:, ::2]  # still strided
        out.append(s)
    return out


def test_the_snapshot_follows_in_place_and_stays_private(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store, chunk_elems=512)
    seq = _states(4)
    live = {k: v.clone() for k, v in seq[0].items()}
    pub.publish(live)
    snap = dict(pub.published[0])
    assert not {t.data_ptr() for t in snap.values()} & {t.data_ptr() for t in live.values()}
    copies = []
    real = publisher_mod.snapshot
    monkeypatch.setattr(publisher_mod, "snapshot", lambda t: copies.append(1) or real(t))
    recv = zeros_like(seq[0])
    fol = Follower(store, recv)
    fol.sync()
    for s in seq[1:]:
        for k in live:  # the trainer's tensors change in place between versions
            live[k].copy_(s[k])
        pub.publish(live)
        assert all(pub.published[0][k] is snap[k] for k in snap)  # the same tensors, updated
        assert_state(pub.published[0], s)
        fol.sync()
        assert_state(recv, s)
    assert copies == []  # no copy of the model after the first version
    live["w"].view(-1)[:10] = 7.0  # the caller's tensors are the caller's
    assert_state(pub.published[0], seq[-1])


def test_a_failed_publish_leaves_the_snapshot_the_base(tmp_path):
    class Failing(LocalStore):
        fail = False

        def put(self, key, data):
            if self.fail and key.endswith(".dcr"):
                raise OSError("injected: upload failed")
            return super().put(key, data)

    store = Failing(tmp_path / "s")
    seq = _states(3)
    pub = Publisher(store, chunk_elems=512)
    pub.publish(seq[0])
    store.fail = True
    with pytest.raises(PublishError, match="injected"):
        pub.publish(seq[1])
    assert_state(pub.published[0], seq[0])  # nothing of the failed version reached the snapshot
    store.fail = False
    r = pub.publish(seq[2])  # a delta against version 0, the last one committed
    assert r.version == 1 and r.manifest.base_version == 0
    assert_state(pub.published[0], seq[2])
    recv = zeros_like(seq[0])
    Follower(LocalStore(tmp_path / "s"), recv).sync()
    assert_state(recv, seq[2])


def test_a_lost_commit_race_leaves_the_snapshot_and_the_next_publish_rebuilds(tmp_path):
    store = LocalStore(tmp_path / "s")
    seq = _states(3)
    pub = Publisher(store, chunk_elems=512)
    pub.publish(seq[0])
    other = Publisher(store, chunk_elems=512)
    real = pub._commit

    def racing(*a, **k):  # another publisher commits first, between our upload and our commit
        other.publish(seq[2])
        return real(*a, **k)
    pub._commit = racing
    with pytest.raises(CommitConflict):
        pub.publish(seq[1])
    assert_state(pub.published[0], seq[0])
    pub._commit = real
    pub.publish(seq[1])  # the store moved on: rebuilt from it, then a delta (not the in-place path)
    recv = zeros_like(seq[0])
    Follower(store, recv).sync()
    assert_state(recv, seq[1])
    assert_state(pub.published[0], seq[1])


def test_a_version_that_changes_most_elements_copies_the_snapshot_whole(tmp_path):
    store = LocalStore(tmp_path / "s")
    seq = _states(1)
    dense = {k: (v + 1 if v.dtype == torch.int64 else (v.float() * 1.5 + 0.25).to(v.dtype)) for k, v in seq[0].items()}
    pub = Publisher(store, chunk_elems=512)
    pub.publish(seq[0])
    snap = dict(pub.published[0])
    pub.publish(dense)
    assert all(pub.published[0][k] is snap[k] for k in snap)
    assert_state(pub.published[0], dense)
    recv = zeros_like(seq[0])
    Follower(store, recv).sync()
    assert_state(recv, dense)


def test_a_sharded_snapshot_follows_its_shard(tmp_path):
    """A rank's row shard of a global tensor: the changes come as global indices and go into the
    shard at its local ones."""
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(40, 24, generator=g).to(torch.bfloat16)]
    nxt = full[0].clone()
    nxt.view(-1)[::7] += 1
    full.append(nxt)
    spec = ShardSpec.of((40, 24), (16, 0), (12, 24))
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store, chunk_elems=64)
    for f in full:
        pub.publish({"w": f[16:28].clone()}, {"w": spec})
        assert_state(pub.published[0], {"w": f[16:28]})
    recv = {"w": torch.zeros(12, 24, dtype=torch.bfloat16)}
    Follower(store, recv, {"w": spec}).sync()
    assert_state(recv, {"w": full[1][16:28]})


def test_a_schema_change_takes_a_fresh_copy(tmp_path):
    store = LocalStore(tmp_path / "s")
    seq = _states(2)
    pub = Publisher(store, chunk_elems=512)
    pub.publish(seq[0])
    grown = {**seq[1], "extra": torch.arange(5, dtype=torch.int32)}
    pub.publish(grown)
    assert_state(pub.published[0], grown)
    assert not {t.data_ptr() for t in pub.published[0].values()} & {t.data_ptr() for t in grown.values()}
    recv = zeros_like(seq[0])
    Follower(store, recv).sync()
    assert_state(recv, grown)


def _sparse(n=3, seed=1):
    """``n`` versions changing ~1/20 of their elements (under ``_Changes.MAX_SHARE``), NaN
    payloads and -0.0 among the new values."""
    g = torch.Generator().manual_seed(seed)
    out = [{"w": torch.randn(64, 48, generator=g).to(torch.bfloat16), "b": torch.randn(40, 30, generator=g)}]
    for i in range(1, n):
        s = {k: v.clone() for k, v in out[-1].items()}
        flat = s["w"].view(-1)
        flat[i::20] = torch.randn(flat[i::20].numel(), generator=g).to(torch.bfloat16)
        s["w"].view(torch.int16).view(-1)[7 + i] = 0x7FC0 + i  # a NaN payload
        s["b"].view(-1)[i::23] = -0.0
        out.append(s)
    return out


@pytest.mark.parametrize("fv", [2, 3])
def test_a_publish_that_fails_after_its_changes_went_in_takes_them_out(tmp_path, fv):
    """Format 3 writes each chunk's changes into the snapshot while the diff runs (the diff reads
    no base chunk after it reported its changes); versions 1 and 2 at the commit. A commit that
    loses its race comes after the whole diff: the snapshot must still end at the base."""
    store = LocalStore(tmp_path / "s")
    seq = _sparse(3)
    pub = Publisher(store, chunk_elems=512, format_version=fv)
    pub.publish(seq[0])
    other = Publisher(store, chunk_elems=512, format_version=fv)
    real, seen = pub._commit, []

    def racing(*a, **k):
        seen.append({k: v.clone() for k, v in pub.published[0].items()})
        other.publish(seq[2])
        return real(*a, **k)
    pub._commit = racing
    with pytest.raises(CommitConflict):
        pub.publish(seq[1])
    assert_state(seen[0], seq[1] if fv == 3 else seq[0])  # where the diff left the snapshot
    assert_state(pub.published[0], seq[0])
    pub._commit = real
    pub.publish(seq[1])
    recv = zeros_like(seq[0])
    Follower(store, recv).sync()
    assert_state(recv, seq[1])


def test_a_diff_that_fails_midway_leaves_the_snapshot_the_base(tmp_path, monkeypatch):
    """The version is split into parts (one tensor each): the second part's encode fails after
    the first part's changes went into the snapshot."""
    store = LocalStore(tmp_path / "s")
    seq = _sparse(3)
    pub = Publisher(store, chunk_elems=512, part_bytes=1)
    pub.publish(seq[0])
    real, calls = publisher_mod.diff, []

    def failing(base, target, **kw):
        calls.append(sorted(target))
        if len(calls) == 2:
            raise OSError("injected: encode failed")
        return real(base, target, **kw)
    monkeypatch.setattr(publisher_mod, "diff", failing)
    with pytest.raises(PublishError, match="injected"):
        pub.publish(seq[1])
    assert len(calls) == 2 and calls[0] != calls[1]
    assert_state(pub.published[0], seq[0])
    monkeypatch.setattr(publisher_mod, "diff", real)
    r = pub.publish(seq[2])
    assert r.manifest.base_version == 0
    recv = zeros_like(seq[0])
    Follower(store, recv).sync()
    assert_state(recv, seq[2])


def test_a_version_that_turns_out_dense_midway_takes_its_early_changes_out(tmp_path):
    """The first chunks' changes went into the snapshot before the count passed ``MAX_SHARE``:
    they are taken out again, and a failed publish of such a version leaves the base."""
    store = LocalStore(tmp_path / "s")
    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16)}
    dense = {"w": base["w"].clone()}
    dense["w"].view(-1)[::16] += 1  # 1/16 of the first chunks: under the limit
    dense["w"].view(-1)[2048:] += 1  # then every element: over it
    pub = Publisher(store, chunk_elems=256)
    pub.publish(base)
    real = pub._commit

    def failing(*a, **k):
        raise OSError("injected: commit failed")
    pub._commit = failing
    with pytest.raises(OSError, match="injected"):
        pub.publish(dense)
    assert_state(pub.published[0], base)
    pub._commit = real
    pub.publish(dense)
    assert_state(pub.published[0], dense)
    recv = zeros_like(base)
    Follower(store, recv).sync()
    assert_state(recv, dense)


def test_a_snapshot_that_cannot_be_restored_is_rebuilt_from_the_store(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "s")
    seq = _sparse(3)
    pub = Publisher(store, chunk_elems=512)
    pub.publish(seq[0])
    real = pub._commit

    def failing(*a, **k):
        raise OSError("injected: commit failed")

    def broken(self):
        raise RuntimeError("injected: undo failed")
    pub._commit = failing
    monkeypatch.setattr(publisher_mod._Changes, "undo", broken)
    with pytest.raises(OSError, match="injected: commit failed"):
        pub.publish(seq[1])
    assert pub.published is None  # forgotten, not left half-written
    pub._commit = real
    r = pub.publish(seq[2])  # rebuilt from the store, then a delta against version 0
    assert r.manifest.base_version == 0
    recv = zeros_like(seq[0])
    Follower(store, recv).sync()
    assert_state(recv, seq[2])


def test_a_publisher_on_a_store_takes_the_verified_digest_instead_of_summing_the_state(tmp_path, monkeypatch):
    """A new publisher rebuilds its base from the store; alone, its digest of that base is the
    one its sync checked against the manifest, taken as it is (no O(model) sum), and the next
    version is a delta on it that a follower applies bit-exactly (its digests checked)."""
    store = LocalStore(tmp_path / "s")
    seq = _states(3)
    Publisher(store, chunk_elems=512).publish(seq[0])
    Publisher(store, chunk_elems=512).publish(seq[1])
    summed, real = [], publisher_mod.state_contrib
    monkeypatch.setattr(publisher_mod, "state_contrib", lambda *a, **k: summed.append(1) or real(*a, **k))
    pub = Publisher(store, chunk_elems=512)
    r = pub.publish(seq[2])
    assert r.manifest.base_version == 1 and r.manifest.parts  # a delta on the rebuilt base
    assert summed == []
    recv = zeros_like(seq[0])
    Follower(store, recv).sync()
    assert_state(recv, seq[2])


def test_a_first_keyframe_fills_the_snapshot_as_it_encodes(tmp_path, monkeypatch):
    """A keyframe alone (a store's first version) is encoded from the caller's tensors, each
    chunk copied into a fresh snapshot as it is encoded (``diff(copy_into=...)``), not copied
    whole first: the snapshot is still private, holds every bit (NaN payloads, -0.0, a strided
    view, integers, a 0-d and an empty tensor, tensors over several chunks and parts), and the
    next delta is made against it."""
    seq = _states(3, seed=4)
    for s in seq:
        s["scalar"], s["empty"] = torch.tensor(-0.0), torch.zeros(0, 5, dtype=torch.float16)
    copies = []
    real = publisher_mod.snapshot
    monkeypatch.setattr(publisher_mod, "snapshot", lambda t: copies.append(1) or real(t))
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store, chunk_elems=512, part_bytes=4096, workers=2)
    live = {k: v.clone() for k, v in seq[0].items()}
    r = pub.publish(live)
    assert copies == [] and len(r.manifest.keyframe_parts) > 1
    snap = pub.published[0]
    assert not {t.data_ptr() for t in snap.values() if t.numel()} & {t.data_ptr() for t in live.values() if t.numel()}
    assert_state(snap, seq[0])
    for k in live:  # the caller's tensors are the caller's
        live[k].zero_()
    assert_state(pub.published[0], seq[0])
    recv = zeros_like(seq[0])
    fol = Follower(store, recv)
    for s in seq[1:]:
        for k in live:
            live[k].copy_(s[k])
        assert pub.publish(live).manifest.parts  # a delta against the snapshot
        assert fol.sync().steps[-1][0] == "delta"
        assert_state(recv, s)
        assert_state(pub.published[0], s)


def test_diff_copy_into_gets_every_chunk_and_changes_no_byte(monkeypatch):
    import time

    from nemo_dcr import diff
    from nemo_dcr.errors import DcrError
    monkeypatch.setattr(time, "time", lambda: 1700000000.0)  # the header's "created": the same bytes
    s = _states(1, seed=5)[0]
    s["scalar"] = torch.tensor(float("nan"))
    want = diff({}, s, chunk_elems=700, encoding="overwrite", workers=2)
    into = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in s.items()}
    assert diff({}, s, chunk_elems=700, encoding="overwrite", workers=2, copy_into=into) == want
    assert_state(into, s)
    with pytest.raises(DcrError, match="copy_into needs a contiguous CPU tensor"):
        diff({}, s, copy_into={"b": torch.empty(s["b"].shape, dtype=torch.float64)})
    with pytest.raises(DcrError, match="copy_into needs a contiguous CPU tensor"):
        diff({}, s, copy_into={"w": torch.empty(s["w"].shape[::-1], dtype=s["w"].dtype).t()})


def test_diff_write_base_writes_each_chunk_before_its_report_or_writes_it_back(monkeypatch):
    """``diff(write_base=...)``: a chunk asked yes is in the base before its ``on_change`` report
    (a contiguous tensor by the encoder's pass, a strided one after it), with the bytes of a diff
    that writes nothing; asked no, nothing is written; a chunk whose report raises is written
    back, so the base holds exactly the chunks reported; version 2 refuses it."""
    import time

    from nemo_dcr import diff
    from nemo_dcr.errors import DcrError
    from nemo_dcr.state.flat import FlatAccess
    monkeypatch.setattr(time, "time", lambda: 1700000000.0)  # the header's "created": the same bytes
    seq = _sparse(2, seed=7)
    seq[0]["s"], seq[1]["s"] = (v.t()[::2] for v in (seq[0]["b"], seq[1]["b"]))  # a strided tensor too
    old, new = seq
    plain = diff({k: v.clone() for k, v in old.items()}, new, chunk_elems=256, workers=2)

    def run(answer, fail_at=None):
        base = {k: v.clone() for k, v in old.items()}
        base["s"] = old["b"].clone().t()[::2]  # strided, its own memory: written through the view
        reported = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in base.items()}
        calls = []

        def on_change(name, dtype, shape, gidx, o, n):
            calls.append(name)
            if answer:  # in the base already
                assert torch.equal(FlatAccess(base[name]).gather(gidx), n)
            if fail_at is not None and len(calls) == fail_at:
                raise RuntimeError("injected: report failed")
            reported[name][gidx] = True
        out = None
        try:
            out = diff(base, new, chunk_elems=256, workers=2, on_change=on_change, write_base=lambda: answer)
        except RuntimeError:
            assert fail_at is not None
        return out, base, reported, calls

    out, base, _, calls = run(True)
    assert out == plain and len(calls) > 4
    assert_state(base, new)
    out, base, _, _ = run(False)
    assert out == plain
    assert_state(base, old)
    _, base, reported, calls = run(True, fail_at=3)
    assert len(calls) >= 3
    for k in ("w", "b", "s"):
        want = torch.where(reported[k], FlatAccess(new[k]).read(0, new[k].numel()),
                           FlatAccess(old[k]).read(0, old[k].numel()))
        assert torch.equal(FlatAccess(base[k]).read(0, base[k].numel()), want), k
    with pytest.raises(DcrError, match="write_base needs a segmented delta"):
        diff(old, new, format_version=2, write_base=lambda: True)
