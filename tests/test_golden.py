"""Golden files: deltas written by an earlier build (tests/data/golden/, made by
tests/data/make_golden.py) must still apply bit-exactly, and encoding the same inputs again must
give the same bytes, so the format cannot change by accident."""
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


@pytest.fixture(scope="module")
def inputs():
    return G.load_inputs(GOLDEN)


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """Every golden delta encoded again by this build."""
    return G.encode_all(GOLDEN, str(tmp_path_factory.mktemp("golden")))


def golden(name: str) -> bytes:
    with open(os.path.join(GOLDEN, name), "rb") as f:
        return f.read()


def test_golden_set_is_complete():
    assert sorted(DELTAS) == sorted(n for n in os.listdir(GOLDEN) if n.endswith(".dcr"))


@pytest.mark.parametrize("encoding", G.ENCODINGS)
def test_golden_delta_applies_bit_exactly(encoding, inputs):
    base, target, _, _ = inputs
    r = DeltaReader.open(os.path.join(GOLDEN, f"{encoding}.dcr"))
    assert r.header.encoding == encoding
    state = {k: v.clone() for k, v in base.items()}
    report = apply(state, r)
    assert_state(state, target)
    assert report.tensors_removed == ["old_head.fp32"]


def test_golden_encodings_cover_every_chunk_coding():
    """The set holds every chunk coding at least once (else a coding could change unnoticed)."""
    seen = set()
    for name in DELTAS:
        for t in DeltaReader.open(os.path.join(GOLDEN, name)).header.tensors:
            seen.update(c.enc for c in t.chunks)
    assert seen == {"classes", "xor", "add", "overwrite"}


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_golden_shard_deltas_apply_to_a_whole_tensor(order, inputs):
    """Two ranks' row shards, encoded alone, applied (in either order) to a receiver holding the
    whole tensor; then each applied to a receiver holding just that shard."""
    _, _, sb, st = inputs
    whole = {"big": sb["big"].clone()}
    for r in order:
        apply(whole, os.path.join(GOLDEN, f"shard{r}.dcr"))
    assert_state(whole, st)
    for r, (off, rows) in enumerate(G.SHARD_ROWS):
        spec = ShardSpec.of(tuple(sb["big"].shape), (off, 0), (rows, sb["big"].shape[1]))
        part = {"big": sb["big"][off:off + rows].clone()}
        apply(part, os.path.join(GOLDEN, f"shard{r}.dcr"), shards={"big": spec})
        assert_state(part, {"big": st["big"][off:off + rows]})


def test_golden_cli_delta_rebuilds_the_target_file(tmp_path):
    """The delta `nemo-dcr diff` wrote applies to the base file and rebuilds the target file byte for byte."""
    out = tmp_path / "out.safetensors"
    apply_checkpoint(os.path.join(GOLDEN, "base.safetensors"), os.path.join(GOLDEN, "cli_diff.dcr"), str(out))
    assert out.read_bytes() == golden("target.safetensors")
    assert_state(load_file(out), load_file(os.path.join(GOLDEN, "target.safetensors")))


FOOTER = struct.Struct("<QQII8s")  # docs/format.md: header stored length, raw length, crc32, version, end magic


def _split(blob: bytes):
    """-> (preamble and chunk payloads, header dict): the bytes before the stored header, by the
    footer as docs/format.md defines it, and the header as the reader decodes it."""
    stored_len = FOOTER.unpack_from(blob, len(blob) - FOOTER.size)[0]
    return blob[:len(blob) - FOOTER.size - stored_len], DeltaReader.open(blob).raw_header  # the JSON as written


@pytest.mark.parametrize("name", DELTAS)
def test_encoding_again_gives_the_golden_bytes(name, encoded):
    old, new = golden(name), encoded[name]
    (old_payload, old_header), (new_payload, new_header) = _split(old), _split(new)
    # "tool" names the release that wrote the delta; every other field is the format
    strip = lambda h: json.dumps({k: v for k, v in h.items() if k != "tool"}, sort_keys=True, indent=1)  # noqa: E731
    assert strip(new_header) == strip(old_header), f"{name}: header differs from the golden file"
    assert new_payload == old_payload, f"{name}: chunk payload bytes differ from the golden file"
    if new_header["tool"] == old_header["tool"]:
        assert new == old


@pytest.mark.parametrize("encoding", ["classes", "auto"])
def test_reference_codec_matches_the_golden_bytes(encoding, inputs, monkeypatch):
    """With the C kernel off, the PyTorch reference decodes the golden ``classes`` chunks and
    writes the same bytes again (the reference defines them; the kernel repeats them)."""
    from nemo_dcr import diff
    from nemo_dcr.codec import native
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", True)
    assert native.backend() == "reference"
    base, target, _, _ = inputs
    state = {k: v.clone() for k, v in base.items()}
    apply(state, os.path.join(GOLDEN, f"{encoding}.dcr"))
    assert_state(state, target)
    with G.pinned_clock():
        again = diff(base, target, encoding=encoding, chunk_elems=G.CHUNK, workers=1)
    assert _split(again)[0] == _split(golden(f"{encoding}.dcr"))[0]


def test_encoder_threads_do_not_change_the_bytes(inputs):
    """The golden files were encoded on one thread; four threads give the same payload bytes."""
    from nemo_dcr import diff
    base, target, _, _ = inputs
    with G.pinned_clock():
        again = diff(base, target, encoding="auto", chunk_elems=G.CHUNK, workers=4)
    assert _split(again)[0] == _split(golden("auto.dcr"))[0]
