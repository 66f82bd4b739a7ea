"""The "add" value coding: the change as a difference in the format's monotone integer order.

A small optimizer update moves a BF16 value by one or two ulps. In the *monotone* order of the
format (the order of the real numbers, with -0.0 just below +0.0) that is a difference of +-1 or
+-2, whatever carries the mantissa makes; XOR pays for those carries and does not say which way
the value moved. Here each changed element is sent as

    d = key(new) - key(old)  (mod 2^bits),  zigzag-coded: 0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ...

where ``key`` maps floating-point bits to their monotone order (negative values: all bits
flipped; positive: sign bit set) and is the identity for integers and bool. ``key`` is a
bijection of the bit patterns, so NaN payloads, infinities, -0.0 and subnormals round-trip like
any other bits. All arithmetic is done on non-negative int64 values below 2^32, so nothing
relies on overflow. Widths of 1, 2 and 4 bytes; 8-byte dtypes keep XOR/overwrite.

``encode`` and ``decode`` run in the C library where it is loaded (``csrc/dcr_portable.c``, the
same arithmetic in the width's own unsigned integers, one pass; the torch passes here, ~15x
slower on BF16, stay the reference and the fallback).
"""
from __future__ import annotations

import torch

from nemo_dcr.codec import native
from nemo_dcr.state.dtypes import INT_VIEW

WIDTHS = (1, 2, 4)


def unsigned(bits: torch.Tensor) -> torch.Tensor:
    w = bits.element_size()
    return bits.to(torch.int64) & ((1 << (8 * w)) - 1)


def key(u: torch.Tensor, w: int, is_float: bool) -> torch.Tensor:
    if not is_float:
        return u
    mask, sign = (1 << (8 * w)) - 1, 1 << (8 * w - 1)
    return torch.where(u >= sign, mask - u, u | sign)


def unkey(k: torch.Tensor, w: int, is_float: bool) -> torch.Tensor:
    if not is_float:
        return k
    mask, sign = (1 << (8 * w)) - 1, 1 << (8 * w - 1)
    return torch.where(k >= sign, k - sign, mask - k)


def to_bits(u: torch.Tensor, w: int) -> torch.Tensor:
    """Non-negative int64 < 2^(8w) -> the integer view dtype with the same bits."""
    half = 1 << (8 * w - 1)
    signed = torch.where(u >= half, u - (1 << (8 * w)), u)
    return signed.to(INT_VIEW[w]) if w > 1 else u.to(torch.uint8)


def _native(old: torch.Tensor, other: torch.Tensor, is_float: bool, direction: int,
            use_native: bool | None) -> torch.Tensor | None:
    """``dcr_ordered`` over contiguous host copies of ``old`` and ``other`` (the new bits for
    ``encode``, the coded differences for ``decode``): None where it does not run."""
    w = old.element_size()
    lib = native.lib() if use_native is not False and w in WIDTHS and old.device.type == "cpu" \
        and other.device.type == "cpu" and other.element_size() == w and old.numel() == other.numel() else None
    if lib is None:
        return None
    o, x = old.contiguous(), other.contiguous()
    out = torch.empty(o.numel(), dtype=INT_VIEW[w])
    if lib.dcr_ordered(o.data_ptr(), x.data_ptr(), o.numel(), w, int(is_float), direction, out.data_ptr()) != 0:
        return None
    return out.view(o.shape)


def encode(old: torch.Tensor, new: torch.Tensor, is_float: bool, use_native: bool | None = None) -> torch.Tensor:
    """old/new: integer views (same width). -> zigzag differences in the same integer view."""
    out = _native(old, new, is_float, 0, use_native)
    if out is not None:
        return out
    w = new.element_size()
    mod = 1 << (8 * w)
    d = (key(unsigned(new), w, is_float) - key(unsigned(old), w, is_float)) % mod
    s = torch.where(d >= mod // 2, d - mod, d)               # signed difference in [-mod/2, mod/2)
    z = torch.where(s >= 0, 2 * s, -2 * s - 1)                # zigzag, in [0, mod)
    return to_bits(z, w)


def decode(old: torch.Tensor, z_bits: torch.Tensor, is_float: bool, use_native: bool | None = None) -> torch.Tensor:
    """Inverse of ``encode``: the new bits from the old bits and the coded differences."""
    out = _native(old, z_bits, is_float, 1, use_native)
    if out is not None:
        return out
    w = old.element_size()
    mod = 1 << (8 * w)
    z = unsigned(z_bits)
    s = torch.where(z % 2 == 0, z // 2, -(z + 1) // 2)
    k = (key(unsigned(old), w, is_float) + s) % mod
    return to_bits(unkey(k, w, is_float), w)
