"""Decompression is capped by what the header declares (issue 14, decoder hardening): a zstd bomb --
a frame that does not declare its content size and expands to 1 GiB -- in place of a chunk's
4 KiB value stream is a DeltaFormatError raised when the delta is opened (before the first
write: every frame a writer makes declares its size, so one that does not is refused unread), and
the process that reads it never holds more than a few MB more than before (measured in a fresh
process, whose peak RSS is not hidden by an earlier test's)."""
import io
import json
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
import zstandard

from nemo_dcr import DeltaFormatError, DeltaReader, apply, diff
from nemo_dcr.codec.chunk import unpack
from nemo_dcr.codec.format import PREAMBLE, DeltaWriter

GIB = 1 << 30


def bomb(size: int = GIB) -> bytes:
    """A zstd frame of ``size`` zero bytes that does not declare its content size (~32 KB)."""
    c = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    out, block = bytearray(), bytes(1 << 24)
    for _ in range(size // len(block)):
        out += c.compress(block)
    out += c.flush()
    assert zstandard.frame_content_size(bytes(out)) == -1
    return bytes(out)


def bombed_delta(frame: bytes):
    """A real xor delta of one float32 tensor whose zstd value stream is replaced by ``frame``
    (the header's vraw kept, every checksum valid)."""
    g = torch.Generator().manual_seed(0)
    base = torch.zeros(4096)
    target = base.clone()
    target[torch.randperm(4096, generator=g)[:1024]] = torch.randn(1024, generator=g)
    # (version 2's container: one payload area; the frames are checked alike in every version)
    blob = diff({"w": base}, {"w": target}, encoding="xor", chunk_elems=4096, workers=1, format_version=2)
    r = DeltaReader(blob)
    h = json.loads(json.dumps(r.raw_header))
    (c,) = h["tensors"][0]["chunks"]
    assert c["vz"], "the value stream must be zstd-compressed for this test"
    lo = c["off"]
    pos = bytes(r.buf[lo:lo + c["plen"]])
    c.update(vlen=len(frame), crc=zlib.crc32(frame, zlib.crc32(pos)))
    out = io.BytesIO()
    w = DeltaWriter(out, 2)
    w.add_payload(pos + frame)
    c["off"] = PREAMBLE.size
    w.finish(h)
    return base, blob, out.getvalue(), c["vraw"]


def test_unpack_refuses_frames_that_do_not_declare_their_size():
    with pytest.raises(DeltaFormatError, match="does not declare its content size"):
        unpack(bomb(64 << 20), True, 4096)
    with pytest.raises(DeltaFormatError, match="does not declare its content size"):
        unpack(zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 4096), True, 4096)
    assert unpack(zstandard.ZstdCompressor().compress(b"x" * 4096), True, 4096) == b"x" * 4096


def test_a_zstd_bomb_in_a_delta_is_refused_without_allocating_it(tmp_path):
    base, honest, bad, vraw = bombed_delta(bomb())
    assert vraw <= 4096 * 4 and len(bad) < 100_000
    recv = {"w": base.clone()}
    with pytest.raises(DeltaFormatError, match="does not declare its content size"):
        apply(recv, bad, workers=1)
    assert torch.equal(recv["w"], base)  # nothing written
    (tmp_path / "bad.dcr").write_bytes(bad)
    (tmp_path / "ok.dcr").write_bytes(honest)
    script = textwrap.dedent(f"""
        import json, resource, torch
        from nemo_dcr import DeltaFormatError, apply
        recv = {{"w": torch.zeros(4096)}}
        apply({{"w": torch.zeros(4096)}}, {str(tmp_path / 'ok.dcr')!r}, workers=1)  # warm: every import, pool
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            apply(recv, {str(tmp_path / 'bad.dcr')!r}, workers=1)
            err = None
        except DeltaFormatError as e:
            err = str(e)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(json.dumps({{"error": err, "grew_kb": grew, "untouched": int(recv["w"].count_nonzero()) == 0}}))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["error"] is not None and res["untouched"], res
    assert res["grew_kb"] < 64 * 1024, res  # the frame would expand to 1 GiB
