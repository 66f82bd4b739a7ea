"""Worker processes for tests/test_fsdp2.py: real FSDP2 (``fully_shard``) models over gloo, on CPU.

A trainer group builds the same small model on every rank (one seed), shards it with
``fully_shard`` on a 1-D mesh (FSDP: ``Shard(0)``, uneven last shards, an empty shard on the
last rank) or a 2-D mesh (HSDP: ``(Replicate(), Shard(0))``), with FSDP2's mixed precision
(fp32 master weights, bf16 compute), and publishes version 0 (the initial weights) and one
version per optimizer step through ``PublishLoop`` (what the callbacks drive), which takes
``module_snapshot(model, dtype="bfloat16")``: each rank its own blocks, no all-gather. As the
reference, every rank then joins ``full_tensor()`` (test only) and rank 0 writes the whole
model, cast to bf16, to ``<refs>/ref-v<version>.pt``.

A receiver group holds the same model in bf16 under another FSDP2 layout (another world size)
and follows the versions with ``RolloutLoader`` (the module itself: its DTensor blocks are
placed by their placements); rank 0 compares the gathered result with the references.
Results go to ``<out>/<rank>.json`` like dcr_testing/mp_workers.py.
"""
from __future__ import annotations

import datetime
import os

import torch

TIMEOUT = datetime.timedelta(seconds=30)
STEPS = 3
CHUNK = 16  # small delta chunks: several per shard, so chunk and shard boundaries cross


class Tiny(torch.nn.Module):
    """Rows 11, 10, 10, 5 and 2: uneven over 3 and 2 ranks; 2 rows leave a rank of 3 empty."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.up = torch.nn.Linear(6, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.down = torch.nn.Linear(10, 5)
        self.head = torch.nn.Linear(5, 2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 2))  # a plain buffer: FSDP2 leaves it whole

    def forward(self, x):
        h = self.norm(torch.nn.functional.gelu(self.up(self.embed(x))))
        return self.head(torch.tanh(self.down(h))) * self.scale


def build(mesh_shape, dtype=torch.float32, mixed=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Tiny().to(dtype)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mixed else {}
    for layer in (model.embed, model.up, model.down, model.head):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def full_state(model, dtype=None) -> dict:
    """The whole model (every rank must call it: ``full_tensor`` all-gathers), cast to ``dtype``."""
    from torch.distributed.tensor import DTensor
    out = {}
    for n, t in model.state_dict().items():
        t = t.full_tensor() if isinstance(t, DTensor) else t
        out[n] = t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()
    return out


def open_store(spec: dict):
    from nemo_dcr.stores import LocalStore
    return LocalStore(spec["root"])


def _train(rank, world, spec, res):
    from nemo_dcr.integrations.publish_loop import PublishLoop
    from nemo_dcr.integrations.snapshot import is_sharded, module_snapshot

    model = build(spec["mesh"], mixed=True)
    res["sharded"] = is_sharded(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    # what both callbacks drive: its own gloo group, the snapshot on this thread, the joint
    # publish in the background
    loop = PublishLoop(spec["root"], dtype="bfloat16", publish_initial=True, chunk_elems=CHUNK,
                       device=spec.get("device", "auto"))
    loop.start(model)
    res["joint"] = loop.joint
    res["versions"], res["shards"] = [], []
    g = torch.Generator().manual_seed(7)
    for step in range(STEPS + 1):
        if step:
            x = torch.randint(0, 11, (4, 5), generator=g)  # the same batch on every rank
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loop.step_end(model, step)
        else:
            loop.train_start(model, 0)
        loop.flush()
        res["device"] = loop.device.active  # the device path (spec "device": "on") or the host copy
        res["versions"].append(loop.last_published["version"])
        tensors, shards = module_snapshot(model, dtype="bfloat16")  # what this rank published
        res["shards"].append({n: [list(s.offsets), list(s.shape)] for n, s in shards.items()})
        res.setdefault("names", sorted(tensors))
        res.setdefault("dtypes", sorted({str(t.dtype) for t in tensors.values()}))
        ref = full_state(model, torch.bfloat16)
        if rank == 0:
            torch.save(ref, os.path.join(spec["refs"], f"ref-v{step}.pt"))
    loop.stop()


def _receive(rank, world, spec, res):
    import torch.distributed as dist

    from nemo_dcr.integrations.rollout import RolloutLoader

    model = build(spec["mesh"], dtype=torch.bfloat16)
    loader = RolloutLoader(open_store(spec), model, group=dist.new_group(backend="gloo"))
    res["versions"], res["mismatches"] = [], []
    for v in range(STEPS + 1):
        loader.update(v)
        res["versions"].append(loader.version)
        got = full_state(model)
        if rank == 0:
            ref = torch.load(os.path.join(spec["refs"], f"ref-v{v}.pt"))
            from nemo_dcr.state.dtypes import int_view
            for n in sorted(ref):
                if got[n].dtype != ref[n].dtype or not torch.equal(int_view(got[n]), int_view(ref[n])):
                    res["mismatches"].append(f"{n}@v{v}")


SCENARIOS = {"train": _train, "receive": _receive}


def main(rank: int, world: int, port: int, spec: dict, scenario: str, out: str) -> None:
    from dcr_testing.procs import run_rank
    run_rank(rank, world, port, out, lambda res: SCENARIOS[scenario](rank, world, spec, res), TIMEOUT)
