"""The state digest's C kernel (csrc/, ``dcr_sd_contrib``) against the torch reference
(``statedigest._kernel``), bit for bit: every dtype, special values, every index path (whole
tensor, a run of the canonical tensor, a general shard, explicit indices past 2**32), both the
SIMD and the scalar builds, both definitions of the weights, and the weight clamp's two edge
cases constructed on purpose."""
from __future__ import annotations

import ctypes
from functools import partial

import pytest
import torch

from dcr_testing import record_held_calls
from dcr_testing.shards import cut
from nemo_dcr import ShardSpec
from nemo_dcr.codec import native
from nemo_dcr.errors import DcrError
from nemo_dcr.state import statedigest as sd
from nemo_dcr.state.dtypes import DTYPES, dtype_name, int_view
from nemo_dcr.state.statedigest import ChangeDigest, P, RunningSum, StateDigest, state_contrib

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"no C kernels: {native.build_error}")

M32 = 0xFFFFFFFF


@pytest.fixture(params=[1, 2, 0], ids=["simd", "avx2", "scalar"])
def simd(request):
    native.lib().dcr_set_simd(request.param)
    yield request.param
    native.lib().dcr_set_simd(1)


def test_each_setting_reaches_its_build(simd):
    """``dcr_set_simd`` picks the state digest's build: the best the CPU has, AVX2 at most (so
    an AVX-512 machine tests the AVX2 build too: it took the AVX-512 one before), or the plain
    one. (The build is read before the fixture's setting is changed back.)"""
    lib = native.lib()
    build = lib.dcr_sd_build()
    lib.dcr_set_simd(1)
    best = lib.dcr_sd_build()
    assert best in (0, 1, 2)
    assert build == {1: best, 2: min(best, 1), 0: 0}[simd]


@pytest.fixture
def reference(monkeypatch):
    """A function running its argument with the C kernels switched off (the torch reference)."""
    def run(fn, *a, **k):
        with monkeypatch.context() as m:
            m.setattr(native, "lib", lambda: None)
            return fn(*a, **k)
    return run


def special_tensor(dtype, n, seed):
    """Random raw bits with every special pattern of the dtype's width planted in."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    w = torch.empty((), dtype=dtype).element_size()
    view = int_view(torch.empty(0, dtype=dtype)).dtype
    raw = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g).view(view)
    bits = 8 * w
    specials = [0, 1, (1 << bits) - 1, 1 << (bits - 1), (1 << (bits - 1)) - 1, (1 << (bits - 1)) + 1]
    if dtype.is_floating_point and w >= 2:
        fi = torch.finfo(dtype)
        vals = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, fi.tiny / 2, -fi.tiny / 4, fi.max,
                             fi.min], dtype=torch.float32).to(dtype)
        specials += [int(v) & ((1 << bits) - 1) for v in int_view(vals).tolist()]
    for k, v in enumerate(specials if n else []):
        v = v - (1 << bits) if (v >= 1 << (bits - 1) and raw.dtype != torch.uint8) else v
        raw[(k * 7919) % n] = v
    return raw.view(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_whole_tensor_equals_reference_every_dtype(dtype, simd, reference, definition):
    tensor_contrib = partial(sd.tensor_contrib, definition=definition)
    # lengths not a multiple of any vector width or the C block size
    for n, seed in ((0, 1), (1, 2), (17, 3), (4096 * 3 + 5, 4)):
        t = special_tensor(dtype, n, seed).reshape(-1)
        assert tensor_contrib("w", t) == reference(tensor_contrib, "w", t), (dtype, n)
    # non-contiguous views: a step slice and a transpose (read through the flat accessor)
    m = special_tensor(dtype, 29 * 31, seed=6).reshape(29, 31)
    for v in (m[:, ::3], m.t(), m[1:, 2:].t()[::2]):
        assert not v.is_contiguous()
        assert tensor_contrib("w", v) == reference(tensor_contrib, "w", v), (dtype, v.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16, torch.float32, torch.int32,
                                   torch.uint8, torch.bool, torch.float8_e4m3fn], ids=str)
def test_lengths_around_the_kernels_step_equal_reference(dtype, simd, reference, definition):
    """The written-out kernels of 1-, 2- and 4-byte elements (``csrc/dcr_sd_vec.h``) sum four
    groups of 16 (AVX-512) or 8 (AVX2) elements a step, then single groups to their block's end
    (4096), then a scalar tail: lengths that end in each of those, at canonical starts that are
    not a multiple of 8, for the one-side and the change kernels, on every build. Definition 2
    (``csrc/dcr_sd_blocked.h``) sums blocks of 1024 canonical indices in groups of 8: lengths
    that end inside and at a block's end, from a start inside the first block."""
    tensor_contrib = partial(sd.tensor_contrib, definition=definition)
    change_contrib = partial(sd.change_contrib, definition=definition)
    lengths = [16 * k + r for k in range(10) for r in (0, 5)] + [4096 + 16 * g + 3 for g in (1, 2, 3)] \
        + [2 * 4096 + 48, 3 * 4096 + 64 + 16 + 1, 1024 - 41, 1024 - 41 + 8, 2048 - 41 + 1]
    for n in lengths:
        t = special_tensor(dtype, n + 41, seed=n)
        spec = ShardSpec.of((n + 41,), (41,), (n,))  # a run starting at canonical index 41
        part = t[41:].clone()
        assert tensor_contrib("w", part, spec) == reference(tensor_contrib, "w", part, spec), n
        g = torch.Generator().manual_seed(n)
        idx = torch.randperm(3 * n + 7, generator=g)[:n]
        old, new = special_tensor(dtype, n, seed=n + 1), special_tensor(dtype, n, seed=n + 2)
        assert change_contrib("w", dtype, (3 * n + 7,), idx, old, new) \
            == reference(change_contrib, "w", dtype, (3 * n + 7,), idx, old, new), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.bool], ids=str)
def test_shards_and_strides_equal_reference(dtype, simd, reference, definition):
    tensor_contrib = partial(sd.tensor_contrib, definition=definition)
    full = special_tensor(dtype, 48 * 40, seed=5).reshape(48, 40)
    specs = [ShardSpec.of((48, 40), (8, 0), (16, 40)),   # a run of the canonical tensor: counted index
             ShardSpec.of((48, 40), (0, 10), (48, 20)),  # a column block: explicit indices
             ShardSpec.of((48, 40), (47, 39), (1, 1))]
    for spec in specs:
        shard = cut(full, spec).clone()
        assert tensor_contrib("w", shard, spec) == reference(tensor_contrib, "w", shard, spec)
    nc = full.t()  # non-contiguous: read through computed indices
    assert tensor_contrib("w", nc) == reference(tensor_contrib, "w", nc)
    # the sum over a cover equals the whole, on the native path alone
    parts = [ShardSpec.of((48, 40), (0, 0), (48, 10)), ShardSpec.of((48, 40), (0, 10), (48, 30))]
    assert sum((tensor_contrib("w", cut(full, s).clone(), s) for s in parts), StateDigest.zero(definition)) \
        == tensor_contrib("w", full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.float8_e4m3fn], ids=str)
def test_changes_past_2_pow_32_equal_reference(dtype, simd, reference, definition):
    tensor_contrib = partial(sd.tensor_contrib, definition=definition)
    changes_contrib = partial(sd.changes_contrib, definition=definition)
    shape = (1 << 21, 1 << 12)  # 2**33 elements, never materialised
    g = torch.Generator().manual_seed(9)
    idx = torch.randperm(1 << 20, generator=g)[:5000].to(torch.int64) * 8191 + 3
    assert int(idx.max()) > 1 << 32
    bits = special_tensor(dtype, 5000, seed=9)
    assert changes_contrib("big", dtype, shape, idx, bits) == reference(changes_contrib, "big", dtype, shape, idx, bits)
    # a shard past 2**32 that is one run: the kernel counts indices from its offset
    spec = ShardSpec.of(shape, ((1 << 20) + 5, 0), (2, 1 << 12))
    t = special_tensor(dtype, spec.numel, seed=10).reshape(spec.shape)
    assert tensor_contrib("big", t, spec) == reference(tensor_contrib, "big", t, spec)
    # a run that crosses 2**32 inside a vector of the kernel: it starts at 2**32 - 37
    rows = ((1 << 32) - 37) // 3  # exactly: 2**32 - 37 is divisible by 3
    spec = ShardSpec.of((rows + 100, 3), (rows, 0), (50, 3))
    t = special_tensor(dtype, spec.numel, seed=11).reshape(spec.shape)
    assert tensor_contrib("big", t, spec) == reference(tensor_contrib, "big", t, spec)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 9000])  # around the kernel's reduction block
def test_change_in_one_pass_equals_the_two_sides(dtype, n, simd, reference, definition):
    """``change_contrib`` (``dcr_sd_change``: each index weighed once for old and new) is exactly
    ``contrib(new) - contrib(old)``, in C and in the torch reference, special values included."""
    changes_contrib = partial(sd.changes_contrib, definition=definition)
    change_contrib = partial(sd.change_contrib, definition=definition)
    shape = (n + 17, 3)
    g = torch.Generator().manual_seed(n)
    idx = torch.randperm(shape[0] * shape[1], generator=g)[:n]
    old, new = special_tensor(dtype, n, seed=1), special_tensor(dtype, n, seed=2)
    two = changes_contrib("w", dtype, shape, idx, new) - changes_contrib("w", dtype, shape, idx, old)
    assert change_contrib("w", dtype, shape, idx, old, new) == two
    assert reference(change_contrib, "w", dtype, shape, idx, old, new) == two
    assert change_contrib("w", dtype, shape, idx, old, old) == StateDigest.zero(definition)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64], ids=str)
def test_a_chunks_changes_take_one_call_and_sum_as_the_general_path(dtype, monkeypatch, definition):
    """A chunk's changes as diff and apply report them (1-D host tensors, int64 indices) go to
    ``dcr_sd_change_in`` alone, which checks their range and sums them in one call; the general
    path (2-D indices here) gives the same digest, and an index past the end is refused by both."""
    changes_contrib = partial(sd.changes_contrib, definition=definition)
    change_contrib = partial(sd.change_contrib, definition=definition)
    shape = (700, 3)
    g = torch.Generator().manual_seed(3)
    idx = torch.sort(torch.randperm(2100, generator=g)[:300]).values
    old, new = special_tensor(dtype, 300, seed=3), special_tensor(dtype, 300, seed=4)
    called = record_held_calls(monkeypatch)
    fast = change_contrib("w", dtype, shape, idx, old, new)
    assert called == ["dcr_sd_change_in"]
    assert change_contrib("w", dtype, list(shape), idx.reshape(30, 10), old, new) == fast
    assert fast == changes_contrib("w", dtype, shape, idx, new) - changes_contrib("w", dtype, shape, idx, old)
    for bad in (2100, -1):
        worse = idx.clone()
        worse[-1 if bad > 0 else 0] = bad
        for i in (worse, worse.reshape(30, 10)):
            with pytest.raises(DcrError, match="out of range"):
                change_contrib("w", dtype, shape, i, old, new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
def test_a_running_sum_adds_chunks_in_c_from_several_threads(dtype, monkeypatch, definition):
    """``RunningSum.add_change``: one GIL-keeping call a chunk (``dcr_sd_change_acc``), adding into
    lanes kept in C. Chunks reported from four threads at once sum to what the general path's
    parts add up to; a chunk with an index past the end is refused and leaves the sum as it was;
    parts added whole (``add``) join it."""
    from concurrent.futures import ThreadPoolExecutor
    changes_contrib = partial(sd.changes_contrib, definition=definition)
    change_contrib = partial(sd.change_contrib, definition=definition)
    shape, numel = (700, 3), 2100
    g = torch.Generator().manual_seed(11)
    chunks = [(torch.sort(torch.randperm(numel, generator=g)[:60]).values, special_tensor(dtype, 60, seed=20 + i),
               special_tensor(dtype, 60, seed=200 + i)) for i in range(48)]
    start = StateDigest((5, P - 1, 0, 123456789), definition)
    want = start
    for idx, old, new in chunks:  # (2-D indices: the general path)
        want = want + change_contrib("w", dtype, list(shape), idx.reshape(6, 10), old, new)
    called = record_held_calls(monkeypatch)
    s = RunningSum(start, definition=definition)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda c: s.add_change("w", dtype, shape, *c), chunks))
    assert set(called) == {"dcr_sd_change_acc"} and len(called) == len(chunks)
    assert s.total == want
    idx, old, new = chunks[0]
    for bad in (numel, -1):
        worse = idx.clone()
        worse[-1 if bad > 0 else 0] = bad
        with pytest.raises(DcrError, match="out of range"):
            s.add_change("w", dtype, shape, worse, old, new)
        assert s.total == want
    part = changes_contrib("v", dtype, (9,), torch.arange(9), special_tensor(dtype, 9, seed=3))
    s.add(part)
    assert s.total == want + part


def test_change_digest_moves_a_state_digest_to_the_new_state(simd, definition):
    """A ChangeDigest fed changes (old and new bits), arrivals (old None) and departures (new
    None) takes the whole digest of the old state to that of the new one."""
    g = torch.Generator().manual_seed(5)
    a = special_tensor(torch.bfloat16, 50_000, seed=5)
    b = a.clone()
    idx = torch.randperm(a.numel(), generator=g)[:700]
    b[idx] = special_tensor(torch.bfloat16, 700, seed=6)
    gone = special_tensor(torch.float32, 33, seed=7)
    came = torch.arange(9, dtype=torch.int64)
    d = ChangeDigest(definition=definition)
    d("a", torch.bfloat16, (50_000,), idx, a[idx], b[idx])
    d("gone", torch.float32, (33,), torch.arange(33), gone, None)
    d("came", torch.int64, (9,), torch.arange(9), None, came)
    before = state_contrib({"a": a, "gone": gone}, definition=definition)
    assert before + d.total == state_contrib({"a": b, "came": came}, definition=definition)


# ----------------------------------------------------------------------------- the clamp's edges

def _inv_xorshift(h, s):
    r = h
    for _ in range(32 // s + 1):
        r = h ^ (r >> s)
    return r & M32


def _inv_mix(h):
    h = _inv_xorshift(h, 16)
    h = (h * pow(sd._F2, -1, 1 << 32)) & M32
    h = _inv_xorshift(h, 15)
    h = (h * pow(sd._F1, -1, 1 << 32)) & M32
    return _inv_xorshift(h, 16)


def _mix(h):
    h ^= h >> 16
    h = (h * sd._F1) & M32
    h ^= h >> 15
    h = (h * sd._F2) & M32
    return h ^ (h >> 16)


def test_weight_clamp_edges_equal_reference(simd, reference):
    """Indices whose lane weight ``mix(u ^ t) >> 1`` is 0 (clamped up to 1) or P (clamped down
    to P - 1), built by inverting the keyed index permutation: the C kernel must clamp the same."""
    shape = (1 << 34,)
    keys = sd._keys("edge", "bfloat16", shape)
    idx = []
    for lane in range(sd.LANES):
        for h in (0, 1, M32 - 1, M32):  # >> 1 gives 0, 0, P, P
            u = _inv_mix(h) ^ keys.t[lane]
            for hi in (0, 3):
                lo = _inv_mix(_inv_mix(u) ^ keys.s2 ^ hi) ^ keys.s1
                i = (hi << 32) | lo
                assert _mix(_mix(lo ^ keys.s1) ^ keys.s2 ^ hi) == u  # the inversion is right
                idx.append(i)
    idx = torch.tensor(sorted(set(idx)), dtype=torch.int64)
    for seed in range(3):
        bits = special_tensor(torch.bfloat16, idx.numel(), seed)
        got = sd.changes_contrib("edge", torch.bfloat16, shape, idx, bits)
        assert got == reference(sd.changes_contrib, "edge", torch.bfloat16, shape, idx, bits)
        # and the weights are what the definition says (1 and P - 1, never 0 or P)
        r = [min(max(_mix(_mix(_mix((i & M32) ^ keys.s1) ^ keys.s2 ^ (i >> 32)) ^ keys.t[0]) >> 1, 1), P - 1)
             for i in idx.tolist()]
        assert set(r) & {1, P - 1}


def test_state_contrib_spreads_over_workers(reference):
    """Ranges on several threads add up to the same digest as one."""
    t = special_tensor(torch.bfloat16, (1 << 23) + 1234, seed=11)
    one = sd.tensor_contrib("w", t, workers=1)
    assert sd.tensor_contrib("w", t, workers=2) == one == sd.tensor_contrib("w", t, workers=4)
    assert one == reference(sd.tensor_contrib, "w", t)


# ----------------------------------------------------------------------------- pinned values

def _payload_state():
    """NaN payloads (quiet and signalling, both signs), -0.0, subnormals and odd sizes, per dtype."""
    out = {}
    for k, dtype in enumerate(DTYPES.values()):
        t = special_tensor(dtype, 37 + k, seed=100 + k)
        if dtype.is_floating_point and t.element_size() >= 2:
            w = t.element_size()
            iv = int_view(t).reshape(-1)
            top = 8 * w - 1
            exp_all = {2: 0x7F80 if dtype == torch.bfloat16 else 0x7C00, 4: 0x7F800000, 8: 0x7FF0000000000000}[w]
            for j, p in enumerate((1, 3, 1 << (top - 9), 0x55)):  # NaN payloads, some signalling
                v = exp_all | p
                iv[j] = v if j % 2 == 0 else v - (1 << (top + 1)) + (1 << top)  # odd j: sign bit set
            iv[5] = -(1 << top)  # -0.0
        out[f"t.{dtype_name(dtype)}"] = t
    return out


# Digests of _payload_state() computed with the torch reference before the C kernel existed
# (commit 750676a): the values manifests already hold, which the C path must keep giving; and
# under definition 2, computed with the torch reference when it was written (this commit's).
PINNED_HEX = {1: "257174cf02cf597441d29f534452f348", 2: "2ba6c97351ed3100723caa5361c26196"}


def test_pinned_digests_reference_and_native(simd, reference, definition):
    state = _payload_state()
    got = state_contrib(state, definition=definition).hex()
    assert got == reference(state_contrib, state, definition=definition).hex()
    assert got == PINNED_HEX[definition]


@pytest.mark.parametrize("strided", [False, True], ids=["one-call-jobs", "ranges"])
def test_a_states_tensors_are_summed_side_by_side(monkeypatch, strided):
    """``state_contrib`` spreads the ranges of all its tensors over the workers: two tensors are
    summed at once (the kernel's calls wait for each other at a barrier, which a tensor-after-tensor
    sum never reaches), and the total is the sum of the tensors' own. Contiguous tensors of one
    range go in jobs of one C call each (``many_contrib``), others range by range (``_pieces``)."""
    import threading
    g = torch.Generator().manual_seed(11)
    state = {n: torch.randn(2 * (1000 + 37 * k), generator=g).to(torch.bfloat16) for k, n in enumerate("abcd")}
    if strided:
        state = {n: t[::2] for n, t in state.items()}
    expected = StateDigest.zero()
    for n, t in state.items():
        expected = expected + sd.tensor_contrib(n, t)
    met = threading.Barrier(2, timeout=30)
    calls = []
    real, real_many = sd._native_kernel, sd.many_contrib

    def kernel(*a, **k):
        calls.append("range")
        met.wait()  # BrokenBarrierError after 30 s if the other tensor's range never runs meanwhile
        return real(*a, **k)

    def many(ranges, **k):
        run = real_many(ranges, **k)

        def waiting():
            calls.append("job")
            met.wait()
            return run()
        return waiting

    monkeypatch.setattr(sd, "_native_kernel", kernel)
    monkeypatch.setattr(sd, "many_contrib", many)
    monkeypatch.setattr(sd, "_NATIVE_RANGE", 2400)  # each tensor a job of its own (smaller ones share one)
    monkeypatch.setattr(sd, "MANY_JOB", 2400)
    assert state_contrib(state, workers=2) == expected
    assert calls == ["range" if strided else "job"] * 4


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_a_shard_of_runs_sums_run_by_run_as_the_reference(dtype, simd, reference, monkeypatch, definition):
    """A shard held as one run per row (a column block: a TP engine's row-parallel weight) is
    summed by ``dcr_sd_contrib_runs``, runs counted from their canonical starts, in ranges of
    whole runs; the same digest as the torch reference, for runs around ``RUN_MIN`` and the
    kernel's vector width, ranges cut between runs, and a local tensor that is a view."""
    tensor_contrib = partial(sd.tensor_contrib, definition=definition)
    called = []
    real = sd._run_pieces
    monkeypatch.setattr(sd, "_run_pieces", lambda *a: called.append(a[-1]) or real(*a))
    monkeypatch.setattr(sd, "_NATIVE_RANGE", 700)  # several ranges of whole runs a shard
    rows, cols = 61, 90
    full = special_tensor(dtype, rows * cols, seed=12).reshape(rows, cols)
    for width in (sd.RUN_MIN - 1, sd.RUN_MIN, 17, 33, 64):
        spec = ShardSpec.of((rows, cols), (0, 5), (rows, width))
        shard = cut(full, spec).clone()
        assert tensor_contrib("w", shard, spec) == reference(tensor_contrib, "w", shard, spec), width
        # the same shard as a view of the full tensor (not contiguous: read range by range)
        view = cut(full, spec)
        assert not view.is_contiguous()
        assert tensor_contrib("w", view, spec) == tensor_contrib("w", shard, spec)
    # three sums a width (the shard, its view, the shard again); shorter runs: an index per element
    assert called == [w for w in (sd.RUN_MIN, 17, 33, 64) for _ in range(3)]
    # a block of rows and columns: runs that do not start at a row's first element
    spec = ShardSpec.of((rows, cols), (7, 40), (20, 50))
    shard = cut(full, spec).clone()
    assert tensor_contrib("w", shard, spec) == reference(tensor_contrib, "w", shard, spec)
    # the column blocks of a tensor add up to its whole digest
    parts = [ShardSpec.of((rows, cols), (0, o), (rows, w)) for o, w in ((0, 30), (30, 41), (71, 19))]
    assert sum((tensor_contrib("w", cut(full, s).clone(), s) for s in parts), StateDigest.zero(definition)) \
        == tensor_contrib("w", full)


def test_the_runs_kernel_refuses_bad_arguments_before_summing(definition):
    lib = native.lib()
    keys = sd._keys("w", "bfloat16", (4, 8), definition)
    t, kp, c = sd._native_keys(keys)
    bits = torch.zeros(8, dtype=torch.int16)
    out = (ctypes.c_uint64 * sd.LANES)(7, 7, 7, 7)

    def call(starts, w=2, n_runs=None, length=4, defn=definition):
        g = torch.tensor(starts, dtype=torch.int64)
        return lib.dcr_sd_contrib_runs(bits.data_ptr(), w, g.data_ptr(), len(starts) if n_runs is None else n_runs,
                                       length, keys.s1, keys.s2, t, kp, c, out, defn)

    assert call([0, -4]) != 0  # a negative canonical start
    assert call([0, 4], w=3) != 0  # no such width
    assert call([0, 4], n_runs=-1) != 0
    assert call([0, 4], defn=3) != 0 and call([0, 4], defn=0) != 0  # no such definition
    assert list(out) == [7, 7, 7, 7]  # refused before anything was written
    assert call([0, 4]) == 0
    assert list(out) == list(sd._native_kernel(lib, keys, bits, start=0))  # runs 0..3 and 4..7: one run 0..7


def test_many_ranges_in_one_call_sum_as_one_call_each(simd, reference, definition):
    """``many_contrib``: each range's contribution, in one ``dcr_sd_contrib_many`` call, equal to
    ``range_contrib`` of it (C and torch reference) on every dtype, special values included, at
    any canonical start (a tensor's leading elements, a run inside it, its last elements)."""
    ranges = []
    for k, dtype in enumerate(DTYPES.values()):
        t = special_tensor(dtype, 50 + 37 * k, seed=70 + k)
        ranges.append((f"t{k}", dtype, (t.numel() + 3 * k,), int_view(t), (0, k, 3 * k)[k % 3]))
    got = sd.many_contrib(ranges, definition=definition)()
    assert got == [sd.range_contrib(*r, definition=definition) for r in ranges]
    assert got == reference(lambda: sd.many_contrib(ranges, definition=definition)())
    assert len(set(got)) == len(got)  # each range its own sums (no range's keys or bits reused)
    assert sd.many_contrib([])() == []


def test_many_ranges_are_checked_before_the_call():
    with pytest.raises(DcrError, match="out of range"):
        sd.many_contrib([("w", torch.int16, (3,), torch.zeros(4, dtype=torch.int16), 0)])
    with pytest.raises(DcrError, match="out of range"):
        sd.many_contrib([("w", torch.int16, (6,), torch.zeros(4, dtype=torch.int16), 3)])
    with pytest.raises(DcrError, match="out of range"):
        sd.many_contrib([("w", torch.int16, (6,), torch.zeros(4, dtype=torch.int16), -1)])
    with pytest.raises(DcrError, match="2-byte elements, dtype needs 4"):  # bits of another width
        sd.many_contrib([("w", torch.float32, (4,), torch.zeros(4, dtype=torch.int16), 0)])


def test_the_many_ranges_kernel_refuses_bad_arguments_before_summing(definition):
    lib = native.lib()
    bits = torch.zeros(8, dtype=torch.int16)
    keys = sd._keys("w", "bfloat16", (8,), definition)
    t, kp, c = sd._native_keys(keys)
    out = (ctypes.c_uint64 * (2 * sd.LANES))(*([7] * 2 * sd.LANES))

    def call(w=2, count=8, ptr=None, n=2, start=0, defn=definition):
        ptrs = (ctypes.c_uint64 * 2)(bits.data_ptr(), bits.data_ptr() if ptr is None else ptr)
        widths = (ctypes.c_int32 * 2)(2, w)
        counts = (ctypes.c_int64 * 2)(8, count)
        starts = (ctypes.c_int64 * 2)(0, start)
        s1 = (ctypes.c_uint32 * 2)(keys.s1, keys.s1)
        s2 = (ctypes.c_uint32 * 2)(keys.s2, keys.s2)
        tt = (ctypes.c_uint32 * 8)(*t, *t)
        kpp = (ctypes.c_uint64 * 32)(*kp, *kp)
        cc = (ctypes.c_uint64 * 8)(*c, *c)
        return lib.dcr_sd_contrib_many(n, ptrs, widths, counts, starts, s1, s2, tt, kpp, cc, out, defn)

    assert call(w=3) != 0  # no such width
    assert call(count=-1) != 0
    assert call(ptr=0) != 0  # elements at no address
    assert call(n=-1) != 0
    assert call(start=-1) != 0
    assert call(defn=3) != 0  # no such definition
    assert list(out) == [7] * 2 * sd.LANES  # refused before anything was written
    assert call() == 0
    one = list(sd._native_kernel(lib, keys, bits, start=0))
    assert list(out) == one + one
