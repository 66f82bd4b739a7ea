"""Corrupted, truncated and foreign deltas; wrong bases; re-delivery; interrupted applies.

Rules checked throughout:
* a damaged delta raises a ``DcrError`` subclass -- never another exception, never a hang --
  or (only for bytes nothing reads) still applies bit-exactly;
* ``DeltaFormatError`` and ``BaseMismatchError`` are raised before anything is written, so
  the receiver is untouched (values and the set of names).
"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from dcr_testing import deadline
from dcr_testing.deltas import rewrite
from nemo_dcr import (
    BaseMismatchError,
    DcrError,
    DeltaFormatError,
    DeltaReader,
    PartialApplyError,
    ShardSpec,
    TargetMismatchError,
    apply,
    diff,
)
from nemo_dcr.codec.format import FOOTER, PREAMBLE, TRAILER
from nemo_dcr.state.dtypes import int_view

# ----------------------------------------------------------------------------- helpers

def bits(t):
    return int_view(t).contiguous().clone()


def snapshot(state):
    return {k: (v.dtype, tuple(v.shape), bits(v)) for k, v in state.items()}


def unchanged(state, snap) -> bool:
    if set(state) != set(snap):
        return False
    return all(state[k].dtype == snap[k][0] and tuple(state[k].shape) == snap[k][1]
               and torch.equal(int_view(state[k]), snap[k][2]) for k in state)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(int_view(a), int_view(b))


def states_equal(a, b) -> bool:
    return set(a) == set(b) and all(same_bits(a[k], b[k]) for k in a)


def clone_state(s):
    return {k: v.clone() for k, v in s.items()}


def small_states(seed=0):
    """Base and target covering every entry kind: delta (several chunks, both encodings),
    delta without change, removed, added (full), dtype change (full)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(16, generator=g)
    b = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    b[2, 7] = 0.0  # row 2 is never touched by the delta: +0.0 and a NaN with a payload
    int_view(b)[2, 6] = 0x7FC1
    base = {
        "a": a,
        "b": b,
        "same": torch.arange(6, dtype=torch.int32),
        "gone": torch.tensor([1, -2, 3], dtype=torch.int8),
        "retyped": torch.ones(3, dtype=torch.float16),
    }
    ta = a.clone()
    ta[::3] += 1.0
    tb = b.clone()
    tb[1] = 0.25  # a whole row set to one value: overwrite wins there
    tb[3, ::2] = (tb[3, ::2].float() * 1.01).to(torch.bfloat16)
    target = {
        "a": ta,
        "b": tb,
        "same": base["same"].clone(),
        "new": torch.tensor([0.0, -0.0, float("nan"), float("inf")], dtype=torch.float16),
        "retyped": torch.ones(3, dtype=torch.float32),
    }
    return base, target


@pytest.fixture(scope="module")
def states():
    return small_states()


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def blob(states, request):
    """The delta in format version 2 (header at the end) and 3 (segments, the default)."""
    base, target = states
    return diff(base, target, chunk_elems=8, workers=1, format_version=request.param)


def rebuild(blob_bytes: bytes, mutate) -> bytes:
    """Same payloads, a header changed by ``mutate`` -- written with valid checksums, in the
    delta's own version."""
    h = copy.deepcopy(DeltaReader(blob_bytes).raw_header)
    mutate(h)
    return rewrite(blob_bytes, h)


def try_apply(state, delta, **kw):
    """Apply; return the exception (a DcrError) or None. Any other exception fails the test."""
    try:
        with deadline(20):
            apply(state, delta, workers=1, **kw)
    except DcrError as e:
        return e
    return None


# ----------------------------------------------------------------------------- sanity

def test_small_delta_is_sane(states, blob):
    base, target = states
    kinds = {t["name"]: t["kind"] for t in DeltaReader(blob).raw_header["tensors"]}
    assert kinds == {"a": "delta", "b": "delta", "same": "delta", "gone": "removed", "new": "full",
                     "retyped": "full"}
    encs = {c["enc"] for t in DeltaReader(blob).raw_header["tensors"] for c in t.get("chunks", ())}
    assert "overwrite" in encs and encs & {"xor", "add"} and encs <= {"xor", "add", "overwrite"}
    s = clone_state(base)
    apply(s, blob)
    assert states_equal(s, target)
    s = clone_state(base)  # rebuilt with its own header: the crafted deltas below differ by their change alone
    apply(s, rebuild(blob, lambda h: None))
    assert states_equal(s, target)


# ----------------------------------------------------------------------------- truncation

def test_every_truncation_raises_format_error(states, blob):
    base, _ = states
    recv = clone_state(base)
    snap = snapshot(recv)
    for n in range(len(blob)):
        with deadline(20):
            with pytest.raises(DeltaFormatError):
                apply(recv, blob[:n], workers=1)
            with pytest.raises(DeltaFormatError):
                DeltaReader(blob[:n])
        assert unchanged(recv, snap), n


def test_truncation_from_the_front_and_middle_raises_format_error(states, blob):
    base, _ = states
    recv = clone_state(base)
    snap = snapshot(recv)
    rng = random.Random(0)
    cuts = [blob[k:] for k in range(1, len(blob))]
    for _ in range(200):  # a range cut out of the middle
        i = rng.randrange(len(blob))
        j = rng.randrange(i + 1, len(blob) + 1)
        cuts.append(blob[:i] + blob[j:])
    cuts.append(blob + b"\0")  # trailing garbage moves the footer
    for c in cuts:
        with pytest.raises(DeltaFormatError):
            apply(recv, c, workers=1)
    assert unchanged(recv, snap)


# ----------------------------------------------------------------------------- bit flips

@pytest.mark.parametrize("mask", [0xFF, 0x01, 0x80])
def test_every_flipped_byte_is_caught_or_harmless(states, blob, mask):
    base, target = states
    flags = range(PREAMBLE.size - 4, PREAMBLE.size)  # u32 flags: read by nobody
    harmless = []
    for pos in range(len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= mask
        recv = clone_state(base)
        snap = snapshot(recv)
        err = try_apply(recv, bytes(bad))
        if err is None:
            assert states_equal(recv, target), f"flip at {pos} applied without error but wrongly"
            harmless.append(pos)
        else:
            # every other byte is under a checksum or a marker checked before the first write
            assert isinstance(err, DeltaFormatError), f"flip at {pos}: {type(err).__name__}: {err}"
            assert unchanged(recv, snap), f"flip at {pos}: {type(err).__name__} after writing"
    # everything except the reserved flags word is covered by a checksum or a marker
    assert set(harmless) <= set(flags), harmless


def test_flipped_bytes_in_a_file(tmp_path, states, blob):
    base, _ = states
    rng = random.Random(1)
    flags = set(range(PREAMBLE.size - 4, PREAMBLE.size))
    positions = [p for p in range(len(blob)) if p not in flags]
    for pos in rng.sample(positions, 40) + [0, len(blob) - 1, len(blob) - FOOTER.size]:
        bad = bytearray(blob)
        bad[pos] ^= 0x55
        p = tmp_path / "d.dcr"
        p.write_bytes(bytes(bad))
        recv = clone_state(base)
        snap = snapshot(recv)
        err = try_apply(recv, p)
        assert isinstance(err, DeltaFormatError), (pos, err)
        assert unchanged(recv, snap)


def test_multi_byte_corruption_sampled(states, blob):
    base, target = states
    rng = random.Random(2)
    for _ in range(300):
        bad = bytearray(blob)
        for pos in rng.sample(range(len(blob)), rng.randint(2, 8)):
            bad[pos] = rng.randrange(256)
        recv = clone_state(base)
        snap = snapshot(recv)
        err = try_apply(recv, bytes(bad))
        if err is None:
            assert states_equal(recv, target)
        elif isinstance(err, (DeltaFormatError, BaseMismatchError)):
            assert unchanged(recv, snap)


# ----------------------------------------------------------------------------- crafted headers

def _first(h, name):
    return next(t for t in h["tensors"] if t["name"] == name)


def _chunk(h, name="a", i=0):
    return _first(h, name)["chunks"][i]


HEADER_TAMPERS = {
    "format": lambda h: h.update(format=1),  # the container says 2 (3)
    "format-unknown": lambda h: h.update(format=4),
    "tensors-not-list": lambda h: h.update(tensors={}),
    "duplicate-name": lambda h: h["tensors"].append(copy.deepcopy(h["tensors"][0])),
    "unknown-kind": lambda h: _first(h, "a").update(kind="patch"),
    "unknown-dtype": lambda h: _first(h, "a").update(dtype="complex64"),
    "negative-shape": lambda h: _first(h, "a").update(shape=[-16]),
    "region-rank": lambda h: _first(h, "a")["region"].update(offsets=[0, 0]),
    "region-outside": lambda h: _first(h, "a")["region"].update(offsets=[4]),
    "chunks-not-list": lambda h: _first(h, "a").update(chunks=None),
    "chunk-missing-key": lambda h: _chunk(h).pop("crc"),
    "chunk-float-field": lambda h: _chunk(h).update(k=1.0),
    "chunk-bool-field": lambda h: _chunk(h).update(k=True),
    "chunk-negative": lambda h: _chunk(h).update(start=-1),
    "chunk-k-zero": lambda h: _chunk(h).update(k=0),
    "chunk-k-over-n": lambda h: _chunk(h).update(k=_chunk(h)["n"] + 1),
    "chunk-past-end": lambda h: _chunk(h, "a", 1).update(start=15),
    "chunks-overlap": lambda h: _chunk(h, "a", 1).update(start=0),
    "chunk-payload-outside": lambda h: _chunk(h).update(off=10**9),
    "chunk-payload-in-preamble": lambda h: _chunk(h).update(off=0),
    "chunk-encoding": lambda h: _chunk(h).update(enc="zip"),
    "chunk-position-coding": lambda h: _chunk(h).update(pos="rle"),
    "chunk-flag-type": lambda h: _chunk(h).update(pz=1),
    "chunk-digest-type": lambda h: _chunk(h).update(pre=None),
    "chunk-crc": lambda h: _chunk(h).update(crc=_chunk(h)["crc"] ^ 1),
    "full-not-dense": lambda h: _first(h, "new")["chunks"][0].update(k=_first(h, "new")["chunks"][0]["k"] - 1),
    "full-not-covered": lambda h: _first(h, "new").update(shape=[5], region={"offsets": [0], "shape": [5]}),
    "full-as-xor": lambda h: _first(h, "new")["chunks"][0].update(enc="xor"),
    "no-name": lambda h: _first(h, "a").pop("name"),
    "no-base-digest": lambda h: _first(h, "a").pop("base_digest"),
    "no-target-digest": lambda h: _first(h, "a").pop("target_digest"),
    "no-target-digest-full": lambda h: _first(h, "new").pop("target_digest"),
    "digest-type": lambda h: _first(h, "b").update(base_digest=123),
    # a tensor digest in an algorithm this build does not know (a newer writer's): refused with
    # the header, not reported as a wrong base, and never after writing the tensors before it
    "digest-algorithm": lambda h: _first(h, "new").update(target_digest="blake9:" + "0" * 32),
    "base-digest-algorithm": lambda h: _first(h, "b").update(base_digest="md5:" + "0" * 32),
    "removed-digest-algorithm": lambda h: _first(h, "gone").update(base_digest="x:1"),
}


@pytest.mark.parametrize("name", sorted(HEADER_TAMPERS))
def test_malformed_header_with_valid_checksum_is_format_error(states, blob, name):
    base, _ = states
    bad = rebuild(blob, HEADER_TAMPERS[name])
    if name != "chunk-crc":  # chunk checksums are checked by apply, not on open
        with pytest.raises(DeltaFormatError):
            DeltaReader(bad)
    recv = clone_state(base)
    snap = snapshot(recv)
    with pytest.raises(DeltaFormatError):
        apply(recv, bad)
    assert unchanged(recv, snap)


DECODE_TAMPERS = {
    # checksummed, structurally valid headers whose streams do not decode as described
    "praw": lambda h: _chunk(h).update(praw=_chunk(h)["praw"] + 1),
    "vraw": lambda h: _chunk(h).update(vraw=_chunk(h)["vraw"] + 2),
    "k": lambda h: _chunk(h).update(k=_chunk(h)["k"] - 1),
    "pos-dense": lambda h: _chunk(h).update(pos="dense"),
    "vz": lambda h: _chunk(h).update(vz=not _chunk(h)["vz"]),
    "post": lambda h: _chunk(h).update(post="0" * 16),
    "pre": lambda h: _chunk(h).update(pre="0" * 16),
    "target-digest": lambda h: _first(h, "a").update(target_digest="0" * 32),
}


@pytest.mark.parametrize("name", sorted(DECODE_TAMPERS))
def test_inconsistent_header_raises_dcr_error(states, blob, name):
    base, target = states
    bad = rebuild(blob, DECODE_TAMPERS[name])
    recv = clone_state(base)
    snap = snapshot(recv)
    err = try_apply(recv, bad)
    if name == "post":  # the pre-image still matches, so the chunk applies normally
        assert err is None and states_equal(recv, target)
        return
    assert err is not None
    if isinstance(err, PartialApplyError):
        assert isinstance(err.__cause__, DcrError)
    elif isinstance(err, (DeltaFormatError, BaseMismatchError)):
        assert unchanged(recv, snap)


def test_wrong_target_digest_is_target_mismatch(states, blob):
    base, target = states
    # "a" is the first entry applied, so the failure comes after the first write
    bad = rebuild(blob, DECODE_TAMPERS["target-digest"])
    recv = clone_state(base)
    with pytest.raises(PartialApplyError) as ei:
        apply(recv, bad)
    assert isinstance(ei.value.__cause__, TargetMismatchError)
    assert same_bits(recv["a"], target["a"])  # it was applied; only the recorded digest is wrong


# ----------------------------------------------------------------------------- foreign inputs

def _safetensors_bytes():
    from safetensors.torch import save
    return save({"w": torch.randn(4, 4), "b": torch.zeros(3, dtype=torch.bfloat16)})


@pytest.mark.parametrize("make", [
    lambda: b"",
    lambda: b"\0",
    lambda: bytes(31),
    lambda: bytes(32),
    lambda: bytes(1000),
    lambda: bytes(random.Random(0).randrange(256) for _ in range(4096)),
    lambda: b"NDCRDLT\x00" + bytes(100),
    lambda: b"NDCRDLT\x00" + bytes(random.Random(1).randrange(256) for _ in range(100)) + b"\x00TLDRCDN",
    lambda: _safetensors_bytes(),
    lambda: b"PK\x03\x04" + bytes(200),  # a zip (torch.save) preamble
], ids=["empty", "one", "31", "32-zeros", "1000-zeros", "random", "magic-only", "magics-random",
        "safetensors", "zip"])
def test_foreign_bytes_are_format_errors(states, make):
    base, _ = states
    recv = clone_state(base)
    snap = snapshot(recv)
    data = make()
    with pytest.raises(DeltaFormatError):
        DeltaReader(data)
    with pytest.raises(DeltaFormatError):
        apply(recv, data)
    with pytest.raises(DeltaFormatError):
        apply(recv, bytearray(data))
    assert unchanged(recv, snap)


def test_foreign_files_are_format_errors(tmp_path, states, blob):
    base, target = states
    recv = clone_state(base)
    snap = snapshot(recv)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "model.safetensors").write_bytes(_safetensors_bytes())
    (tmp_path / "text").write_text("hello, not a delta\n" * 10)
    (tmp_path / "dir").mkdir()
    for p in ["empty", "model.safetensors", "text", "dir", "missing"]:
        with pytest.raises(DeltaFormatError):
            apply(recv, tmp_path / p)
        with pytest.raises(DeltaFormatError):
            apply(recv, str(tmp_path / p))
    assert unchanged(recv, snap)
    # and the real thing, from a file, works
    (tmp_path / "ok.dcr").write_bytes(blob)
    apply(recv, tmp_path / "ok.dcr")
    assert states_equal(recv, target)


def test_unsupported_versions(states, blob):
    base, _ = states
    version = DeltaReader(blob).version
    # preamble version, and the footer's (version 2) or the trailer's (version 3)
    positions = (8, len(blob) - (12 if version == 2 else TRAILER.size))
    for pos in positions:
        for other in (4, 5 - version):  # unknown; the other container's
            bad = bytearray(blob)
            bad[pos:pos + 4] = other.to_bytes(4, "little")
            with pytest.raises(DeltaFormatError):
                apply(clone_state(base), bytes(bad))
    if version == 2:
        # a version 2 delta relabelled 1 in preamble and footer: its header says 2 (and its
        # chunk digests are not BLAKE2b), so it is refused as it is, not read as version 1
        bad = bytearray(blob)
        for pos in positions:
            bad[pos:pos + 4] = (1).to_bytes(4, "little")
        with pytest.raises(DeltaFormatError, match="format field"):
            apply(clone_state(base), bytes(bad))


# ----------------------------------------------------------------------------- wrong base

def _wrong_values(s):
    s["b"] = s["b"].clone()
    s["b"][2, 5] = 7.0  # a position the delta does not touch: only the digest catches it


def _wrong_values_touched(s):
    s["a"] = s["a"].clone()
    s["a"][3] = -s["a"][3]


def _neg_zero(s):
    s["b"] = s["b"].clone()
    s["b"][2, 7] = -0.0  # == +0.0 as a float; only the sign bit differs


def _nan_payload(s):
    s["b"] = s["b"].clone()
    int_view(s["b"])[2, 6] = 0x7FC2  # another quiet NaN


WRONG_BASES = {
    "values-untouched-position": _wrong_values,
    "values-touched-position": _wrong_values_touched,
    "negative-zero": _neg_zero,
    "nan-payload": _nan_payload,
    "already-other-target": lambda s: s.update(b=s["b"] + 1),
    "dtype": lambda s: s.update(b=s["b"].to(torch.float16)),
    "dtype-same-width": lambda s: s.update(a=s["a"].view(torch.int32)),
    "shape": lambda s: s.update(b=s["b"].reshape(8, 4).clone()),
    "shape-bigger": lambda s: s.update(a=torch.zeros(17)),
    "scalar-instead": lambda s: s.update(a=torch.tensor(1.0)),
    "missing-changed": lambda s: s.pop("a"),
    "missing-unchanged": lambda s: s.pop("same"),
}


@pytest.mark.parametrize("name", sorted(WRONG_BASES))
def test_wrong_base_raises_and_leaves_receiver_alone(states, blob, name):
    base, _ = states
    recv = clone_state(base)
    WRONG_BASES[name](recv)
    snap = snapshot(recv)
    objs = dict(recv)
    with pytest.raises(BaseMismatchError):
        apply(recv, blob)
    assert unchanged(recv, snap)  # including "gone" still present and "new" not added
    assert all(recv[k] is objs[k] for k in recv)


def test_wrong_base_on_last_entry_blocks_earlier_ones():
    """All bases are checked before the first write: a mismatch on the entry applied last
    leaves the earlier entries untouched too."""
    torch.manual_seed(0)
    base = {f"t{i}": torch.randn(50) for i in range(5)}
    target = {k: v + 1 for k, v in base.items()}
    blob = diff(base, target, chunk_elems=16)
    recv = clone_state(base)
    recv["t4"][0] += 1
    snap = snapshot(recv)
    with pytest.raises(BaseMismatchError):
        apply(recv, blob)
    assert unchanged(recv, snap)


def test_sharded_receiver_wrong_base():
    torch.manual_seed(0)
    base = torch.randn(8, 6)
    target = base.clone()
    target[:, ::2] += 1
    spec = ShardSpec.of((8, 6), (4, 0), (4, 6))
    blob = diff({"w": base[4:]}, {"w": target[4:]}, shards={"w": spec})
    recv_full = base.clone()
    recv_full[5, 1] += 1  # inside the region the delta covers
    snap = bits(recv_full)
    with pytest.raises(BaseMismatchError):
        apply({"w": recv_full}, blob)
    assert torch.equal(int_view(recv_full), snap)
    # a difference outside the covered region does not matter
    recv_ok = base.clone()
    recv_ok[0, 0] += 1
    apply({"w": recv_ok}, blob)
    assert same_bits(recv_ok[4:], target[4:]) and not same_bits(recv_ok[:4], base[:4])


# ----------------------------------------------------------------------------- retry / resume

@pytest.mark.parametrize("encoding", ["xor", "overwrite", "add", "auto"])
def test_applying_twice_is_harmless(states, encoding):
    base, target = states
    blob = diff(base, target, encoding=encoding, chunk_elems=8)
    recv = clone_state(base)
    apply(recv, blob)
    assert states_equal(recv, target)
    rep = apply(recv, blob)
    assert states_equal(recv, target)
    # every entry, delta or whole ("full"), is recognised as already at its target and skipped
    entries = DeltaReader(blob).raw_header["tensors"]
    assert rep.chunks_applied == 0 and rep.tensors_added == []
    assert rep.tensors_changed == 0
    assert rep.tensors_skipped == sum(1 for t in entries if t["kind"] != "removed")
    rep3 = apply(recv, blob, resume=True)
    assert rep3.tensors_changed == 0
    assert states_equal(recv, target)


def test_xor_twice_on_a_single_tensor():
    torch.manual_seed(0)
    base = torch.randn(1000).to(torch.bfloat16)
    target = base.clone()
    target[::7] = -target[::7]
    blob = diff({"w": base}, {"w": target}, encoding="xor", chunk_elems=100)
    assert {c["enc"] for c in DeltaReader(blob).raw_header["tensors"][0]["chunks"]} == {"xor"}
    recv = {"w": base.clone()}
    r1 = apply(recv, blob)
    r2 = apply(recv, blob)
    assert same_bits(recv["w"], target)
    assert r1.chunks_applied == 10 and r2.chunks_applied == 0 and r2.tensors_skipped == 1


def test_half_applied_state_resumes(states, blob):
    """Tensor "a" already at the target, "b" still at the base (an apply interrupted between
    tensors): finishing with resume=True (and also without) reaches the target."""
    base, target = states
    for resume in (True, False):
        recv = clone_state(base)
        recv["a"] = target["a"].clone()
        rep = apply(recv, blob, resume=resume)
        assert states_equal(recv, target)
        assert rep.tensors_skipped >= 1


def _half_chunk_state(rows=8, cols=16, seed=3):
    """Base, target, and a receiver with the first half of one tensor's chunks applied."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=g)
    target = base.clone()
    for r in range(rows):  # every row changes, so every chunk (= one row) exists
        target[r, torch.randperm(cols, generator=g)[: 1 + r]] += 1.0
    half = ShardSpec.of((rows, cols), (0, 0), (rows // 2, cols))
    blob_half = diff({"w": base[: rows // 2]}, {"w": target[: rows // 2]}, shards={"w": half})
    recv = {"w": base.clone()}
    apply(recv, blob_half)  # the first half rows reach the target through the API itself
    assert same_bits(recv["w"][: rows // 2], target[: rows // 2])
    assert same_bits(recv["w"][rows // 2:], base[rows // 2:])
    blob_full = diff({"w": base}, {"w": target}, chunk_elems=cols)
    assert len(DeltaReader(blob_full).raw_header["tensors"][0]["chunks"]) == rows
    return base, target, recv, blob_full


def test_half_applied_tensor_needs_resume():
    base, target, recv, blob_full = _half_chunk_state()
    snap = bits(recv["w"])
    with pytest.raises(BaseMismatchError):
        apply(recv, blob_full)
    assert torch.equal(int_view(recv["w"]), snap)
    rep = apply(recv, blob_full, resume=True)
    assert same_bits(recv["w"], target)
    assert rep.chunks_already_applied == 4 and rep.chunks_applied == 4
    # and after that the same delta is recognised as done
    rep2 = apply(recv, blob_full)
    assert rep2.tensors_skipped == 1 and same_bits(recv["w"], target)


def test_resume_from_base_and_from_target():
    base, target, _, blob_full = _half_chunk_state(seed=4)
    for start in (base, target):
        recv = {"w": start.clone()}
        apply(recv, blob_full, resume=True)
        assert same_bits(recv["w"], target)


def test_resume_does_not_accept_a_wrong_base():
    base, target, recv, blob_full = _half_chunk_state(seed=5)
    recv["w"][6, :] = 123.0  # a chunk that is neither its pre- nor its post-image
    with pytest.raises(PartialApplyError) as ei:
        apply(recv, blob_full, resume=True, workers=1)
    assert isinstance(ei.value.__cause__, BaseMismatchError)
    assert same_bits(recv["w"][:6], target[:6])  # chunks before the damaged one were finished


def test_partial_apply_error_then_resume():
    """A failure after the first write is a PartialApplyError; fixing the cause and calling
    again with resume=True finishes."""
    torch.manual_seed(0)
    base = {"a": torch.randn(40), "b": torch.randn(40)}
    target = {"a": base["a"] + 1, "b": base["b"] * 2}
    blob = diff(base, target, chunk_elems=10)
    recv = clone_state(base)
    recv["b"] = torch.full((40,), 9.0)  # damaged: neither base nor target
    # without resume the base check stops everything before a write
    with pytest.raises(BaseMismatchError):
        apply(recv, blob)
    assert same_bits(recv["a"], base["a"])
    # with resume the damage is only found chunk by chunk, after "a" was written
    with pytest.raises(PartialApplyError) as ei:
        apply(recv, blob, resume=True, workers=1)
    assert isinstance(ei.value.__cause__, BaseMismatchError)
    assert same_bits(recv["a"], target["a"])
    recv["b"] = base["b"].clone()  # e.g. reloaded from the checkpoint
    apply(recv, blob, resume=True)
    assert states_equal(recv, target)


def test_error_types_are_dcr_errors():
    for cls in (DeltaFormatError, BaseMismatchError, TargetMismatchError, PartialApplyError):
        assert issubclass(cls, DcrError)


def test_bytes_spliced_before_the_header(states, blob):
    """Extra bytes between the payloads and the header: every offset and checksum still
    holds, so this must either be refused or apply exactly."""
    base, target = states
    r = DeltaReader(blob)
    for extra in (b"\0", bytes(100), blob):
        spliced = blob[:r.payload_end] + extra + blob[r.payload_end:]
        recv = clone_state(base)
        snap = snapshot(recv)
        err = try_apply(recv, spliced)
        if err is None:
            assert states_equal(recv, target)
        else:
            assert isinstance(err, DeltaFormatError) and unchanged(recv, snap)


def test_sampled_flips_in_a_compressed_delta():
    """A larger delta whose streams are zstd-compressed: ~300 flipped positions spread over
    the whole file, plus every byte of the preamble and footer."""
    torch.manual_seed(7)
    base = {"w": torch.randn(64, 128).to(torch.bfloat16), "v": torch.randn(3000)}
    target = {"w": (base["w"].float() * (1 + 1e-2 * torch.randn(64, 128))).to(torch.bfloat16),
              "v": base["v"].clone()}
    target["v"][1000:2000] = 0.0
    blob = diff(base, target, chunk_elems=1024, workers=1)
    chunks = [c for t in DeltaReader(blob).raw_header["tensors"] for c in t["chunks"]]
    assert any(c["vz"] for c in chunks) and any(c["pz"] for c in chunks)
    n = len(blob)
    flags = set(range(PREAMBLE.size - 4, PREAMBLE.size))
    positions = sorted(set(range(0, n, max(1, n // 300))) | set(range(PREAMBLE.size)) | set(range(n - FOOTER.size, n)))
    assert len(positions) >= 300
    for pos in positions:
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        recv = clone_state(base)
        snap = snapshot(recv)
        err = try_apply(recv, bytes(bad))
        if pos in flags:
            assert err is None and states_equal(recv, target)
        else:
            assert isinstance(err, DeltaFormatError), (pos, err)
            assert unchanged(recv, snap)
