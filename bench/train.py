"""A small decoder-only transformer trained on synthetic data, publishing BF16 weights per step.

This is the benchmark's stand-in for an RL trainer: fp32 master weights, AdamW, and after every
(published) optimizer step the BF16 view of every parameter -- what a trainer would send to its
inference engines.

    from bench.train import make_checkpoints
    ckpts = make_checkpoints(steps=8, lr=1e-6, warmup_steps=300, cache_dir="runs/bench-cache")
    # ckpts[0]: BF16 weights after the warm-up (the fine-tune's base); ckpts[i]: after fine-tune step i

The task is a fixed random sparse Markov chain over the vocabulary (each token has a handful of
likely successors), so the loss falls fast and the weights after the warm-up are "trained", not
just initialised. Everything is seeded; a run is deterministic for a given torch build and
thread count.

The warmed-up fp32 weights are cached in memory per (config, seed, warm-up steps, warm-up lr),
and, with ``cache_dir``, on disk too (one ``warm-<key>.pt`` file per key; ``runs/`` is
git-ignored), so re-running a benchmark does not train the warm-up again.

Run as a script to see the loss and the change rate per step, or with ``--save DIR`` to write
each checkpoint as ``DIR/step_XXXX.safetensors`` (for exercising the CLI on real files).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

WARMUP_LR = 1e-3


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    d_ff: int = 1024      # SwiGLU hidden width (three matrices per layer)
    seq_len: int = 64
    batch: int = 16
    successors: int = 4   # Markov chain: likely next tokens per token


SMALL = Config(vocab=128, d_model=64, n_layers=2, n_heads=2, d_ff=256, seq_len=32, batch=8)


# ----------------------------------------------------------------------------- model

class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.n_heads = c.n_heads
        self.attn_norm = RMSNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)
        self.mlp_norm = RMSNorm(c.d_model)
        self.gate = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.up = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.down = nn.Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.n_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def n_params(c: Config) -> int:
    return sum(p.numel() for p in TinyLM(c).parameters())


# ----------------------------------------------------------------------------- data

class MarkovData:
    """A fixed random sparse Markov chain; ``batch()`` draws sequences from it deterministically."""

    def __init__(self, c: Config, seed: int):
        g = torch.Generator().manual_seed(10_000 + seed)
        nxt = torch.stack([torch.randperm(c.vocab, generator=g)[: c.successors] for _ in range(c.vocab)])
        w = torch.rand(c.vocab, c.successors, generator=g) + 0.1
        self.trans = torch.zeros(c.vocab, c.vocab).scatter_(1, nxt, w / w.sum(1, keepdim=True))
        self.c = c

    def batch(self, g: torch.Generator) -> torch.Tensor:
        c = self.c
        seq = torch.empty(c.batch, c.seq_len + 1, dtype=torch.int64)
        seq[:, 0] = torch.randint(c.vocab, (c.batch,), generator=g)
        for t in range(c.seq_len):
            seq[:, t + 1] = torch.multinomial(self.trans[seq[:, t]], 1, generator=g).squeeze(1)
        return seq

    def entropy(self) -> float:
        """Per-token entropy of the chain (the best achievable loss, in nats)."""
        p = self.trans
        return float(-(p * torch.log(p.clamp_min(1e-30))).sum(1).mean())


# ----------------------------------------------------------------------------- training

def publish(model: nn.Module) -> dict[str, torch.Tensor]:
    """The BF16 view a trainer would publish."""
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}


def _step(model, opt, data, g) -> float:
    seq = data.batch(g)
    logits = model(seq[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


_WARM_CACHE: dict = {}  # (config, seed, warmup_steps, warmup_lr) -> (fp32 state_dict, losses)
DEFAULT_CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "bench-cache")


def warm_cache_path(cache_dir: str, c: Config, seed: int, warmup_steps: int, warmup_lr: float) -> str:
    """The disk-cache file of one warm-up: a hash of everything that determines it (the torch
    version included: another build may train to other bits)."""
    key = json.dumps({"config": asdict(c), "seed": seed, "warmup_steps": warmup_steps, "warmup_lr": warmup_lr,
                      "torch": torch.__version__, "v": 1}, sort_keys=True)
    return os.path.join(cache_dir, f"warm-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt")


def _warm_model(c: Config, seed: int, warmup_steps: int, warmup_lr: float, log, cache_dir: str | None = None) -> TinyLM:
    key = (c, seed, warmup_steps, warmup_lr)
    torch.manual_seed(seed)
    model = TinyLM(c)
    if key in _WARM_CACHE:
        model.load_state_dict(_WARM_CACHE[key][0])
        return model
    path = warm_cache_path(cache_dir, c, seed, warmup_steps, warmup_lr) if cache_dir and warmup_steps else None
    if path and os.path.exists(path):
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(saved["state_dict"])
            _WARM_CACHE[key] = (saved["state_dict"], list(saved["losses"]))
            if log:
                log(f"warm-up: {warmup_steps} steps loaded from {path}")
            return model
        except Exception as e:  # a stale or truncated file: train again and overwrite it
            if log:
                log(f"warm-up cache {path} unusable ({e}); training")
            torch.manual_seed(seed)
            model = TinyLM(c)
    losses = []
    if warmup_steps:
        data = MarkovData(c, seed)
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=warmup_lr, betas=(0.9, 0.95), weight_decay=0.01)
        t0 = time.perf_counter()
        for i in range(warmup_steps):
            losses.append(_step(model, opt, data, g))
            if log and (i % 50 == 0 or i == warmup_steps - 1):
                log(f"warm-up step {i:4d}  loss {losses[-1]:.3f}  (chain entropy {data.entropy():.3f})"
                    f"  {time.perf_counter() - t0:.1f}s")
    state = copy.deepcopy(model.state_dict())
    _WARM_CACHE[key] = (state, losses)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save({"state_dict": state, "losses": losses}, tmp)
        os.replace(tmp, path)  # atomic: a concurrent run sees the old file or the whole new one
        if log:
            log(f"warm-up cached in {path}")
    return model


def make_checkpoints(steps: int, lr: float, warmup_steps: int = 0, seed: int = 0, publish_every: int = 1, *,
                     config: Config = Config(), warmup_lr: float = WARMUP_LR, log=None,
                     losses: list | None = None, cache_dir: str | None = None) -> list[dict[str, torch.Tensor]]:
    """Train ``warmup_steps`` at ``warmup_lr``, then ``steps`` fine-tune steps at ``lr`` with a fresh
    AdamW (as when an RL run starts from a trained checkpoint).

    Returns the BF16 weights after the warm-up, then after every ``publish_every``-th fine-tune
    step: ``1 + steps // publish_every`` dicts. The warm-up is cached per (config, seed, steps,
    lr), so sweeping ``lr`` trains it once; with ``cache_dir`` also on disk, so the next process
    does not train it either. ``losses``, if given, receives the fine-tune losses.
    """
    if steps < 0 or publish_every < 1:
        raise ValueError("steps must be >= 0 and publish_every >= 1")
    model = _warm_model(config, seed, warmup_steps, warmup_lr, log, cache_dir)
    data = MarkovData(config, seed)
    g = torch.Generator().manual_seed(seed + 1)  # fine-tune batches differ from the warm-up's
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    out = [publish(model)]
    for i in range(1, steps + 1):
        loss = _step(model, opt, data, g)
        if losses is not None:
            losses.append(loss)
        if i % publish_every == 0:
            out.append(publish(model))
    return out


def change_rate(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Fraction of elements whose bits differ."""
    changed = sum(int((a[n].view(torch.int16) != b[n].view(torch.int16)).sum()) for n in a)
    return changed / sum(t.numel() for t in a.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="fine-tune steps")
    ap.add_argument("--lr", type=float, default=1e-6, help="fine-tune learning rate")
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--publish-every", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="a tiny model (for smoke tests)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="warm-up disk cache ('' for none)")
    ap.add_argument("--save", metavar="DIR", help="write each checkpoint as DIR/step_XXXX.safetensors")
    a = ap.parse_args(argv)
    c = SMALL if a.small else Config()
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    log(f"model {n_params(c):,} parameters, {asdict(c)}")
    losses: list = []
    ckpts = make_checkpoints(a.steps, a.lr, a.warmup_steps, a.seed, a.publish_every, config=c, log=log, losses=losses,
                             cache_dir=a.cache_dir or None)
    for i in range(1, len(ckpts)):
        log(f"publish {i}: change rate {100 * change_rate(ckpts[i - 1], ckpts[i]):.3f} %"
            f"  loss {losses[i * a.publish_every - 1]:.4f}")
    if a.save:
        from safetensors.torch import save_file
        os.makedirs(a.save, exist_ok=True)
        for i, ck in enumerate(ckpts):
            path = os.path.join(a.save, f"step_{i * a.publish_every:04d}.safetensors")
            save_file(ck, path)
            log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
