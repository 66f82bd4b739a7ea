"""Whole-region ("full") entries written into differently sharded receivers, the applied-chunk
journal, and the change hook that incremental digests use."""
import threading

import torch

from dcr_testing import assert_bits_equal
from nemo_dcr import ShardSpec, apply, diff
from nemo_dcr.state.index_map import IndexMap


def _shards(full, n, dim):
    size = full.shape[dim] // n
    out = []
    for i in range(n):
        off = [0] * full.dim()
        off[dim] = i * size
        spec = ShardSpec.of(full.shape, off, full.narrow(dim, i * size, size).shape)
        out.append((full.narrow(dim, i * size, size).clone(), spec))
    return out


def test_keyframe_from_row_shards_into_column_shards_over_stale_data():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(8, 12, generator=g).bfloat16()
    parts = [diff({}, {"w": t}, shards={"w": s}) for t, s in _shards(full, 4, 0)]  # a keyframe of 4 parts
    for recv_t, recv_s in _shards(torch.randn(8, 12, generator=g).bfloat16(), 3, 1):  # stale receivers
        for p in parts:
            apply({"w": recv_t}, p, shards={"w": recv_s})
        assert_bits_equal(recv_t, full[:, recv_s.offsets[1]:recv_s.offsets[1] + recv_s.shape[1]], "column shard")


def test_keyframe_of_whole_tensors_into_column_shards_row_by_row():
    """A keyframe's chunk holding many rows of a receiver's columns is copied into it as one
    strided copy (``state/runs.py``, ``copy_runs``): every element width, chunks cut mid-row, a
    3-D box; each receiver's bits, and nothing outside its shard, as the tensor's."""
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64):
        full = (torch.randn(16, 12, generator=g) * 8).to(dtype)
        for chunk in (None, 40):  # a chunk per tensor, and chunks that start and end mid-row
            blob = diff({}, {"w": full}, **({"chunk_elems": chunk} if chunk else {}))
            for recv_t, recv_s in _shards(torch.zeros_like(full), 3, 1):
                version = recv_t._version
                apply({"w": recv_t}, blob, shards={"w": recv_s})
                # written through numpy: torch's version counter says so all the same (the rollout
                # loader sends a replica on, and a vLLM worker rebuilds a layer, by it)
                assert recv_t._version > version
                assert_bits_equal(recv_t, full[:, recv_s.offsets[1]:recv_s.offsets[1] + recv_s.shape[1]],
                                  f"{dtype} column shard, chunks of {chunk}")
    box = torch.randn(4, 6, 10, generator=g).bfloat16()
    spec = ShardSpec.of(box.shape, (1, 2, 3), (3, 4, 5))
    recv = torch.zeros(3, 4, 5, dtype=torch.bfloat16)
    apply({"w": recv}, diff({}, {"w": box}), shards={"w": spec})
    assert_bits_equal(recv, box[1:4, 2:6, 3:8], "3-D box")


def test_full_entry_already_at_target_is_skipped():
    full = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    blob = diff({}, {"w": full})
    recv = {"w": full.clone()}
    rep = apply(recv, blob)
    assert rep.tensors_skipped == 1 and rep.chunks_applied == 0


def test_journal_makes_xor_redelivery_safe_for_partial_receivers():
    """A receiver holding only part of a region cannot check pre-images; the journal does it."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(8, 8, generator=g)
    target = base.clone()
    target.view(torch.int32)[:, ::3] ^= 0x5A5A
    blob = diff({"w": base}, {"w": target}, encoding="xor", chunk_elems=5)
    recv_spec = ShardSpec.of((8, 8), (0, 4), (8, 4))
    recv = {"w": base[:, 4:].clone()}
    journal = set()
    r1 = apply(recv, blob, shards={"w": recv_spec}, journal=journal)
    assert r1.unverified == ["w"] and journal
    r2 = apply(recv, blob, shards={"w": recv_spec}, journal=journal)  # re-delivered
    assert r2.chunks_applied == 0 and r2.chunks_already_applied == r1.chunks_applied
    assert_bits_equal(recv["w"], target[:, 4:])
    # without the journal the same re-delivery would undo the XOR: that is what the journal prevents
    apply(recv, blob, shards={"w": recv_spec})
    assert not torch.equal(recv["w"].view(torch.int32), target[:, 4:].view(torch.int32))


def test_on_change_reports_global_positions_and_bits():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(6, 10, generator=g).half()
    target = base.clone()
    target.view(torch.int16)[torch.rand(6, 10, generator=g) < 0.3] ^= 0x0101
    blob = diff({"w": base}, {"w": target}, chunk_elems=7)
    recv_spec = ShardSpec.of((6, 10), (2, 0), (3, 10))
    recv = {"w": base[2:5].clone()}
    seen, lock = [], threading.Lock()

    def hook(name, dtype, gshape, gidx, old, new):
        with lock:
            seen.append((gidx.clone(), old.clone(), new.clone()))
        assert name == "w" and dtype == torch.float16 and gshape == (6, 10)

    apply(recv, blob, shards={"w": recv_spec}, on_change=hook)
    gidx = torch.cat([s[0] for s in seen])
    old = torch.cat([s[1] for s in seen])
    new = torch.cat([s[2] for s in seen])
    flat_b, flat_t = base.reshape(-1).view(torch.int16), target.reshape(-1).view(torch.int16)
    expect = torch.nonzero(flat_b != flat_t).squeeze(1)
    expect = expect[(expect >= 20) & (expect < 50)]  # rows 2..4 of a 10-wide tensor
    assert torch.equal(torch.sort(gidx).values, expect)
    assert torch.equal(old, flat_b[gidx]) and torch.equal(new, flat_t[gidx])
    local, mask = IndexMap(recv_spec).to_local(gidx)
    assert bool(mask.all())
    assert_bits_equal(recv["w"], target[2:5])


def test_entries_stream_over_the_workers_with_the_one_worker_outcome():
    """All entries' chunks go to the workers as one stream (run_plans): with several workers the
    tensors, the report (counts, added/removed in entry order) and the state digest moved by the
    changes are those of one worker; an entry whose chunk fails its pre-image check stops the
    apply as a PartialApplyError once an entry before it was written, and a resume finishes."""
    import pytest

    from nemo_dcr.errors import PartialApplyError
    from nemo_dcr.state.statedigest import ChangeDigest, state_contrib

    g = torch.Generator().manual_seed(3)
    base = {f"t{i}": (torch.randn(300 + 37 * i, generator=g) * 0.02).bfloat16() for i in range(9)}
    base["gone"] = torch.randn(10, generator=g).bfloat16()
    target = {k: v.clone() for k, v in base.items() if k != "gone"}
    for i, k in enumerate(sorted(target)):
        flat = target[k].view(torch.int16).view(-1)
        flat[i::7] ^= 1
    target["new"] = torch.randn(50, generator=g).bfloat16()
    blob = diff(base, target, chunk_elems=64)
    outs = []
    for workers in (1, 2, 3):
        recv = {k: v.clone() for k, v in base.items()}
        change = ChangeDigest()
        rep = apply(recv, blob, workers=workers, on_change=change)
        assert sorted(recv) == sorted(target)
        for k in target:
            assert_bits_equal(recv[k], target[k], k)
        assert state_contrib(base) + change.total == state_contrib(target)
        outs.append((rep.tensors_changed, rep.chunks_applied, rep.elements_changed, rep.tensors_added,
                     rep.tensors_removed, rep.tensors_skipped))
    assert outs[0] == outs[1] == outs[2]

    recv = {k: v.clone() for k, v in base.items()}
    last = sorted(k for k in base if k.startswith("t"))[-1]
    at = int(torch.nonzero(base[last].view(torch.int16) != target[last].view(torch.int16)).max())
    recv[last].view(torch.int16)[at] ^= 4  # not the base at a changed position: its last chunk fails
    with pytest.raises(PartialApplyError):
        apply(recv, blob, workers=2, verify=False)
    recv[last].view(torch.int16)[at] ^= 4  # repaired: a resume finishes what was left
    apply(recv, blob, workers=2, resume=True)
    for k in target:
        assert_bits_equal(recv[k], target[k], k)
