"""A chunk's positions a receiver holds, as runs rather than elements (nemo_dcr/state/runs.py; a
receiver group's decode, nemo_dcr/sync/chunk_gather.py; docs/results.md, twenty-fifth turn):

- ``IndexMap.rows``: a shard's runs, consecutive in its local and the canonical order;
- which runs of a chunk each rank holds (``_held``) and answers for (``_answering``: the lowest
  holding a position), equal to the per-element index maps on row, column, box and index-shape
  layouts, overlapping ones included;
- ``classes.run_counts`` / ``run_select``: the C kernels equal to the torch reference on every
  classes dtype, NaN payloads, -0.0, subnormals and infinities included, and refusing what does
  not fit; their ``_many`` forms (a version's chunks in one call) equal to one call each."""
import numpy as np
import pytest
import torch

from dcr_testing import bits as int_bits
from nemo_dcr.codec import classes
from nemo_dcr.codec.native import lib
from nemo_dcr.errors import DcrError
from nemo_dcr.state import runs as R
from nemo_dcr.state.index_map import IndexMap, ShardSpec

pytestmark = pytest.mark.skipif(lib() is None, reason="the C kernels are what is compared with the reference")

# (global shape, region (offsets, shape) or None: whole, [receiver specs as (offsets, shape[, index_shape])])
LAYOUTS = [
    ((24, 40), None, [((0, 0), (24, 13)), ((0, 13), (24, 14)), ((0, 27), (24, 13))]),   # columns
    ((24, 40), ((8, 0), (8, 40)), [((0, 0), (24, 20)), ((0, 20), (24, 20))]),          # a row shard, columns
    ((24, 40), ((0, 10), (24, 20)), [((0, 0), (7, 40)), ((7, 0), (17, 40))]),          # a column shard, rows
    ((30, 16), None, [((0, 0), (7, 16)), ((7, 0), (12, 16)), ((19, 0), (11, 16))]),    # rows off chunk bounds
    ((6, 8, 10), ((1, 0, 0), (4, 8, 10)), [((0, 0, 0), (6, 4, 10)), ((0, 4, 0), (6, 4, 5)),
                                           ((0, 4, 5), (6, 4, 5))]),                    # 3-D boxes
    ((12, 40), None, [((0, 0), (12, 25)), ((0, 10), (12, 30)), ((0, 5), (12, 25))]),   # overlapping columns
    ((12, 40), None, [((0, 0), (12, 20)), ((0, 0), (12, 20)), ((0, 20), (12, 20))]),   # a shard held twice
    ((12, 18), None, [((0, 0, 0), (12, 1, 6), (12, 3, 6)), ((0, 1, 0), (12, 2, 6), (12, 3, 6))]),  # index shapes
]


def _specs(shape, region, recv):
    reg = ShardSpec.full(shape) if region is None else ShardSpec.of(shape, *region)
    return reg, {r: ShardSpec.of(shape, *s[:2], index_shape=s[2] if len(s) > 2 else None) for r, s in enumerate(recv)}


def _by_element(reg: ShardSpec, spec: ShardSpec, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunk positions, local indices) the shard holds, by the per-element index maps."""
    glob = IndexMap(reg).to_global(torch.arange(start, start + n))
    local, mask = IndexMap(spec).to_local(glob)
    return mask.nonzero().flatten().numpy(), local.numpy()


def _elements(runs) -> tuple[np.ndarray, np.ndarray]:
    return R.expand(runs.cstart, runs.length), R.expand(runs.lstart, runs.length)


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_rows_cover_each_shard_once_in_both_orders(layout):
    shape, region, recv = LAYOUTS[layout]
    for spec in [*_specs(shape, region, recv)[1].values(), _specs(shape, region, recv)[0]]:
        local, glob, length = IndexMap(spec).rows()
        m = IndexMap(spec)
        assert local.numel() * length == spec.numel
        every = torch.arange(spec.numel)
        want = m.to_global(every).view(-1, length)
        assert torch.equal(want[:, 0], glob) and torch.equal(local, every.view(-1, length)[:, 0])
        assert bool((want[:, 1:] - want[:, :-1] == 1).all())  # each run consecutive in canonical order
        assert bool((glob[1:] > glob[:-1]).all())


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_each_rank_holds_and_answers_what_the_index_maps_say(layout, chunk):
    shape, region, recv = LAYOUTS[layout]
    reg, specs = _specs(shape, region, recv)
    for start in range(0, reg.numel, chunk):
        n = min(chunk, reg.numel - start)
        held = {}
        for r, spec in specs.items():
            runs = R.chunk_runs(reg, start, n, spec)
            assert R.chunk_runs(reg, start, n, spec) is runs  # kept per layout
            assert not runs.cstart.flags.writeable  # (so shared safely)
            c, local = _elements(runs)
            want_c, want_local = _by_element(reg, spec, start, n)
            assert np.array_equal(c, want_c) and np.array_equal(local, want_local), (r, start)
            if len(runs):
                held[r] = runs
        ranks = sorted(specs)
        disjoint = not any(specs[a].overlaps(specs[b]) for i, a in enumerate(ranks) for b in ranks[i + 1:])
        answers = R.answering(held, n, disjoint)
        covered = np.zeros(n, dtype=bool)
        for r in sorted(held):  # the lowest rank holding a position answers for it
            c, local = _by_element(reg, specs[r], start, n)
            own = ~covered[c]
            covered[c] = True
            got = _elements(answers[r]) if r in answers else (np.empty(0), np.empty(0))
            assert np.array_equal(got[0], c[own]) and np.array_equal(got[1], local[own]), (r, start)
        assert sum(a.total for a in answers.values()) == int(covered.sum())


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
SPECIAL = {  # NaN payloads, -0.0, subnormals, infinities (unsigned bits)
    1: [0x7F, 0xFF, 0x80, 0x01, 0x87, 0x7C],
    2: [0x7FC1, 0xFF81, 0x7F81, 0x8000, 0x0001, 0x807F, 0x7F80],
    4: [0x7FC00001, 0xFFA00005, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000],
}


def _base(dtype, n=6000, seed=3):
    g = torch.Generator().manual_seed(seed)
    b = int_bits((torch.randn(n, generator=g) * 4).to(dtype)).clone()
    w = b.element_size()
    at = torch.randperm(n, generator=g)[: 8 * len(SPECIAL[w])]
    b[at] = torch.tensor(SPECIAL[w] * 8, dtype=torch.int64).to(b.dtype)  # (wraps into the signed view)
    return b


RUNS = (np.array([0, 100, 1000, 4000, 2500, 5999], dtype=np.int64),  # starts (out of order, one run empty)
        np.array([50, 700, 0, 1000, 300, 1], dtype=np.int64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_run_counts_and_select_in_c_equal_the_reference(dtype):
    base, mant = _base(dtype), classes.MANTISSA[dtype]
    start, length = RUNS
    hi = (1 << (8 * base.element_size() - 1 - mant)) - 1  # every exponent is a class
    for lo, top in ((0, hi), (3, hi // 2)):  # the whole range, and one that clamps at both ends
        counts = classes.run_counts(base, start, length, lo, top, mant, use_native=True)
        assert np.array_equal(counts, classes.run_counts(base, start, length, lo, top, mant, use_native=False))
        ctx = [classes.context(base[s:s + n], [[lo], [top]], mant) for s, n in zip(start, length)]
        assert np.array_equal(counts, np.stack([np.bincount(c.numpy(), minlength=top - lo + 1) for c in ctx]))
        g = np.random.default_rng(5)
        req = [(r, c, v) for r in range(len(start)) for c in range(top - lo + 1)
               for v in g.permutation(int(counts[r, c]))[: max(1, int(counts[r, c]) // 3)]]
        run, cls, within = (np.array(x, dtype=np.int64) for x in zip(*g.permutation(req)))
        got = classes.run_select(base, start, length, lo, top, mant, run, cls, within, use_native=True)
        assert np.array_equal(got, classes.run_select(base, start, length, lo, top, mant, run, cls, within,
                                                      use_native=False))
        for j in range(len(run)):  # the within-th element of its class in its run
            assert int(np.flatnonzero(ctx[run[j]].numpy() == cls[j])[within[j]]) == got[j]


@pytest.mark.parametrize("simd", [0, 1, 2, 3], ids=["scalar", "best", "avx2", "avx2-without-pdep"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_run_kernels_vector_loops_equal_the_reference(dtype, simd):
    """2-byte runs of a block (64) or more take the vector loops (AVX-512BW or AVX2, and
    ``dcr_set_simd`` picks): runs starting anywhere, with tails of every kind, and class ranges of
    one class, a few (clamped at both ends), MAXA (64) and one more (the scalar loop), each equal
    to the torch reference, NaN payloads, -0.0 and subnormals among the bits."""
    base, mant = _base(dtype, n=20000), classes.MANTISSA[dtype]
    start = np.array([1, 333, 5000, 9001, 12345, 17000, 0, 640], dtype=np.int64)
    length = np.array([64, 1000, 4097, 127, 63, 2999, 20000, 128], dtype=np.int64)
    ex = (int_bits(base).to(torch.int64) & 0x7FFF) >> mant
    mode = int(torch.bincount(ex).argmax())
    lib().dcr_set_simd(simd)
    try:
        every = (1 << (15 - mant)) - 1  # the dtype's last class (float16: 31, so never more than MAXA)
        for lo, top in ((mode, mode), (mode - 3, mode + 4), (mode - 32, mode + 31), (mode - 32, mode + 32)):
            lo, top = max(lo, 0), min(top, every)
            counts = classes.run_counts(base, start, length, lo, top, mant, use_native=True)
            assert np.array_equal(counts, classes.run_counts(base, start, length, lo, top, mant, use_native=False))
            assert np.array_equal(counts.sum(1), length)
            g = np.random.default_rng(lo + top)
            req = [(r, c, v) for r in range(len(start)) for c in range(top - lo + 1)
                   for v in (range(int(counts[r, c])) if c == 0 else
                             g.permutation(int(counts[r, c]))[: max(1, int(counts[r, c]) // 3)])]
            run, cls, within = (np.array(x, dtype=np.int64) for x in zip(*g.permutation(req)))
            got = classes.run_select(base, start, length, lo, top, mant, run, cls, within, use_native=True)
            assert np.array_equal(got, classes.run_select(base, start, length, lo, top, mant, run, cls, within,
                                                          use_native=False))
            past = np.array([counts[1, 0]])  # one past the last of a class in a run of many blocks
            with pytest.raises(classes.RankPastClass):
                classes.run_select(base, start, length, lo, top, mant, np.array([1]), np.array([0]), past)
    finally:
        lib().dcr_set_simd(1)


@pytest.mark.parametrize("native", [True, False])
def test_run_select_refuses_what_the_runs_do_not_hold(native):
    base, mant = _base(torch.bfloat16), classes.MANTISSA[torch.bfloat16]
    start, length = RUNS
    counts = classes.run_counts(base, start, length, 0, 255, mant)
    r, c = np.unravel_index(int(np.argmax(counts)), counts.shape)
    past = np.array([counts[r, c]])
    with pytest.raises(classes.RankPastClass):
        classes.run_select(base, start, length, 0, 255, mant, np.array([r]), np.array([c]), past, use_native=native)
    for run, cls, within in (([len(start)], [0], [0]), ([0], [256], [0]), ([0], [0], [-1])):
        with pytest.raises(DcrError):
            classes.run_select(base, start, length, 0, 255, mant, np.array(run), np.array(cls), np.array(within),
                               use_native=native)
    with pytest.raises(DcrError):  # a run past the base
        classes.run_counts(base, np.array([5990]), np.array([20]), 0, 255, mant, use_native=native)
    assert classes.run_select(base, start, length, 0, 255, mant, *(np.empty(0, dtype=np.int64),) * 3,
                              use_native=native).size == 0


def test_the_kernels_alone_refuse_runs_past_their_base():
    """The Python checks aside, the C kernels never read past the base they are given."""
    base, mant = _base(torch.bfloat16, n=100), classes.MANTISSA[torch.bfloat16]
    counts = np.zeros(256, dtype=np.uint32)
    for start, n in ((90, 11), (101, 0), (-1, 2), (0, -1)):
        s, ln = np.array([start], dtype=np.int64), np.array([n], dtype=np.int64)
        assert lib().dcr_cls_run_counts(base.data_ptr(), 100, 2, mant, 0, 255, s.ctypes.data, ln.ctypes.data, 1,
                                        counts.ctypes.data) == -7
        req, got = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        assert lib().dcr_cls_run_select(base.data_ptr(), 100, 2, mant, 0, 255, s.ctypes.data, ln.ctypes.data, 1,
                                        req.ctypes.data, req.ctypes.data, req.ctypes.data, 1, got.ctypes.data) == -7
    s, ln = np.array([90], dtype=np.int64), np.array([10], dtype=np.int64)  # the last ten: in bounds
    assert lib().dcr_cls_run_counts(base.data_ptr(), 100, 2, mant, 0, 255, s.ctypes.data, ln.ctypes.data, 1,
                                    counts.ctypes.data) == 0 and int(counts.sum()) == 10


@pytest.mark.parametrize("order", ["stream", "kernel", "any"])
def test_many_calls_at_once_equal_one_call_each(order):
    """``run_counts_many`` / ``run_select_many`` (a version's chunks in one C call): each call's
    counts, offsets and base bits as ``run_counts`` / ``run_select`` give them alone, over calls of
    every dtype and class range, an empty call among them; requests in a chunk's stream order
    (the one-sort path), in the kernel's order already (by run, class and place: no sort, as a row
    shard's requests come) and in any order (the fallback); and the torch reference the same."""
    g = np.random.default_rng(11)
    calls, reqs = [], []
    for i, dtype in enumerate([*DTYPES, torch.bfloat16]):
        base, mant = _base(dtype, n=3000, seed=i), classes.MANTISSA[dtype]
        start, length = (np.empty(0, dtype=np.int64),) * 2 if i == 2 else RUNS  # call 2: no runs
        start = np.minimum(start, 3000 - length)
        hi = (1 << (8 * base.element_size() - 1 - mant)) - 1
        lo, top = (0, hi) if i % 2 else (2, hi // 2)
        calls.append(classes.RunCall(base, start, length, lo, top, mant))
        counts = classes.run_counts(base, start, length, lo, top, mant)
        req = [(c, r, v) for c in range(top - lo + 1) for r in range(len(start))
               for v in sorted(g.permutation(int(counts[r, c]))[: int(counts[r, c]) // 4])]
        if order == "kernel":
            req.sort(key=lambda x: (x[1], x[0], x[2]))
        elif order == "any":
            req = [req[j] for j in g.permutation(len(req))]
        reqs.append(tuple(np.array(x, dtype=np.int64).reshape(-1) for x in (zip(*req) if req else ([], [], []))))
    per = np.array([r[0].size for r in reqs])
    cls, run, within = (np.concatenate([r[j] for r in reqs]) for j in range(3))
    assert per.sum() > 1000 and per[2] == 0
    for native in (True, False):
        flat = classes.run_counts_many(calls, use_native=native)
        alone = [classes.run_counts(c.base, c.start, c.length, c.lo, c.hi, c.mant).reshape(-1) for c in calls]
        assert np.array_equal(flat, np.concatenate(alone))
        off, bits = classes.run_select_many(calls, per, run, cls, within, use_native=native)
        q = 0
        for c, (k, r, v) in zip(calls, reqs):
            one = classes.run_select(c.base, c.start, c.length, c.lo, c.hi, c.mant, r, k, v)
            assert np.array_equal(off[q:q + r.size], one)
            at = torch.from_numpy(c.start[r] + one)
            want = (c.base[at].to(torch.int64) & ((1 << (8 * c.base.element_size())) - 1)).numpy()
            assert np.array_equal(bits[q:q + r.size], want.astype(np.uint32))
            q += r.size


def test_many_calls_refuse_what_one_call_refuses():
    """A request past its class's members is ``RankPastClass``, named by its call; a request or a
    run out of range, or a base not contiguous, is refused before the kernel runs."""
    base, mant = _base(torch.bfloat16), classes.MANTISSA[torch.bfloat16]
    start, length = RUNS
    counts = classes.run_counts(base, start, length, 0, 255, mant)
    r, c = np.unravel_index(int(np.argmax(counts)), counts.shape)
    calls = [classes.RunCall(base, start, length, 0, 255, mant)] * 2
    one = np.array([1, 1])
    with pytest.raises(classes.RankPastClass, match="call 1"):
        classes.run_select_many(calls, one, np.array([r, r]), np.array([c, c]), np.array([0, counts[r, c]]))
    with pytest.raises(DcrError):
        classes.run_select_many(calls, one, np.array([0, len(start)]), np.array([0, 0]), np.array([0, 0]))
    with pytest.raises(DcrError):
        classes.run_select_many(calls, np.array([1, 2]), np.array([0, 0]), np.array([0, 0]), np.array([0, 0]))
    with pytest.raises(DcrError, match="outside its base"):
        classes.run_counts_many([classes.RunCall(base, np.array([5990]), np.array([20]), 0, 255, mant)])
    with pytest.raises(DcrError, match="contiguous"):
        classes.run_counts_many([classes.RunCall(base[::2], np.array([0]), np.array([20]), 0, 255, mant)])


def _placing(seed: int, calls: int = 6):
    """Chunks' runs' class counts (some runs and classes empty, every count width) in a random
    chunk order, and per chunk changes in stream order (class by class, ranks increasing), some
    classes with none; one chunk with no runs' changes at all."""
    g = np.random.default_rng(seed)
    counts, order, changes, cls, rank = [], [], [], [], []
    for i in range(calls):
        runs, ncls = int(g.integers(1, 40)), int(g.integers(1, 12))
        n = g.integers(0, 30, size=(runs, ncls)) * (g.random((runs, ncls)) < 0.7)
        counts.append(n.astype([np.uint8, np.uint16, np.uint32][i % 3]))
        order.append(g.permutation(runs).astype(np.int64))
        k = 0
        for c in range(ncls):
            total = int(n[:, c].sum())
            if i == 2 or not total or g.random() < 0.2:
                continue
            r = np.sort(g.choice(total, size=int(g.integers(1, total + 1)), replace=False))
            cls.append(np.full(r.size, c)), rank.append(r)
            k += r.size
        changes.append(k)
    return counts, order, np.array(changes), np.concatenate(cls), np.concatenate(rank)


@pytest.mark.parametrize("seed", range(4))
def test_place_many_in_c_equals_numpy_and_the_counts(seed):
    """Each change goes to the run (chunk order) holding its rank's element of its class, at its
    place among that run's elements of the class: the C walk equals numpy's cumulative sum and
    search and the counts themselves; changes out of rank order (a walk from the first run again)
    too."""
    counts, order, changes, cls, rank = _placing(seed)
    run, within = classes.place_many(counts, order, changes, cls, rank, use_native=True)
    ref = classes.place_many(counts, order, changes, cls, rank, use_native=False)
    assert np.array_equal(run, ref[0]) and np.array_equal(within, ref[1])
    share = np.repeat(np.arange(len(counts)), changes)
    for j in range(cls.size):  # the counts say so: members of the class in the runs before, plus within
        n = counts[share[j]][order[share[j]]].astype(np.int64)[:, cls[j]]
        assert within[j] < n[run[j]] and int(n[:run[j]].sum()) + within[j] == rank[j]
    shuffled = np.concatenate([g[::-1] for g in np.split(np.arange(cls.size), np.cumsum(changes)[:-1])])
    run2, within2 = classes.place_many(counts, order, changes, cls[shuffled], rank[shuffled], use_native=True)
    assert np.array_equal(run2, run[shuffled]) and np.array_equal(within2, within[shuffled])


@pytest.mark.parametrize("native", [True, False])
def test_place_many_refuses_a_change_its_runs_do_not_hold(native):
    """A rank past its class's members, a class outside the chunk's, a negative rank: refused as
    ``RankPastClass`` naming the chunk (its call); arguments that do not fit, before the kernel."""
    counts, order, changes, cls, rank = _placing(7)
    last = int(np.flatnonzero(changes)[-1])
    at = int(changes[:last + 1].sum()) - 1  # the last change of that chunk
    for bump in (None, 1 << 20, -(1 << 40)):  # a class out of range, then a rank past, a negative rank
        c, r = cls.copy(), rank.copy()
        if bump is None:
            c[at] = counts[last].shape[1]
        else:
            r[at] = bump
        with pytest.raises(classes.RankPastClass) as e:
            classes.place_many(counts, order, changes, c, r, use_native=native)
        assert e.value.call == last
    with pytest.raises(DcrError):
        classes.place_many(counts, order, changes + 1, cls, rank, use_native=native)
    with pytest.raises(DcrError):
        classes.place_many(counts, order[:-1], changes, cls, rank, use_native=native)


@pytest.mark.parametrize("w", [1, 2, 4])
def test_new_bits_on_the_host_equal_new_values(w):
    """A group's new bits put together in numpy, in the width's own arithmetic, equal the torch
    form's on every bit pattern of 1 and 2 bytes (4 bytes: NaN payloads, -0.0, subnormals,
    infinities and random ones), with differences across the whole range, 0, 1 and -1 among them."""
    g = np.random.default_rng(w)
    mod = 1 << (8 * w)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[w]
    if w < 4:
        old = np.tile(np.arange(mod, dtype=np.int64), 4)
    else:
        old = np.concatenate([np.array(SPECIAL[4], dtype=np.int64), g.integers(0, mod, size=1 << 16)])
    d = g.integers(0, mod, size=old.size)
    d[: 3 * (old.size // 4)] = np.repeat([0, 1, mod - 1], old.size // 4)
    got = classes.new_bits_host(old.astype(unsigned), d)
    want = classes.new_values(torch.from_numpy(old), torch.from_numpy(d), w).numpy()
    assert got.dtype == unsigned and np.array_equal(got.astype(np.int64), want)


def _classes_deltas():
    """Two deltas of every classes dtype's tensors (6000 elements with NaN payloads, -0.0,
    subnormals and infinities, 3 % of them changed), in chunks of 1000, every chunk ``classes``."""
    from nemo_dcr import diff
    from nemo_dcr.codec.format import DeltaReader
    readers = []
    for seed in (1, 2):
        base, target = {}, {}
        for dtype in DTYPES:
            b = _base(dtype, seed=seed + 10)
            t = b.clone()
            at = torch.randperm(b.numel(), generator=torch.Generator().manual_seed(seed))[:180]
            t[at] = t[at] ^ 1  # (the lowest mantissa bit: its class stays)
            base[str(dtype)], target[str(dtype)] = b.view(dtype), t.view(dtype)
        readers.append(DeltaReader.open(diff(base, target, encoding="classes", chunk_elems=1000)))
    chunks = [(i, c, e.torch_dtype) for i, r in enumerate(readers) for e in r.header.tensors for c in e.chunks]
    assert chunks and all(c.enc == "classes" for _, c, _ in chunks)
    return readers, chunks


@pytest.mark.parametrize("native", [True, False])
def test_chunk_streams_many_equal_one_call_each(native):
    """Every classes dtype's chunks of two deltas in one call: each chunk's classes, ranks and
    differences are ``chunk_streams``' of it, where the offsets say."""
    from nemo_dcr.codec.chunk import chunk_streams, chunk_streams_many
    readers, chunks = _classes_deltas()
    cls, rank, d, first = chunk_streams_many([r.buf for r in readers], chunks, use_native=native)
    assert first[-1] == cls.size == rank.size == d.size == sum(c.k for _, c, _ in chunks)
    for i, (b, c, dtype) in enumerate(chunks):
        one = chunk_streams(c, readers[b].payload(c), dtype.itemsize, dtype)
        for got, want in zip((cls, rank, d), one):
            assert np.array_equal(got[first[i]:first[i + 1]], want.numpy())


@pytest.mark.parametrize("native", [True, False])
def test_chunk_streams_many_name_the_chunk_that_fails(native):
    """A payload byte changed (its checksum) or streams that do not decode are refused as
    ``StreamsDoNotDecode`` naming that chunk, the first of them."""
    import dataclasses

    from nemo_dcr.codec.chunk import StreamsDoNotDecode, chunk_streams_many
    readers, chunks = _classes_deltas()
    bufs = [bytearray(r.buf) for r in readers]
    b, c, _ = chunks[5]
    bufs[b][c.off + c.plen] ^= 0x40  # the value stream's first byte
    with pytest.raises(StreamsDoNotDecode, match="checksum") as e:
        chunk_streams_many(bufs, chunks, use_native=native)
    assert e.value.call == 5
    bufs[b][c.off + c.plen] ^= 0x40
    wrong = list(chunks)
    b, c, dtype = wrong[7]
    wrong[7] = (b, dataclasses.replace(c, k=c.k - 1, cls=((*c.cls[0][:1], c.cls[0][1] - 1, *c.cls[0][2:]),
                                                           *c.cls[1:])), dtype)  # a change fewer: trailing bits
    with pytest.raises(StreamsDoNotDecode) as e:
        chunk_streams_many(bufs, wrong, use_native=native)
    assert e.value.call == 7


def test_a_spec_of_lists_is_worked_out_each_time_with_the_same_runs():
    """``chunk_runs`` keeps a layout's runs by its specs; a spec of lists (unhashable) is worked
    out afresh instead, the same runs, and its total is the positions it holds."""
    region = ShardSpec((24, 40), (8, 0), (8, 40))
    kept = R.chunk_runs(region, 5, 200, ShardSpec((24, 40), (0, 20), (24, 20)))
    listed = R.chunk_runs(ShardSpec([24, 40], [8, 0], [8, 40]), 5, 200, ShardSpec([24, 40], [0, 20], [24, 20]))
    assert R.chunk_runs(region, 5, 200, ShardSpec((24, 40), (0, 20), (24, 20))) is kept  # a lookup
    for a, b in zip((kept.cstart, kept.lstart, kept.length), (listed.cstart, listed.lstart, listed.length)):
        assert np.array_equal(a, b)
    # the shard holds columns 20-39: 20 of each of the chunk's rows 0-4 (from column 5 of row 0 on)
    assert kept.total == listed.total == int(listed.length.sum()) == 100


def _r(*rows) -> R.Runs:
    """Runs from (chunk start, local start, length) triples."""
    return R.Runs(*(np.array([r[i] for r in rows], dtype=np.int64) for i in range(3)))


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_copy_and_gather_of_runs_in_c_equal_numpy(w, monkeypatch):
    """``copy_runs`` (a chunk's runs written where a receiver holds them) and ``gather_runs`` (a
    chunk's bits gathered from a receiver holding all of it) in one C call (``dcr_copy_runs``)
    equal the numpy copies, every width, runs alike (one strided copy there) and not; both bump
    the version counter; runs outside either tensor are refused with nothing copied."""
    from nemo_dcr.codec import native
    g = torch.Generator().manual_seed(w)
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w]
    src = torch.randint(-100, 100, (700,), generator=g).to(view)
    alike = _r(*[(7 + 40 * i, 3 + 33 * i, 17) for i in range(12)])
    odd = _r((0, 600, 5), (5, 0, 1), (6, 300, 90), (96, 10, 4))
    for runs in (alike, odd):
        outs = []
        for loaded in (native.lib, lambda: None):
            monkeypatch.setattr(native, "lib", loaded)
            dst = torch.zeros(700, dtype=view)
            before = dst._version
            R.copy_runs(dst, src, runs)
            assert dst._version > before
            outs.append((dst, R.gather_runs(dst, R.Runs(np.concatenate(([0], np.cumsum(runs.length)[:-1])),
                                                        runs.lstart, runs.length))))
        monkeypatch.undo()
        (c_dst, c_got), (np_dst, np_got) = outs
        assert torch.equal(c_dst, np_dst) and torch.equal(c_got, np_got)
        want = torch.cat([src[c:c + n] for c, n in zip(runs.cstart.tolist(), runs.length.tolist())])
        assert torch.equal(c_got, want)  # gathered back in run order: the source's runs
    dst = torch.zeros(700, dtype=view)
    for bad in (_r((0, 0, 8), (695, 8, 6)), _r((0, 0, 8), (8, 696, 8)), _r((0, 0, 8), (8, -1, 2))):
        with pytest.raises(IndexError, match="runs outside their tensors"):
            R.copy_runs(dst, src, bad)
        assert not dst.any()  # the good first run was not copied either
