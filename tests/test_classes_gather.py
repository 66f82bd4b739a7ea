"""``classes`` deltas on receivers sharded differently from the trainer (nemo_dcr/sync/chunk_gather.py).

The trainer (this process) publishes every tensor whole with ``encoding='classes'``; three receiver
ranks (a ``RolloutLoader`` group over gloo, tests/dcr_testing/gather_workers.py) hold them split
by columns (every chunk crosses every rank), by rows at boundaries that are not chunk boundaries,
over two of the three ranks, or whole (a replica). Each classes chunk is decoded with the group's
help (the classes of the base elements, the base bits at the changed positions): bit-exact on
integer views, NaN payloads, -0.0, subnormals and infinities included, in bf16, fp16 (held
non-contiguous), fp32 and both fp8s. A base that is not the version's on one rank is the same
typed error on every rank, and nothing is written anywhere. Columns held by several ranks at once
(overlapping, not a replica) are decoded and written by every rank holding them.

Alone (no group), a receiver holding part of a classes chunk is refused before its first write."""
import re
import time

import pytest
import torch

from dcr_testing import bits as int_bits
from dcr_testing import gather_workers as G
from dcr_testing import mp_workers as W
from dcr_testing.procs import launch
from nemo_dcr.codec.chunk import CLASSES
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.delta import apply
from nemo_dcr.errors import BaseMismatchError, DcrError, PartialApplyError
from nemo_dcr.integrations.rollout import RolloutLoader
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.versions import manifest_at

DEADLINE = 90.0


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A store with versions 0..2 of G.global_state, every delta chunk that can be 'classes'."""
    root = str(tmp_path_factory.mktemp("gather") / "store")
    pub = Publisher(root, chunk_elems=G.CHUNK, encoding="classes")
    for v in range(3):
        assert pub.publish(G.global_state(v), step=v).version == v
    store = LocalStore(root)
    for v in (1, 2):
        m = manifest_at(store, v)
        classes = {e.name for p in m.parts for e in DeltaReader.open(store.get(p.key)).header.tensors
                   if any(c.enc == CLASSES for c in e.chunks)}
        assert classes == set(G.LAYOUT), f"version {v}: classes chunks only in {classes}"
    return root


@pytest.mark.parametrize("route", ["gather", "gather-located", "gather-widths"])
def test_group_sharded_differently_decodes_classes_chunks_bit_exactly(published, tmp_path, route):
    """``gather-located``: as on a GPU engine's TP workers, the chunks held whole located against
    the bits where they are, the group's exchanges fed from there (gather_workers.follow_located).
    ``gather-widths``: the class counts sent 4, 2 and 1 bytes wide, chunk by chunk."""
    out = tmp_path / f"out-{time.monotonic_ns()}"
    out.mkdir()
    spec = {"kind": "local", "root": published}
    res, codes, hung = launch(W.main, G.WORLD, lambda r, port: (r, G.WORLD, port, spec, route, str(out)), out,
                              DEADLINE)
    assert not hung, f"ranks {hung} still running after {DEADLINE}s; results so far: {res}"
    failed = [r for r in range(G.WORLD) if not res.get(r, {}).get("ok")]
    assert not failed, "\n".join(f"rank {r}:\n{res.get(r, {}).get('traceback')}" for r in failed)
    for r in range(G.WORLD):
        assert res[r]["versions"] == [1, 2]
        assert all(n > 0 for n in res[r]["gathered"]), res[r]["gathered"]  # base bits came from the peers
        # rank 1's scribble: the same typed error on every rank, before anything was written
        err = res[r]["error"]
        assert err is not None and err.startswith("BaseMismatchError:"), err
        # one rank puts each chunk together and checks it (chunk_gather._checker): it names the
        # chunk, and every rank raises what it found
        assert "cols_bf16: chunk at element" in err and "does not match its base" in err
        assert len(re.findall(r"rank \d: BaseMismatchError", err)) == 1, err
        assert err == res[0]["error"]
        assert res[r]["unchanged"] and res[r]["version_after_error"] == 1
    assert res[0]["held"] == sorted(G.LAYOUT)  # (rank 0 applies the replica and broadcasts it)
    assert "cols_f16" not in res[2]["held"]
    if route == "gather-located":
        # rows_f32's chunks held whole inside a rank's rows went through the group's located
        # decode; the replica's chunks through apply's
        assert all(res[r]["located"]["group_locate"] > 0 for r in range(G.WORLD)), [res[r]["located"] for r in res]
        assert all(res[r]["located"]["locate"] >= res[r]["located"]["group_locate"] for r in range(G.WORLD))


@pytest.mark.parametrize("route", ["gather-overlapping", "gather-one-width"])
def test_group_holding_columns_of_one_tensor_decodes_bit_exactly(published, tmp_path, route):
    """``gather-overlapping``: columns held by two or three ranks at once (not a replica): the
    lowest rank answers for a position, and every rank holding it writes it, found through the
    index maps (``Decoded`` without ``local``). ``gather-one-width``: disjoint columns, each rank
    answering for what it holds (``Decoded`` with ``local``). One tensor, so every chunk the group
    decodes is of one element width (the paths without a mask per width). Each rank's columns
    end at the target's bits."""
    out = tmp_path / "out"
    out.mkdir()
    spec = {"kind": "local", "root": published}
    res, codes, hung = launch(W.main, G.WORLD, lambda r, port: (r, G.WORLD, port, spec, route, str(out)), out,
                              DEADLINE)
    assert not hung, f"ranks {hung} still running after {DEADLINE}s; results so far: {res}"
    failed = [r for r in range(G.WORLD) if not res.get(r, {}).get("ok")]
    assert not failed, "\n".join(f"rank {r}:\n{res.get(r, {}).get('traceback')}" for r in failed)
    for r in range(G.WORLD):
        assert res[r]["versions"] == [1, 2] and all(n > 0 for n in res[r]["gathered"]), res[r]
        if route == "gather-overlapping":
            assert res[r]["local"] == [0, 0]  # (overlapping shards: the index maps say what a rank holds)
        else:
            assert all(n > 0 for n in res[r]["local"]), res[r]  # (disjoint: each decoded chunk says what is held)


def test_alone_a_receiver_holding_every_tensor_whole_gathers_nothing(published, monkeypatch):
    """A follower alone, holding each tensor whole, holds every classes chunk whole: it syncs
    without planning the entries a second time to look for chunks held in part (~5 % of a delta
    sync of many small tensors), bit-exactly."""
    import importlib

    from nemo_dcr.sync.follower import Follower

    def refuse(*a, **k):
        raise AssertionError("decode_partial called by a lone receiver holding every tensor whole")
    monkeypatch.setattr(importlib.import_module("nemo_dcr.sync.follower"), "decode_partial", refuse)
    held = {n: t.clone() for n, t in G.global_state(1).items()}
    assert Follower(published, held, version=1, verify_initial=False).sync(2).version == 2
    assert all(torch.equal(int_bits(held[n]), int_bits(t)) for n, t in G.global_state(2).items())


def test_alone_a_receiver_holding_part_of_a_classes_chunk_is_refused_before_writing(published):
    tensors, shards = G.local_state(1, 0)
    before = {n: int_bits(t).clone() for n, t in tensors.items()}
    loader = RolloutLoader(published, tensors, shards, version=1, verify_initial=False)  # (only part of the state)
    with pytest.raises(DcrError, match="coded against the whole base chunk") as e:
        loader.update(2)
    assert not isinstance(e.value, PartialApplyError)
    assert all(torch.equal(before[n], int_bits(t)) for n, t in tensors.items())
    # apply() itself refuses before its first write as well ("norm", whole, comes first otherwise)
    store = LocalStore(published)
    blob = store.get(manifest_at(store, 2).parts[0].key)
    with pytest.raises(DcrError, match="coded against the whole base chunk") as e:
        apply(tensors, blob, shards=shards, verify=False, resume=True)
    assert not isinstance(e.value, (PartialApplyError, BaseMismatchError))
    assert all(torch.equal(before[n], int_bits(t)) for n, t in tensors.items())
