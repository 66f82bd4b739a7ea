"""Property-based round trips: ``apply(base, diff(base, target)) == target`` bit for bit.

Every comparison goes through integer views of the raw bits; floats are never compared as
floats (NaN payloads, -0.0 and subnormals must survive exactly).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dcr import DeltaReader, apply, diff
from nemo_dcr.codec.chunk import CLASSES_ENOUGH, encode_chunk
from nemo_dcr.codec.classes import MANTISSA as CLASSES_DTYPES
from nemo_dcr.state.dtypes import DTYPES, INT_VIEW, int_view

SETTINGS = dict(derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPE_NAMES = sorted(DTYPES)
SHAPES = [(), (0,), (3, 0, 2), (1,), (2,), (17,), (130,), (3, 5, 7), (2, 33), (4, 1, 9)]
RATES = [0.0, 0.01, 0.5, 1.0]
CHUNKS = [1, 7, 64, 1 << 20]
ENCODINGS = ["auto", "portable", "xor", "overwrite", "add", "classes"]
PURE = ("xor", "overwrite", "add")
LAYOUTS = ["contiguous", "transposed", "sliced"]

# Special bit patterns (unsigned) per dtype: NaNs with several payloads and signs, +-0,
# subnormals, infinities, all-ones. Integer dtypes get the extremes.
SPECIAL = {
    "float16": [0x7E00, 0x7C01, 0x7DFF, 0xFE00, 0xFC01, 0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x7C00, 0xFC00, 0xFFFF],
    "bfloat16": [0x7FC0, 0x7F81, 0x7FFF, 0xFFC0, 0xFF81, 0x0000, 0x8000, 0x0001, 0x007F, 0x8001, 0x7F80, 0xFF80,
                 0xFFFF],
    "float32": [0x7FC00000, 0x7F800001, 0x7FBFFFFF, 0xFFC00000, 0xFF800001, 0x00000000, 0x80000000, 0x00000001,
                0x007FFFFF, 0x80000001, 0x7F800000, 0xFF800000, 0xFFFFFFFF],
    "float64": [0x7FF8000000000000, 0x7FF0000000000001, 0x7FF7FFFFFFFFFFFF, 0xFFF8000000000000, 0xFFF0000000000001,
                0x0, 0x8000000000000000, 0x1, 0x000FFFFFFFFFFFFF, 0x8000000000000001, 0x7FF0000000000000,
                0xFFF0000000000000, 0xFFFFFFFFFFFFFFFF],
    "float8_e4m3fn": [0x7F, 0xFF, 0x00, 0x80, 0x01, 0x07, 0x81, 0x7E, 0xFE],
    "float8_e5m2": [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF, 0x7C, 0xFC, 0x00, 0x80, 0x01, 0x03, 0x81],
}
# the transitions that a float comparison would get wrong
SPECIAL_PAIRS = {
    "float16": [(0x0000, 0x8000), (0x7E00, 0x7E01), (0x7E00, 0xFE00), (0x0001, 0x8001)],
    "bfloat16": [(0x0000, 0x8000), (0x7FC0, 0x7FC1), (0x7FC0, 0xFFC0), (0x0001, 0x8001)],
    "float32": [(0x0, 0x80000000), (0x7FC00000, 0x7FC00001), (0x7FC00000, 0xFFC00000), (0x1, 0x80000001)],
    "float64": [(0x0, 0x8000000000000000), (0x7FF8000000000000, 0x7FF8000000000001), (0x1, 0x8000000000000001)],
    "float8_e4m3fn": [(0x00, 0x80), (0x7F, 0xFF), (0x01, 0x81)],
    "float8_e5m2": [(0x00, 0x80), (0x7D, 0x7E), (0x7E, 0xFE), (0x01, 0x81)],
}


def _signed(u: int, w: int) -> int:
    bits = 8 * w
    return u - (1 << bits) if w > 1 and u >= 1 << (bits - 1) else u


def _int_dtype(dtype):
    return INT_VIEW[torch.empty((), dtype=dtype).element_size()]


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous integer copy of the bits (works for any strides)."""
    return int_view(t).contiguous().clone()


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert tuple(a.shape) == tuple(b.shape), (a.shape, b.shape)
    assert torch.equal(int_view(a), int_view(b))


def random_bits(shape, dtype, g):
    w = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(_int_dtype(dtype)).reshape(shape)


def make_pair(dname, shape, rate, specials, seed):
    """(base, target) as contiguous tensors of dtype ``dname``; ``rate`` of elements differ."""
    dtype = DTYPES[dname]
    w = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    base = random_bits((n,), dtype, g)
    if rate >= 1.0:
        changed = torch.ones(n, dtype=torch.bool)
    elif rate <= 0.0:
        changed = torch.zeros(n, dtype=torch.bool)
    else:
        changed = torch.rand(n, generator=g) < rate
        if n and not bool(changed.any()):
            changed[int(torch.randint(0, n, (1,), generator=g))] = True
    flip = random_bits((n,), dtype, g)
    if dtype == torch.bool:
        flip = torch.ones_like(flip)
    else:
        flip[flip == 0] = 1
    target = torch.where(changed, base ^ flip, base)
    if specials and dname in SPECIAL and n:
        pats = [_signed(p, w) for p in SPECIAL[dname]]
        pairs = [(_signed(a, w), _signed(b, w)) for a, b in SPECIAL_PAIRS[dname]]
        pos = torch.randperm(n, generator=g)
        for i, p in enumerate(pos[: min(n, 2 * len(pats))].tolist()):
            if i < len(pats):  # a special value in both: unchanged special
                base[p] = target[p] = pats[i]
            else:  # a special value replacing another special value
                base[p] = pats[i % len(pats)]
                target[p] = pats[(i * 5 + 3) % len(pats)]
        for j, p in enumerate(pos[2 * len(pats): 2 * len(pats) + len(pairs)].tolist()):
            a, b = pairs[j]
            if rate == 0.0:
                b = a
            base[p], target[p] = a, b
        if rate == 0.0:
            target = base.clone()
    return base.view(dtype).reshape(shape), target.view(dtype).reshape(shape)


class Layout:
    """A tensor with the same values, laid out differently in memory; ``owner`` holds the
    whole storage so tests can check that nothing outside the view was touched."""

    def __init__(self, t: torch.Tensor, kind: str, g: torch.Generator):
        self.kind = kind
        if kind == "transposed" and t.dim() >= 2:
            self.owner = t.transpose(0, -1).contiguous().clone()
            self.view = self.owner.transpose(0, -1)
        elif kind in ("sliced", "transposed"):
            if t.dim() == 0:
                self.owner = random_bits((3,), t.dtype, g).view(t.dtype)
                self.view = self.owner[1]
                int_view(self.view).copy_(int_view(t))
            else:
                shape = (2 * t.shape[0] + 1,) + tuple(t.shape[1:])
                self.owner = random_bits(shape, t.dtype, g).view(t.dtype)
                self.view = self.owner[1::2]
                int_view(self.view).copy_(int_view(t))
        else:
            self.owner = t.clone()
            self.view = self.owner
        assert torch.equal(int_view(self.view), int_view(t))
        self.owner_bits = bits_of(self.owner)

    def outside_untouched(self) -> bool:
        """Every storage element outside the view still holds its original bits."""
        now = bits_of(self.owner)
        if self.kind == "contiguous" or (self.kind == "transposed" and self.view.dim() >= 2):
            return True
        if self.view.dim() == 0:
            return bool(now[0] == self.owner_bits[0] and now[2] == self.owner_bits[2])
        return torch.equal(now[0::2], self.owner_bits[0::2])


def payload_bytes(blob) -> int:
    h = DeltaReader(blob).raw_header
    return sum(c["plen"] + c["vlen"] for t in h["tensors"] for c in t.get("chunks", ()))


# ----------------------------------------------------------------------------- properties

@settings(max_examples=1500, **SETTINGS)
@given(
    dname=st.sampled_from(DTYPE_NAMES),
    shape=st.sampled_from(SHAPES),
    rate=st.sampled_from(RATES),
    specials=st.booleans(),
    chunk=st.sampled_from(CHUNKS),
    encoding=st.sampled_from(ENCODINGS),
    layouts=st.tuples(*[st.sampled_from(LAYOUTS)] * 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip(dname, shape, rate, specials, chunk, encoding, layouts, seed):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed ^ 0x5A5A)
    base, target = make_pair(dname, shape, rate, specials, seed)
    lb, lt, lr = (Layout(x, k, g) for x, k in zip((base, target, base), layouts))
    blob = diff({"x": lb.view}, {"x": lt.view}, encoding=encoding, chunk_elems=chunk, workers=1)
    assert isinstance(blob, bytes)
    # the inputs are not modified by diff
    assert_bits_equal(lb.view, base)
    assert_bits_equal(lt.view, target)

    h = DeltaReader(blob).raw_header
    (entry,) = h["tensors"]
    assert entry["kind"] == "delta" and entry["dtype"] == dname and entry["shape"] == list(shape)
    n_changed = int((int_view(base) != int_view(target)).sum())
    assert sum(c["k"] for c in entry["chunks"]) == n_changed
    assert all(c["n"] <= chunk for c in entry["chunks"])
    if encoding == "portable" or (encoding == "classes" and base.dtype not in CLASSES_DTYPES):
        assert all(c["enc"] in PURE for c in entry["chunks"])  # classes not applicable: the smallest of the rest
    elif encoding != "auto":
        want = "xor" if encoding == "add" and base.element_size() == 8 else encoding  # add: widths 1, 2, 4
        assert all(c["enc"] == want for c in entry["chunks"])
    if n_changed == 0:
        assert entry["chunks"] == []

    recv = {"x": lr.view}
    rep = apply(recv, blob)
    assert recv["x"] is lr.view  # in place, same object
    assert_bits_equal(lr.view, target)
    assert lr.outside_untouched()
    assert rep.elements_changed == n_changed
    assert rep.chunks_applied == len(entry["chunks"])

    # re-delivery is harmless and leaves the target
    rep2 = apply(recv, blob)
    assert rep2.chunks_applied == 0 and rep2.elements_changed == 0
    assert_bits_equal(lr.view, target)
    assert lr.outside_untouched()


@settings(max_examples=300, **SETTINGS)
@given(
    dname=st.sampled_from(DTYPE_NAMES),
    shape=st.sampled_from([(1,), (17,), (130,), (3, 5, 7), (2, 33), (300,)]),
    rate=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
    specials=st.booleans(),
    chunk=st.sampled_from([1, 7, 64, 1 << 20]),
    seed=st.integers(0, 2**31 - 1),
)
def test_auto_never_larger_than_pure(dname, shape, rate, specials, chunk, seed):
    """``portable`` is the smallest of xor/add/overwrite, per chunk and in total. ``auto`` takes a
    ``classes`` chunk when it costs at most CLASSES_ENOUGH bytes per change, else the smallest of
    everything."""
    base, target = make_pair(dname, shape, rate, specials, seed)
    blobs = {e: diff({"x": base}, {"x": target}, encoding=e, chunk_elems=chunk, workers=1) for e in ENCODINGS}
    sizes = {e: payload_bytes(b) for e, b in blobs.items()}
    for e in PURE:
        assert sizes["portable"] <= sizes[e]
    # whole file: headers differ by the encoding names, digests of different values and the
    # creation time, and a mix of per-chunk encoding names compresses worse than one name
    # repeated (tiny chunks: hundreds of them): allow that noise, no more
    header = len(blobs["portable"]) - sizes["portable"]
    assert len(blobs["portable"]) <= min(len(blobs[e]) for e in PURE) + 48 + header // 8
    chunks = {e: DeltaReader(b).raw_header["tensors"][0]["chunks"] for e, b in blobs.items()}
    assert len({tuple(c["start"] for c in cs) for cs in chunks.values()}) == 1
    for p, x, o, d in zip(chunks["portable"], chunks["xor"], chunks["overwrite"], chunks["add"]):
        assert p["plen"] == x["plen"] == o["plen"] == d["plen"]  # same positions everywhere
        assert p["vlen"] == min(x["vlen"], o["vlen"], d["vlen"])
    size = lambda c: c["plen"] + c["vlen"]  # noqa: E731
    cost = lambda c: size(c) + 8 * len(c.get("cls", []))  # noqa: E731
    for a, p, c in zip(chunks["auto"], chunks["portable"], chunks["classes"]):
        if base.dtype not in CLASSES_DTYPES:
            assert {**a, "off": 0} == {**p, "off": 0}  # (offsets: after headers of different sizes)
        elif a["enc"] == "classes":
            # the same chunk as the pure classes one, at another offset when earlier chunks differ
            assert {**a, "off": 0} == {**c, "off": 0} and (cost(a) <= CLASSES_ENOUGH * a["k"] or cost(a) <= size(p))
        else:
            assert size(a) == size(p) and size(p) < cost(c)
    # and every one of them round-trips
    for b in blobs.values():
        r = {"x": base.clone()}
        apply(r, b)
        assert_bits_equal(r["x"], target)


@settings(max_examples=150, **SETTINGS)
@given(
    dname=st.sampled_from(DTYPE_NAMES),
    new_dname=st.sampled_from(DTYPE_NAMES),
    shape=st.sampled_from(SHAPES),
    new_shape=st.sampled_from(SHAPES),
    chunk=st.sampled_from([7, 64]),
    encoding=st.sampled_from(ENCODINGS),
    seed=st.integers(0, 2**31 - 1),
)
def test_added_removed_retyped_reshaped(dname, new_dname, shape, new_shape, chunk, encoding, seed):
    g = torch.Generator().manual_seed(seed)
    kept_b, kept_t = make_pair(dname, shape, 0.5, True, seed)
    base = {
        "kept": kept_b,
        "gone": random_bits((5, 3), torch.float32, g).view(torch.float32),
        "morph": make_pair(dname, shape, 0.0, True, seed + 1)[0],
    }
    added_t = Layout(make_pair(new_dname, new_shape, 0.0, True, seed + 2)[0], "sliced", g).view
    morph_t = make_pair(new_dname, new_shape, 0.0, True, seed + 3)[0]
    target = {"kept": kept_t, "added": added_t, "morph": morph_t}
    blob = diff(base, target, encoding=encoding, chunk_elems=chunk, workers=1)
    kinds = {t["name"]: t["kind"] for t in DeltaReader(blob).raw_header["tensors"]}
    same_layout = DTYPES[dname] == DTYPES[new_dname] and tuple(shape) == tuple(new_shape)
    assert kinds == {"kept": "delta", "gone": "removed", "added": "full",
                     "morph": "delta" if same_layout else "full"}

    recv = {k: v.clone() for k, v in base.items()}
    kept_obj = recv["kept"]
    rep = apply(recv, blob)
    assert set(recv) == set(target)
    for k in target:
        assert_bits_equal(recv[k], target[k])
    assert recv["kept"] is kept_obj
    assert rep.tensors_removed == ["gone"]
    assert "added" in rep.tensors_added
    # the receiver of a new tensor gets it even without any base entry for "morph"
    recv2 = {"kept": kept_b.clone(), "gone": base["gone"].clone()}
    if not same_layout:
        apply(recv2, blob)
        assert set(recv2) == set(target)
        for k in target:
            assert_bits_equal(recv2[k], target[k])


# ----------------------------------------------------------------------------- fixed cases

@pytest.mark.parametrize("dname", sorted(SPECIAL))
def test_float_lookalikes_are_changes(dname):
    """+0.0 -> -0.0 and NaN payload changes compare equal (or unequal) as floats, but are
    bit changes; NaN -> same NaN is not a change."""
    dtype = DTYPES[dname]
    w = torch.empty((), dtype=dtype).element_size()
    iv = _int_dtype(dtype)
    pairs = SPECIAL_PAIRS[dname]
    b = torch.tensor([_signed(a, w) for a, _ in pairs] + [_signed(SPECIAL[dname][0], w)], dtype=iv)
    t = torch.tensor([_signed(c, w) for _, c in pairs] + [_signed(SPECIAL[dname][0], w)], dtype=iv)
    base, target = b.view(dtype), t.view(dtype)
    for enc in ENCODINGS:
        blob = diff({"x": base}, {"x": target}, encoding=enc, chunk_elems=2)
        entry = DeltaReader(blob).raw_header["tensors"][0]
        assert sum(c["k"] for c in entry["chunks"]) == len(pairs)
        r = {"x": base.clone()}
        apply(r, blob)
        assert_bits_equal(r["x"], target)


@pytest.mark.parametrize("dname", DTYPE_NAMES)
def test_every_dtype_all_patterns_single_chunk_sizes(dname):
    """Exhaustive over chunk sizes 1..9 for one small tensor per dtype, including k == 1
    chunks (one changed element) for every width."""
    base, target = make_pair(dname, (23,), 0.3, True, seed=len(dname))
    for chunk in range(1, 10):
        blob = diff({"x": base}, {"x": target}, chunk_elems=chunk, workers=1)
        r = {"x": base.clone()}
        apply(r, blob)
        assert_bits_equal(r["x"], target)


def test_multi_tensor_state_with_workers():
    torch.manual_seed(0)
    base, target = {}, {}
    for i, dname in enumerate(DTYPE_NAMES):
        b, t = make_pair(dname, (3, 41), [0.0, 0.01, 0.5, 1.0][i % 4], True, seed=i)
        base[f"t{i:02d}.{dname}"], target[f"t{i:02d}.{dname}"] = b, t
    blob = diff(base, target, chunk_elems=16, workers=4)
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, blob, workers=4)
    for k in target:
        assert_bits_equal(recv[k], target[k])


def test_auto_mixes_encodings_and_beats_both():
    """Half the tensor gets tiny bf16 updates (XOR wins: high bytes are zero), the other half
    is reset to a constant (overwrite wins: the new values are all equal)."""
    torch.manual_seed(1)
    n = 1 << 14
    base = torch.randn(n).to(torch.bfloat16)
    target = base.clone()
    target[: n // 2] = (base[: n // 2].float() * (1 + 1e-2 * torch.randn(n // 2))).to(torch.bfloat16)
    target[n // 2:] = 0.5
    blobs = {e: diff({"x": base}, {"x": target}, encoding=e, chunk_elems=1024, workers=1) for e in ENCODINGS}
    encs = {c["enc"] for c in DeltaReader(blobs["auto"]).raw_header["tensors"][0]["chunks"]}
    # small moves: xor, add or classes; resets: overwrite
    assert "overwrite" in encs and encs & {"xor", "add", "classes"}
    sizes = {e: payload_bytes(b) for e, b in blobs.items()}
    assert all(sizes["auto"] < sizes[e] for e in ENCODINGS if e != "auto")
    # the whole object within 1 % of the smallest: auto reckons a classes table at _ROW_BYTES a
    # row of the header, and takes a classes chunk at or under CLASSES_ENOUGH bytes a change
    # without trying the rest (here, where half the chunk's elements change, an add chunk would
    # be ~6 % smaller than such a classes chunk: 0.7 % of the whole object)
    assert len(blobs["auto"]) <= 1.01 * min(len(blobs[e]) for e in ENCODINGS if e != "auto")
    for b in blobs.values():
        r = {"x": base.clone()}
        apply(r, b)
        assert_bits_equal(r["x"], target)


def test_no_zstd_frame_of_content_is_shorter_than_min_frame():
    """``MIN_FRAME`` bounds every value stream ``pack`` makes from below (with the raw length):
    one byte, runs of one byte that zstd shrinks the most, small and large streams (two
    compressors), at every level a publisher may ask for."""
    from nemo_dcr.codec.chunk import FAST_STREAM, MIN_FRAME, pack
    g = torch.Generator().manual_seed(0)
    for level in (1, 3, 19):
        for raw in (b"\0", b"\0\0", bytes(64), bytes(FAST_STREAM), bytes(1 << 17), bytes(1 << 19), b"ab" * 9000,
                    torch.randint(0, 4, (1 << 17,), generator=g, dtype=torch.uint8).numpy().tobytes()):
            for parts in (1, 2, 4):  # (a chunk's own values: a block per byte plane)
                stored, _ = pack(raw, level, parts)
                assert len(stored) >= min(len(raw), MIN_FRAME), (level, len(raw), parts, len(stored))


@pytest.mark.parametrize("dname", ["bfloat16", "float32"])
@pytest.mark.parametrize("n", [512, 16384, 50000])
def test_a_chunks_own_values_are_one_frame_with_a_block_per_plane(dname, n):
    """An overwrite stream (a keyframe's chunk) from ``FAST_STREAM`` bytes on: one standard frame
    declaring its content size, which ``unpack`` gives back byte for byte; its planes in blocks of
    their own make it smaller than the same parameters in one run of blocks (the exponent plane's
    literal table no longer shared with the mantissa planes': zstd cuts blocks at 128 KiB, so
    only planes of that many bytes, or a multiple, were apart before), and the chunk encodes so."""
    import zstandard

    from nemo_dcr.codec import chunk as chunk_mod
    from nemo_dcr.codec import planes
    dtype = DTYPES[dname]
    g = torch.Generator().manual_seed(n)
    bits = int_view((torch.randn(n, generator=g) * 0.02).to(dtype))
    raw = bytes(planes.split(bits))
    w = bits.element_size()
    assert len(raw) >= chunk_mod.FAST_STREAM
    stored, z = chunk_mod.pack(raw, 1, w)
    assert z and zstandard.frame_content_size(stored) == len(raw)
    assert chunk_mod.unpack(stored, True, len(raw)) == raw
    one_run, _ = chunk_mod.pack(raw, 1)
    assert len(stored) < 0.98 * len(one_run), (len(stored), len(one_run))
    c = encode_chunk(None, bits, 0, level=1)
    assert c.enc == "overwrite" and c.val_bytes == stored


@pytest.mark.parametrize("dname,bound_taken", [("bfloat16", True), ("float16", True), ("float32", False)])
def test_classes_taken_without_trying_the_rest_only_where_it_would_win(dname, bound_taken, monkeypatch):
    """A ``classes`` chunk costing no more than its positions alone plus the shortest value
    stream is taken without trying xor, add and overwrite: every chunk comes out as it does
    after trying them (the bound off). The bound is taken for some 2-byte chunks; FP32's classes
    chunks cost ~4 bytes a change (its mantissas), far above their positions alone, so every
    coding is tried for them, as before."""
    from nemo_dcr.codec import chunk as chunk_mod
    dtype = DTYPES[dname]
    g = torch.Generator().manual_seed(7)
    base = torch.randn(1 << 16, generator=g).to(dtype)
    target = base.clone()
    for rate, lo in ((0.01, 0), (0.05, 1 << 15)):  # an optimizer-like nudge, then wider changes
        idx = torch.randperm(1 << 15, generator=g)[: int(rate * (1 << 15))] + lo
        target[idx] = (base[idx].float() * (1 + 0.01 * torch.randn(idx.numel(), generator=g))).to(dtype)

    def chunks(n):
        out = []
        for s in range(0, base.numel(), n):
            c = chunk_mod.encode_chunk(int_view(base)[s:s + n], int_view(target)[s:s + n], s, "auto", 1,
                                       keep_changes=False, dtype=dtype)
            if c is not None:
                out.append(c)
        return out
    bounded, taken = {}, 0
    for n in (1024, 4096, 16384):
        bounded[n] = chunks(n)
        taken += sum(1 for c in bounded[n] if c.enc == "classes" and set(c.alt_val_len) == {"classes"}
                     and c.alt_val_len["classes"] > CLASSES_ENOUGH * c.k)
    assert (taken > 0) == bound_taken
    monkeypatch.setattr(chunk_mod, "MIN_FRAME", -(1 << 40))  # the bound never holds: every coding tried
    for n, got in bounded.items():
        want = chunks(n)
        assert [(c.header(0), c.pos_bytes, c.val_bytes) for c in got] == \
            [(c.header(0), c.pos_bytes, c.val_bytes) for c in want]
