"""Reference codec for one chunk, in pure PyTorch. It defines the bytes of the format.

A chunk is a contiguous range ``[start, start + n)`` of a region's flat index. Encoding:

1. ``x = old_bits ^ new_bits`` on integer views; the changed positions are ``x != 0``.
2. Positions are coded (``positions.py``); values are the new bits (``overwrite``), ``x`` at
   the changed positions (``xor``), or the difference in the format's monotone order (``add``,
   ``ordered.py``), split into byte planes (``planes.py``).
3. Each stream is zstd-compressed, or stored raw when zstd does not make it smaller.
4. ``pre``/``post`` are digests of the old and new bits at the changed positions. The
   receiver checks the bits it holds against them before touching anything: ``pre`` means
   "apply", ``post`` means "already applied, skip" (so an XOR re-delivered is harmless),
   anything else is a wrong base.
"""
from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass

import torch
import zstandard

from . import ordered, planes, positions
from .digest import values_digest
from .errors import DeltaFormatError

OVERWRITE, XOR, ADD = "overwrite", "xor", "add"
ENCODINGS = (OVERWRITE, XOR, ADD)
AUTO = "auto"  # mixed: per chunk, the smallest of them
CHOICES = (AUTO, OVERWRITE, XOR, ADD)
_PREFER = {XOR: 0, ADD: 1, OVERWRITE: 2}  # ties

_tls = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "c", None)
    if cache is None:
        cache = _tls.c = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "d", None)
    if d is None:
        d = _tls.d = zstandard.ZstdDecompressor()
    return d


def pack(raw: bytes, level: int):
    """(stored bytes, zstd?) -- zstd only when it is smaller."""
    if not raw:
        return b"", False
    z = _compressor(level).compress(raw)
    return (z, True) if len(z) < len(raw) else (raw, False)


def unpack(stored, compressed: bool, raw_len: int) -> bytes:
    if not compressed:
        if len(stored) != raw_len:
            raise DeltaFormatError(f"stream is {len(stored)} bytes, header says {raw_len}")
        return bytes(stored)
    try:
        out = _decompressor().decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise DeltaFormatError(f"zstd stream does not decode: {e}") from None
    if len(out) != raw_len:
        raise DeltaFormatError(f"zstd stream gives {len(out)} bytes, header says {raw_len}")
    return out


@dataclass
class EncodedChunk:
    start: int
    n: int
    k: int
    enc: str
    pos: str
    pos_bytes: bytes
    val_bytes: bytes
    pos_raw: int
    val_raw: int
    pos_z: bool
    val_z: bool
    pre: str
    post: str
    alt_val_len: dict  # stored value bytes of every encoding tried (for inspect/bench)
    changes: tuple | None = None  # (positions, old bits or None, new bits) when asked for

    def header(self, offset: int) -> dict:
        return {
            "start": self.start, "n": self.n, "k": self.k, "enc": self.enc, "pos": self.pos,
            "off": offset, "plen": len(self.pos_bytes), "vlen": len(self.val_bytes),
            "praw": self.pos_raw, "vraw": self.val_raw, "pz": self.pos_z, "vz": self.val_z,
            "crc": zlib.crc32(self.val_bytes, zlib.crc32(self.pos_bytes)),
            "pre": self.pre, "post": self.post,
        }


def encode_chunk(old: torch.Tensor | None, new: torch.Tensor, start: int, encoding: str = AUTO,
                 level: int = 3, keep_changes: bool = False, is_float: bool = True) -> EncodedChunk | None:
    """old/new: 1-D integer views of the chunk. ``old=None`` means "no base": every element
    is sent, overwrite. Returns None when nothing changed."""
    n = new.numel()
    if old is None:
        idx = torch.arange(n, dtype=torch.int64)
        newv, xorv, prev = new, None, None
    else:
        x = torch.bitwise_xor(old, new)
        idx = torch.nonzero(x).squeeze(1)
        if idx.numel() == 0:
            return None
        newv = new[idx]
        xorv = x[idx]
        prev = old[idx]
    k = idx.numel()
    pos_coding, pos_raw = positions.encode(idx, n)
    pos_bytes, pos_z = pack(pos_raw, level)
    tried = {}
    if encoding in (AUTO, OVERWRITE) or xorv is None:
        tried[OVERWRITE] = pack(planes.split(newv), level)
    add_ok = xorv is not None and new.element_size() in ordered.WIDTHS
    if xorv is not None and (encoding in (AUTO, XOR) or (encoding == ADD and not add_ok)):
        tried[XOR] = pack(planes.split(xorv), level)
    if add_ok and encoding in (AUTO, ADD):
        tried[ADD] = pack(planes.split(ordered.encode(prev, newv, is_float)), level)
    enc = min(tried, key=lambda e: (len(tried[e][0]), _PREFER[e]))
    val_bytes, val_z = tried[enc]
    w = new.element_size()
    return EncodedChunk(
        start=start, n=n, k=k, enc=enc, pos=pos_coding, pos_bytes=pos_bytes, val_bytes=val_bytes,
        pos_raw=len(pos_raw), val_raw=k * w, pos_z=pos_z, val_z=val_z,
        pre=values_digest(prev) if prev is not None else "", post=values_digest(newv),
        alt_val_len={e: len(v[0]) for e, v in tried.items()},
        changes=(idx, prev, newv) if keep_changes else None,
    )


def decode_chunk(h: dict, payload, w: int):
    """Header entry + its payload bytes -> (positions relative to the chunk, value bits)."""
    if zlib.crc32(payload) != h["crc"]:
        raise DeltaFormatError("chunk checksum mismatch")
    p = memoryview(payload)
    pos_raw = unpack(p[: h["plen"]], h["pz"], h["praw"])
    val_raw = unpack(p[h["plen"]:], h["vz"], h["vraw"])
    idx = positions.decode(h["pos"], pos_raw, h["n"], h["k"])
    vals = planes.join(val_raw, h["k"], w)
    return idx, vals
