"""The delta header's parse (codec/header.py, codec/format.py's SegmentMerger): the typed entries
it builds, and the malformed headers it refuses, with the message naming what is wrong."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from nemo_dcr import DeltaReader, diff
from nemo_dcr.codec.format import SegmentMerger
from nemo_dcr.codec.header import ChunkEntry, TensorEntry, parse_header
from nemo_dcr.codec.versions import VERSIONS
from nemo_dcr.errors import DeltaFormatError


def _reader() -> DeltaReader:
    """A delta of every tensor kind: two changed (BF16 and FP32), one added, one removed."""
    g = torch.Generator().manual_seed(7)
    base = {"a": torch.randn(5000, generator=g).bfloat16(), "b": torch.randn(300, generator=g),
            "gone": torch.zeros(4)}
    target = {"a": base["a"].clone(), "b": base["b"].clone(), "new": torch.arange(6, dtype=torch.int32)}
    target["a"][::37] += 1
    target["b"][:10] = 0
    return DeltaReader.open(diff(base, target, encoding="classes"))


def test_the_parsed_entries_are_what_their_constructors_make():
    """The parse builds its frozen entries without their ``__init__`` (``_built``): each holds
    exactly its dataclass's fields, equals the constructor's copy of it and stays frozen (a field
    added to the dataclass but not to the parse fails here)."""
    r = _reader()
    kinds, encodings = set(), set()
    for t in r.header.tensors:
        kinds.add(t.kind.value)
        assert set(vars(t)) == {f.name for f in dataclasses.fields(TensorEntry)}
        assert dataclasses.replace(t) == t
        for c in t.chunks:
            encodings.add(c.enc)
            assert set(vars(c)) == {f.name for f in dataclasses.fields(ChunkEntry)}
            assert dataclasses.replace(c) == c
        with pytest.raises(dataclasses.FrozenInstanceError):
            t.name = "other"  # type: ignore[misc]
    assert kinds == {"delta", "full", "removed"}
    assert {"classes", "overwrite"} <= encodings


def _refused(r: DeltaReader, edit) -> str:
    h = copy.deepcopy(r.raw_header)
    edit({t["name"]: t for t in h["tensors"]})
    with pytest.raises(DeltaFormatError) as e:
        parse_header(h, r.payload_end, VERSIONS[r.version])
    return str(e.value)


def test_malformed_tensor_entries_are_refused_with_what_is_wrong():
    r = _reader()
    parse_header(copy.deepcopy(r.raw_header), r.payload_end, VERSIONS[r.version])  # as written: fine

    def chunks_not_a_list(ts):
        ts["a"]["chunks"] = {}

    def chunk_twice(ts):
        ts["a"]["chunks"].append(dict(ts["a"]["chunks"][0]))

    def full_chunk_short(ts):  # one element fewer than its range: a well-formed chunk, not dense
        c = ts["new"]["chunks"][0]
        c.update(k=c["n"] - 1, vraw=(c["n"] - 1) * 4)
        if not c["vz"]:
            c["vlen"] = c["vraw"]

    def full_without_chunks(ts):
        ts["new"]["chunks"] = []

    assert _refused(r, chunks_not_a_list).endswith("a: chunks")
    assert _refused(r, chunk_twice).endswith("a: chunk range")
    assert _refused(r, full_chunk_short).endswith("new: full tensor chunks must be dense and contiguous")
    assert _refused(r, full_without_chunks).endswith("new: full tensor not covered")


def _merger() -> SegmentMerger:
    def fail(why):
        raise DeltaFormatError(why)
    m = SegmentMerger(fail)
    m.add({"open": {"format": 4}}, 0, 0)
    return m


def _piece(name: str, last: bool = True, **chunk) -> dict:
    return {"name": name, "kind": "delta", "chunks": [{"off": 4, "plen": 3, "vlen": 5, **chunk}], "last": last}


def test_segment_pieces_are_merged_with_their_offsets_made_absolute():
    m = _merger()
    m.add({"tensors": [_piece("a", last=False)]}, 100, 12)
    m.add({"tensors": [{**_piece("a"), "target_digest": "sdn:0"}]}, 200, 12)
    (t,) = m.tensors
    assert [c["off"] for c in t["chunks"]] == [104, 204]
    assert list(t) == ["name", "kind", "chunks", "target_digest"]
    assert t["target_digest"] == "sdn:0"


@pytest.mark.parametrize("chunk,why", [
    ({"vlen": True}, "a chunk of 'a'"),
    ({"off": "4"}, "a chunk of 'a'"),
    ({"plen": -1}, "a chunk of 'a' lies outside its segment"),
    ({"vlen": 6}, "a chunk of 'a' lies outside its segment"),
])
def test_a_chunk_outside_its_segment_or_not_of_integers_is_refused(chunk, why):
    with pytest.raises(DeltaFormatError, match=why):
        _merger().add({"tensors": [_piece("a", **chunk)]}, 100, 12)


def test_a_tensor_again_after_its_last_piece_is_refused():
    m = _merger()
    m.add({"tensors": [_piece("a")]}, 100, 12)
    with pytest.raises(DeltaFormatError, match="tensor 'a' again after its last piece"):
        m.add({"tensors": [_piece("a")]}, 200, 12)
