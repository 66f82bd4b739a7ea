"""IndexMap / ShardSpec: local <-> canonical flat index maps, and applying a delta made by
one shard layout to a receiver with another."""
from __future__ import annotations

import math

import pytest
import torch

from dcr_testing.shards import cut, grid
from nemo_dcr import DcrError, IndexMap, ShardSpec, apply, diff
from nemo_dcr.state import index_map
from nemo_dcr.state.dtypes import int_view

# ----------------------------------------------------------------------------- helpers

def split_dim(global_shape, dim, tp):
    """Megatron-style TP split of ``dim`` into ``tp`` contiguous pieces (uneven allowed)."""
    n = global_shape[dim]
    bounds = [n * r // tp for r in range(tp + 1)]
    specs = []
    for r in range(tp):
        offsets = [0] * len(global_shape)
        shape = list(global_shape)
        offsets[dim] = bounds[r]
        shape[dim] = bounds[r + 1] - bounds[r]
        specs.append(ShardSpec.of(global_shape, offsets, shape))
    return specs




def reference_global_indices(spec):
    g = torch.arange(math.prod(spec.global_shape), dtype=torch.int64).reshape(spec.global_shape)
    return cut(g, spec).reshape(-1)


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(int_view(a), int_view(b))


LAYOUTS = [
    # (global shape, {dim: pieces})
    ((8, 6), {0: 2}),
    ((8, 6), {0: 4}),
    ((8, 6), {1: 2}),
    ((8, 6), {1: 3}),
    ((8, 6), {1: 6}),
    ((8, 6), {0: 2, 1: 3}),
    ((7, 5), {0: 2}),  # uneven
    ((7, 5), {1: 2}),  # uneven
    ((4, 6, 8), {0: 2}),
    ((4, 6, 8), {0: 4}),
    ((4, 6, 8), {1: 2}),
    ((4, 6, 8), {1: 3}),
    ((4, 6, 8), {2: 2}),
    ((4, 6, 8), {2: 4}),
    ((4, 6, 8), {0: 2, 2: 2}),
    ((4, 6, 8), {1: 2, 2: 4}),
    ((4, 6, 8), {0: 2, 1: 3, 2: 2}),
    ((2, 3, 4, 5), {1: 3, 3: 5}),
    ((17,), {0: 3}),
    ((1, 9), {1: 2}),
    ((9, 1), {0: 2}),
    ((0, 5), {1: 2}),  # empty global tensor
    ((4, 0), {0: 2}),
    ((3, 0, 2), {2: 2}),
]


def layout_id(p):
    shape, splits = p
    return f"{'x'.join(map(str, shape)) or 'scalar'}-" + "-".join(f"d{d}tp{k}" for d, k in splits.items())


# ----------------------------------------------------------------------------- ShardSpec

def test_shardspec_full_and_of():
    s = ShardSpec.full((4, 6))
    assert s.is_full and s.numel == 24 and s.offsets == (0, 0)
    assert ShardSpec.of((4, 6)) == s
    p = ShardSpec.of((4, 6), (2, 0), (2, 6))
    assert not p.is_full and p.numel == 12
    assert s.contains(p) and not p.contains(s)
    assert s.slices_of(p) == (slice(2, 4), slice(0, 6))
    assert p.to_json() == {"offsets": [2, 0], "shape": [2, 6]}


def test_shardspec_scalar_and_empty():
    s = ShardSpec.full(())
    assert s.numel == 1 and s.is_full and s.slices_of(s) == ()
    e = ShardSpec.of((0, 3), (0, 1), (0, 2))
    assert e.numel == 0


@pytest.mark.parametrize("args", [
    ((4, 6), (3, 0), (2, 6)),   # runs past the end
    ((4, 6), (0, 0), (4, 7)),
    ((4, 6), (0,), (4, 6)),     # rank mismatch
    ((4, 6), (0, 0), (4,)),
    ((4, 6), (-1, 0), (1, 6)),
    ((-2, 6), (0, 0), (0, 6)),
])
def test_shardspec_rejects_bad_layouts(args):
    with pytest.raises(DcrError):
        ShardSpec.of(*args)
    with pytest.raises(DcrError):
        IndexMap(ShardSpec(*args))


def test_slices_of_requires_containment():
    a = ShardSpec.of((8, 6), (0, 0), (4, 6))
    b = ShardSpec.of((8, 6), (2, 0), (4, 6))
    assert not a.contains(b)
    with pytest.raises(DcrError):
        a.slices_of(b)
    with pytest.raises(DcrError):  # other global shape
        a.slices_of(ShardSpec.of((8, 7), (0, 0), (2, 6)))


# ----------------------------------------------------------------------------- IndexMap

@pytest.fixture(params=["numpy", "torch"])
def general_maps(request, monkeypatch):
    """The general maps run on numpy arrays for a few host indices, on torch tensors else
    (index_map._small): each test below runs both ways."""
    monkeypatch.setattr(index_map, "SMALL", 1 << 40 if request.param == "numpy" else -1)
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_to_global_matches_reference_and_round_trips(layout, general_maps):
    gshape, splits = layout
    specs = grid(gshape, splits)
    gnumel = math.prod(gshape)
    seen = torch.zeros(gnumel, dtype=torch.int64)
    for spec in specs:
        m = IndexMap(spec)
        assert m.numel == spec.numel
        local = torch.arange(spec.numel, dtype=torch.int64)
        glob = m.to_global(local)
        assert glob.dtype == torch.int64
        assert torch.equal(glob, reference_global_indices(spec))
        # round trip
        back, mask = m.to_local(glob)
        assert bool(mask.all())
        assert torch.equal(back, local)
        # a shuffled subset round-trips too (order preserved)
        perm = torch.randperm(spec.numel, generator=torch.Generator().manual_seed(spec.numel + 1))
        back2, mask2 = m.to_local(m.to_global(perm))
        assert bool(mask2.all()) and torch.equal(back2, perm)
        # canonical indices known to be held: the same local ones without the mask
        assert torch.equal(m.held_to_local(m.to_global(perm)), perm)
        seen[glob] += 1
    # the shards tile the global tensor exactly once
    assert torch.equal(seen, torch.ones(gnumel, dtype=torch.int64))


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_to_local_of_every_global_index(layout, general_maps):
    gshape, splits = layout
    gnumel = math.prod(gshape)
    allg = torch.arange(-3, gnumel + 3, dtype=torch.int64)  # includes out-of-range indices
    for spec in grid(gshape, splits):
        m = IndexMap(spec)
        local, mask = m.to_local(allg)
        assert mask.dtype == torch.bool and mask.shape == allg.shape
        ref = torch.zeros(gnumel, dtype=torch.bool)
        ref[reference_global_indices(spec)] = True
        expected_mask = torch.cat([torch.zeros(3, dtype=torch.bool), ref, torch.zeros(3, dtype=torch.bool)])
        assert torch.equal(mask, expected_mask)
        # global indices are visited in increasing order, and so are the local ones of a shard
        assert torch.equal(local, torch.arange(spec.numel, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.uint8])
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_rebuild_full_tensor_from_shards(layout, dtype):
    gshape, splits = layout
    torch.manual_seed(0)
    n = math.prod(gshape)
    w = torch.empty((), dtype=dtype).element_size()
    full = torch.randint(0, 256, (n * w,), dtype=torch.uint8).view(dtype).reshape(gshape)
    rebuilt = torch.zeros(gshape, dtype=dtype)
    flat = int_view(rebuilt).reshape(-1)
    for spec in grid(gshape, splits):
        local = cut(full, spec)
        assert tuple(local.shape) == spec.shape
        g = IndexMap(spec).to_global(torch.arange(spec.numel))
        flat[g] = int_view(local).reshape(-1)
    assert bits_equal(rebuilt, full)


def test_scalar_map():
    m = IndexMap(ShardSpec.full(()))
    assert m.identity and m.numel == 1
    assert torch.equal(m.to_global(torch.tensor([0])), torch.tensor([0]))
    local, mask = m.to_local(torch.tensor([-1, 0, 1]))
    assert torch.equal(local, torch.tensor([0])) and mask.tolist() == [False, True, False]


@pytest.mark.parametrize("spec", [
    ShardSpec.full((0,)), ShardSpec.full((3, 0)), ShardSpec.of((4, 6), (1, 2), (0, 3)),
    ShardSpec.of((4, 6, 8), (0, 2, 0), (4, 0, 8)),
])
def test_empty_maps(spec):
    m = IndexMap(spec)
    assert m.numel == 0
    assert m.to_global(torch.empty(0, dtype=torch.int64)).numel() == 0
    local, mask = m.to_local(torch.arange(0, 30))
    assert local.numel() == 0 and not bool(mask.any())


def test_row_shard_is_one_run_and_full_is_identity():
    assert IndexMap(ShardSpec.full((4, 6))).identity
    m = IndexMap(ShardSpec.of((8, 6), (2, 0), (2, 6)))
    assert not m.identity and m.run_offset == 12
    m3 = IndexMap(ShardSpec.of((4, 6, 8), (1, 0, 0), (2, 6, 8)))
    assert m3.run_offset == 48
    col = IndexMap(ShardSpec.of((8, 6), (0, 3), (8, 3)))
    assert col.run_offset is None
    assert torch.equal(col.to_global(torch.arange(6)), torch.tensor([3, 4, 5, 9, 10, 11]))


def test_index_dtype_is_coerced():
    m = IndexMap(ShardSpec.of((8, 6), (0, 3), (8, 3)))
    g = m.to_global(torch.arange(6, dtype=torch.int32))
    assert g.dtype == torch.int64
    local, _ = m.to_local(g.to(torch.int32))
    assert local.dtype == torch.int64 and torch.equal(local, torch.arange(6))


# ----------------------------------------------------------------------------- resharded apply

def _make_pair(gshape, dtype, seed, rate=0.2):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(gshape)
    w = torch.empty((), dtype=dtype).element_size()
    base = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g).view(dtype).reshape(gshape)
    tb = int_view(base).reshape(-1).clone()
    changed = torch.rand(n, generator=g) < rate
    flip = torch.randint(1, 1 << (8 * min(w, 2) - 1), (n,), generator=g).to(tb.dtype)
    tb[changed] ^= flip[changed]
    if len(gshape) >= 2:  # one whole row rewritten: a dense chunk somewhere
        row = math.prod(gshape[1:])
        tb[row:2 * row] ^= 1
    target = tb.view(dtype).reshape(gshape)
    assert not bits_equal(base, target)
    return base, target


RESHARD_CASES = [
    # (global shape, sender split, receiver splits to try)
    ((8, 12), (0, 4), [{0: 2}, {1: 2}, {}, {0: 4}, {1: 3}, {0: 2, 1: 2}]),
    ((4, 6, 8), (0, 4), [{0: 2}, {1: 2}, {2: 2}, {}]),
    ((4, 6, 8), (1, 3), [{0: 2}, {1: 2}, {2: 4}, {}]),
    ((4, 6, 8), (2, 4), [{0: 4}, {1: 3}, {2: 2}, {}]),
    ((10, 7), (1, 4), [{0: 2}, {1: 2}, {}]),  # uneven in both
]


@pytest.mark.parametrize("chunk_elems", [5, 64, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", RESHARD_CASES, ids=lambda c: f"{c[0]}-d{c[1][0]}tp{c[1][1]}")
def test_resharded_receiver_reaches_target(case, dtype, chunk_elems):
    gshape, (sdim, stp), receivers = case
    base, target = _make_pair(gshape, dtype, seed=sum(gshape) * 7 + stp)
    ln_base, ln_target = _make_pair((gshape[-1],), torch.float32, seed=99, rate=0.5)
    send_specs = split_dim(gshape, sdim, stp)
    blobs = []
    for spec in send_specs:
        blobs.append(diff({"w": cut(base, spec), "ln": ln_base}, {"w": cut(target, spec), "ln": ln_target},
                          shards={"w": spec}, chunk_elems=chunk_elems))
    for splits in receivers:
        for rspec in grid(gshape, splits):
            recv = {"w": cut(base, rspec).clone(), "ln": ln_base.clone()}
            w_obj = recv["w"]
            touched = 0
            for blob in blobs:
                rep = apply(recv, blob, shards={"w": rspec})
                touched += rep.tensors_changed
            assert recv["w"] is w_obj  # in place
            assert bits_equal(recv["w"], cut(target, rspec)), (splits, rspec)
            assert bits_equal(recv["ln"], ln_target)
            assert touched >= 2  # ln once, w at least once


def test_resharded_report_kinds():
    gshape = (8, 12)
    base, target = _make_pair(gshape, torch.bfloat16, seed=3)
    blobs = [diff({"w": cut(base, s)}, {"w": cut(target, s)}, shards={"w": s}, chunk_elems=7)
             for s in split_dim(gshape, 0, 4)]
    # receiver TP=2 on dim 0: holds 2 sender regions whole (verified), the other 2 not at all
    r0 = split_dim(gshape, 0, 2)[0]
    recv = {"w": cut(base, r0).clone()}
    reps = [apply(recv, b, shards={"w": r0}) for b in blobs]
    assert [r.tensors_changed for r in reps] == [1, 1, 0, 0]
    assert all(not r.unverified for r in reps)
    assert bits_equal(recv["w"], cut(target, r0))
    # receiver TP=2 on dim 1: overlaps every sender region without holding any whole
    c0 = split_dim(gshape, 1, 2)[0]
    recv = {"w": cut(base, c0).clone()}
    reps = [apply(recv, b, shards={"w": c0}) for b in blobs]
    assert all(r.unverified == ["w"] for r in reps)
    assert bits_equal(recv["w"], cut(target, c0))
    # unsharded receiver: every region verified
    recv = {"w": base.clone()}
    reps = [apply(recv, b) for b in blobs]
    assert all(r.tensors_changed == 1 and not r.unverified for r in reps)
    assert bits_equal(recv["w"], target)
    # re-delivery to the unsharded receiver is recognised as already applied
    again = [apply(recv, b) for b in blobs]
    assert all(r.tensors_skipped == 1 and r.chunks_applied == 0 for r in again)
    assert bits_equal(recv["w"], target)


def test_resharded_receiver_non_contiguous_views():
    """Receiver shards that are views into one larger buffer (column shards are strided)."""
    gshape = (4, 6, 8)
    base, target = _make_pair(gshape, torch.float16, seed=11)
    blobs = [diff({"w": cut(base, s)}, {"w": cut(target, s)}, shards={"w": s}, chunk_elems=9)
             for s in split_dim(gshape, 0, 4)]
    buf = base.clone()
    for rspec in split_dim(gshape, 2, 2):
        view = cut(buf, rspec)
        assert not view.is_contiguous()
        recv = {"w": view}
        for b in blobs:
            apply(recv, b, shards={"w": rspec})
    assert bits_equal(buf, target)


def test_sharded_sender_to_mismatched_global_shape_is_rejected():
    from nemo_dcr import BaseMismatchError
    base, target = _make_pair((8, 6), torch.float32, seed=5)
    s = split_dim((8, 6), 0, 4)[1]
    blob = diff({"w": cut(base, s)}, {"w": cut(target, s)}, shards={"w": s})
    wrong = ShardSpec.of((8, 7), (0, 0), (4, 7))
    recv = {"w": torch.zeros(4, 7)}
    with pytest.raises(BaseMismatchError):
        apply(recv, blob, shards={"w": wrong})
    assert int(int_view(recv["w"]).abs().sum()) == 0


# ----------------------------------------------------------------------------- index shapes

def _shapes_of(n, dims=3):
    import itertools
    return [s for k in range(1, dims + 1) for s in itertools.product(range(1, n + 1), repeat=k) if math.prod(s) == n]


def _flat(shape, offsets, size):
    g = torch.arange(math.prod(shape)).reshape(shape)
    return g[tuple(slice(o, o + s) for o, s in zip(offsets, size))].reshape(-1)


def _is_box(shape, flat):
    coords = [(flat // math.prod(shape[d + 1:])) % shape[d] for d in range(len(shape))]
    lo, hi = [int(c.min()) for c in coords], [int(c.max()) for c in coords]
    return math.prod(h - lo_ + 1 for lo_, h in zip(lo, hi)) == flat.numel()


def _strides_of(shape):
    return {math.prod(shape[d + 1:]) for d in range(len(shape))}


@pytest.mark.parametrize("n", [12, 16])
def test_reshape_box_moves_boxes_exactly_between_index_shapes(n):
    """Every box moved between two shapes of the same elements holds the same elements there, and
    where one shape refines the other a box that is one there is always found."""
    import random

    from nemo_dcr.state.index_map import reshape_box
    rng = random.Random(n)
    moved = 0
    for a in _shapes_of(n):
        for _ in range(12):
            o = [rng.randrange(d) for d in a]
            s = [rng.randint(1, d - oo) for d, oo in zip(a, o)]
            want = _flat(a, o, s)
            for b in _shapes_of(n):
                r = reshape_box(a, o, s, b)
                if r is not None:
                    moved += 1
                    assert torch.equal(_flat(b, *r), want), (a, o, s, b, r)
                elif _strides_of(a) <= _strides_of(b) or _strides_of(b) <= _strides_of(a):
                    assert not _is_box(b, want), (a, o, s, b)
    assert moved > 1000


def test_a_spec_in_an_index_shape_contains_and_views_the_canonical_regions():
    """A receiver holding the query rows of every head of a head-interleaved fused weight
    ((heads, 3, head_dim) rows) is a box only in that index shape: it contains the regions the
    publisher sends in the canonical shape that lie inside it, and views them in canonical order."""
    heads, hd, cols = 4, 2, 3
    g = (heads * 3 * hd, cols)
    idx = (heads, 3, hd * cols)
    spec = ShardSpec.of(g, (0, 0, 0), (heads, 1, hd * cols), index_shape=idx)  # every head's q rows
    whole = torch.arange(math.prod(g)).reshape(g)
    local = whole.reshape(idx)[:, 0:1, :].contiguous()
    assert spec.box_shape == idx and not spec.is_full
    head1_q = ShardSpec.of(g, (3 * hd, 0), (hd, cols))  # head 1's q rows, as the publisher's region
    assert spec.contains(head1_q) and spec.overlaps(head1_q)
    assert torch.equal(spec.view_of(local, head1_q), whole[3 * hd:4 * hd])
    head1_k = ShardSpec.of(g, (4 * hd, 0), (hd, cols))
    assert not spec.contains(head1_k) and not spec.overlaps(head1_k)
    imap = IndexMap(spec)
    assert torch.equal(imap.to_global(torch.arange(spec.numel)), local.reshape(-1))
    loc, mask = imap.to_local(whole.reshape(-1))
    assert torch.equal(whole.reshape(-1)[mask], local.reshape(-1)) and torch.equal(loc, torch.arange(spec.numel))


# ----------------------------------------------------------------------------- strided parts

def _factor_case(global_shape, storage_shape, place):
    """Place canonical element numbers into a storage with ``place(storage, canonical)``; factor the
    pairs and check the view's elements are the spec's canonical elements in row-major order."""
    from nemo_dcr.state.strided import factor
    canon = torch.arange(math.prod(global_shape)).reshape(global_shape)
    storage = torch.full(storage_shape, -1, dtype=torch.int64)
    place(storage, canon)
    held = storage.reshape(-1) >= 0
    part = factor(storage.reshape(-1)[held], held.nonzero()[:, 0], global_shape)
    assert part is not None
    view = part.view(storage)
    assert tuple(view.shape) == part.spec.shape and part.spec.global_shape == tuple(global_shape)
    assert torch.equal(view.reshape(-1), IndexMap(part.spec).to_global(torch.arange(part.spec.numel)))
    return part


def test_factor_finds_the_layouts_engines_load_into():
    def tp_transposed(storage, canon):  # GPT-2's Conv1D c_attn at TP=2, rank 0: q, k, v column blocks
        t = canon.T
        storage[0:4], storage[4:8], storage[8:12] = t[0:4], t[8:12], t[16:20]
    cases = [
        ((8, 24), (24, 8), lambda s, c: s.copy_(c.T)),                                  # transposed
        ((4, 6), (10, 6), lambda s, c: s[3:7].copy_(c)),                                # a fused layer's rows
        ((8, 24), (12, 8), tp_transposed),
        ((24, 4), (24, 4), lambda s, c: s.copy_(c.reshape(4, 3, 2, 4).transpose(0, 1).reshape(24, 4))),  # heads
        ((10, 4), (16, 4), lambda s, c: s[:10].copy_(c)),                               # padded vocabulary
        ((6,), (6,), lambda s, c: s.copy_(c)),
        ((1,), (1,), lambda s, c: s.copy_(c)),
    ]
    specs = [_factor_case(*c).spec for c in cases]
    assert specs[0].is_full and specs[0].index_shape is None  # a transpose is a view of the canonical shape
    assert specs[2].index_shape is not None and not specs[2].is_full  # three column blocks: a box only finer
    assert specs[3].is_full


def test_factor_refuses_maps_no_strided_view_holds():
    from nemo_dcr.state.strided import factor
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(24, generator=g)
    assert factor(perm, torch.arange(24), (6, 4)) is None
    assert factor(torch.tensor([0, 1, 3]), torch.tensor([0, 1, 2]), (4,)) is None  # a hole
    assert factor(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), (4,)) is None


def test_factor_pieces_splits_a_per_group_regroup_into_boxes():
    """Falcon's fused QKV, grouped per kv head in the checkpoint ((groups, q_per_group + 2, head_dim)
    rows), loaded as [all queries; all keys; all values]: no one strided view holds it, a few do."""
    from nemo_dcr.state.strided import factor, factor_pieces
    groups, qpg, hd, cols = 2, 2, 3, 4
    g = (groups * (qpg + 2) * hd, cols)
    canon = torch.arange(math.prod(g)).reshape(groups, qpg + 2, hd, cols)
    storage = torch.cat([canon[:, :qpg].reshape(-1, cols), canon[:, qpg].reshape(-1, cols),
                         canon[:, qpg + 1].reshape(-1, cols)])
    can, loc = storage.reshape(-1), torch.arange(storage.numel())
    assert factor(can, loc, g) is None
    parts = factor_pieces(can, loc, g)
    assert parts is not None and 1 < len(parts) <= 3  # the keys and values together are one box
    seen = torch.cat([p.view(storage).reshape(-1) for p in parts])
    want = torch.cat([IndexMap(p.spec).to_global(torch.arange(p.spec.numel)) for p in parts])
    assert torch.equal(seen, want) and torch.equal(seen.sort().values, torch.arange(math.prod(g)))
    # a transposed box is one piece, however its runs rise and fall
    t = torch.arange(24).reshape(4, 6)
    assert len(factor_pieces(t.T.reshape(-1), torch.arange(24), (4, 6))) == 1
    assert factor_pieces(torch.randperm(24, generator=torch.Generator().manual_seed(1)), torch.arange(24),
                         (4, 6), max_pieces=4) is None


def test_maps_of_one_spec_share_its_work_and_a_bad_spec_fails_every_time():
    """An ``IndexMap`` works its spec out once (``index_map._derived``): a second map of an equal
    spec maps alike without working it out again, and a spec that does not fit is refused each
    time it is asked for, never remembered."""
    from nemo_dcr.state import index_map as im
    spec = ShardSpec((6, 8, 5), (2, 0, 1), (3, 8, 3))
    a = IndexMap(spec)
    hits = im._derived.cache_info().hits
    b = IndexMap(ShardSpec((6, 8, 5), (2, 0, 1), (3, 8, 3)))
    assert im._derived.cache_info().hits == hits + 1
    local = torch.arange(spec.numel)
    assert torch.equal(a.to_global(local), b.to_global(local))
    assert torch.equal(b.to_local(b.to_global(local))[0], local)
    listed = IndexMap(ShardSpec([6, 8, 5], [2, 0, 1], [3, 8, 3]))  # (unhashable: not kept, same map)
    assert torch.equal(listed.to_global(local), a.to_global(local))
    bad = ShardSpec((4,), (3,), (2,))
    for _ in range(2):
        with pytest.raises(DcrError, match="does not fit"):
            IndexMap(bad)
