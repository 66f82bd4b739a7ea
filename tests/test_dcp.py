"""Publishing ``torch.distributed.checkpoint`` directories saved by ``dcp.save`` from a gloo
group of 3 processes (workers in dcr_testing/mp_dcp.py): from one process (the Python API),
from the CLI with 2 rank processes, and from the saving group itself right after it saved;
each rank reads only its share of the saved shards through DCP; a plain receiver pulls every
version bit for bit."""
import pytest
import torch

from dcr_testing import assert_state
from dcr_testing import mp_dcp as W
from dcr_testing.cli import run_cli
from dcr_testing.procs import run_scenario
from nemo_dcr.checkpoint.dcp import assign, load_shards, publish_dcp, read_layout
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.errors import DcrError
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.versions import read_head, read_manifest

DEADLINE = 120.0


def run_group(world, spec, scenario, tmp_path):
    return run_scenario(W.main, world, spec, scenario, tmp_path, DEADLINE,
                        preload=("torch.distributed.checkpoint", "torch.distributed.tensor"))


def model(k):
    return {n.removeprefix("model."): t for n, t in W.global_state(k).items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    res = run_group(3, {"root": str(root), "checkpoints": 3}, "save", root)
    assert res[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    return root


def test_the_layout_is_dcps_own_metadata(saved):
    layout = read_layout(str(saved / "ckpt-0"), prefix="model.")
    assert sorted(layout) == ["count", "embed", "norm", "proj"]  # no optimizer, no pickled objects
    assert [(c.spec.offsets, c.spec.shape, c.saved_by) for c in layout["embed"].chunks] == [
        ((0, 0), (4, 6), 0), ((4, 0), (4, 6), 1), ((8, 0), (3, 6), 2)]
    assert layout["embed"].dtype == torch.bfloat16 and layout["proj"].shape == (5, 9)
    assert len(layout["norm"].chunks) == 1  # replicated: saved once
    # 2 publisher ranks: saving ranks {0, 1} and {2}; contiguous rows merge into one rectangle
    a0, a1 = assign(layout, 0, 2), assign(layout, 1, 2)
    assert a0["embed"].offsets == (0, 0) and a0["embed"].shape == (8, 6)
    assert a1["embed"].offsets == (8, 0) and a1["embed"].shape == (3, 6)
    # a rank's share is read by DCP, nothing else: the values are the global state's
    t, s = load_shards(str(saved / "ckpt-0"), 1, 3, prefix="model.")
    assert torch.equal(t["embed"].view(torch.int16), model(0)["embed"][4:8].view(torch.int16))
    assert s["proj"].offsets == (0, 3) and torch.equal(t["proj"].view(torch.int32),
                                                       model(0)["proj"][:, 3:6].contiguous().view(torch.int32))


def test_chunks_that_do_not_tile_a_rectangle_are_refused(saved, tmp_path, capsys):
    layout = read_layout(str(saved / "ckpt-0"), prefix="model.")
    from dataclasses import replace
    odd = {"embed": replace(layout["embed"], chunks=(layout["embed"].chunks[0], layout["embed"].chunks[2]))}
    with pytest.raises(DcrError, match="do not form one rectangle"):
        assign(odd, 0, 1)
    with pytest.raises(DcrError, match="not a torch.distributed.checkpoint directory"):
        read_layout(str(saved))
    root = tmp_path / "store"
    r = run_cli(capsys, "publish", "--store", root)  # neither a checkpoint nor --dcp
    assert r.returncode != 0 and "--dcp DIR" in r.stderr
    r = run_cli(capsys, "publish", "--store", root, "--dcp", saved / "ckpt-0", "--prefix", "nothing.")
    assert r.returncode != 0 and "holds no tensors under 'nothing.'" in r.stderr
    # a checksum the format version cannot name: refused in the parent, before any rank starts
    r = run_cli(capsys, "publish", "--store", root, "--dcp", saved / "ckpt-0", "--prefix", "model.", "--ranks", 2,
                "--format-version", 2, "--object-checksum", "blake3")
    assert r.returncode != 0 and "needs format_version 3" in r.stderr
    assert not root.exists() or not any(root.iterdir())  # nothing written


def test_dcp_checkpoints_published_three_ways_are_pulled_bit_for_bit(saved, tmp_path, capsys):
    root = str(tmp_path / "store")
    store = LocalStore(root)
    r0 = publish_dcp(store, str(saved / "ckpt-0"), prefix="model.", step=0)  # one process
    assert r0.version == 0 and r0.manifest.kind == "keyframe"
    # format version 2 from the rank processes: what a receiver of an earlier release reads
    r = run_cli(capsys, "publish", "--store", root, "--dcp", saved / "ckpt-1", "--prefix", "model.", "--ranks", 2,
                "--format-version", 2)
    assert r.returncode == 0, r.stderr
    assert "published version 1 on version 0" in r.stdout and "2 rank(s)" in r.stdout
    m1 = read_manifest(store, read_head(store)[0].manifest)
    assert m1.world_size == 2 and m1.parts and m1.format == 2
    assert {p.algo for p in m1.parts} == {"sha256"}
    assert {DeltaReader.open(store.get(p.key)).version for p in m1.parts} == {2}
    res = run_group(3, {"root": str(saved), "store": root, "k": 2}, "publish", tmp_path)  # the saving group
    assert [res[r]["version"] for r in range(3)] == [2, 2, 2]
    assert res[0]["held"]["embed"] == [[0, 0], [4, 6]] and res[2]["held"]["proj"] == [[0, 6], [5, 3]]
    assert "norm" in res[1]["names"] and "norm" not in res[0]["names"]  # as DCP saved it: once

    recv = {n: torch.zeros_like(t) for n, t in model(0).items()}
    f = Follower(store, recv)
    for k in range(3):
        f.sync(k)
        assert_state(recv, model(k))  # NaN payloads, -0.0, subnormals, inf included
