"""Byte planes (codec/planes.py): the C library's split and join give the reference's bytes, for
every width, odd lengths, every bit pattern, and read-only input; a join of some runs of the
values (a keyframe chunk into a receiver's part of it) writes those runs alone, or refuses runs
outside either side before writing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_dcr.codec import native, planes
from nemo_dcr.errors import DeltaFormatError
from nemo_dcr.state.dtypes import INT_VIEW
from nemo_dcr.state.runs import Runs

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


def _runs(*rows):
    """Runs from (chunk start, local start, length) triples."""
    return Runs(*(np.array([r[i] for r in rows], dtype=np.int64) for i in range(3)))


@pytest.mark.parametrize("use", [False, True])
@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_join_of_runs_writes_each_run_where_it_is_held(use, w):
    """A keyframe chunk into a receiver holding its region in part (``delta/apply._apply_runs``):
    the values of each run, and only those, where the runs say; the C call and the reference
    (join, then ``copy_runs``) alike, every width, runs of every length and step, ones alike
    enough for ``copy_runs``' strided copy included; and the write is seen by the version counter."""
    if use and native.lib() is None:
        pytest.skip(f"C kernels unavailable: {native.build_error}")
    k = 517
    v = _values(w, k, seed=w)
    raw = planes.split(v, use_native=False)
    alike = [(7 + 40 * i, 3 + 33 * i, 17) for i in range(12)]  # one length, one step each way
    odd = _runs((0, 0, 1), (1, 500, 16), (300, 100, 217), (516, 1, 1))
    for runs in (_runs(*alike), odd, _runs(), _runs((5, 9, 0))):
        held = torch.zeros(520, dtype=INT_VIEW[w])
        before = held._version
        planes.join_runs(raw, k, w, held, runs, use_native=use)
        want = torch.zeros(520, dtype=INT_VIEW[w])
        for c, loc, n in zip(runs.cstart, runs.lstart, runs.length):
            want[loc:loc + n] = v[c:c + n]
        assert torch.equal(held, want)
        assert (held._version > before) == bool(len(runs))


@pytest.mark.parametrize("use", [False, True])
def test_join_of_runs_refuses_a_run_outside_either_side_before_writing(use):
    if use and native.lib() is None:
        pytest.skip(f"C kernels unavailable: {native.build_error}")
    v = _values(2, 64, seed=9)
    raw = planes.split(v, use_native=False)
    for bad in (_runs((0, 0, 8), (60, 8, 5)),    # past the stream's end
                _runs((0, 0, 8), (8, 95, 8)),    # past the receiver's end
                _runs((0, 0, 8), (-1, 8, 4))):   # before the stream's start
        held = torch.zeros(100, dtype=torch.int16)
        with pytest.raises(IndexError, match="runs outside their tensors"):
            planes.join_runs(raw, 64, 2, held, bad, use_native=use)
        assert not held.any()  # the good first run was not written either
    with pytest.raises(DeltaFormatError, match="value stream has 128 bytes, expected 65 x 2"):
        planes.join_runs(raw, 65, 2, torch.zeros(100, dtype=torch.int16), _runs((0, 0, 1)), use_native=use)
    with pytest.raises(ValueError, match="1-D, 2 bytes, on the host wanted"):
        planes.join_runs(raw, 64, 2, torch.zeros(10, 10, dtype=torch.int16), _runs((0, 0, 1)), use_native=use)
