"""Byte planes (codec/planes.py): the C library's split and join give the reference's bytes, for
every width, odd lengths, every bit pattern, and read-only input."""
from __future__ import annotations

import pytest
import torch

from nemo_dcr.codec import native, planes
from nemo_dcr.errors import DeltaFormatError
from nemo_dcr.state.dtypes import INT_VIEW

needs_native = pytest.mark.skipif(native.lib() is None, reason=f"C kernels unavailable: {native.build_error}")


def _values(w: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (k * w,), dtype=torch.uint8, generator=g)
    return raw.view(INT_VIEW[w])


@needs_native
@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize("k", [1, 7, 8, 9, 63, 64, 65, 4099])
def test_native_planes_are_the_reference(w, k):
    v = _values(w, k, seed=w * 10007 + k)
    ref = planes.split(v, use_native=False)
    got = planes.split(v, use_native=True)
    assert isinstance(ref, bytes) and bytes(got) == ref
    # plane p holds byte p of each value, least significant first, whichever made it
    b = v.view(torch.uint8).reshape(k, w)
    assert bytes(got[:k]) == b[:, 0].numpy().tobytes() and bytes(got[(w - 1) * k:]) == b[:, w - 1].numpy().tobytes()
    for use in (False, True):
        for src in (ref, memoryview(ref), bytearray(ref)):  # bytes and views are read-only
            back = planes.join(src, k, w, use_native=use)
            assert back.dtype == INT_VIEW[w] and torch.equal(back, v)
            back[0] = 0  # writable: the receiver's own buffer, not a view of the payload


@needs_native
def test_a_strided_input_is_split_as_its_values():
    v = _values(2, 200, seed=3)[::2]  # not contiguous
    assert bytes(planes.split(v, use_native=True)) == planes.split(v, use_native=False)


@pytest.mark.parametrize("use", [False, True])
def test_empty_and_wrong_lengths(use):
    if use and native.lib() is None:
        pytest.skip(f"C kernels unavailable: {native.build_error}")
    assert bytes(planes.split(torch.empty(0, dtype=torch.int16), use_native=use)) == b""
    assert planes.join(b"", 0, 2, use_native=use).numel() == 0
    with pytest.raises(DeltaFormatError, match="value stream has 5 bytes, expected 3 x 2"):
        planes.join(b"\0" * 5, 3, 2, use_native=use)


@pytest.mark.parametrize("use", [False, True])
def test_join_into_a_range_writes_it_and_says_so(use):
    """The receiver joins a dense chunk straight into its own range; whoever watches the tensor's
    version counter (the rollout loader's staging copy) sees the write."""
    if use and native.lib() is None:
        pytest.skip(f"C kernels unavailable: {native.build_error}")
    v = _values(2, 100, seed=5)
    held = torch.zeros(300, dtype=torch.bfloat16)
    before = held._version
    out = planes.join(planes.split(v, use_native=False), 100, 2, use_native=use, out=held[100:200].view(torch.int16))
    assert torch.equal(held.view(torch.int16)[100:200], v) and out.data_ptr() == held[100:].data_ptr()
    assert not held.view(torch.int16)[:100].any() and not held.view(torch.int16)[200:].any()
    assert held._version > before
    with pytest.raises(ValueError, match="join into a tensor of 50 x 2 bytes"):
        planes.join(planes.split(v, use_native=False), 100, 2, use_native=use, out=held[:50])
