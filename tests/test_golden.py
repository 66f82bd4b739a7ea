"""Golden files: deltas written by an earlier build (tests/data/golden/ for format version 1,
tests/data/golden_v2/ for version 2, tests/data/golden_v3/ to golden_v5/ for versions 3 to 5, made by
tests/data/make_golden.py from the same inputs) must
still apply bit-exactly, and encoding the same inputs again in the same version must give the
same bytes, so the format cannot change by accident."""
from __future__ import annotations

import importlib.util
import json
import os
import struct

import pytest
from safetensors.torch import load_file

from dcr_testing import assert_state
from nemo_dcr import DeltaReader, ShardSpec, apply
from nemo_dcr.checkpoint.files import apply_checkpoint

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
GOLDEN = os.path.join(DATA, "golden")

_spec = importlib.util.spec_from_file_location("make_golden", os.path.join(DATA, "make_golden.py"))
G = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(G)

DELTAS = [f"{e}.dcr" for e in G.ENCODINGS] + [f"shard{r}.dcr" for r in range(len(G.SHARD_ROWS))] + ["cli_diff.dcr"]
VERSIONS = G.VERSIONS


@pytest.fixture(scope="module")
def inputs():
    return G.load_inputs(GOLDEN)


@pytest.fixture(scope="module", params=VERSIONS)
def encoded(request, tmp_path_factory):
    """(version, every golden delta of that format version encoded again by this build)."""
    return request.param, G.encode_all(GOLDEN, str(tmp_path_factory.mktemp("golden")), version=request.param)


def golden(name: str, version: int = 1) -> bytes:
    with open(os.path.join(G.deltas_dir(version), name), "rb") as f:
        return f.read()


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_set_is_complete(version):
    d = G.deltas_dir(version)
    assert sorted(DELTAS) == sorted(n for n in os.listdir(d) if n.endswith(".dcr"))
    assert {DeltaReader.open(os.path.join(d, n)).version for n in DELTAS} == {version}


def test_golden_versions_differ_only_in_their_digests():
    """Version 2 is version 1 with BLAKE3 digests: same chunk payload bytes, same header apart
    from the format number and the digests (tensor digests, chunk pre/post, the state digests
    over them), and every digest of each is the algorithm its version names. Version 3 is version
    2 in segments with summed tensor digests: the same chunks, payloads and chunk digests (its
    offsets differ: each segment's index sits before its payloads). Version 4 is version 3 with
    the tensor digests keyed by name (``sdn:``): the same segments but for the digests; version 5
    is version 4 with them under the state digest's definition 2 (``sdb:``)."""
    def no_digests(blob, chunk_digests=True):
        h = json.loads(json.dumps(DeltaReader.open(blob).raw_header))
        for k in ("format", "tool", "base_digest", "target_digest"):
            h.pop(k, None)
        for t in h["tensors"]:
            t.pop("base_digest", None), t.pop("target_digest", None)
            for c in t.get("chunks", []):  # (a removed tensor has none)
                c.pop("off")
                if chunk_digests:
                    c.pop("pre"), c.pop("post")
        return h
    for name in DELTAS:
        v1, v2, v3, v4, v5 = (golden(name, v) for v in (1, 2, 3, 4, 5))
        assert len({_split(v)[0][16:] for v in (v1, v2, v3, v4, v5)}) == 1, name
        assert no_digests(v1) == no_digests(v2), name
        assert no_digests(v2, False) == no_digests(v3, False) == no_digests(v4, False) == no_digests(v5, False), name
        for blob, prefix in ((v1, "sha256:"), (v2, "blake3:"), (v3, "sd:"), (v4, "sdn:"), (v5, "sdb:")):
            for t in DeltaReader.open(blob).header.tensors:
                assert all(d.startswith(prefix) for d in (t.base_digest, t.target_digest) if d), (name, t.name)


@pytest.mark.parametrize("version", [v for v in VERSIONS if v >= 3])
def test_golden_v3_indexes_come_before_their_chunks(version):
    """From version 3 every chunk's payload lies after the index that lists it: a reader that
    has the object's first N bytes knows every chunk that ends within them."""
    from nemo_dcr.codec.format import PREAMBLE, read_segment
    for name in DELTAS:
        blob = golden(name, version)
        pos, spans = PREAMBLE.size, []
        while pos < len(blob) - 16:
            index, start, pos = read_segment(blob, pos, len(blob) - 16, AssertionError)
            spans.append((start - 16, start, pos))  # the index (at most), its payloads
        chunks = [c for t in DeltaReader.open(blob).header.tensors for c in t.chunks]
        assert chunks
        for c in chunks:
            assert any(idx_end <= c.off and c.off + c.payload_len <= end for _, idx_end, end in spans), name


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("encoding", G.ENCODINGS)
def test_golden_delta_applies_bit_exactly(encoding, version, inputs):
    base, target, _, _ = inputs
    r = DeltaReader.open(os.path.join(G.deltas_dir(version), f"{encoding}.dcr"))
    assert r.header.encoding == encoding
    state = {k: v.clone() for k, v in base.items()}
    report = apply(state, r)
    assert_state(state, target)
    assert report.tensors_removed == ["old_head.fp32"]


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_encodings_cover_every_chunk_coding(version):
    """The set holds every chunk coding at least once (else a coding could change unnoticed)."""
    seen = set()
    for name in DELTAS:
        for t in DeltaReader.open(os.path.join(G.deltas_dir(version), name)).header.tensors:
            seen.update(c.enc for c in t.chunks)
    assert seen == {"classes", "xor", "add", "overwrite"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_golden_shard_deltas_apply_to_a_whole_tensor(order, version, inputs):
    """Two ranks' row shards, encoded alone, applied (in either order) to a receiver holding the
    whole tensor; then each applied to a receiver holding just that shard."""
    _, _, sb, st = inputs
    whole = {"big": sb["big"].clone()}
    for r in order:
        apply(whole, os.path.join(G.deltas_dir(version), f"shard{r}.dcr"))
    assert_state(whole, st)
    for r, (off, rows) in enumerate(G.SHARD_ROWS):
        spec = ShardSpec.of(tuple(sb["big"].shape), (off, 0), (rows, sb["big"].shape[1]))
        part = {"big": sb["big"][off:off + rows].clone()}
        apply(part, os.path.join(G.deltas_dir(version), f"shard{r}.dcr"), shards={"big": spec})
        assert_state(part, {"big": st["big"][off:off + rows]})


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_cli_delta_rebuilds_the_target_file(tmp_path, version):
    """The delta `nemo-dcr diff` wrote applies to the base file and rebuilds the target file byte for byte."""
    out = tmp_path / "out.safetensors"
    apply_checkpoint(os.path.join(GOLDEN, "base.safetensors"), os.path.join(G.deltas_dir(version), "cli_diff.dcr"),
                     str(out))
    assert out.read_bytes() == golden("target.safetensors")
    assert_state(load_file(out), load_file(os.path.join(GOLDEN, "target.safetensors")))


FOOTER = struct.Struct("<QQII8s")  # docs/format.md: header stored length, raw length, crc32, version, end magic


def _split(blob: bytes):
    """-> (preamble and chunk payloads, header dict): the bytes before the stored header, by the
    footer as docs/format.md defines it, and the header as the reader decodes it. Version 3
    (segments, each index before its payloads): the preamble and every chunk's payload in order."""
    r = DeltaReader.open(blob)
    if r.version >= 3:
        return blob[:16] + b"".join(bytes(r.payload(c)) for t in r.header.tensors for c in t.chunks), r.raw_header
    stored_len = FOOTER.unpack_from(blob, len(blob) - FOOTER.size)[0]
    return blob[:len(blob) - FOOTER.size - stored_len], r.raw_header  # the JSON as written


@pytest.mark.parametrize("name", DELTAS)
def test_encoding_again_gives_the_golden_bytes(name, encoded):
    version, blobs = encoded
    old, new = golden(name, version), blobs[name]
    (old_payload, old_header), (new_payload, new_header) = _split(old), _split(new)
    # "tool" names the release that wrote the delta; every other field is the format
    strip = lambda h: json.dumps({k: v for k, v in h.items() if k != "tool"}, sort_keys=True, indent=1)  # noqa: E731
    assert new_payload == old_payload, f"{name}: chunk payload bytes differ from the golden file"
    if version >= 3:
        # each segment's index as decoded, in order: the same segments listing the same pieces,
        # chunk offsets relative to their segment's payloads. Not the indexes' zstd bytes (the
        # goldens' were compressed at level 15, writers now use SEGMENT_LEVEL: codec/format.py;
        # any level decodes), nor so the absolute offsets the reader derives from their lengths
        assert _indexes(new) == _indexes(old), f"{name}: segments differ from the golden file"
        return
    assert strip(new_header) == strip(old_header), f"{name}: header differs from the golden file"
    if new_header["tool"] == old_header["tool"]:
        assert new == old


def _indexes(blob: bytes) -> list:
    """A version-3 delta's segment indexes in order, as decoded (the opening one without "tool")."""
    from nemo_dcr.codec.format import PREAMBLE, read_segment
    pos, out = PREAMBLE.size, []
    while pos < len(blob) - 16:
        index, _, pos = read_segment(blob, pos, len(blob) - 16, AssertionError)
        if "open" in index:
            index = {"open": {k: v for k, v in index["open"].items() if k != "tool"}}
        out.append(index)
    return out


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("encoding", ["classes", "auto"])
def test_reference_codec_matches_the_golden_bytes(encoding, version, inputs, monkeypatch):
    """With the C kernel off, the PyTorch reference decodes the golden ``classes`` chunks and
    writes the same bytes again (the reference defines them; the kernel repeats them)."""
    from nemo_dcr import diff
    from nemo_dcr.codec import native
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", True)
    assert native.backend() == "reference"
    base, target, _, _ = inputs
    state = {k: v.clone() for k, v in base.items()}
    apply(state, os.path.join(G.deltas_dir(version), f"{encoding}.dcr"))
    assert_state(state, target)
    with G.pinned_clock():
        again = diff(base, target, encoding=encoding, chunk_elems=G.CHUNK, workers=1, format_version=version)
    assert _split(again)[0] == _split(golden(f"{encoding}.dcr", version))[0]


@pytest.mark.parametrize("version", VERSIONS)
def test_encoder_threads_do_not_change_the_bytes(inputs, version):
    """The golden files were encoded on one thread; four threads give the same payload bytes."""
    from nemo_dcr import diff
    base, target, _, _ = inputs
    with G.pinned_clock():
        again = diff(base, target, encoding="auto", chunk_elems=G.CHUNK, workers=4, format_version=version)
    assert _split(again)[0] == _split(golden("auto.dcr", version))[0]
