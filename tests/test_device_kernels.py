"""The device path's Triton kernels (nemo_dcr/device), run on CPU tensors under TRITON_INTERPRET=1
against the reference: the changes found, the snapshot update, the ``classes`` bytes (exactly
``codec/classes.encode_reference``'s), the checked in-place apply and the digest update.
Small tensors: the interpreter runs each program in Python. Skipped where triton is absent
(it is the optional ``gpu`` extra); on a CUDA machine run tests/gpu/run_device_kernels.py."""
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported: before importing it
pytest.importorskip("triton")

from dcr_testing import assert_bits_equal  # noqa: E402
from dcr_testing.device_cases import FLOATS, INTS, make_pair  # noqa: E402
from nemo_dcr.codec import classes  # noqa: E402
from nemo_dcr.codec.chunk import CHOICES, encode_chunk  # noqa: E402
from nemo_dcr.device import kernels  # noqa: E402
from nemo_dcr.device.apply import PreImageMismatch, apply_, digest_change  # noqa: E402
from nemo_dcr.device.diff import bits, diff_  # noqa: E402
from nemo_dcr.device.encode import encode_changes_chunks  # noqa: E402
from nemo_dcr.errors import DcrError  # noqa: E402
from nemo_dcr.state.statedigest import tensor_contrib  # noqa: E402

if not kernels.interpreted():
    pytest.skip("nemo_dcr.device.kernels was imported without TRITON_INTERPRET=1", allow_module_level=True)


def _reference_changes(base, live):
    ob, nb = bits(base), bits(live)
    idx = torch.nonzero(ob != nb).squeeze(1)
    return idx, ob[idx], nb[idx]


def _check_diff(base, live, chunk, block, **kw):
    snap = base.clone()
    kw.setdefault("capacity", max(base.numel(), 1))  # one compact pass (the interpreter is slow)
    ch = diff_(snap, live, chunk_elems=chunk, block=block, **kw)
    idx, o, nw = _reference_changes(base, live)
    assert torch.equal(ch.pos, idx)
    assert torch.equal(ch.old, o) and torch.equal(ch.new, nw)
    assert_bits_equal(snap, live, "snapshot after update")
    return ch


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("rate", [0.01, 0.3])
@pytest.mark.parametrize("n,chunk,block", [(0, None, 64), (1, None, 64), (1023, None, 1024),
                                           (1300, 500, 256), (333, 100, 32)])
def test_classes_bytes_match_the_reference(dtype, rate, n, chunk, block):
    base, live = make_pair(dtype, n, rate if n > 1 else 1.0, seed=n + int(rate * 100))
    ch = _check_diff(base, live, chunk, block)
    got = {c.start // (chunk or max(n, 1)): (c.k, c.cls, c.pos_bytes, c.val_bytes)
           for c in encode_changes_chunks(ch, "classes")}
    chunk = chunk or max(n, 1)
    mant = classes.MANTISSA[dtype]
    for c in range(0, -(-n // chunk)):
        s = slice(c * chunk, (c + 1) * chunk)
        ref = classes.encode_reference(bits(base)[s], bits(live)[s], mant)
        if ref[0] == 0:
            assert c not in got
        else:
            assert got[c] == ref, f"chunk {c}"
    assert sum(v[0] for v in got.values()) == ch.k


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_plain_diff_on_integer_views(dtype):
    base, live = make_pair(dtype, 1500, 0.05, seed=3)
    ch = _check_diff(base, live, 500, 64, use_classes=False)
    assert ch.cls is None and ch.k > 0


def test_every_bit_pattern_change_is_found():
    # NaN payload, -0.0 vs +0.0, inf, subnormal: bitwise different, some compare equal as floats
    pats = [(0x7FC0, 0x7FC1), (0x8000, 0x0000), (0x7F80, 0xFF80), (0x0001, 0x0002), (0x7FC0, 0x7FC0)]
    base = torch.tensor([a for a, _ in pats], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    live = torch.tensor([b for _, b in pats], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ch = _check_diff(base, live, None, 16)
    assert ch.pos.tolist() == [0, 1, 2, 3]
    c, = encode_changes_chunks(ch, "classes")
    assert (c.k, c.cls, c.pos_bytes, c.val_bytes) == classes.encode_reference(bits(base), bits(live), 7)


def test_the_compact_stream_grows_past_its_first_capacity():
    base, live = make_pair(torch.bfloat16, 2000, 0.3, seed=5)
    ch = _check_diff(base, live, 700, 64, capacity=1)
    assert ch.k > 500


def test_refusals_leave_the_snapshot_alone():
    base, live = make_pair(torch.bfloat16, 64 * 3, 0.3, seed=6)
    snap = base.clone().view(8, 24)
    with pytest.raises(DcrError, match="contiguous"):
        diff_(snap.t(), live.view(8, 24).t())
    with pytest.raises(DcrError, match="does not match"):
        diff_(snap, live.view(24, 8))
    with pytest.raises(DcrError, match="does not match"):
        diff_(snap, live.view(8, 24).to(torch.float16))
    with pytest.raises(DcrError, match="classes"):
        diff_(snap.view(torch.int16), live.view(8, 24).view(torch.int16), use_classes=True)
    assert_bits_equal(snap.reshape(-1), base)


def test_no_update_leaves_the_snapshot_and_a_second_diff_is_empty():
    base, live = make_pair(torch.float16, 1000, 0.05, seed=7)
    snap = base.clone()
    ch = diff_(snap, live, update=False, block=256)
    assert ch.k > 0
    assert_bits_equal(snap, base)
    diff_(snap, live, block=256)
    assert diff_(snap, live, block=256).k == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2, torch.int32], ids=str)
def test_trainer_to_receiver_round_trip(dtype):
    """Trainer: device diff + host coder; receiver: host decode, device apply with pre-images."""
    base, live = make_pair(dtype, 1200, 0.3, seed=8)
    snap, recv = base.clone(), base.clone()
    ch = diff_(snap, live, chunk_elems=500, block=128, capacity=1200)
    if classes.applicable(dtype):
        mant = classes.MANTISSA[dtype]
        for c in encode_changes_chunks(ch, "classes"):
            s = slice(c.start, c.start + c.n)
            idx, newv = classes.decode_reference(bits(recv)[s], c.cls, c.pos_bytes, c.val_bytes, c.k, mant)
            pos = idx + c.start
            apply_(recv, pos, newv, bits(recv)[pos].clone(), block=64)
    else:
        apply_(recv, ch.pos, ch.new, ch.old, block=64)
    assert_bits_equal(recv, live)


def test_apply_checks_before_the_first_write():
    base, live = make_pair(torch.bfloat16, 900, 0.3, seed=9)
    idx, o, nw = _reference_changes(base, live)
    target = base.clone()
    wrong = o.clone()
    wrong[-1] ^= 1  # the last pre-image differs: nothing at all may be written
    with pytest.raises(PreImageMismatch, match=f"first at position {int(idx[-1])}"):
        apply_(target, idx, nw, wrong, block=64)
    assert_bits_equal(target, base)
    with pytest.raises(DcrError, match="out of range"):
        apply_(target, torch.cat([idx[:-1], torch.tensor([900])]), nw, o, block=64)
    with pytest.raises(DcrError, match="strictly increasing"):
        apply_(target, idx.flip(0), nw.flip(0), o.flip(0), block=64)
    with pytest.raises(DcrError, match="contiguous"):
        apply_(target.view(30, 30).t(), idx, nw, o)
    assert_bits_equal(target, base)
    apply_(target, idx[:0], nw[:0], o[:0])
    apply_(target, idx, nw, o, block=64)
    assert_bits_equal(target, live)


def test_digest_change_is_the_whole_digest_difference():
    base, live = make_pair(torch.bfloat16, 1000, 0.05, seed=10)
    snap = base.clone()
    ch = diff_(snap, live, block=64)
    d = digest_change("w", torch.bfloat16, (1000,), ch.pos, ch.old, ch.new)
    assert tensor_contrib("w", base) + d == tensor_contrib("w", live)


def _header(c):
    h = c.header(0)
    return h, c.pos_bytes, c.val_bytes, c.alt_val_len


@pytest.mark.parametrize("dtype,rate", [(torch.bfloat16, 0.01), (torch.bfloat16, 0.3), (torch.float32, 0.3),
                                        (torch.float8_e4m3fn, 0.05), (torch.int16, 0.05), (torch.bool, 0.1)],
                         ids=str)
def test_chunks_match_encode_chunk_for_every_encoding(dtype, rate):
    """The whole chunk (header fields, both streams, the digests, which encoding won) from the
    compact stream equals the reference's from the whole chunks, for every encoding."""
    n, chunk = 1100, 400
    base, live = make_pair(dtype, n, rate, seed=11)
    ch = diff_(base.clone(), live, chunk_elems=chunk, block=256, capacity=n)
    for encoding in CHOICES:
        got = encode_changes_chunks(ch, encoding, level=3, keep_changes=True)
        ref = [c for s in range(0, n, chunk)
               if (c := encode_chunk(bits(base)[s:s + chunk], bits(live)[s:s + chunk], s, encoding, 3,
                                     keep_changes=True, is_float=dtype.is_floating_point, dtype=dtype)) is not None]
        assert [_header(c) for c in got] == [_header(c) for c in ref], encoding
        for g, r in zip(got, ref):
            for a, b in zip(g.changes, r.changes):
                assert torch.equal(a, b)
