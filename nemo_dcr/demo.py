"""``nemo-dcr demo``: the main job for now, on the embedded local default (a directory).

A small transformer is trained with AdamW (fp32 master weights); after each optimizer step its
BF16 weights are saved as a sharded safetensors checkpoint, the way a trainer publishes them.
Each step is diffed against the previous one, applied to the receiver's copy, and the rebuilt
checkpoint is checked byte for byte against the trainer's. A table per step is printed and
written to ``WORKDIR/summary.json``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import torch
from torch import nn

from .files import apply_checkpoint, diff_checkpoints
from .stats import inspect


class TinyLM(nn.Module):
    def __init__(self, vocab=512, d=256, layers=4, heads=4, ctx=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=True)

    def forward(self, x):
        n = x.shape[1]
        h = self.emb(x) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def markov_batches(vocab=512, ctx=64, batch=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    trans = torch.softmax(torch.randn(vocab, vocab, generator=g) * 3, dim=-1)
    while True:
        x = torch.empty(batch, ctx + 1, dtype=torch.long)
        x[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for i in range(ctx):
            x[:, i + 1] = torch.multinomial(trans[x[:, i]], 1, generator=g).squeeze(1)
        yield x[:, :-1], x[:, 1:]


def bf16_state(model: nn.Module) -> dict:
    return {k: v.detach().to(torch.bfloat16).clone() if v.is_floating_point() else v.detach().clone()
            for k, v in model.state_dict().items()}


def save_sharded(state: dict, out: str, shards: int = 2) -> None:
    """A Hugging Face-style sharded directory with model.safetensors.index.json."""
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: state[n].contiguous() for n in part}, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def _tree_digest(path: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        h.update(name.encode())
        with open(os.path.join(path, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def run_demo(workdir: str = "runs/demo", steps: int = 6, warmup: int = 30, lr: float = 5e-6, seed: int = 0,
             out=print) -> list:
    torch.manual_seed(seed)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    if os.path.exists(workdir):
        shutil.rmtree(workdir)
    trainer_dir, rollout_dir, delta_dir = (os.path.join(workdir, d) for d in ("trainer", "rollout", "deltas"))
    os.makedirs(delta_dir)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    data = markov_batches(seed=seed)
    nparams = sum(p.numel() for p in model.parameters())
    out(f"nemo-dcr demo: {nparams / 1e6:.1f}M-parameter transformer, {warmup} warm-up steps at lr 1e-3, "
        f"then {steps} steps at lr {lr:g}; workdir {workdir}")

    def step():
        x, y = next(data)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(warmup):
        loss = step()
    for g in opt.param_groups:
        g["lr"] = lr
    save_sharded(bf16_state(model), os.path.join(trainer_dir, "v0000"))
    shutil.copytree(os.path.join(trainer_dir, "v0000"), rollout_dir)  # the receiver starts from v0
    rows = []
    out(f"{'ver':>4} {'loss':>7} {'change %':>9} {'delta B':>10} {'dense B':>11} {'ratio':>7} "
        f"{'B/chg':>6} {'diff s':>7} {'apply s':>8}  verified")
    for v in range(1, steps + 1):
        loss = step()
        prev, cur = os.path.join(trainer_dir, f"v{v - 1:04d}"), os.path.join(trainer_dir, f"v{v:04d}")
        save_sharded(bf16_state(model), cur)
        delta = os.path.join(delta_dir, f"v{v:04d}.dcr")
        t0 = time.perf_counter()
        diff_checkpoints(prev, cur, delta, progress=False)
        t1 = time.perf_counter()
        apply_checkpoint(rollout_dir, delta, rollout_dir, progress=False)
        t2 = time.perf_counter()
        ok = _tree_digest(rollout_dir) == _tree_digest(cur)
        s = inspect(delta)
        row = {"version": v, "loss": loss, "change_rate": s["change_rate"], "delta_bytes": s["bytes"],
               "dense_bytes": s["dense_bytes"], "ratio": s["ratio_to_dense"],
               "bytes_per_changed": s["bytes_per_changed"], "diff_s": t1 - t0, "apply_s": t2 - t1,
               "verified": ok}
        rows.append(row)
        bpc = f"{row['bytes_per_changed']:.2f}" if row["bytes_per_changed"] else "-"
        out(f"{v:>4} {loss:>7.3f} {100 * row['change_rate']:>9.3f} {row['delta_bytes']:>10,} "
            f"{row['dense_bytes']:>11,} {row['ratio']:>6.1f}x {bpc:>6} {row['diff_s']:>7.2f} "
            f"{row['apply_s']:>8.2f}  {'bit-exact' if ok else 'MISMATCH'}")
        if not ok:
            raise SystemExit(f"demo: version {v} did not rebuild bit-exactly")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=2)
    out(f"all {steps} versions rebuilt byte-identical on the receiver; summary in {workdir}/summary.json")
    return rows
