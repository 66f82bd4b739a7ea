"""FSDP2 (``fully_shard``, DTensor parameters) as a trainer and as a receiver, over gloo in
several processes (workers in dcr_testing/mp_fsdp2.py).

Each trainer rank publishes its own blocks from the DTensor placements (no all-gather), fp32
master weights published as bf16; what a plain receiver of whole tensors pulls, and what a
receiver under another FSDP2 layout holds, equal the whole model (``full_tensor``) bit for bit."""
import pytest
import torch

from dcr_testing import assert_bits_equal
from dcr_testing import mp_fsdp2 as W
from dcr_testing.procs import run_scenario
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.follower import Follower

DEADLINE = 120.0


def run_group(world, spec, scenario, tmp_path):
    return run_scenario(W.main, world, spec, scenario, tmp_path, DEADLINE,
                        preload=("torch.distributed.fsdp", "torch.distributed.tensor"))


def pull_whole(store, refs):
    """A plain receiver: whole bf16 tensors, following every version."""
    ref0 = torch.load(refs / "ref-v0.pt")
    recv = {n: torch.zeros_like(t) for n, t in ref0.items()}
    f = Follower(store, recv)
    for v in range(W.STEPS + 1):
        f.sync(v)
        ref = torch.load(refs / f"ref-v{v}.pt")
        assert sorted(recv) == sorted(ref)
        for n in ref:
            assert_bits_equal(recv[n], ref[n], f"{n}@v{v}")
    return ref0


@pytest.mark.parametrize("mesh", [(3,), (2, 2)], ids=["fsdp3", "hsdp2x2"])
def test_fsdp2_ranks_publish_their_blocks_and_receivers_of_any_layout_follow(mesh, tmp_path):
    refs = tmp_path / "refs"
    refs.mkdir()
    spec = {"root": str(tmp_path / "store"), "mesh": list(mesh), "refs": str(refs)}
    world = 1
    for n in mesh:
        world *= n
    res = run_group(world, spec, "train", tmp_path)
    assert all(res[r]["sharded"] and res[r]["joint"] for r in res)  # a DTensor module is published jointly
    assert [res[r]["versions"] for r in range(world)] == [list(range(W.STEPS + 1))] * world
    # fp32 master weights (FSDP2's mixed precision keeps them), published as bf16
    assert all(res[r]["dtypes"] in ([], ["torch.bfloat16"]) for r in res)
    layout = res[0]["shards"][0]
    if mesh == (3,):
        # uneven: 11 rows as 4+4+3, 10 as 4+4+2; the 2-row head leaves rank 2 empty
        assert layout["embed.weight"] == [[0, 0], [4, 6]]
        assert res[2]["shards"][0]["embed.weight"] == [[8, 0], [3, 6]]
        assert res[2]["shards"][0]["up.bias"] == [[8], [2]]
        assert "head.weight" not in res[2]["names"] and "head.weight" in res[1]["names"]
    else:
        # HSDP: the replicate dimension's coordinate 1 (ranks 2, 3) holds copies: they publish nothing
        assert res[2]["names"] == [] and res[3]["names"] == []
        assert res[1]["shards"][0]["embed.weight"] == [[6, 0], [5, 6]]
    # the plain buffer is published once, by rank 0
    assert "scale" in res[0]["names"] and all("scale" not in res[r]["names"] for r in range(1, world))

    store = LocalStore(spec["root"])
    ref0 = pull_whole(store, refs)
    assert ref0["up.weight"].dtype == ref0["scale"].dtype == torch.bfloat16  # buffers cast too

    # a receiver group under another FSDP2 layout (2 ranks), bf16 throughout
    rres = run_group(2, {**spec, "mesh": [2]}, "receive", tmp_path)
    assert rres[0]["versions"] == list(range(W.STEPS + 1))
    assert rres[0]["mismatches"] == []


def test_fsdp2_on_the_callbacks_device_path(tmp_path, monkeypatch):
    """The callbacks' device path (``device="on"``; its Triton kernels interpreted on CPU
    tensors in the rank processes) captures each rank's DTensor blocks, as the host path copies
    them: what a plain receiver pulls equals ``full_tensor()`` of every version bit for bit."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (read when the ranks import the kernels)
    refs = tmp_path / "refs"
    refs.mkdir()
    spec = {"root": str(tmp_path / "store"), "mesh": [3], "refs": str(refs), "device": "on"}
    res = run_group(3, spec, "train", tmp_path)
    assert all(res[r]["device"] and res[r]["joint"] for r in res)
    assert [res[r]["versions"] for r in range(3)] == [list(range(W.STEPS + 1))] * 3
    pull_whole(LocalStore(spec["root"]), refs)
