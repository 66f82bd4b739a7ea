"""Every size a delta declares is bounded before anything is allocated (issue 13, items 10 and 11).

Each test crafts a malicious delta with valid checksums; reading or applying it must be a
``DeltaFormatError`` (a one-line error for the CLI), raised before the receiver is touched, never
an ``OverflowError``/``MemoryError`` or gigabytes of allocation.
"""
from __future__ import annotations

import io
import struct
import zlib

import pytest
import torch
import zstandard

from dcr_testing import assert_bits_equal
from nemo_dcr import DcrError, DeltaFormatError, DeltaReader, apply, diff
from nemo_dcr.codec.format import END_MAGIC, FOOTER, FORMAT_VERSION, MAGIC, PREAMBLE, DeltaWriter
from nemo_dcr.codec.versions import VERSIONS

V2 = 2  # the deltas crafted here have version 2's container (header at the end); version 3's
#         segments are bounded the same way (tests/test_format_v3.py)


def craft(raw_header: dict, payloads: list[bytes]) -> bytes:
    """A delta with these payloads back to back and this header, every checksum valid."""
    out = io.BytesIO()
    w = DeltaWriter(out, V2)
    for p in payloads:
        w.add_payload(p)
    w.finish(raw_header)
    return out.getvalue()


def with_header_bytes(blob: bytes, raw: bytes) -> bytes:
    """``blob``'s payloads with a header whose raw JSON is ``raw`` (valid footer and crc)."""
    r = DeltaReader(blob)
    stored = zstandard.ZstdCompressor(level=3).compress(raw)
    return (bytes(r.buf[:r.payload_end]) + stored
            + FOOTER.pack(len(stored), len(raw), zlib.crc32(stored), V2, END_MAGIC))


def one_chunk_delta():
    """A delta of one float32 tensor with one xor chunk whose streams are zstd-compressed."""
    g = torch.Generator().manual_seed(0)
    base = torch.zeros(4096)
    target = base.clone()
    target[torch.randperm(4096, generator=g)[:300]] = 1.0
    blob = diff({"w": base}, {"w": target}, encoding="xor", chunk_elems=4096, workers=1, format_version=V2)
    r = DeltaReader(blob)
    (c,) = r.raw_header["tensors"][0]["chunks"]
    assert c["pz"] or c["vz"]
    return base, target, blob, r


def refused(blob: bytes, base: dict) -> DeltaFormatError:
    recv = {k: v.clone() for k, v in base.items()}
    with pytest.raises(DeltaFormatError) as ei:
        apply(recv, blob, workers=1)
    for k in base:
        assert_bits_equal(recv[k], base[k], k)
    return ei.value


@pytest.mark.parametrize("field,value", [("praw", 1 << 64), ("vraw", 1 << 63), ("praw", (1 << 63) - 1),
                                         ("n", 1 << 63), ("k", 1 << 63)])
def test_chunk_sizes_at_or_past_2_63_are_format_errors(field, value):
    base, _, blob, r = one_chunk_delta()
    h = r.raw_header
    h["tensors"][0]["chunks"][0][field] = value
    bad = craft(h, [bytes(r.buf[PREAMBLE.size:r.payload_end])])
    with pytest.raises(DeltaFormatError):
        DeltaReader(bad)
    refused(bad, {"w": base})


def _lying_frame(declared: int, content: bytes) -> bytes:
    """A zstd frame whose header declares ``declared`` bytes of content and holds ``content``
    in one raw block."""
    fhd = 0b11100000  # 8-byte frame content size, single segment
    block = struct.pack("<I", (len(content) << 3) | 1)[:3]  # last block, raw
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + struct.pack("<Q", declared) + block + content


@pytest.mark.parametrize("declared", [1 << 62, (1 << 40) + 3])
def test_zstd_frame_lying_about_its_content_size_is_a_format_error(declared):
    """The value stream is a zstd frame that declares far more content than the header's
    ``vraw``: zstd would allocate what the frame declares (MemoryError before)."""
    base, _, blob, r = one_chunk_delta()
    h = r.raw_header
    c = h["tensors"][0]["chunks"][0]
    payload = bytes(r.payload(r.header.tensors[0].chunks[0]))
    pos, val = payload[:c["plen"]], payload[c["plen"]:]
    real = zstandard.ZstdDecompressor().decompress(val) if c["vz"] else val
    frame = _lying_frame(declared, real)
    c.update(vz=True, vlen=len(frame), crc=zlib.crc32(frame, zlib.crc32(pos)))
    bad = craft(h, [pos + frame])
    err = refused(bad, {"w": base})
    assert "declares" in str(err)


def test_lying_frame_is_refused_by_the_reference_unpack_too():
    from nemo_dcr.codec.chunk import unpack
    with pytest.raises(DeltaFormatError):
        unpack(_lying_frame(1 << 62, b"abcd"), True, 4)
    assert unpack(_lying_frame(4, b"abcd"), True, 4) == b"abcd"  # an honest frame still decodes


def test_header_that_decompresses_far_beyond_its_stored_size_is_refused():
    """A few KB of stored header claiming 64 MiB of JSON (before: accepted, and a 2 GiB one
    took 4.4 GB and ~10 s)."""
    _, _, blob, r = one_chunk_delta()
    h = r.raw_header
    h["meta"] = {"pad": " " * (64 << 20)}
    import json
    raw = json.dumps(h, separators=(",", ":"), sort_keys=True).encode()
    bad = with_header_bytes(blob, raw)
    assert len(bad) < 64 << 10
    with pytest.raises(DeltaFormatError, match="header claims"):
        DeltaReader(bad)


@pytest.mark.parametrize("fv", [2, 3])
def test_header_raw_length_bound_leaves_real_headers_alone(fv):
    """Many tiny tensors (the most compressible real header there is) still open."""
    state = {f"layers.{i:05d}.bias": torch.zeros(1) for i in range(3000)}
    blob = diff({}, state, workers=1, format_version=fv)
    assert len(DeltaReader(blob).header.tensors) == 3000


def test_chunk_larger_than_the_headers_chunk_elems_is_refused():
    """A 20 KB delta whose one chunk claims 2^22 dense elements of a tensor (the header says
    chunks hold at most 1024): before, it applied at O(declared) memory."""
    n = 1 << 22
    vals = zstandard.ZstdCompressor(level=19).compress(bytes(4 * n))
    crc = zlib.crc32(vals)
    chunk = {"start": 0, "n": n, "k": n, "enc": "overwrite", "pos": "dense", "off": PREAMBLE.size, "plen": 0,
             "vlen": len(vals), "praw": 0, "vraw": 4 * n, "pz": False, "vz": True, "crc": crc, "pre": "",
             "post": "0" * 16}
    header = {"format": V2, "chunk_elems": 1024, "base_digest": "", "target_digest": "",
              "tensors": [{"name": "w", "kind": "full", "dtype": "float32", "shape": [n],
                           "region": {"offsets": [0], "shape": [n]}, "target_digest": "sha256:0", "chunks": [chunk]}],
              "meta": {}}
    bad = craft(header, [vals])
    assert len(bad) < 20 << 10
    with pytest.raises(DeltaFormatError, match="chunk_elems"):
        DeltaReader(bad)
    recv = {}
    with pytest.raises(DeltaFormatError):
        apply(recv, bad)
    assert recv == {}


@pytest.mark.parametrize("chunk_elems", [1 << 40, 0, True, 2.5])
def test_header_chunk_elems_out_of_range_is_refused(chunk_elems):
    _, _, blob, r = one_chunk_delta()
    h = r.raw_header
    h["chunk_elems"] = chunk_elems
    bad = craft(h, [bytes(r.buf[PREAMBLE.size:r.payload_end])])
    with pytest.raises(DeltaFormatError):
        DeltaReader(bad)


def test_value_stream_size_must_be_k_times_the_element_size():
    """``vraw`` is what the decoder allocates: it must be exactly ``k * w``."""
    base, _, blob, r = one_chunk_delta()
    h = r.raw_header
    c = h["tensors"][0]["chunks"][0]
    c["vraw"] = c["vraw"] * 1000
    bad = craft(h, [bytes(r.buf[PREAMBLE.size:r.payload_end])])
    with pytest.raises(DeltaFormatError, match="value stream"):
        DeltaReader(bad)


@pytest.mark.parametrize("shape", [[True, 16], [1 << 40, 1 << 40], [1] * 65])
def test_tensor_shapes_are_bounded(shape):
    _, _, blob, r = one_chunk_delta()
    h = r.raw_header
    t = h["tensors"][0]
    t["shape"] = shape
    t["region"] = {"offsets": [0] * len(shape), "shape": shape}
    bad = craft(h, [bytes(r.buf[PREAMBLE.size:r.payload_end])])
    with pytest.raises(DeltaFormatError):
        DeltaReader(bad)


def test_diff_refuses_chunks_a_reader_would_refuse():
    with pytest.raises(DcrError, match="chunk_elems"):
        diff({}, {"w": torch.zeros(4)}, chunk_elems=1 << 40)


def test_typed_header_is_what_the_writer_wrote():
    """The typed model parses exactly the JSON the writer wrote (and that JSON is unchanged)."""
    base, target, blob, r = one_chunk_delta()
    h, raw = r.header, r.raw_header
    (t,) = h.tensors
    (c,) = t.chunks
    rc = raw["tensors"][0]["chunks"][0]
    assert t.name == "w" and t.kind.value == raw["tensors"][0]["kind"] and t.dtype == "float32"
    assert t.shape == (4096,) and t.region.shape == (4096,) and t.target_digest == raw["tensors"][0]["target_digest"]
    assert {f: getattr(c, f) for f in rc} == rc
    assert h.chunk_elems == raw["chunk_elems"] and h.base_digest == raw["base_digest"]
    with pytest.raises(AttributeError):
        c.k = 3  # frozen
    recv = {"w": base.clone()}
    apply(recv, blob)
    assert_bits_equal(recv["w"], target)


def test_container_constants_unchanged():
    assert MAGIC == b"NDCRDLT\x00" and END_MAGIC == b"\x00TLDRCDN" and FORMAT_VERSION == 5
    assert sorted(VERSIONS) == [1, 2, 3, 4, 5]  # a reader still reads versions 1 to 5 (tests/test_golden.py)
    from nemo_dcr.codec.format import SEGMENT, TRAILER
    assert SEGMENT.format == "<IIII" and TRAILER.format == "<II8s"  # version 3 (docs/format.md)


def test_kernel_errors_are_dcr_errors(monkeypatch):
    """Asking for the C kernel where it is unavailable is a DcrError, not a RuntimeError."""
    from nemo_dcr.codec import classes, native
    monkeypatch.setattr(native, "lib", lambda: None)
    old = torch.zeros(8, dtype=torch.bfloat16).view(torch.int16)
    with pytest.raises(DcrError, match="C kernels unavailable"):
        classes.encode(old, old, classes.MANTISSA[torch.bfloat16], use_native=True)
    with pytest.raises(DcrError, match="C kernels unavailable"):
        classes.decode(old, [], b"", b"", 0, classes.MANTISSA[torch.bfloat16], use_native=True)
