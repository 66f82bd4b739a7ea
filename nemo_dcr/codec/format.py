"""The delta container: one file (or object) per delta. Specified in docs/format.md.

Versions 1 and 2:

    preamble  MAGIC (8 bytes) | u32 format version | u32 flags (0)
    payloads  for each chunk, in header order: position stream, then value stream
    header    zstd-compressed UTF-8 JSON
    footer    u64 header stored length | u64 header raw length | u32 crc32(header stored)
              | u32 format version | END_MAGIC (8 bytes)

The header sits at the end so a delta can be written in one streaming pass with bounded memory;
a reader seeks to the fixed 32-byte footer first.

Version 3 puts each chunk's index before the chunk, so a receiver decodes and applies the chunks
of an object while the rest of it still arrives (the writer holds one segment, ~32 KiB):

    preamble  as above (version 3)
    segments  each: u32 index stored length | u32 index raw length | u32 crc32(index stored)
              | u32 payload length | the index (zstd-compressed UTF-8 JSON) | the payloads it lists
              first {"open": {...}} (the header's fields known before any tensor), then
              {"tensors": [piece, ...]}, last {"close": {...}} (the state digests, the counts)
    trailer   u32 format version | u32 segments | END_MAGIC (8 bytes)

All integers little-endian.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from typing import BinaryIO, NoReturn

import zstandard

from nemo_dcr.codec.checksum import crc32
from nemo_dcr.codec.header import PREAMBLE, ChunkEntry, DeltaHeader, parse_header
from nemo_dcr.codec.versions import FORMAT_VERSION, VERSIONS
from nemo_dcr.errors import DeltaFormatError

MAGIC = b"NDCRDLT\x00"
END_MAGIC = b"\x00TLDRCDN"
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


SEGMENT = struct.Struct("<IIII")  # version 3: index stored length, raw length, crc32, payload length
TRAILER = struct.Struct("<II8s")  # version 3: format version, segments, END_MAGIC
SEGMENTED = 3                     # the first version whose container is segments
# payload bytes a version-3 writer gathers before it writes a segment: a delta part of a few
# hundred KB (a 32 MB part at 1-3 %) is then several segments, applied while the rest arrives
# (at 1 MiB it was one, applied once all of it was there). At 128 KiB a 155 KB part (10M BF16
# at 1 %) was a segment of 128 KiB and a short one: nothing was applied before ~83 % of it had
# come. At 32 KiB a segment's own cost, its ~16-byte header and its pieces' names and digests
# in the index, is ~0.6-0.8 % of a delta's bytes (docs/results.md, issue 25's sixth turn)
SEGMENT_BYTES = 32 << 10
# ... and a keyframe's (every tensor sent whole: the model's bytes, applied as they come) this many
# times that, 1 MiB: at 32 KiB a model of many small tensors was a segment per tensor, each with its
# own index to make and parse (a keyframe of 4096 tensors of 32K BF16: 4096 segments), while a
# keyframe's 1M-element chunks are a segment each at any size (docs/results.md, twenty-second turn)
KEYFRAME_SEGMENT_SCALE = 32
SEGMENT_PIECES = 1024             # ... or tensor pieces (many unchanged tensors make no payload)
MAX_SEGMENTS = 1 << 24


def _index_bytes(index: dict, strong: int) -> tuple[bytes, int]:
    raw = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
    level = strong if len(raw) <= HEADER_STRONG_MAX else 3
    return zstandard.ZstdCompressor(level=level).compress(raw), len(raw)


class DeltaWriter:
    """Streams chunk payloads to ``f`` and finishes with the header and footer. ``version``:
    the format version written in the preamble and footer (``codec/versions.py``); the header's
    ``format`` field must say the same.

    The encoder drives it the same way for every version: ``open(fields)`` (the header's fields
    known before the first tensor), then per tensor ``begin_tensor(fields)``, ``add_chunk(c)`` for
    each chunk (-> the chunk's header entry), ``end_tensor(entry)``, and ``finish(header)``.
    Versions 1 and 2 write each payload at once and the header at the end; version 3 gathers up
    to ``SEGMENT_BYTES`` of payloads and writes them after their index."""

    def __init__(self, f: BinaryIO, version: int = FORMAT_VERSION, keyframe: bool = False):
        """``keyframe``: the object sends every tensor whole (no base): its segments gather
        ``KEYFRAME_SEGMENT_SCALE`` times ``SEGMENT_BYTES``."""
        self.f = f
        self.version = version
        self.keyframe = keyframe
        self.f.write(PREAMBLE.pack(MAGIC, version, 0))
        self.offset = PREAMBLE.size
        self.segmented = version >= SEGMENTED
        self._segments = 0
        self._payload: list = []         # version 3: the open segment's payloads (not joined: written one by one)
        self._payload_len = 0
        self._pieces: list[dict] = []    # ... and its index
        self._tensor: dict | None = None  # the tensor being written: its fields
        self._chunks: list[dict] = []     # ... and its chunks in the open segment
        self._full = False                # the open segment has its payloads: closed at the next chunk or tensor end

    # -- version 3 segments ---------------------------------------------------------------
    def _write_segment(self, index: dict, payload: list | tuple = ()) -> None:
        stored, raw_len = _index_bytes(index, SEGMENT_LEVEL)
        n = sum(len(p) for p in payload)
        self.f.write(SEGMENT.pack(len(stored), raw_len, crc32(stored), n))
        self.f.write(stored)
        for p in payload:  # each stream as the encoder made it: no copy into one buffer first
            if p:
                self.f.write(p)
        self.offset += SEGMENT.size + len(stored) + n
        self._segments += 1

    def _flush(self) -> None:
        if self._tensor is not None and self._chunks:  # a tensor goes on in the next segment
            self._pieces.append({**self._tensor, "chunks": self._chunks, "last": False})
            self._chunks = []
        if self._pieces:
            self._write_segment({"tensors": self._pieces}, self._payload)
        self._pieces, self._payload, self._payload_len, self._full = [], [], 0, False

    def open(self, fields: dict) -> None:
        """The header's fields known before the first tensor (version 3 writes them first)."""
        if self.segmented:
            self._write_segment({"open": fields})

    def begin_tensor(self, fields: dict) -> None:
        """A tensor's entry without its chunks and target digest (name, kind, dtype, shape,
        region, base digest)."""
        self._tensor, self._chunks = dict(fields), []

    def add_chunk(self, c) -> dict:
        """Write an ``EncodedChunk``'s payload -> its header entry (``off``: from the start of the
        object in versions 1 and 2, of its segment's payloads in version 3)."""
        if not self.segmented:
            return c.header(self.add_payload(c.pos_bytes, c.val_bytes))
        if self._full:  # the tensor goes on past a full segment: it closes with the piece so far
            self._flush()
        h = c.header(self._payload_len)
        self._payload += (c.pos_bytes, c.val_bytes)
        self._payload_len += len(c.pos_bytes) + len(c.val_bytes)
        self._chunks.append(h)
        # full: closed at the tensor's next chunk or at its end, whichever comes first, so that a
        # tensor whose last chunk fills the segment ends in it. Closed at once, every such tensor
        # (a delta's tensor of one 4Mi-element chunk, the usual case) left a piece without chunks
        # in the next segment, for its target digest alone, which a receiver parsed, planned and
        # started as a piece of its own: half a 1 % delta's pieces (docs/results.md, "A tensor's
        # end in the segment of its last chunk")
        self._full = self._payload_len >= SEGMENT_BYTES * (KEYFRAME_SEGMENT_SCALE if self.keyframe else 1)
        return h

    def end_tensor(self, entry: dict) -> None:
        """The tensor's whole entry (its target digest known now)."""
        chunks, self._tensor, self._chunks = self._chunks, None, []  # ended: _flush must not continue it
        if self.segmented:
            piece = {k: v for k, v in entry.items() if k != "chunks"}
            self._pieces.append({**piece, "chunks": chunks, "last": True})
            if self._full or len(self._pieces) >= SEGMENT_PIECES:
                self._flush()

    def add_payload(self, *parts: bytes) -> int:
        """Write one chunk payload; returns its offset."""
        off = self.offset
        for p in parts:
            self.f.write(p)
            self.offset += len(p)
        return off

    def finish(self, header: dict) -> int:
        if self.segmented:
            self._flush()
            close = {k: header[k] for k in ("base_digest", "target_digest") if k in header}
            self._write_segment({"close": {**close, "tensors": len(header["tensors"])}})
            self.f.write(TRAILER.pack(self.version, self._segments, END_MAGIC))
            self.offset += TRAILER.size
            return self.offset
        # the header holds per-chunk digests and class tables: a strong level makes a small one
        # ~12 % smaller for a few ms (30 KB: 5.8 ms); a large one (many chunks) keeps level 3
        stored, raw_len = _index_bytes(header, HEADER_LEVEL)
        self.f.write(stored)
        self.f.write(FOOTER.pack(len(stored), raw_len, crc32(stored), self.version, END_MAGIC))
        self.offset += len(stored) + FOOTER.size
        return self.offset


class DeltaReader:
    """Random access to a delta in memory or in a file. Validates structure on open."""

    def __init__(self, buf, name: str = "<delta>"):
        self.name = name
        self.payloads_checked = False  # check_payloads ran: the chunks' decoders need not CRC again
        self.buf = memoryview(buf) if not isinstance(buf, memoryview) else buf
        self.size = len(self.buf)
        self.raw_header: dict = {}  # the JSON as stored (for tools that rewrite a header; version 3:
        #                             the segments' indexes merged into one header of version 2's form)
        self.version = 0  # the format version, from the preamble (set by _read_header)
        self.header: DeltaHeader = self._read_header()
        self.payload_end = self.size - (TRAILER.size if self.version >= SEGMENTED
                                        else FOOTER.size + self._stored_len)

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
        if number >= SEGMENTED:
            return self._read_segments(number)
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
        if crc32(stored) != crc:
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

    def _read_segments(self, number: int) -> DeltaHeader:
        """Version 3: every segment's index, checked, merged into one header (the chunks'
        offsets made absolute), then parsed as versions 1 and 2 are."""
        if self.size < PREAMBLE.size + TRAILER.size:
            self._fail(f"{self.size} bytes is too short to be a nemo-dcr delta")
        nseg = read_trailer(self.buf, self.size, number, self._fail)
        limit = self.size - TRAILER.size
        merged = SegmentMerger(self._fail)
        pos = PREAMBLE.size
        while pos < limit:
            index, start, pos = read_segment(self.buf, pos, limit, self._fail)
            merged.add(index, start, pos - start)
        if merged.closed is None:
            self._fail("truncated or damaged: no closing segment")
        if merged.count != nseg:
            self._fail(f"the trailer counts {nseg} segments, the object holds {merged.count}")
        header = merged.header()
        self.raw_header = header
        self.version = number
        try:
            return parse_header(header, limit, VERSIONS[number])
        except DeltaFormatError as e:
            self._fail(str(e))

    @classmethod
    def of_segment(cls, buf, header: DeltaHeader, version: int, name: str = "<delta>") -> DeltaReader:
        """A reader of some chunks of ``buf`` with ``header`` parsed already (``SegmentStream``:
        one segment of an object still arriving)."""
        r = cls.__new__(cls)
        r.name, r.buf, r.size = name, memoryview(buf) if not isinstance(buf, memoryview) else buf, len(buf)
        r.raw_header, r.version, r.header, r.payload_end = {}, version, header, len(buf)
        r._stored_len = 0
        r.payloads_checked = False
        return r

    def payload(self, chunk: ChunkEntry) -> memoryview:
        return self.buf[chunk.off:chunk.off + chunk.payload_len]

    def check_payloads(self) -> None:
        """Verify every chunk checksum and the sizes its zstd frames declare (reads the whole
        payload area, decodes nothing): a bad chunk is found before anything is written."""
        from nemo_dcr.codec.chunk import check_frame
        for t in self.header.tensors:
            for c in t.chunks:
                p = self.payload(c)
                if crc32(p) != c.crc:
                    self._fail(f"tensor {t.name!r}: chunk at element {c.start} fails its checksum")
                try:
                    if c.pz:
                        check_frame(p[:c.plen], c.praw)
                    if c.vz:
                        check_frame(p[c.plen:], c.vraw)
                except DeltaFormatError as e:
                    self._fail(f"tensor {t.name!r}: chunk at element {c.start}: {e}")
        self.payloads_checked = True


HEADER_LEVEL = 15
# version 3's segment indexes: level 6, not 15. On bench/kernels.py's 64M-element BF16 delta at
# 1 % (six indexes, 28 KB of JSON) level 15 took 4.1 ms of the publisher's CPU to save 368 bytes
# (0.09 % of the 427 KB delta) over level 6 (0.5 ms): worth it only on a link under ~1 Mbit/s.
# (Level 3: 0.2 ms, 1.2 KB more.) Any level decodes; the v3 goldens' indexes were written at 15.
SEGMENT_LEVEL = 6
HEADER_STRONG_MAX = 1 << 20


def read_trailer(buf, size: int, number: int, fail: Callable[[str], NoReturn]) -> int:
    """The version-3 trailer at the end of ``buf[:size]``, checked against the preamble's format
    version ``number`` -> the segment count it names."""
    tversion, nseg, end = TRAILER.unpack_from(buf, size - TRAILER.size)
    if end != END_MAGIC:
        fail("truncated or damaged: end marker missing")
    if tversion != number:
        fail("preamble and trailer disagree on the format version")
    return nseg


def read_segment(buf, pos: int, limit: int, fail: Callable[[str], NoReturn]) -> tuple[dict, int, int]:
    """The version-3 segment at ``pos`` (within ``buf[:limit]``) -> (its index, checked for
    length, checksum and JSON; where its payloads start; where the next segment starts)."""
    from nemo_dcr.codec.chunk import unpack
    if pos + SEGMENT.size > limit:
        fail("truncated or damaged: a segment header runs past the end")
    stored_len, raw_len, crc, payload_len = SEGMENT.unpack_from(buf, pos)
    start = pos + SEGMENT.size + stored_len
    if stored_len == 0 or start + payload_len > limit:
        fail("segment length out of range")
    if raw_len > header_bound(stored_len):
        fail(f"segment index claims {raw_len} bytes from {stored_len} stored (at most {header_bound(stored_len)})")
    stored = buf[pos + SEGMENT.size:start]
    if crc32(stored) != crc:
        fail("segment index checksum mismatch")
    try:
        index = json.loads(unpack(stored, True, raw_len))
    except DeltaFormatError as e:
        fail(f"segment index does not decode: {e}")
    except (ValueError, RecursionError) as e:
        fail(f"segment index is not JSON: {e}")
    if not isinstance(index, dict) or len(index) != 1:
        fail("malformed segment index: not an object of one field")
    return index, start, start + payload_len


class SegmentMerger:
    """Version-3 segment indexes, in order, into one header of version 2's form: an ``open``
    segment first, ``tensors`` segments (a tensor's pieces one after another, its last one with
    ``"last": true`` and its target digest), a ``close`` segment last. Chunk offsets are made
    absolute and must lie in their own segment's payloads."""

    _SAME = ("kind", "dtype", "shape", "region", "base_digest")

    def __init__(self, fail: Callable[[str], NoReturn]):
        self._fail = fail
        self.opened: dict | None = None
        self.closed: dict | None = None
        self.count = 0
        self.tensors: list[dict] = []   # whole entries, in order
        self._open_tensor: dict | None = None

    def add(self, index: dict, start: int, length: int) -> None:
        fail = self._fail
        self.count += 1
        if self.count > MAX_SEGMENTS:
            fail(f"more than {MAX_SEGMENTS} segments")
        if self.closed is not None:
            fail("malformed segment: a segment after the closing one")
        if "open" in index:
            if self.count != 1 or not isinstance(index["open"], dict):
                fail("malformed segment: the opening segment is not first")
            self.opened = index["open"]
            return
        if self.opened is None:
            fail("malformed segment: the first segment does not open the delta")
        if "close" in index:
            c = index["close"]
            if not isinstance(c, dict) or length or self._open_tensor is not None:
                fail("malformed segment: the closing segment")
            if c.get("tensors") != len(self.tensors):
                fail(f"the closing segment counts {c.get('tensors')!r} tensors, the segments hold {len(self.tensors)}")
            self.closed = c
            return
        pieces = index.get("tensors")
        if not isinstance(pieces, list) or not pieces:
            fail("malformed segment: no tensors")
        for p in pieces:
            self._piece(p, start, length)

    def _piece(self, p, start: int, length: int) -> None:
        fail = self._fail
        if not isinstance(p, dict) or not isinstance(p.get("chunks"), list) or not isinstance(p.get("last"), bool):
            fail("malformed segment: tensor piece")
        chunks = []
        # (plain loops, no generator expressions: once per chunk and per piece of every delta
        # opened, on the GIL before anything is applied)
        for c in p["chunks"]:
            if not isinstance(c, dict):
                fail(f"malformed segment: a chunk of {p.get('name')!r}")
            off, plen, vlen = c.get("off"), c.get("plen"), c.get("vlen")
            if type(off) is not int or type(plen) is not int or type(vlen) is not int:  # (not bool)
                fail(f"malformed segment: a chunk of {p.get('name')!r}")
            if off < 0 or plen < 0 or vlen < 0 or off + plen + vlen > length:
                fail(f"malformed segment: a chunk of {p.get('name')!r} lies outside its segment")
            c = dict(c)
            c["off"] = start + off
            chunks.append(c)
        t = self._open_tensor
        if t is None:
            t = dict(p)
            del t["chunks"], t["last"]
            t["chunks"] = []
            if self.tensors and self.tensors[-1].get("name") == t.get("name"):
                fail(f"malformed segment: tensor {t.get('name')!r} again after its last piece")
            self._open_tensor = t
        elif p.get("name") != t.get("name") or any(p.get(k) != t.get(k) for k in self._SAME):
            fail(f"malformed segment: tensor {t.get('name')!r} ends without its last piece")
        t["chunks"].extend(chunks)
        if p["last"]:
            t["target_digest"] = p.get("target_digest")
            if "target_digest" not in p:
                t.pop("target_digest", None)
            if t.get("kind") == "removed" and not t["chunks"]:
                del t["chunks"]  # as version 2 writes a removed tensor
            self.tensors.append(t)
            self._open_tensor = None
        elif "target_digest" in p:
            fail(f"malformed segment: tensor {t.get('name')!r}: a target digest before its last piece")

    def header(self) -> dict:
        assert self.opened is not None and self.closed is not None
        closed = {k: v for k, v in self.closed.items() if k != "tensors"}
        return {**self.opened, **closed, "tensors": self.tensors}


def _failing(name: str) -> Callable[[str], NoReturn]:
    """``fail(why)``: raises ``DeltaFormatError`` naming the object ``name``."""
    def fail(why: str) -> NoReturn:
        raise DeltaFormatError(f"{name}: {why}")
    return fail


class SegmentStream:
    """A version-3 object read while it arrives in ``buf`` (its first ``filled`` bytes there):
    ``ready(filled)`` -> a reader of each segment complete by then, in order, its chunks only
    (a tensor's piece: apply with ``verify=False``, which checks each chunk's pre-image; the
    tensor digests need the whole tensor). A tensor sent whole (``full``: new, or a keyframe's)
    comes once its last piece is there. The segments are checked as they come, as
    ``DeltaReader`` checks them; the whole object still is, once it is all there
    (``DeltaReader.open``). ``streamable`` is False for an object of version 1 or 2."""

    def __init__(self, buf, name: str = "<delta>"):
        self.buf, self.name = buf, name
        self.pos = PREAMBLE.size
        # a function of the name, not a bound method: the merger keeps it, and a cycle through
        # self would keep the download's buffer until a garbage collection, not until let go
        self._fail = _failing(name)
        self.merger = SegmentMerger(self._fail)
        self.streamable: bool | None = None  # known once the preamble is in
        self.version = 0
        self._full: dict | None = None  # a tensor sent whole, its pieces so far

    def ready(self, filled: int) -> Iterator[DeltaReader]:
        """The readers of the segments complete within the first ``filled`` bytes, in order,
        each parsed when the caller takes it (a part all there: its first segment is applied
        while the rest are still to be parsed)."""
        if self.streamable is None:
            if filled < PREAMBLE.size:
                return
            magic, number, _ = PREAMBLE.unpack_from(self.buf, 0)
            if magic != MAGIC:
                self._fail("not a nemo-dcr delta (bad magic)")
            self.streamable, self.version = number >= SEGMENTED and number in VERSIONS, number
        if not self.streamable:
            return
        limit = len(self.buf) - TRAILER.size
        while self.pos + SEGMENT.size <= min(filled, limit) and self.merger.closed is None:
            stored_len, _, _, payload_len = SEGMENT.unpack_from(self.buf, self.pos)
            if self.pos + SEGMENT.size + stored_len + payload_len > filled:
                break  # not all there yet (read_segment checks the lengths against the object)
            index, start, self.pos = read_segment(self.buf, self.pos, limit, self._fail)
            self.merger.add(index, start, self.pos - start)
            pieces = index.get("tensors")
            if not pieces:
                continue
            assert self.merger.opened is not None  # add() refuses tensors before the opening segment
            entries = []
            for p in pieces:  # as the merger made them absolute; target digests on last pieces only
                e = {k: v for k, v in p.items() if k not in ("last", "chunks")}
                e["chunks"] = [{**c, "off": start + c["off"]} for c in p["chunks"]]
                if e.get("kind") == "full":  # written whole (it may be new): its pieces wait for its last
                    if self._full is not None:
                        e["chunks"] = self._full["chunks"] + e["chunks"]
                    if not p["last"]:
                        self._full = e
                        continue
                    self._full = None
                if e.get("kind") != "removed":
                    e.setdefault("target_digest", "")
                entries.append(e)
            if not entries:
                continue
            header = parse_header({**self.merger.opened, "tensors": entries}, self.pos, VERSIONS[self.version])
            yield DeltaReader.of_segment(self.buf, header, self.version, self.name)

    def wanted(self, filled: int) -> int:
        """With the first ``filled`` bytes there: how many must be there before ``ready`` can
        give another segment (a receiver waits for those, not for each read of its download)."""
        if self.streamable is False or self.merger.closed is not None \
                or self.pos + SEGMENT.size > len(self.buf) - TRAILER.size:
            return len(self.buf) + 1  # nothing more to give: what comes is the end of the download
        if self.streamable is None or self.pos + SEGMENT.size > filled:
            return min(len(self.buf), max(PREAMBLE.size, self.pos + SEGMENT.size))
        stored_len, _, _, payload_len = SEGMENT.unpack_from(self.buf, self.pos)
        return min(len(self.buf), self.pos + SEGMENT.size + stored_len + payload_len)

    def finish(self) -> list[str]:
        """Once the whole object is there (its size and sha256 checked) and every segment was
        taken: what ``DeltaReader.open`` checks beyond the segments (the closing segment last, the
        trailer) -> the names of its tensors, in order. The object is not parsed a second time."""
        limit = len(self.buf) - TRAILER.size
        if not self.streamable or self.merger.closed is None or self.pos != limit:
            self._fail("truncated or damaged: no closing segment where the trailer begins")
        nseg = read_trailer(self.buf, len(self.buf), self.version, self._fail)
        if self.merger.count != nseg:
            self._fail(f"the trailer counts {nseg} segments, the object holds {self.merger.count}")
        names = [t["name"] for t in self.merger.tensors]
        if len(set(names)) != len(names):
            self._fail("a tensor named twice")
        for t in self.merger.tensors:  # (each piece was parsed: the order across a tensor's pieces)
            end = 0
            for c in t.get("chunks", ()):
                if c["start"] < end:
                    self._fail(f"{t['name']}: chunk range")
                end = c["start"] + c["n"]
        return names
