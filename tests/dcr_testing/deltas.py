"""Crafted deltas for the tests: a real delta with its header (or payload bytes) changed and every
checksum made valid again, in the delta's own format version, so that what a test changes is what
the reader sees."""
from __future__ import annotations

import copy
import io
import json
import zlib

import zstandard

from nemo_dcr.codec.format import END_MAGIC, PREAMBLE, SEGMENT, SEGMENTED, TRAILER, DeltaReader, DeltaWriter


def rewrite(blob: bytes, header: dict, area: bytes | None = None) -> bytes:
    """``blob`` with ``header`` (``DeltaReader.raw_header`` changed: chunk offsets count from the
    start of ``blob``) and, when given, ``area`` in place of the bytes between its preamble and
    ``payload_end``; every checksum valid.

    Versions 1 and 2: the area as it is, then the header. Version 3: an opening segment, one
    segment of every tensor whose payloads are the chunks' bytes (where ``blob``'s own header
    puts them) back to back, and the closing segment; an offset the change moved stays moved by
    as much (``off=0`` then points before the payloads, as it points into the preamble in
    version 2)."""
    r = DeltaReader(blob)
    area = bytes(r.buf[PREAMBLE.size:r.payload_end]) if area is None else area
    if r.version < SEGMENTED:
        out = io.BytesIO()
        w = DeltaWriter(out, r.version)
        w.add_payload(area)
        w.finish(header)
        return out.getvalue()
    payload = bytearray()
    where: dict = {}  # (tensor, chunk) -> (its offset in blob, in the new payloads)
    for i, t in enumerate(r.raw_header["tensors"]):
        for j, c in enumerate(t.get("chunks", ())):
            where[i, j] = (c["off"], len(payload))
            lo = c["off"] - PREAMBLE.size
            payload += area[lo:lo + c["plen"] + c["vlen"]]
    h = copy.deepcopy(header)
    tensors = h.pop("tensors", None)
    close = {k: h.pop(k) for k in ("base_digest", "target_digest") if k in h}
    pieces = tensors
    if isinstance(tensors, list):
        pieces = [_piece(t, i, where) for i, t in enumerate(tensors)]
        close["tensors"] = len(tensors)
    out = bytearray(PREAMBLE.pack(*PREAMBLE.unpack_from(blob, 0)))
    segments = [({"open": h}, b""), ({"tensors": pieces}, bytes(payload)), ({"close": close}, b"")]
    for index, data in segments:
        raw = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
        stored = zstandard.ZstdCompressor().compress(raw)
        out += SEGMENT.pack(len(stored), len(raw), zlib.crc32(stored), len(data)) + stored + data
    return bytes(out + TRAILER.pack(r.version, len(segments), END_MAGIC))


def _piece(t, i: int, where: dict):
    """Tensor entry ``i`` as a version-3 piece (its last), offsets moved into the new payloads."""
    if not isinstance(t, dict):
        return t
    t = dict(t)
    chunks = t.get("chunks", [])
    if isinstance(chunks, list):
        t["chunks"] = [_moved(c, where.get((i, j))) for j, c in enumerate(chunks)]
    t["last"] = True
    return t


def _moved(c, at):
    if not isinstance(c, dict) or at is None or not isinstance(c.get("off"), int) or isinstance(c["off"], bool):
        return c
    old, new = at
    return {**c, "off": new + c["off"] - old}


def same_delta(a: bytes, b: bytes) -> None:
    """Assert that two deltas are equal but for when and in which publish they were written:
    every header field and every payload byte. (Version 3's chunk offsets move with the length
    of its opening segment, which holds the creation time: compared as payloads, not offsets.)"""
    ra, rb = DeltaReader(a), DeltaReader(b)
    assert ra.version == rb.version
    ha, hb = copy.deepcopy(ra.raw_header), copy.deepcopy(rb.raw_header)
    for h in (ha, hb):  # when and in which publish: the rest must be equal
        h.pop("created"), h.get("meta", {}).pop("publish_id", None)
    if ra.version < SEGMENTED:
        assert bytes(ra.buf[:ra.payload_end]) == bytes(rb.buf[:rb.payload_end])
    else:
        for r, h in ((ra, ha), (rb, hb)):
            for t in h["tensors"]:
                for c in t.get("chunks", ()):
                    off = c.pop("off")
                    c["payload"] = bytes(r.buf[off:off + c["plen"] + c["vlen"]])
    assert ha == hb
