"""Sharding-independent, incrementally updatable state digest (nemo_dcr.statedigest)."""
from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch

from dcr_testing.procs import launch
from dcr_testing.shards import cut, grid
from nemo_dcr import DcrError, ShardSpec
from nemo_dcr.state import statedigest as sd
from nemo_dcr.state.dtypes import DTYPES, INT_VIEW, int_view
from nemo_dcr.state.statedigest import P, StateDigest, allreduce_digest, changes_contrib, state_contrib, tensor_contrib

ALL_DTYPES = list(DTYPES.values())  # every width 1/2/4/8, incl. bool, float8, bf16, fp64, int64


# ----------------------------------------------------------------------------- helpers

def random_tensor(shape, dtype, seed):
    """Random raw bits of every pattern (NaN payloads, -0.0, high bits of int64 ...)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    w = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * w,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)




def sharded_digest(name, t, specs, definition=1):
    d = StateDigest.zero(definition)
    for spec in specs:
        d = d + tensor_contrib(name, cut(t, spec).clone(), spec, definition=definition)
    return d


def flat_bits(t):
    return int_view(t.contiguous()).reshape(-1)


# ----------------------------------------------------------------------------- pure-Python reference

def _mix_ref(h):
    h ^= h >> 16
    h = (h * sd._F1) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * sd._F2) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def _weight_ref(i, keys, lane):
    u = _mix_ref(_mix_ref((i & 0xFFFFFFFF) ^ keys.s1) ^ keys.s2 ^ (i >> 32))
    return min(max(_mix_ref(u ^ keys.t[lane]) >> 1, 1), P - 1)


def _table_ref(j, lane):
    """Definition 2's table: the same weight of ``j``, with fixed keys."""
    return min(max(_mix_ref(_mix_ref(j ^ 0x9E3779B9) ^ (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1)[lane]) >> 1,
                   1), P - 1)


def reference_digest(name, t, definition=1):
    """The definition, element by element, in unbounded Python integers (docs/format.md)."""
    keys = sd._keys(name, sd.dtype_name(t.dtype), tuple(t.shape))
    w = t.element_size()
    mask = (1 << (8 * w)) - 1
    lanes = [0] * sd.LANES
    for i, x in enumerate(flat_bits(t).tolist()):
        x &= mask
        limbs = [x] if w == 1 else [(x >> (16 * j)) & 0xFFFF for j in range(w // 2)]
        for lane in range(sd.LANES):
            if definition == 1:
                r = _weight_ref(i, keys, lane)
            else:  # the block's weight times the table's entry for the place in the block
                r = _weight_ref(i >> 10, keys, lane) * _table_ref(i & 1023, lane) % P
            v = keys.c[lane] + sum(limb * keys.kpow[lane][j] for j, limb in enumerate(limbs))
            lanes[lane] = (lanes[lane] + r * v) % P
    return StateDigest(tuple(lanes), definition)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.bfloat16, torch.float32, torch.int64,
                                   torch.float64], ids=str)
def test_matches_pure_python_definition(dtype, definition):
    t = random_tensor((5, 23) if definition == 1 else (3, 1100), dtype, seed=1)  # (def 2: three blocks)
    if dtype.is_floating_point or dtype == torch.int64:  # extreme bit patterns: all ones, sign bit only
        b = int_view(t).reshape(-1)
        b[0] = -1
        b[1] = torch.iinfo(b.dtype).min
        b[2] = 0
    assert tensor_contrib("m.w", t, definition=definition) == reference_digest("m.w", t, definition)


# ----------------------------------------------------------------------------- sharding independence

LAYOUTS = [
    ((12, 10), {0: 2}),
    ((12, 10), {0: 4}),
    ((12, 10), {1: 2}),
    ((12, 10), {1: 4}),
    ((13, 7), {0: 4}),  # uneven
    ((13, 7), {1: 3}),  # uneven, non-contiguous runs
    ((6, 5, 8), {0: 2}),
    ((6, 5, 8), {1: 2}),
    ((6, 5, 8), {2: 4}),
    ((6, 5, 8), {0: 2, 2: 2}),
    ((4, 6, 9), {1: 3, 2: 3}),
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_sharding_independent_every_dtype(dtype, definition):
    for k, (shape, splits) in enumerate(LAYOUTS + [((40, 70), {0: 3}), ((40, 70), {1: 4})]):  # (blocks of 1024)
        t = random_tensor(shape, dtype, seed=100 + k)
        whole = tensor_contrib("layer.w", t, definition=definition)
        assert whole == sharded_digest("layer.w", t, grid(shape, splits), definition), (shape, splits)


def test_trainer_tp4_receiver_tp1_tp2_agree():
    state = {
        "qkv": random_tensor((16, 12), torch.bfloat16, 1),  # column parallel (dim 0)
        "proj": random_tensor((12, 16), torch.bfloat16, 2),  # row parallel (dim 1)
        "step": random_tensor((3, 4, 8), torch.int64, 3),
        "mask": random_tensor((8, 8), torch.bool, 4),
    }
    dims = {"qkv": 0, "proj": 1, "step": 2, "mask": 0}
    full = state_contrib(state)
    for tp in (1, 2, 4):
        ranks = [StateDigest.zero() for _ in range(tp)]
        for name, t in state.items():
            for r, spec in enumerate(grid(tuple(t.shape), {dims[name]: tp})):
                ranks[r] = ranks[r] + state_contrib({name: cut(t, spec)}, {name: spec})
        assert sum(ranks, StateDigest.zero()) == full, tp


def test_scalar_and_empty():
    s = torch.tensor(3.5, dtype=torch.float32)
    assert tensor_contrib("s", s) == tensor_contrib("s", s.reshape(()), ShardSpec.full(()))
    assert tensor_contrib("s", s) != StateDigest.zero()
    # an empty tensor contributes nothing: present-but-empty equals missing (documented)
    assert tensor_contrib("e", torch.empty(0, 4)) == StateDigest.zero()


# ----------------------------------------------------------------------------- incremental update

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64,
                                   torch.float8_e4m3fn, torch.bool], ids=str)
def test_incremental_update_equals_recompute(dtype):
    shape = (40, 33)
    t = random_tensor(shape, dtype, seed=7)
    d = tensor_contrib("w", t)
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        idx = torch.randperm(t.numel(), generator=g)[:50]
        new = t.clone()
        flat = int_view(new).reshape(-1)
        repl = flat_bits(random_tensor((50,), dtype, seed=int(torch.randint(0, 1 << 30, (1,), generator=g))))
        if dtype.is_floating_point and t.element_size() >= 2:
            w = t.element_size() * 8
            iv = INT_VIEW[t.element_size()]
            sign = torch.tensor(-(1 << (w - 1)), dtype=torch.int64).to(iv)  # -0.0
            repl[0] = sign
            repl[1] = 0  # +0.0
            repl[2] = int_view(torch.tensor([float("nan")], dtype=dtype))[0] ^ 1  # NaN payload
            repl[3] = int_view(torch.tensor([float("nan")], dtype=dtype))[0] ^ 3
        flat[idx] = repl
        old_bits = flat_bits(t)[idx]
        d = d + changes_contrib("w", dtype, shape, idx, flat[idx]) - changes_contrib("w", dtype, shape, idx, old_bits)
        assert d == tensor_contrib("w", new)
        t = new


def test_incremental_update_on_shards_with_global_indices():
    shape = (20, 16)
    t = random_tensor(shape, torch.float32, seed=9)
    specs = grid(shape, {1: 4})
    d = state_contrib({"w": t})
    idx = torch.tensor([0, 17, 63, 64, 200, 319])
    new = t.clone()
    new.view(-1)[idx] = torch.tensor([-0.0, float("nan"), 1.0, -1.0, float("inf"), 0.0])
    d_inc = d + changes_contrib("w", "float32", shape, idx, new.reshape(-1)[idx]) \
        - changes_contrib("w", torch.float32, shape, idx, t.reshape(-1)[idx])
    assert d_inc == sharded_digest("w", new, specs) == tensor_contrib("w", new)


def test_changes_contrib_accepts_dtype_or_bits_and_validates():
    shape = (4, 4)
    t = random_tensor(shape, torch.bfloat16, seed=2)
    idx = torch.arange(16)
    a = changes_contrib("w", torch.bfloat16, shape, idx, t.reshape(-1))
    assert a == changes_contrib("w", "bfloat16", shape, idx, int_view(t).reshape(-1))
    assert a == tensor_contrib("w", t)
    with pytest.raises(DcrError):
        changes_contrib("w", torch.bfloat16, shape, torch.tensor([16]), t.reshape(-1)[:1])
    with pytest.raises(DcrError):
        changes_contrib("w", torch.bfloat16, shape, torch.tensor([-1]), t.reshape(-1)[:1])
    with pytest.raises(DcrError):
        changes_contrib("w", torch.float32, shape, idx, t.reshape(-1))  # width mismatch
    with pytest.raises(DcrError):
        changes_contrib("w", torch.bfloat16, shape, idx[:3], t.reshape(-1))  # count mismatch
    with pytest.raises(DcrError):
        tensor_contrib("w", t, ShardSpec.of((8, 4), (0, 0), (2, 4)))  # shape != shard shape


def test_indices_beyond_2_pow_32():
    """A huge canonical tensor: a shard at a high offset agrees with changes_contrib, and indices
    equal mod 2**32 get different weights."""
    shape = (1 << 21, 1 << 12)  # 2**33 elements, never materialised
    spec = ShardSpec.of(shape, ((1 << 20) + 5, 0), (3, 1 << 12))  # starts past 2**32
    t = random_tensor(spec.shape, torch.bfloat16, seed=3)
    start = ((1 << 20) + 5) << 12
    assert start > 1 << 32
    idx = torch.arange(start, start + t.numel())
    assert tensor_contrib("big", t, spec) == changes_contrib("big", torch.bfloat16, shape, idx, t.reshape(-1))
    one = torch.tensor([1], dtype=torch.int16)
    lo = changes_contrib("big", torch.bfloat16, shape, torch.tensor([12345]), one)
    hi = changes_contrib("big", torch.bfloat16, shape, torch.tensor([12345 + (1 << 32)]), one)
    assert lo != hi


# ----------------------------------------------------------------------------- detection

def _lanes_changed(a: StateDigest, b: StateDigest) -> int:
    return sum(x != y for x, y in zip(a.lanes, b.lanes))


# guaranteed lanes that change for one changed element: 4 - (limbs - 1)
MIN_LANES = {1: 4, 2: 4, 4: 3, 8: 1}


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e5m2, torch.bfloat16, torch.int16,
                                   torch.float32, torch.int32, torch.float64, torch.int64], ids=str)
def test_every_single_bit_flip_changes_digest(dtype, definition):
    changes_contrib = partial(sd.changes_contrib, definition=definition)
    tensor_contrib = partial(sd.tensor_contrib, definition=definition)
    shape = (7, 9) if definition == 1 else (3, 1100)
    t = random_tensor(shape, dtype, seed=11)
    w = t.element_size()
    iv = INT_VIEW[w]
    idx_all = [0, 31, 62] if definition == 1 else [0, 1023, 1024, 3299]  # (def 2: a block's edges)
    flat = flat_bits(t)
    for i in idx_all:
        idx = torch.tensor([i])
        old = flat[i:i + 1]
        d_old = changes_contrib("w", dtype, shape, idx, old)
        for bit in range(8 * w):
            m = torch.tensor(1 << bit if bit < 8 * w - 1 else -(1 << bit), dtype=torch.int64).to(iv) \
                if iv != torch.uint8 else torch.tensor(1 << bit, dtype=torch.uint8)
            new = old ^ m
            d_new = changes_contrib("w", dtype, shape, idx, new)
            assert _lanes_changed(d_old, d_new) >= MIN_LANES[w], (i, bit)
    # and through the full digest
    b = t.clone()
    int_view(b).reshape(-1)[5] ^= 1
    assert tensor_contrib("w", b) != tensor_contrib("w", t)


def _short_root_vector(k):
    """Small (d0, d1), not both 0, with d0 + d1*k == 0 (mod P): Gauss-reduce the lattice."""
    u, v = (P, 0), (-k % P, 1)  # both satisfy d0 + d1*k == 0 (mod P)
    norm = lambda a: a[0] * a[0] + a[1] * a[1]  # noqa: E731
    if norm(u) < norm(v):
        u, v = v, u
    while True:
        m = round((u[0] * v[0] + u[1] * v[1]) / norm(v))
        u = (u[0] - m * v[0], u[1] - m * v[1])
        if norm(u) >= norm(v):
            return v
        u, v = v, u


@pytest.mark.parametrize("dtype,limb", [(torch.float32, 0), (torch.int64, 0), (torch.int64, 2)], ids=str)
def test_lane_blind_spot_is_caught_by_the_other_lanes(dtype, limb):
    """A 32-bit lane cannot be injective on 32/64-bit patterns: build a one-element change that lane 0
    misses (limb deltas d with d0 + d1*K_0 == 0 mod P) and check the other lanes still see it."""
    shape = (50,)
    keys = sd._keys("w", sd.dtype_name(dtype), shape)
    d0, d1 = _short_root_vector(keys.kpow[0][1])
    assert max(abs(d0), abs(d1)) < 1 << 16 and (d0 + d1 * keys.kpow[0][1]) % P == 0
    a0 = max(0, -d0)
    a1 = max(0, -d1)
    old = (a0 << (16 * limb)) | (a1 << (16 * (limb + 1)))
    new = ((a0 + d0) << (16 * limb)) | ((a1 + d1) << (16 * (limb + 1)))
    w = 8 * torch.empty((), dtype=dtype).element_size()
    to_bits = lambda x: torch.tensor([x - (1 << w) if x >> (w - 1) else x]).to(INT_VIEW[w // 8])  # noqa: E731
    idx = torch.tensor([17])
    da = changes_contrib("w", dtype, shape, idx, to_bits(old))
    db = changes_contrib("w", dtype, shape, idx, to_bits(new))
    assert da.lanes[0] == db.lanes[0]  # the blind spot of lane 0
    assert da != db
    assert _lanes_changed(da, db) >= MIN_LANES[w // 8]


def test_every_value_of_bool_and_one_byte_types_is_distinct():
    for dtype in (torch.bool, torch.uint8):
        vals = range(2) if dtype == torch.bool else range(256)
        seen = set()
        for v in vals:
            bits = torch.tensor([v], dtype=torch.uint8)
            seen.add(changes_contrib("w", dtype, (10,), torch.tensor([4]), bits).lanes)
        assert len(seen) == len(vals)


def test_random_multi_bit_single_element_changes_detected(definition):
    changes_contrib = partial(sd.changes_contrib, definition=definition)
    g = torch.Generator().manual_seed(12)
    for dtype in (torch.float32, torch.float64, torch.int64):
        iv = INT_VIEW[torch.empty((), dtype=dtype).element_size()]
        a = flat_bits(random_tensor((200,), dtype, seed=13))
        b = flat_bits(random_tensor((200,), dtype, seed=14))
        for k in range(200):
            if torch.equal(a[k:k + 1], b[k:k + 1]):
                continue
            idx = torch.randint(0, 1000, (1,), generator=g)
            da = changes_contrib("w", dtype, (1000,), idx, a[k:k + 1].to(iv))
            db = changes_contrib("w", dtype, (1000,), idx, b[k:k + 1].to(iv))
            assert _lanes_changed(da, db) == sd.LANES  # all lanes, with overwhelming probability


def test_swap_two_elements_changes_digest(definition):
    tensor_contrib = partial(sd.tensor_contrib, definition=definition)
    t = random_tensor((10, 10), torch.float32, seed=15)
    for i, j in [(0, 1), (3, 97), (50, 51), (0, 99)]:
        s = t.clone().reshape(-1)
        s[i], s[j] = t.reshape(-1)[j], t.reshape(-1)[i]
        assert tensor_contrib("w", s.reshape(10, 10)) != tensor_contrib("w", t)
    # swapping rows, and transposing a square matrix
    assert tensor_contrib("w", t.flip(0).contiguous()) != tensor_contrib("w", t)
    assert tensor_contrib("w", t.t().contiguous()) != tensor_contrib("w", t)
    # rows of 1024 (definition 2: whole blocks) swapped, and a square matrix of them transposed
    t = random_tensor((1024, 1024), torch.bfloat16, seed=16)
    assert tensor_contrib("w", t[[1, 0, *range(2, 1024)]].contiguous()) != tensor_contrib("w", t)
    assert tensor_contrib("w", t.t().contiguous()) != tensor_contrib("w", t)


def test_definition_2s_table_and_blocks():
    """Definition 2's table: four lanes of 1024 weights in [1, P), distinct within each lane, so
    that exchanging two different values inside one block always moves every lane (the block's
    weight times (g(i) - g(j)) times the values' difference, no factor 0 mod P); the C library's
    table is the reference's. And the two definitions give different digests of the same bits."""
    table = sd.table2()
    assert table.shape == (sd.LANES, sd.BLOCK2)
    assert (table == sd._table2().numpy()).all()
    assert int(table.min()) >= 1 and int(table.max()) < P
    assert all(len(set(row.tolist())) == sd.BLOCK2 for row in table)
    assert [_table_ref(j, lane) for lane in range(4) for j in (0, 1, 1023)] \
        == [int(table[lane][j]) for lane in range(4) for j in (0, 1, 1023)]
    t = random_tensor((2048,), torch.bfloat16, seed=17)
    base = tensor_contrib("w", t, definition=2)
    flat = int_view(t)
    for i, j in [(0, 1), (0, 1023), (511, 512), (1024, 2047)]:
        if flat[i] == flat[j]:
            continue
        s = t.clone()
        int_view(s)[i], int_view(s)[j] = flat[j], flat[i]
        assert _lanes_changed(tensor_contrib("w", s, definition=2), base) == sd.LANES, (i, j)
    assert base != tensor_contrib("w", t)


def test_an_unknown_definition_is_refused_before_anything_is_summed():
    t = torch.zeros(4, dtype=torch.bfloat16)
    for bad in (0, 3, "2", True, None):
        with pytest.raises(DcrError, match="state digest definition .* is not supported"):
            tensor_contrib("w", t, definition=bad)
        with pytest.raises(DcrError, match="state digest definition .* is not supported"):
            sd.RunningSum(definition=bad)
    with pytest.raises(DcrError, match="state digest definition 3 is not supported"):
        sd.change_contrib("w", torch.bfloat16, (4,), torch.arange(2), t[:2], t[:2], definition=3)
    with pytest.raises(DcrError, match="state digest definition 3 is not supported"):
        state_contrib({"w": t}, definition=3)


def test_name_dtype_and_shape_are_bound(definition):
    tensor_contrib = partial(sd.tensor_contrib, definition=definition)
    state_contrib = partial(sd.state_contrib, definition=definition)
    t = random_tensor((8, 6), torch.bfloat16, seed=16)
    base = state_contrib({"a": t, "b": torch.zeros(3)})
    assert state_contrib({"c": t, "b": torch.zeros(3)}) != base  # moved to another name
    assert state_contrib({"b": t, "a": torch.zeros(3)}) != base  # names exchanged
    assert tensor_contrib("a", t) != tensor_contrib("a", t.view(torch.float16))  # same bits, dtype
    assert tensor_contrib("a", t) != tensor_contrib("a", t.view(torch.int16))
    assert tensor_contrib("a", t) != tensor_contrib("a", t.reshape(6, 8))  # same bits, shape
    assert tensor_contrib("a", t) != tensor_contrib("a", t.reshape(-1))


def test_keys_of_a_model_of_many_tensors_stay_cached():
    """A model of more tensors than 4096 (the cache's old size) summed twice: the second pass
    finds every tensor's keys cached. With the old size every call missed (a cyclic pass evicts
    each name before it comes round again), ~90 us of hashing each."""
    tensors = {f"experts.{i}.w": torch.full((2,), i, dtype=torch.bfloat16) for i in range(5000)}
    first = state_contrib(tensors)
    before = sd._keys1.cache_info()
    assert state_contrib(tensors) == first
    after = sd._keys1.cache_info()
    assert after.misses == before.misses and after.hits - before.hits == len(tensors)


def test_small_tensors_are_summed_in_jobs_of_a_range_each(monkeypatch):
    """The C kernel's ranges go to the workers in jobs of up to one range of elements: small
    tensors share a job (one job per tensor made a model of many small tensors as many jobs of
    microseconds each), a long tensor is cut into ranges as before; the digest is the same."""
    monkeypatch.setattr(sd, "_NATIVE_RANGE", 1000)
    sizes = [300, 300, 300, 300, 2500, 10, 990]
    tensors = {f"t{i}": random_tensor((n,), torch.bfloat16, seed=40 + i) for i, n in enumerate(sizes)}
    pieces = [sd._pieces(name, t, None, 1) for name, t in tensors.items()]
    if not all(threaded for _, _, threaded in pieces):
        pytest.skip("the C kernel is not built here: the reference sums on the calling thread")
    # elements per job: 900 | 300 | 1000 | 1000 | 500 + 10 | 990
    assert [len(job) for job in sd._batches(pieces)] == [3, 1, 1, 1, 2, 1]
    assert state_contrib(tensors, workers=2) == sum((tensor_contrib(n, t) for n, t in tensors.items()),
                                                    StateDigest.zero())


def test_zero_tensor_differs_from_missing_and_duplicates_are_visible():
    z = torch.zeros(5, 5)
    assert tensor_contrib("z", z) != StateDigest.zero()
    assert state_contrib({"a": torch.ones(2), "z": z}) != state_contrib({"a": torch.ones(2)})
    # a shard counted twice (e.g. a replicated tensor summed on every rank) shows up
    d = tensor_contrib("z", z)
    assert d + d != d


# ----------------------------------------------------------------------------- layout / chunking

def test_non_contiguous_equals_contiguous():
    base = random_tensor((9, 14), torch.float32, seed=17)
    for view in (base.t(), base[:, ::2], base[1::3, 2:11], base.t()[::2]):
        assert not view.is_contiguous()
        assert tensor_contrib("w", view) == tensor_contrib("w", view.contiguous())
    # a non-contiguous local shard
    g = random_tensor((8, 10), torch.bfloat16, seed=18)
    spec = ShardSpec.of((8, 10), (0, 5), (8, 5))
    store = torch.empty(5, 8, dtype=torch.bfloat16)
    local = store.t()
    local.copy_(cut(g, spec))
    assert not local.is_contiguous()
    assert tensor_contrib("w", local, spec) == tensor_contrib("w", cut(g, spec).contiguous(), spec)


def test_chunk_and_block_boundaries_do_not_matter(monkeypatch):
    t = random_tensor((37, 29), torch.float64, seed=19)
    spec = ShardSpec.of((37, 58), (0, 29), (37, 29))
    ref = (tensor_contrib("w", t), tensor_contrib("w", t, spec), tensor_contrib("w", t.t()))
    idx = torch.randperm(t.numel(), generator=torch.Generator().manual_seed(1))[:300]
    ref_c = changes_contrib("w", torch.float64, t.shape, idx, flat_bits(t)[idx])
    for chunk, block in [(1, 1), (7, 4), (100, 8), (1 << 10, 16)]:
        monkeypatch.setattr(sd, "CHUNK", chunk)
        monkeypatch.setattr(sd, "_BLOCK", block)
        assert (tensor_contrib("w", t), tensor_contrib("w", t, spec), tensor_contrib("w", t.t())) == ref
        assert changes_contrib("w", torch.float64, t.shape, idx, flat_bits(t)[idx]) == ref_c


# ----------------------------------------------------------------------------- value object

def test_digest_value_object():
    a = tensor_contrib("a", random_tensor((4, 4), torch.float32, seed=20))
    b = tensor_contrib("b", random_tensor((4, 4), torch.float32, seed=21))
    assert a + b == b + a
    assert a + b - b == a
    assert a - a == StateDigest.zero()
    assert a + (-a) == StateDigest.zero()
    assert all(0 <= v < P for v in (a - b).lanes)
    h = a.hex()
    assert len(h) == 8 * sd.LANES and h == h.lower()
    assert StateDigest.from_hex(h) == a
    assert StateDigest.zero().hex() == "0" * 32
    assert hash(StateDigest.from_hex(h)) == hash(a)
    for bad in ("", "0" * 31, "0" * 33, "g" * 32, "7fffffff" + "0" * 24):  # last: lane == P
        with pytest.raises(DcrError):
            StateDigest.from_hex(bad)
    with pytest.raises(DcrError):
        StateDigest((1, 2, 3))


# ----------------------------------------------------------------------------- torch.distributed

def _state():
    return {
        "emb": random_tensor((10, 6), torch.bfloat16, 30),
        "w1": random_tensor((6, 8), torch.float32, 31),
        "ids": random_tensor((4, 3, 5), torch.int64, 32),
    }


def _worker(rank, world, port, out_dir):
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dims = {"emb": 0, "w1": 1, "ids": 2}
        local, shards = {}, {}
        for name, t in _state().items():
            spec = grid(tuple(t.shape), {dims[name]: world})[rank]
            local[name] = cut(t, spec).clone()
            shards[name] = spec
        d = allreduce_digest(state_contrib(local, shards))
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(d.hex(), f)
    finally:
        dist.destroy_process_group()


def test_allreduce_digest_gloo_two_processes(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    world = 2
    found, codes, hung = launch(_worker, world, lambda r, port: (r, world, port, str(tmp_path)), tmp_path, 60)
    assert not hung and sorted(found) == [0, 1], f"ranks hung {hung}, exit codes {codes}"
    expect = state_contrib(_state()).hex()
    for r in range(world):
        assert found[r] == expect


def test_digests_of_the_two_definitions_do_not_mix():
    """A StateDigest carries the definition it was summed with: digests of one definition add,
    subtract and negate into that definition; one of each is refused (their sum is no digest of
    anything, and nothing later could tell); equal lanes of two definitions are not equal
    digests; the text form is the lanes alone, and reading it back says which definition."""
    t = random_tensor((40, 70), torch.bfloat16, seed=18)
    d1, d2 = tensor_contrib("w", t), tensor_contrib("w", t, definition=2)
    assert (d1.definition, d2.definition) == (1, 2)
    assert (d2 + d2).definition == (d2 - d2).definition == (-d2).definition == 2
    for op in (lambda: d1 + d2, lambda: d2 - d1, lambda: d1 + StateDigest.zero(2)):
        with pytest.raises(DcrError, match="definition 1 and one of definition 2|definition 2 and one of definition 1"):
            op()
    assert StateDigest(d2.lanes) != d2 and StateDigest(d2.lanes, 2) == d2
    assert StateDigest.from_hex(d2.hex(), 2) == d2 and StateDigest.from_hex(d1.hex()) == d1
    assert StateDigest.sum_hex([d2.hex(), d2.hex()], 2) == d2 + d2
    assert "definition=2" in repr(d2) and "definition" not in repr(d1)
    with pytest.raises(DcrError, match="cannot be added"):
        sd.RunningSum(d1, definition=2)
    s = sd.RunningSum(d2, definition=2)
    s.add(d2)
    assert s.total == d2 + d2
    with pytest.raises(DcrError, match="cannot be added"):
        s.add(d1)
    with pytest.raises(DcrError, match="definition 3 is not supported"):
        StateDigest((0, 0, 0, 0), 3)
