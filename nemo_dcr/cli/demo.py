"""``nemo-dcr demo``: the main job. A trainer and a rollout engine in two processes, on the
embedded local store (a directory) or any store URL.

* Trainer (this process): a Lightning ``Trainer`` trains a small character-level transformer
  (AdamW, fp32 master weights) with ``DeltaPublishCallback``, which publishes the BF16 weights
  every few optimizer steps.
* Rollout (a separate process): a BF16 copy of the model with ``RolloutLoader``; before each
  sampling batch it brings the weights to the newest version (verified bit-exactly against the
  version's digest) and samples text.

At the end a table per version (change rate, delta vs dense bytes, ratio, publish and apply time,
digest verified) is printed, written to ``WORKDIR/summary.json``, and plotted to
``WORKDIR/demo.png`` when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import codecs
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from typing import cast

import torch
from torch import nn
from torch.utils.data import Dataset

from nemo_dcr.util.extras import require

CTX = 64


def corpus() -> str:
    """The Zen of Python (importing ``this`` prints it once; keep that quiet)."""
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def pretrain(model: nn.Module, steps: int, lr: float = 2e-3, seed: int = 0) -> float:
    """Plain AdamW steps on the corpus, before publishing starts, so the published run is a
    fine-tune of trained weights (as in RL), not training from scratch."""
    g = torch.Generator().manual_seed(seed)
    text = torch.tensor([min(ord(c), 127) for c in corpus()])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        starts = torch.randint(0, len(text) - CTX - 1, (16,), generator=g)
        x = torch.stack([text[s:s + CTX] for s in starts])
        y = torch.stack([text[s + 1:s + CTX + 1] for s in starts])
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


class TinyLM(nn.Module):
    """A small pre-norm transformer language model."""

    mask: torch.Tensor  # a registered buffer (nn.Module.__getattr__ is typed Tensor | Module)

    def __init__(self, vocab=128, d=192, layers=4, heads=4, ctx=CTX):
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
        h = self.blocks(h, mask=self.mask[:n, :n].to(h.dtype), is_causal=True)
        return self.head(self.norm(h))

    @torch.no_grad()
    def sample(self, prompt: str, n: int = 48, seed: int = 0) -> str:
        g = torch.Generator().manual_seed(seed)
        ids = [min(ord(c), 127) for c in prompt]
        for _ in range(n):
            x = torch.tensor([ids[-CTX:]])
            logits = self(x)[0, -1].float()
            ids.append(int(torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=g)))
        return "".join(chr(i) if 32 <= i < 127 or i == 10 else "?" for i in ids[len(prompt):])


def _lightning_module(lr: float, model: nn.Module):
    require("lightning.pytorch", "lightning", "the demo")
    from lightning.pytorch import LightningModule

    class CharLM(LightningModule):
        text: torch.Tensor  # a registered buffer, as TinyLM.mask

        def __init__(self):
            super().__init__()
            self.model = model
            text = torch.tensor([min(ord(c), 127) for c in corpus()])
            self.register_buffer("text", text, persistent=False)
            self.gen = torch.Generator().manual_seed(0)

        def training_step(self, batch, batch_idx):
            starts = torch.randint(0, len(self.text) - CTX - 1, (16,), generator=self.gen)
            x = torch.stack([self.text[s:s + CTX] for s in starts])
            y = torch.stack([self.text[s + 1:s + CTX + 1] for s in starts])
            loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            self.log("loss", loss, prog_bar=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)

        def train_dataloader(self):
            # a range is a map-style dataset (len and getitem); torch's annotation names the Dataset class
            return torch.utils.data.DataLoader(cast(Dataset, range(10**6)), batch_size=1)

    return CharLM()


# ---------------------------------------------------------------------------- rollout process
def rollout_main(store: str, out: str, done: str, deadline_s: float = 600.0) -> None:
    from nemo_dcr.integrations import RolloutLoader
    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16).eval()
    loader = RolloutLoader(store, model)
    t_end = time.monotonic() + deadline_s
    final = None
    with open(out, "w") as f:
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            before = loader.version
            v = loader.update()  # before each sampling batch: newest committed version, verified
            apply_s = time.perf_counter() - t0
            if v is not None and v != before:
                res = loader.last_result
                with loader.sampling():
                    text = model.sample("Beautiful is ", seed=v)
                for _kind, sv in res.steps:  # every version on the way was verified by its digest
                    rec = {"version": sv, "apply_s": apply_s if sv == v else None, "fetched_bytes": res.bytes,
                           "steps": [list(s) for s in res.steps], "verified": True,
                           "sample": text if sv == v else None}
                    f.write(json.dumps(rec) + "\n")
                f.flush()
                print(f"  [rollout] version {v:>3} applied in {apply_s * 1e3:6.1f} ms, verified; "
                      f"sample: {text[:40]!r}", flush=True)
            if final is None and os.path.exists(done):
                with open(done) as fd:
                    final = json.load(fd)["final_version"]
            if final is not None and loader.version == final:
                return
            time.sleep(0.05)  # poll interval of this demo's engine loop
    raise SystemExit(f"rollout: gave up after {deadline_s:.0f} s at version {loader.version}")


# ---------------------------------------------------------------------------- trainer + driver
def run_demo(workdir: str = "runs/demo", store: str | None = None, steps: int = 40, every: int = 4,
             lr: float = 5e-6, keyframe_every: int = 0, pretrain_steps: int = 150, out=print) -> list:
    pl = require("lightning.pytorch", "lightning", "the demo")
    from lightning.pytorch.loggers import CSVLogger

    from nemo_dcr.checkpoint.sync import history
    from nemo_dcr.integrations import DeltaPublishCallback

    if os.path.exists(workdir):
        shutil.rmtree(workdir)
    os.makedirs(workdir)
    store = store or os.path.join(workdir, "store")
    done = os.path.join(workdir, "trainer_done.json")
    rollout_log = os.path.join(workdir, "rollout.jsonl")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyLM()
    loss = pretrain(model, pretrain_steps)
    out(f"nemo-dcr demo: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter model pre-trained "
        f"{pretrain_steps} steps (loss {loss:.2f}); now {steps} fine-tuning steps at lr {lr:g}, a version every "
        f"{every}, trainer and rollout processes on store {store}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rollout = subprocess.Popen([sys.executable, "-m", "nemo_dcr.cli.demo", "rollout", "--store", store,
                                "--out", rollout_log, "--done", done], env=env)
    try:
        pl.seed_everything(0, verbose=False)
        cb = DeltaPublishCallback(store, every_n_steps=every, keyframe_every=keyframe_every, dtype="bfloat16",
                                  submodule="model", publish_initial=True)
        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, callbacks=[cb], enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                             logger=CSVLogger(workdir, name="trainer", version=""))
        trainer.fit(_lightning_module(lr, model))
        final = cb.last_published["version"]
        with open(done, "w") as f:
            json.dump({"final_version": final}, f)
        rc = rollout.wait(timeout=600)
    finally:
        if rollout.poll() is None:
            rollout.kill()
    if rc != 0:
        raise SystemExit(f"demo: the rollout process failed (exit {rc})")
    rows = _table(history(store), _metrics(os.path.join(workdir, "trainer", "metrics.csv")), rollout_log)
    out(f"\n{'ver':>4} {'step':>5} {'change %':>9} {'delta B':>10} {'dense B':>11} {'ratio':>7} "
        f"{'publish s':>9} {'apply s':>8}  verified")
    for r in rows:
        cr = f"{100 * r['change_rate']:.3f}" if r["change_rate"] is not None else "keyframe"
        ratio = f"{r['ratio']:.1f}x" if r["ratio"] else "-"
        pub = f"{r['publish_s']:.2f}" if r["publish_s"] is not None else "-"
        app = f"{r['apply_s']:.3f}" if r["apply_s"] is not None else "-"
        out(f"{r['version']:>4} {r['step'] if r['step'] is not None else '-':>5} {cr:>9} {r['delta_bytes']:>10,} "
            f"{r['dense_bytes']:>11,} {ratio:>7} {pub:>9} {app:>8}  {'bit-exact' if r['verified'] else 'NO'}")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=2)
    plot = _plot(rows, os.path.join(workdir, "demo.png"))
    ok = all(r["verified"] for r in rows)
    out(f"{len(rows)} versions; rollout verified {'every one bit-exactly' if ok else 'NOT all'}; "
        f"summary {workdir}/summary.json"
        + (f", plot {plot}" if plot else ' (pip install "nemo-dcr[plot]" for a plot)'))
    if not ok:
        raise SystemExit("demo: some versions were not verified")
    return rows


def _metrics(path: str) -> dict:
    """step -> dcr metrics logged by the callback."""
    by_step: dict[int, dict] = {}
    if not os.path.exists(path):
        return by_step
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("dcr/publish_s"):
                by_step[int(row["step"])] = {k: float(v) for k, v in row.items() if k.startswith("dcr/") and v}
    return by_step


def _table(manifests, metrics: dict, rollout_log: str) -> list:
    applied = {}
    if os.path.exists(rollout_log):
        with open(rollout_log) as f:
            for line in f:
                r = json.loads(line)
                applied[r["version"]] = r
    rows = []
    for m in sorted(manifests, key=lambda m: m.version):
        dense = m.dense_bytes
        delta = m.delta_bytes() if m.parts else m.keyframe_bytes()
        met = metrics.get(m.step) if m.step is not None else None
        a = applied.get(m.version)
        rows.append({"version": m.version, "step": m.step, "change_rate": m.change_rate,
                     "delta_bytes": delta, "dense_bytes": dense, "ratio": dense / delta if delta else None,
                     "publish_s": met.get("dcr/publish_s") if met else None,
                     "apply_s": a["apply_s"] if a else None, "verified": bool(a and a["verified"]),
                     "sample": a["sample"] if a else None})
    return rows


def _plot(rows, path):
    try:
        matplotlib = require("matplotlib", "plot", "the demo's plot")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # MissingExtraError too: the plot is optional
        return None
    deltas = [r for r in rows if r["change_rate"] is not None]
    if not deltas:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    v = [r["version"] for r in deltas]
    ax[0].plot(v, [100 * r["change_rate"] for r in deltas], marker="o")
    ax[0].set_xlabel("version")
    ax[0].set_ylabel("BF16 elements changed (%)")
    ax[1].bar(v, [r["dense_bytes"] / 2**20 for r in deltas], label="dense", color="#ccc")
    ax[1].bar(v, [r["delta_bytes"] / 2**20 for r in deltas], label="delta", color="#36c")
    ax[1].set_xlabel("version")
    ax[1].set_ylabel("MiB per version")
    ax[1].legend()
    fig.suptitle("nemo-dcr demo: what each version sends")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m nemo_dcr.cli.demo")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rollout")
    r.add_argument("--store", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--done", required=True)
    a = p.parse_args(argv)
    if a.cmd == "rollout":
        torch.set_num_threads(1)
        rollout_main(a.store, a.out, a.done)


if __name__ == "__main__":
    main()
