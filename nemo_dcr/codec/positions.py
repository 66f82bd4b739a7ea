"""Coding of the changed positions inside one chunk.

Three codings, the smallest raw one is chosen per chunk:

* ``dense``  -- every element of the chunk changed; nothing is stored.
* ``bitmap`` -- one bit per element, little-endian bit order (numpy ``packbits(bitorder="little")``).
* ``gaps``   -- the first position, then ``p[i] - p[i-1] - 1``, each as an unsigned LEB128 varint.

Everything is vectorised; no Python loop runs per element. The gap varints are made and read by
the C library where it is loaded (``csrc/dcr_portable.c``: ~20x the torch passes below, which
stay the reference and the fallback), with the same bytes and the same errors.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from nemo_dcr.codec import native
from nemo_dcr.errors import DeltaFormatError

DENSE, BITMAP, GAPS = "dense", "bitmap", "gaps"
CODINGS = (DENSE, BITMAP, GAPS)

_MAX_VARINT = 10  # 64-bit values


def _varint_lengths(v: torch.Tensor) -> torch.Tensor:
    n = torch.ones_like(v)
    for j in range(1, _MAX_VARINT):
        n += (v >= (1 << (7 * j))).to(v.dtype)
    return n


def varint_encode(v: torch.Tensor) -> bytes:
    """Unsigned LEB128 of each int64 value (values must be >= 0)."""
    if v.numel() == 0:
        return b""
    v = v.to(torch.int64)
    lens = _varint_lengths(v)
    width = int(lens.max())
    shifts = torch.arange(width, dtype=torch.int64) * 7
    groups = (v.unsqueeze(1) >> shifts) & 0x7F  # (k, width)
    cont = torch.arange(width).unsqueeze(0) < (lens - 1).unsqueeze(1)
    groups = groups | (cont.to(torch.int64) << 7)
    keep = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)
    return groups[keep].to(torch.uint8).numpy().tobytes()


def varint_decode(buf: bytes, count: int) -> torch.Tensor:
    b = (torch.frombuffer(bytearray(buf), dtype=torch.uint8).to(torch.int64) if buf
         else torch.empty(0, dtype=torch.int64))
    ends = (b & 0x80) == 0
    if int(ends.sum()) != count or (b.numel() and not bool(ends[-1])):
        raise DeltaFormatError(f"position stream holds {int(ends.sum())} varints, header says {count}")
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    group = torch.cumsum(ends.to(torch.int64), 0) - ends.to(torch.int64)  # group id of each byte
    first = torch.ones_like(ends)
    first[1:] = ends[:-1]
    starts = torch.nonzero(first).squeeze(1)
    j = torch.arange(b.numel(), dtype=torch.int64) - starts[group]
    if int(j.max()) >= _MAX_VARINT:
        raise DeltaFormatError("varint longer than 10 bytes in position stream")
    out = torch.zeros(count, dtype=torch.int64)
    out.index_add_(0, group, (b & 0x7F) << (7 * j))
    return out


def encode(idx: torch.Tensor, n: int, use_native: bool | None = None):
    """idx: sorted int64 positions in [0, n). Returns (coding, raw bytes)."""
    k = idx.numel()
    if k == n:
        return DENSE, b""
    lib = native.lib() if use_native is not False and k and idx.device.type == "cpu" else None
    gap_len = -1
    if lib is not None:
        idx = idx.to(torch.int64).contiguous()
        gap_len = lib.dcr_gaps_len(idx.data_ptr(), k)  # -1: not increasing, which only the reference takes
    gaps = None
    if gap_len < 0:
        gaps = idx.clone()
        gaps[1:] = idx[1:] - idx[:-1] - 1
        gap_len = int(_varint_lengths(gaps).sum())
    bitmap_len = (n + 7) // 8
    if bitmap_len < gap_len:
        mask = np.zeros(n, dtype=np.bool_)
        mask[idx.numpy()] = True
        return BITMAP, np.packbits(mask, bitorder="little").tobytes()
    if gaps is not None:
        return GAPS, varint_encode(gaps)
    assert lib is not None  # gaps is None only where the library measured them
    out = bytearray(gap_len)
    lib.dcr_gaps_encode(idx.data_ptr(), k, (ctypes.c_char * gap_len).from_buffer(out))
    return GAPS, bytes(out)


def _gaps_decode_native(lib, raw, n: int, k: int) -> torch.Tensor:
    out = torch.empty(k, dtype=torch.int64)
    bad = ctypes.c_int64(0)
    holder, address = native.buffer_address(raw) if len(raw) else (None, None)  # held until the call returns
    rc = lib.dcr_gaps_decode(address, len(raw), k, n, out.data_ptr(), ctypes.byref(bad))
    if rc == -1:
        ends = int(np.count_nonzero(np.frombuffer(raw, dtype=np.uint8) < 0x80))
        raise DeltaFormatError(f"position stream holds {ends} varints, header says {k}")
    if rc == -2:
        raise DeltaFormatError("varint longer than 10 bytes in position stream")
    if rc == -3:
        where = "past 2^63 - 1" if bad.value < 0 else str(bad.value)  # -1: the sum would not fit
        raise DeltaFormatError(f"position {where} out of range for a chunk of {n}")
    return out


def decode(coding: str, raw: bytes, n: int, k: int, use_native: bool | None = None) -> torch.Tensor:
    """Inverse of ``encode``; validates everything against n and k."""
    if coding == DENSE:
        if k != n or raw:
            raise DeltaFormatError("dense positions with a non-full chunk or a payload")
        return torch.arange(n, dtype=torch.int64)
    if coding == BITMAP:
        if len(raw) != (n + 7) // 8:
            raise DeltaFormatError(f"bitmap of {len(raw)} bytes for a chunk of {n} elements")
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
        if bits[n:].any():
            raise DeltaFormatError("bitmap has bits set past the end of the chunk")
        idx = torch.from_numpy(np.flatnonzero(bits[:n]).astype(np.int64))
        if idx.numel() != k:
            raise DeltaFormatError(f"bitmap marks {idx.numel()} positions, header says {k}")
        return idx
    if coding == GAPS:
        lib = native.lib() if use_native is not False else None
        if lib is not None:
            return _gaps_decode_native(lib, raw, n, k)
        gaps = varint_decode(raw, k)
        idx = torch.cumsum(gaps + 1, 0) - 1
        # gaps of 2^63 and more read as negative; a sum past 2^63 wraps, and shows as a decrease
        if k and (int(gaps.min()) < 0 or bool((idx[1:] <= idx[:-1]).any())):
            raise DeltaFormatError(f"position past 2^63 - 1 out of range for a chunk of {n}")
        if k and int(idx[-1]) >= n:
            raise DeltaFormatError(f"position {int(idx[-1])} out of range for a chunk of {n}")
        return idx
    raise DeltaFormatError(f"unknown position coding {coding!r}")
