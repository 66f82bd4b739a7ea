"""The delta container: one file (or object) per delta. Specified in docs/format.md.

    preamble  MAGIC (8 bytes) | u32 format version | u32 flags (0)
    payloads  for each chunk, in header order: position stream, then value stream
    header    zstd-compressed UTF-8 JSON
    footer    u64 header stored length | u64 header raw length | u32 crc32(header stored)
              | u32 format version | END_MAGIC (8 bytes)

All integers little-endian. The header sits at the end so a delta can be written in one
streaming pass with bounded memory; a reader seeks to the fixed 32-byte footer first.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from typing import BinaryIO

import zstandard

from nemo_dcr.errors import DeltaFormatError

MAGIC = b"NDCRDLT\x00"
END_MAGIC = b"\x00TLDRCDN"
FORMAT_VERSION = 1
PREAMBLE = struct.Struct("<8sII")
FOOTER = struct.Struct("<QQII8s")
MAX_HEADER = 1 << 31


class DeltaWriter:
    """Streams chunk payloads to ``f`` and finishes with the header and footer."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.f.write(PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0))
        self.offset = PREAMBLE.size

    def add_payload(self, *parts: bytes) -> int:
        """Write one chunk payload; returns its offset."""
        off = self.offset
        for p in parts:
            self.f.write(p)
            self.offset += len(p)
        return off

    def finish(self, header: dict) -> int:
        raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        # the header holds per-chunk digests and class tables: a strong level makes a small one
        # ~12 % smaller for a few ms (30 KB: 5.8 ms); a large one (many chunks) keeps level 3
        level = HEADER_LEVEL if len(raw) <= HEADER_STRONG_MAX else 3
        stored = zstandard.ZstdCompressor(level=level).compress(raw)
        self.f.write(stored)
        self.f.write(FOOTER.pack(len(stored), len(raw), zlib.crc32(stored), FORMAT_VERSION, END_MAGIC))
        self.offset += len(stored) + FOOTER.size
        return self.offset


class DeltaReader:
    """Random access to a delta in memory or in a file. Validates structure on open."""

    def __init__(self, buf, name: str = "<delta>"):
        self.name = name
        self.buf = memoryview(buf) if not isinstance(buf, memoryview) else buf
        self.size = len(self.buf)
        self.header = self._read_header()
        self.payload_end = self.size - FOOTER.size - self._stored_len

    @classmethod
    def open(cls, src) -> "DeltaReader":
        """``src``: bytes-like, a path, or a DeltaReader."""
        if isinstance(src, DeltaReader):
            return src
        if isinstance(src, (bytes, bytearray, memoryview)):
            return cls(src)
        path = os.fspath(src)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise DeltaFormatError(f"{path}: empty file, not a nemo-dcr delta")
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise DeltaFormatError(f"{path}: cannot read delta: {e.strerror}") from None
        return cls(m, name=path)

    def _fail(self, why: str):
        raise DeltaFormatError(f"{self.name}: {why}")

    def _read_header(self) -> dict:
        if self.size < PREAMBLE.size + FOOTER.size:
            self._fail(f"{self.size} bytes is too short to be a nemo-dcr delta")
        magic, version, _flags = PREAMBLE.unpack_from(self.buf, 0)
        if magic != MAGIC:
            self._fail("not a nemo-dcr delta (bad magic)")
        if version != FORMAT_VERSION:
            self._fail(f"format version {version} is not supported (this build reads {FORMAT_VERSION})")
        stored_len, raw_len, crc, fversion, end = FOOTER.unpack_from(self.buf, self.size - FOOTER.size)
        if end != END_MAGIC:
            self._fail("truncated or damaged: end marker missing")
        if fversion != version:
            self._fail("preamble and footer disagree on the format version")
        if stored_len > self.size - PREAMBLE.size - FOOTER.size or raw_len > MAX_HEADER:
            self._fail("header length out of range")
        self._stored_len = stored_len
        start = self.size - FOOTER.size - stored_len
        stored = self.buf[start:self.size - FOOTER.size]
        if zlib.crc32(stored) != crc:
            self._fail("header checksum mismatch")
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_len)
            header = json.loads(raw)
        except (zstandard.ZstdError, ValueError) as e:
            self._fail(f"header does not decode: {e}")
        if len(raw) != raw_len:
            self._fail("header length mismatch")
        try:
            validate_header(header, start)
        except DeltaFormatError as e:
            self._fail(str(e))
        return header

    def payload(self, chunk: dict) -> memoryview:
        return self.buf[chunk["off"]:chunk["off"] + chunk["plen"] + chunk["vlen"]]

    def check_payloads(self) -> None:
        """Verify every chunk checksum (reads the whole payload area, decodes nothing)."""
        for t in self.header["tensors"]:
            for c in t.get("chunks", ()):
                if zlib.crc32(self.payload(c)) != c["crc"]:
                    self._fail(f"tensor {t['name']!r}: chunk at element {c['start']} fails its checksum")


_CHUNK_INT = ("start", "n", "k", "off", "plen", "vlen", "praw", "vraw", "crc")


def _need(cond, why):
    if not cond:
        raise DeltaFormatError(f"malformed header: {why}")


HEADER_LEVEL = 15
HEADER_STRONG_MAX = 1 << 20


def validate_header(h: dict, payload_end: int) -> None:
    """Type- and range-check everything a decoder relies on, so decoding never crashes."""
    from nemo_dcr.codec import chunk as _c
    from nemo_dcr.codec import positions as _p
    from nemo_dcr.state.dtypes import DTYPES
    import math

    _need(isinstance(h, dict), "not an object")
    _need(h.get("format") == FORMAT_VERSION, "format field")
    _need(isinstance(h.get("tensors"), list), "tensors is not a list")
    seen = set()
    for t in h["tensors"]:
        _need(isinstance(t, dict) and isinstance(t.get("name"), str), "tensor entry")
        name = t["name"]
        _need(name not in seen, f"duplicate tensor {name!r}")
        seen.add(name)
        _need(t.get("kind") in ("delta", "full", "removed"), f"{name}: kind")
        if t["kind"] == "removed":
            continue
        _need(t.get("dtype") in DTYPES, f"{name}: dtype")
        _need(isinstance(t.get("target_digest"), str), f"{name}: target_digest")
        _need(t["kind"] != "delta" or isinstance(t.get("base_digest"), str), f"{name}: base_digest")
        for key in ("shape",):
            _need(isinstance(t.get(key), list) and all(isinstance(x, int) and x >= 0 for x in t[key]), f"{name}: {key}")
        r = t.get("region")
        _need(isinstance(r, dict), f"{name}: region")
        for key in ("offsets", "shape"):
            _need(isinstance(r.get(key), list) and len(r[key]) == len(t["shape"])
                  and all(isinstance(x, int) and x >= 0 for x in r[key]), f"{name}: region {key}")
        _need(all(o + s <= g for o, s, g in zip(r["offsets"], r["shape"], t["shape"])), f"{name}: region outside tensor")
        numel = math.prod(r["shape"])
        _need(isinstance(t.get("chunks"), list), f"{name}: chunks")
        end = 0
        for c in t["chunks"]:
            _need(isinstance(c, dict), f"{name}: chunk entry")
            for key in _CHUNK_INT:
                _need(isinstance(c.get(key), int) and not isinstance(c.get(key), bool) and c[key] >= 0, f"{name}: chunk {key}")
            if t["kind"] == "full":
                _need(c["start"] == end and c["k"] == c["n"], f"{name}: full tensor chunks must be dense and contiguous")
            _need(c["start"] >= end and c["start"] + c["n"] <= numel and 0 < c["k"] <= c["n"], f"{name}: chunk range")
            end = c["start"] + c["n"]
            _need(c.get("enc") in _c.ENCODINGS and c.get("pos") in _p.CODINGS + (_c.CLASSES,), f"{name}: chunk coding")
            _need((c["enc"] == _c.CLASSES) == (c["pos"] == _c.CLASSES), f"{name}: classes chunk coding")
            _need(c["enc"] != _c.CLASSES or (isinstance(c.get("cls"), list) and t["kind"] == "delta"),
                  f"{name}: classes table")
            _need(isinstance(c.get("pz"), bool) and isinstance(c.get("vz"), bool), f"{name}: chunk flags")
            _need(isinstance(c.get("pre"), str) and isinstance(c.get("post"), str), f"{name}: chunk digests")
            _need(c["off"] >= PREAMBLE.size and c["off"] + c["plen"] + c["vlen"] <= payload_end, f"{name}: chunk payload outside the file")
        if t["kind"] == "full":
            _need(end == numel and all(c["enc"] == _c.OVERWRITE for c in t["chunks"]), f"{name}: full tensor not covered")
