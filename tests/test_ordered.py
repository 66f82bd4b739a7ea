"""The "add" coding: differences in the format's monotone integer order, exact for every bit
pattern (NaN payloads, infinities, -0.0, subnormals)."""
import torch

from nemo_dcr.codec import ordered
from nemo_dcr.state.dtypes import int_view


def test_every_16_bit_pattern_round_trips():
    """All 65536 patterns (bf16 and fp16 share the sign-magnitude layout the order depends on)."""
    g = torch.Generator().manual_seed(0)
    old = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for _ in range(3):
        new = old[torch.randperm(old.numel(), generator=g)]
        assert torch.equal(ordered.decode(old, ordered.encode(old, new, True), True), new)
        assert torch.equal(ordered.decode(new, ordered.encode(new, old, True), True), old)


def test_one_ulp_up_or_down_is_one_zigzag_step():
    x = torch.tensor([1.0, -1.0, 3.5, -2.0e-3, 6.0e4], dtype=torch.float32).bfloat16()
    bits = int_view(x)
    for step, code in ((1, 2), (-1, 1), (2, 4), (-2, 3)):
        k = ordered.key(ordered.unsigned(bits), 2, True) + step
        moved = ordered.to_bits(ordered.unkey(k, 2, True), 2)
        assert torch.equal(ordered.encode(bits, moved, True), torch.full((5,), code, dtype=torch.int16))
        assert torch.equal(ordered.decode(bits, torch.full((5,), code, dtype=torch.int16), True), moved)


def test_special_values_are_neighbours_in_the_order():
    t = torch.tensor
    f = torch.float32
    neg0, pos0 = t([-0.0], dtype=f).view(torch.int32), t([0.0], dtype=f).view(torch.int32)
    assert int(ordered.encode(neg0, pos0, True)) == 2  # -0.0 -> +0.0 is one step up
    tiny = t([1], dtype=torch.int32)  # the smallest positive subnormal
    assert int(ordered.encode(pos0, tiny, True)) == 2
    inf = t([float("inf")], dtype=f).view(torch.int32)
    nan = t([0x7F800001], dtype=torch.int32)  # a NaN with payload 1, just above +inf in the order
    assert int(ordered.encode(inf, nan, True)) == 2
    assert torch.equal(ordered.decode(inf, ordered.encode(inf, nan, True), True), nan)


def test_integers_and_bool_use_plain_modular_differences():
    for dtype, lo, hi in ((torch.int8, -128, 127), (torch.uint8, 0, 255), (torch.int16, -2**15, 2**15 - 1),
                          (torch.int32, -2**31, 2**31 - 1)):
        vals = torch.tensor([lo, hi, 0, -1 if lo < 0 else 1, 7], dtype=dtype)
        old, new = int_view(vals), int_view(vals.roll(1))
        assert torch.equal(ordered.decode(old, ordered.encode(old, new, False), False), new)
    b_old = torch.tensor([True, False, True]).view(torch.uint8)
    b_new = torch.tensor([False, True, True]).view(torch.uint8)
    assert torch.equal(ordered.decode(b_old, ordered.encode(b_old, b_new, False), False), b_new)
