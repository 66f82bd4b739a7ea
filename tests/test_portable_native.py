"""The portable codings' C kernels (csrc/dcr_portable.c): the gap varints of ``codec/positions.py``
and the monotone differences of ``codec/ordered.py`` give the references' bytes and values, and a
malformed position stream is refused by both, whichever runs."""
from __future__ import annotations

import pytest
import torch

from nemo_dcr.codec import native, ordered, positions
from nemo_dcr.errors import DeltaFormatError
from nemo_dcr.state.dtypes import INT_VIEW

needs_native = pytest.mark.skipif(native.lib() is None, reason=f"C kernels unavailable: {native.build_error}")

SPECIAL = {  # sign-magnitude edges: zeros, the smallest subnormals, infinities, NaN payloads, extremes
    1: [0x00, 0x80, 0x01, 0x81, 0x7F, 0xFF, 0x78, 0xF8, 0x79, 0x7E],
    2: [0x0000, 0x8000, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC1, 0x7FFF, 0xFFFF, 0x7C00, 0x7E01],
    4: [0, 0x80000000, 1, 0x80000001, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF,
        0xFFFFFFFF],
}


def _bits(vals, w: int) -> torch.Tensor:
    return torch.tensor([v - (1 << 8 * w) if w > 1 and v >= 1 << (8 * w - 1) else v for v in vals],
                        dtype=INT_VIEW[w])


def _pairs(w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair of special values, then random bit patterns and one-ulp-ish neighbours."""
    g = torch.Generator().manual_seed(seed)
    s = _bits(SPECIAL[w], w)
    a, b = s.repeat_interleave(s.numel()), s.repeat(s.numel())
    r = torch.randint(0, 256, (20000 * w,), dtype=torch.uint8, generator=g).view(INT_VIEW[w])
    q = torch.randint(0, 256, (20000 * w,), dtype=torch.uint8, generator=g).view(INT_VIEW[w])
    near = (r.to(torch.int64) + torch.randint(-3, 4, (r.numel(),), generator=g)).to(INT_VIEW[w])
    return torch.cat([a, r, r]), torch.cat([b, q, near])


@needs_native
@pytest.mark.parametrize("w", [1, 2, 4])
@pytest.mark.parametrize("is_float", [True, False])
def test_native_differences_are_the_reference(w, is_float):
    old, new = _pairs(w, seed=w * 7 + is_float)
    ref = ordered.encode(old, new, is_float, use_native=False)
    got = ordered.encode(old, new, is_float, use_native=True)
    assert got.dtype == ref.dtype == INT_VIEW[w] and torch.equal(got, ref)
    back_ref = ordered.decode(old, ref, is_float, use_native=False)
    back = ordered.decode(old, ref, is_float, use_native=True)
    assert back.dtype == back_ref.dtype and torch.equal(back, back_ref) and torch.equal(back, new)


@needs_native
def test_every_byte_pair_of_width_one():
    a = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    old, new = a.repeat_interleave(256), a.repeat(256)
    for fl in (True, False):
        z = ordered.encode(old, new, fl, use_native=True)
        assert torch.equal(z, ordered.encode(old, new, fl, use_native=False))
        assert torch.equal(ordered.decode(old, z, fl, use_native=True), new)


@needs_native
def test_strided_differences_are_taken_as_their_values():
    old, new = _pairs(2, seed=3)
    o, n = old[::3], new[::3]
    assert not o.is_contiguous()
    assert torch.equal(ordered.encode(o, n, True, use_native=True), ordered.encode(o, n, True, use_native=False))


def _positions(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[:k].sort().values


@needs_native
@pytest.mark.parametrize("n, k", [(1, 1), (10, 1), (1000, 3), (1000, 999), (4096, 41), (1 << 20, 10486),
                                  (1 << 20, 400000)])
def test_native_positions_are_the_reference(n, k):
    idx = _positions(n, k, seed=n + k)
    ref = positions.encode(idx, n, use_native=False)
    got = positions.encode(idx, n, use_native=True)
    assert got == ref
    for use in (False, True):
        assert torch.equal(positions.decode(ref[0], ref[1], n, k, use_native=use), idx)


@needs_native
def test_gaps_of_every_varint_length():
    """Gaps needing 1 to 9 bytes, up to positions past 2^62."""
    n = (1 << 62) + 5
    idx = torch.tensor([0] + [sum(1 << (7 * j) for j in range(1, m + 1)) for m in range(1, 9)] + [1 << 62],
                       dtype=torch.int64)
    coding, raw = positions.encode(idx, n, use_native=True)
    assert coding == positions.GAPS and (coding, raw) == positions.encode(idx, n, use_native=False)
    assert torch.equal(positions.decode(coding, raw, n, idx.numel(), use_native=True), idx)


MALFORMED = [
    (b"\x81", 1, 100, "holds 0 varints"),                 # the last varint never ends
    (b"\x01\x01", 1, 100, "holds 2 varints"),             # one varint more than the header says
    (b"\x01", 2, 100, "holds 1 varints"),                 # one fewer
    (b"\x80" * 10 + b"\x01", 1, 100, "longer than 10"),   # 11 bytes
    (b"\x05\x05", 2, 10, "out of range"),                 # 5, then 11
    (b"\x0a", 1, 10, "out of range"),                     # 10 in a chunk of 10
    (b"\xff" * 9 + b"\x01", 1, 100, "out of range"),      # 2^64 - 1: negative as int64
    (b"\xff" * 8 + b"\x7f" + b"\x05\x05", 3, 1 << 40, "out of range"),  # 2^63 - 1, then past it
]


@pytest.mark.parametrize("raw, k, n, says", MALFORMED)
@pytest.mark.parametrize("use", [False, pytest.param(True, marks=needs_native)])
def test_malformed_gaps_are_refused_by_both(raw, k, n, says, use):
    with pytest.raises(DeltaFormatError, match=says):
        positions.decode(positions.GAPS, raw, n, k, use_native=use)


@needs_native
def test_no_positions_and_no_bytes():
    assert positions.decode(positions.GAPS, b"", 10, 0, use_native=True).numel() == 0


@needs_native
def test_any_position_stream_is_read_alike_by_both():
    """Arbitrary bytes, counts and chunk lengths: both decoders refuse, or both give the same
    positions."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
    @hypothesis.given(raw=st.binary(max_size=40), dk=st.sampled_from([-1, 0, 0, 0, 1]),
                      n=st.one_of(st.integers(0, 300), st.integers(0, (1 << 63) - 1)))
    def check(raw, dk, n):
        k = max(0, sum(b < 0x80 for b in raw) + dk)  # mostly the count the bytes hold
        out = []
        for use in (False, True):
            try:
                out.append(positions.decode(positions.GAPS, raw, n, k, use_native=use).tolist())
            except DeltaFormatError:
                out.append("refused")
        assert out[0] == out[1], (raw, k, n, out)

    check()
