"""``nemo-dcr demo``: the main job, an RL loop. A trainer and a rollout engine in two processes,
on the embedded local store (a directory) or any store URL. The policy and its task (single-digit
addition with a verifiable reward) are in ``demo_policy.py``.

* Rollout (a separate process): a BF16 copy of the policy with ``RolloutLoader``. Before each
  batch it brings the weights to the version the batch is due on (verified bit-exactly against
  the version's digest, and compared with the digest of the trainer's own BF16 bits), samples a
  group of completions per prompt, scores them, and sends tokens, log-probabilities and rewards
  back as one file per batch (the store carries only weights).
* Trainer (this process): a Lightning ``Trainer`` (AdamW, fp32 master weights) takes one
  GRPO-style step per batch and ``DeltaPublishCallback`` publishes the BF16 weights after every
  step, in its background thread.

One step off-policy: batch ``b`` is sampled on version ``b - 1`` while the trainer turns batch
``b - 1`` into version ``b`` and publishes it; the rollout's wait for weights is the time between
sending a batch and holding the next version. A last batch scores the final version.

At the end a table per version (reward, change rate, delta vs dense bytes, publish time, the
rollout's wait and apply time, verified) is printed, written to ``WORKDIR/summary.json``, and
plotted to ``WORKDIR/demo.png`` when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings

import torch

from nemo_dcr.cli.demo_policy import PROMPT_LEN, PolicyLM, decode, grpo_loss, problems, sample, score, warm_up
from nemo_dcr.util.extras import require

POLL_S = 0.005  # how often each side looks for the other's output (a file, the store's HEAD)


def bits_digest(tensors: dict, dtype: torch.dtype | None = None) -> str:
    """SHA-256 of the tensors' raw bits (names sorted; floating-point tensors cast to ``dtype``
    first): the check of the rollout's weights against the trainer's own, independent of the
    digests nemo-dcr records."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RolloutFiles:
    """The rollouts' way back to the trainer: one file per batch, written whole and renamed in."""

    def __init__(self, directory: str):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, batch: int) -> str:
        return os.path.join(self.dir, f"batch-{batch:05d}.pt")

    def put(self, batch: int, data: dict) -> None:
        tmp = self._path(batch) + ".tmp"
        torch.save(data, tmp)
        os.replace(tmp, self._path(batch))

    def get(self, batch: int, writer: subprocess.Popen, timeout_s: float = 600.0) -> dict:
        """Batch ``batch``, once the rollout process has written it (an error if it exits first)."""
        path, t_end = self._path(batch), time.monotonic() + timeout_s
        while not os.path.exists(path):
            if writer.poll() is not None:
                raise SystemExit(f"demo: the rollout process exited (status {writer.returncode}) before batch {batch}")
            if time.monotonic() > t_end:
                raise SystemExit(f"demo: no rollout batch {batch} after {timeout_s:.0f} s")
            time.sleep(POLL_S)
        return torch.load(path, weights_only=True)


# ---------------------------------------------------------------------------- rollout process
def _trainer_digest(path: str, step: int) -> str | None:
    """The digest the trainer wrote for ``step`` (before that step's snapshot, so before the
    version could be committed)."""
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                rec = json.loads(line)
                if rec["step"] == step:
                    return rec["digest"]
    return None


def _wait_for_version(loader, version: int, parent: int, t_end: float) -> None:
    while loader.follower.wait(newer_than=version - 1, timeout=1.0, poll_interval=POLL_S) is None:
        if os.getppid() != parent:
            raise SystemExit("rollout: the trainer process is gone")
        if time.monotonic() > t_end:
            raise SystemExit(f"rollout: gave up waiting for version {version}")


def rollout_main(store: str, workdir: str, batches: int, first: int, prompts: int, group: int,
                 deadline_s: float = 600.0) -> None:
    from nemo_dcr.integrations import RolloutLoader, module_tensors

    torch.manual_seed(0)
    model = PolicyLM().to(torch.bfloat16).eval()
    loader = RolloutLoader(store, model)  # the first update reads a keyframe
    files = RolloutFiles(os.path.join(workdir, "rollouts"))
    bits = os.path.join(workdir, "trainer_bits.jsonl")
    parent, t_end = os.getppid(), time.monotonic() + deadline_s
    with open(os.path.join(workdir, "rollout.jsonl"), "w") as log:
        # batch b on version b - 1; the last two versions (trained on no batch) are scored too
        plan = [max(b - 1, 0) for b in range(batches)]
        plan += [v for v in (batches - 1, batches) if v > plan[-1]]
        for b, v in enumerate(plan):
            final = b >= batches  # nothing left to train on
            target = first + v
            t0 = time.perf_counter()
            _wait_for_version(loader, target, parent, t_end)
            t1 = time.perf_counter()
            before = loader.version
            if loader.update(version=target) != target:  # verified against the version's digest
                raise SystemExit(f"rollout: asked for version {target}, hold {loader.version}")
            t2 = time.perf_counter()
            new = before != target
            res = loader.last_result
            manifest = loader.follower.manifest
            step = manifest.step if manifest is not None else None
            theirs = _trainer_digest(bits, step) if step is not None else None
            mine = bits_digest(module_tensors(model))
            if mine != theirs:
                raise SystemExit(f"rollout: version {target} (step {step}) holds bits {mine[:16]}, the trainer's "
                                 f"were {theirs and theirs[:16]}")
            a, c = problems(prompts, seed=10_000 + b)
            with loader.sampling():
                tokens, logps = sample(model, a, c, group, seed=b)
            reward, mask = score(tokens, a, c, group)
            if not final:
                files.put(b, {"batch": b, "version": target, "tokens": tokens, "logprobs": logps, "mask": mask,
                              "reward": reward})
            rec = {"batch": b, "version": target, "step": step, "final": final, "reward": float(reward.mean()),
                   "new_version": new, "wait_s": t2 - t0 if new else 0.0, "apply_s": t2 - t1 if new else 0.0,
                   "fetched_bytes": res.bytes if new and res is not None else 0,
                   "verified": True, "trainer_bits": True,
                   "sample": decode(tokens[0, :PROMPT_LEN + int(mask[0].sum())])}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if b % 10 == 0 or b == len(plan) - 1:
                print(f"  [rollout] batch {b:>3} on version {target:>3} (waited {1e3 * rec['wait_s']:5.1f} ms, "
                      f"applied in {1e3 * rec['apply_s']:5.1f} ms, verified, = trainer's bits): "
                      f"reward {rec['reward']:.2f}, e.g. {rec['sample']!r}", flush=True)


# ---------------------------------------------------------------------------- trainer + driver
def _lightning_parts(model, lr: float, group: int, clip: float, files: RolloutFiles, batches: int,
                     rollout: subprocess.Popen, bits_path: str):
    require("lightning.pytorch", "lightning", "the demo")
    from lightning.pytorch import Callback, LightningModule

    from nemo_dcr.integrations import module_tensors

    class Rollouts(torch.utils.data.Dataset):
        """Batch ``b``, when the rollout has sent it. A sized dataset: Lightning fetches no batch
        ahead of the step that takes it (as it does for an iterable one of unknown length), which
        would hold up version 0 and, later, the overlap of training and sampling."""

        def __len__(self):
            return batches

        def __getitem__(self, b):
            return files.get(b, rollout)

    class GRPO(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            loss, clipfrac = grpo_loss(self.model, batch["tokens"], batch["logprobs"], batch["mask"],
                                       batch["reward"], group, clip)
            self.log_dict({"reward": batch["reward"].mean(), "clipfrac": clipfrac}, batch_size=1)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Rollouts(), batch_size=None)

    class TrainerBits(Callback):
        """The digest of the BF16 weights the trainer is about to publish, per step. Listed
        before DeltaPublishCallback, so it is written before the step's snapshot."""

        def _write(self, trainer, pl_module):
            with open(bits_path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step,
                                    "digest": bits_digest(module_tensors(pl_module.model), torch.bfloat16)}) + "\n")

        def on_train_start(self, trainer, pl_module):
            self._write(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._write(trainer, pl_module)

    return GRPO(), TrainerBits()


def run_demo(workdir: str = "runs/demo", store: str | None = None, steps: int = 80, lr: float = 3e-4,
             keyframe_every: int = 0, warmup_steps: int = 150, prompts: int = 16, group: int = 8,
             clip: float = 0.2, out=print) -> list:
    pl = require("lightning.pytorch", "lightning", "the demo")
    from lightning.pytorch.loggers import CSVLogger

    from nemo_dcr.checkpoint.sync import history
    from nemo_dcr.integrations import DeltaPublishCallback
    from nemo_dcr.stores import open_store
    from nemo_dcr.sync.versions import read_head

    if os.path.exists(workdir):
        shutil.rmtree(workdir)
    os.makedirs(workdir)
    store = store or os.path.join(workdir, "store")
    head, _ = read_head(open_store(store))
    first = 0 if head is None else head.version + 1  # the version publish_initial will be
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = PolicyLM()
    loss = warm_up(model, warmup_steps)
    out(f"nemo-dcr demo: an RL loop. A {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter policy, "
        f"warmed up {warmup_steps} steps on noisy sums (loss {loss:.2f}), learns single-digit addition from a "
        f"verifiable reward: {steps} GRPO steps ({prompts} prompts x {group} samples, lr {lr:g}), one version per "
        f"step, rollouts one version behind, on store {store}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rollout = subprocess.Popen([sys.executable, "-m", "nemo_dcr.cli.demo", "rollout", "--store", store,
                                "--workdir", workdir, "--batches", str(steps), "--first", str(first),
                                "--prompts", str(prompts), "--group", str(group)], env=env)
    try:
        pl.seed_everything(0, verbose=False)
        module, bits = _lightning_parts(model, lr, group, clip, RolloutFiles(os.path.join(workdir, "rollouts")),
                                        steps, rollout, os.path.join(workdir, "trainer_bits.jsonl"))
        cb = DeltaPublishCallback(store, every_n_steps=1, keyframe_every=keyframe_every, dtype="bfloat16",
                                  submodule="model", publish_initial=True)
        # Lightning's notes (accelerators found, tips, "max_steps reached") off: the table below is the output
        with warnings.catch_warnings(), _quiet("lightning.pytorch.utilities.rank_zero"):
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
            warnings.filterwarnings("ignore", ".*LeafSpec.*")
            trainer = pl.Trainer(accelerator="cpu", max_steps=steps, callbacks=[bits, cb], enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                                 logger=CSVLogger(workdir, name="trainer", version=""))
            trainer.fit(module)
        rc = rollout.wait(timeout=600)
    finally:
        if rollout.poll() is None:
            rollout.kill()
            rollout.wait()
    if rc != 0:
        raise SystemExit(f"demo: the rollout process failed (exit {rc})")
    manifests = [m for m in history(store) if m.version >= first]
    rows = _table(manifests, _metrics(os.path.join(workdir, "trainer", "metrics.csv")),
                  os.path.join(workdir, "rollout.jsonl"))
    out(f"\n{'ver':>4} {'step':>4} {'reward':>6} {'change %':>9} {'delta B':>9} {'dense B':>9} {'ratio':>6} "
        f"{'publish s':>9} {'wait ms':>8} {'apply ms':>8}  verified")
    shown = _shown(len(rows))
    for i, r in enumerate(rows):
        if i not in shown:
            if i - 1 in shown:
                out(f"{'...':>4}")
            continue
        cr = f"{100 * r['change_rate']:.2f}" if r["change_rate"] is not None else "keyframe"
        ratio = f"{r['ratio']:.1f}x" if r["ratio"] else "-"
        pub = f"{r['publish_s']:.3f}" if r["publish_s"] is not None else "-"
        wait = f"{1e3 * r['wait_s']:.1f}" if r["wait_s"] is not None else "-"
        app = f"{1e3 * r['apply_s']:.1f}" if r["apply_s"] is not None else "-"
        rew = f"{r['reward']:.2f}" if r["reward"] is not None else "-"
        out(f"{r['version']:>4} {r['step'] if r['step'] is not None else '-':>4} {rew:>6} {cr:>9} "
            f"{r['delta_bytes']:>9,} {r['dense_bytes']:>9,} {ratio:>6} {pub:>9} {wait:>8} {app:>8}  "
            f"{'bit-exact' if r['verified'] else 'NO'}")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=2)
    plot = _plot(rows, os.path.join(workdir, "demo.png"))
    ok = all(r["verified"] for r in rows)
    early, late = _trend(rows)
    verdict = "every one bit-exactly (= the trainer's own bits)" if ok else "NOT all"
    out(f"reward {early:.2f} over the first versions -> {late:.2f} over the last; {len(rows)} versions; the rollout "
        f"verified {verdict}; "
        f"summary {workdir}/summary.json"
        + (f", plot {plot}" if plot else ' (pip install "nemo-dcr[plot]" for a plot)'))
    if not ok:
        raise SystemExit("demo: some versions were not verified")
    return rows


@contextlib.contextmanager
def _quiet(logger: str):
    """``logger`` at WARNING for the block."""
    lg = logging.getLogger(logger)
    level = lg.level
    lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        lg.setLevel(level)


def _shown(n: int) -> set:
    """The rows printed (all of them are in summary.json): the first few, every tenth, the last."""
    return set(range(n)) if n <= 24 else {i for i in range(n) if i < 4 or i % 10 == 0 or i >= n - 2}


def _trend(rows) -> tuple[float, float]:
    """Mean reward over the first and the last fifth of the versions (at least 3 each)."""
    rs = [r["reward"] for r in rows if r["reward"] is not None]
    k = max(3, len(rs) // 5)
    return sum(rs[:k]) / len(rs[:k]), sum(rs[-k:]) / len(rs[-k:])


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
    """One row per version: what the store holds, the publish metrics, what the rollout saw."""
    by_version: dict[int, list] = {}
    if os.path.exists(rollout_log):
        with open(rollout_log) as f:
            for line in f:
                r = json.loads(line)
                by_version.setdefault(r["version"], []).append(r)
    rows = []
    for m in sorted(manifests, key=lambda m: m.version):
        dense = m.dense_bytes
        delta = m.delta_bytes() if m.parts else m.keyframe_bytes()
        met = metrics.get(m.step) if m.step is not None else None
        seen = by_version.get(m.version, [])
        arrived = next((r for r in seen if r["new_version"]), None)
        rows.append({"version": m.version, "step": m.step, "change_rate": m.change_rate,
                     "reward": sum(r["reward"] for r in seen) / len(seen) if seen else None,
                     "delta_bytes": delta, "dense_bytes": dense, "ratio": dense / delta if delta else None,
                     "publish_s": met.get("dcr/publish_s") if met else None,
                     "wait_s": arrived["wait_s"] if arrived else None,
                     "apply_s": arrived["apply_s"] if arrived else None,
                     "fetched_bytes": arrived["fetched_bytes"] if arrived else None,
                     "verified": bool(arrived and arrived["verified"] and arrived["trainer_bits"]),
                     "sample": seen[0]["sample"] if seen else None})
    return rows


def _plot(rows, path):
    try:
        matplotlib = require("matplotlib", "plot", "the demo's plot")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # MissingExtraError too: the plot is optional
        return None
    v = [r["version"] for r in rows]
    deltas = [r for r in rows if r["change_rate"] is not None]
    dv = [r["version"] for r in deltas]
    fig, ax = plt.subplots(2, 2, figsize=(10, 6.4))
    ax[0, 0].plot(v, [r["reward"] for r in rows], marker=".")
    ax[0, 0].set_ylabel("reward (mean of the batch)")
    ax[0, 0].set_ylim(0, 1)
    ax[0, 1].plot(dv, [100 * r["change_rate"] for r in deltas], marker=".")
    ax[0, 1].set_ylabel("BF16 elements changed (%)")
    ax[1, 0].bar(dv, [r["dense_bytes"] / 2**10 for r in deltas], label="dense", color="#ccc")
    ax[1, 0].bar(dv, [r["delta_bytes"] / 2**10 for r in deltas], label="delta", color="#36c")
    ax[1, 0].set_ylabel("KiB per version")
    ax[1, 0].legend()
    waited = [r for r in rows if r["wait_s"] is not None]
    ax[1, 1].bar([r["version"] for r in waited], [1e3 * r["wait_s"] for r in waited], label="wait for weights",
                 color="#ccc")
    ax[1, 1].bar([r["version"] for r in waited], [1e3 * r["apply_s"] for r in waited], label="of which apply",
                 color="#36c")
    ax[1, 1].set_ylabel("rollout waits (ms)")
    ax[1, 1].legend()
    for a in ax.flat:
        a.set_xlabel("version")
    fig.suptitle("nemo-dcr demo: an RL loop, one version per step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m nemo_dcr.cli.demo")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rollout")
    r.add_argument("--store", required=True)
    r.add_argument("--workdir", required=True)
    r.add_argument("--batches", type=int, required=True)
    r.add_argument("--first", type=int, required=True, help="the version the trainer publishes first")
    r.add_argument("--prompts", type=int, required=True)
    r.add_argument("--group", type=int, required=True)
    a = p.parse_args(argv)
    if a.cmd == "rollout":
        torch.set_num_threads(1)
        rollout_main(a.store, a.workdir, a.batches, a.first, a.prompts, a.group)


if __name__ == "__main__":
    main()
