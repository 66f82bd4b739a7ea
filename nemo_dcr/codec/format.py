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
from typing import BinaryIO, NoReturn

import zstandard

from nemo_dcr.codec.header import ChunkEntry, DeltaHeader, parse_header
from nemo_dcr.codec.versions import FORMAT_VERSION, VERSIONS
from nemo_dcr.errors import DeltaFormatError

MAGIC = b"NDCRDLT\x00"
END_MAGIC = b"\x00TLDRCDN"
PREAMBLE = struct.Struct("<8sII")
FOOTER = struct.Struct("<QQII8s")
# A header's raw (decompressed) length is bounded before anything is allocated: by MAX_HEADER,
# and by what its stored bytes can hold. Real headers compress ~3-10x (digests and checksums
# do not compress); HEADER_RATIO leaves two orders of magnitude of room, so a 70 KB header can
# no longer claim 2 GiB.
MAX_HEADER = 1 << 30
HEADER_RATIO = 1024
HEADER_MIN_BOUND = 1 << 20


def header_bound(stored_len: int) -> int:
    """The largest raw header length a reader accepts for ``stored_len`` stored bytes."""
    return min(MAX_HEADER, max(HEADER_MIN_BOUND, HEADER_RATIO * stored_len))


class DeltaWriter:
    """Streams chunk payloads to ``f`` and finishes with the header and footer. ``version``:
    the format version written in the preamble and footer (``codec/versions.py``); the header's
    ``format`` field must say the same."""

    def __init__(self, f: BinaryIO, version: int = FORMAT_VERSION):
        self.f = f
        self.version = version
        self.f.write(PREAMBLE.pack(MAGIC, version, 0))
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
        self.f.write(FOOTER.pack(len(stored), len(raw), zlib.crc32(stored), self.version, END_MAGIC))
        self.offset += len(stored) + FOOTER.size
        return self.offset


class DeltaReader:
    """Random access to a delta in memory or in a file. Validates structure on open."""

    def __init__(self, buf, name: str = "<delta>"):
        self.name = name
        self.buf = memoryview(buf) if not isinstance(buf, memoryview) else buf
        self.size = len(self.buf)
        self.raw_header: dict = {}  # the JSON as stored (for tools that rewrite a header)
        self.version = 0  # the format version, from the preamble (set by _read_header)
        self.header: DeltaHeader = self._read_header()
        self.payload_end = self.size - FOOTER.size - self._stored_len

    @classmethod
    def open(cls, src) -> DeltaReader:
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

    def _fail(self, why: str) -> NoReturn:
        raise DeltaFormatError(f"{self.name}: {why}")

    def _read_header(self) -> DeltaHeader:
        if self.size < PREAMBLE.size + FOOTER.size:
            self._fail(f"{self.size} bytes is too short to be a nemo-dcr delta")
        magic, number, _flags = PREAMBLE.unpack_from(self.buf, 0)
        if magic != MAGIC:
            self._fail("not a nemo-dcr delta (bad magic)")
        if number not in VERSIONS:
            self._fail(f"format version {number} is not supported (this build reads "
                       f"{', '.join(map(str, VERSIONS))})")
        stored_len, raw_len, crc, fversion, end = FOOTER.unpack_from(self.buf, self.size - FOOTER.size)
        if end != END_MAGIC:
            self._fail("truncated or damaged: end marker missing")
        if fversion != number:
            self._fail("preamble and footer disagree on the format version")
        if stored_len > self.size - PREAMBLE.size - FOOTER.size:
            self._fail("header length out of range")
        if raw_len > header_bound(stored_len):
            self._fail(f"header claims {raw_len} bytes from {stored_len} stored (at most {header_bound(stored_len)})")
        self._stored_len = stored_len
        start = self.size - FOOTER.size - stored_len
        stored = self.buf[start:self.size - FOOTER.size]
        if zlib.crc32(stored) != crc:
            self._fail("header checksum mismatch")
        from nemo_dcr.codec.chunk import unpack
        try:
            raw = unpack(stored, True, raw_len)
            header = json.loads(raw)
        except DeltaFormatError as e:
            self._fail(f"header does not decode: {e}")
        except (ValueError, RecursionError) as e:
            self._fail(f"header is not JSON: {e}")
        self.raw_header = header
        self.version = number  # which digests the chunks carry (codec/versions.py)
        try:
            return parse_header(header, start, VERSIONS[number])
        except DeltaFormatError as e:
            self._fail(str(e))

    def payload(self, chunk: ChunkEntry) -> memoryview:
        return self.buf[chunk.off:chunk.off + chunk.payload_len]

    def check_payloads(self) -> None:
        """Verify every chunk checksum and the sizes its zstd frames declare (reads the whole
        payload area, decodes nothing): a bad chunk is found before anything is written."""
        from nemo_dcr.codec.chunk import check_frame
        for t in self.header.tensors:
            for c in t.chunks:
                p = self.payload(c)
                if zlib.crc32(p) != c.crc:
                    self._fail(f"tensor {t.name!r}: chunk at element {c.start} fails its checksum")
                try:
                    if c.pz:
                        check_frame(p[:c.plen], c.praw)
                    if c.vz:
                        check_frame(p[c.plen:], c.vraw)
                except DeltaFormatError as e:
                    self._fail(f"tensor {t.name!r}: chunk at element {c.start}: {e}")


HEADER_LEVEL = 15
HEADER_STRONG_MAX = 1 << 20
