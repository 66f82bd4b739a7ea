"""Worker processes for tests/test_dcp.py: real ``torch.distributed.checkpoint.save`` from a
gloo group of DTensors (``Shard(0)`` uneven, ``Shard(1)``, ``Replicate()``), plain tensors and
non-tensor entries; and a group that publishes a saved checkpoint with ``publish_dcp``.

Every rank builds the same global state for a checkpoint index (:func:`global_state`, raw bits
included: NaN payloads, -0.0, subnormals) and keeps its placement's part of it, as a trainer's
DTensors hold theirs; results go to ``<out>/<rank>.json`` (dcr_testing/procs.run_rank)."""
from __future__ import annotations

import datetime
import os

import torch

TIMEOUT = datetime.timedelta(seconds=30)
CHUNK = 32


def global_state(k: int) -> dict:
    """The model at checkpoint ``k``: a random start, then a sparse change per checkpoint."""
    g = torch.Generator().manual_seed(99)
    st = {
        "model.embed": torch.randn(11, 6, generator=g).to(torch.bfloat16),   # Shard(0): 4+4+3 rows
        "model.proj": torch.randn(5, 9, generator=g),                        # Shard(1): 3+3+3 columns
        "model.norm": torch.randn(7, generator=g),                           # Replicate()
        "model.count": torch.arange(6, dtype=torch.int64),                   # a plain tensor
    }
    special = st["model.proj"].view(-1).view(torch.int32)
    # a NaN with a payload, -0.0, the smallest subnormal, inf
    special[:4] = torch.tensor([0x7FC00001, -0x80000000, 0x00000001, 0x7F800000], dtype=torch.int32)
    for v in range(1, k + 1):
        u = torch.Generator().manual_seed(700 + v)
        bits = st["model.embed"].view(torch.int16)
        bits[torch.rand(bits.shape, generator=u) < 0.1] ^= 0x3
        st["model.norm"][v % 7] += 0.5
        st["model.count"][v % 6] += v
    return st


def _save(rank, world, spec, res):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    placements = {"model.embed": Shard(0), "model.proj": Shard(1), "model.norm": Replicate()}
    for k in range(spec["checkpoints"]):
        st = global_state(k)
        sd = {n: (distribute_tensor(t, mesh, [placements[n]]) if n in placements else t) for n, t in st.items()}
        sd["optim.step"] = torch.tensor(float(k))  # beside the model, as torchtitan saves it
        sd["train_state"] = {"step": k, "note": "not a weight"}
        dcp.save(sd, checkpoint_id=os.path.join(spec["root"], f"ckpt-{k}"))
    res["files"] = sorted(os.listdir(os.path.join(spec["root"], "ckpt-0")))


def _publish(rank, world, spec, res):
    import torch.distributed as dist

    from nemo_dcr.checkpoint.dcp import load_shards, publish_dcp
    path = os.path.join(spec["root"], f"ckpt-{spec['k']}")
    tensors, shards = load_shards(path, rank, world, prefix="model.")
    res["held"] = {n: [list(s.offsets), list(s.shape)] for n, s in shards.items()}
    res["names"] = sorted(tensors)
    r = publish_dcp(spec["store"], path, group=dist.group.WORLD, prefix="model.", step=spec["k"])
    res["version"] = r.version


SCENARIOS = {"save": _save, "publish": _publish}


def main(rank: int, world: int, port: int, spec: dict, scenario: str, out: str) -> None:
    from dcr_testing.procs import run_rank
    run_rank(rank, world, port, out, lambda res: SCENARIOS[scenario](rank, world, spec, res), TIMEOUT)
