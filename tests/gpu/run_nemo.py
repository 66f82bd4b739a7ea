#!/usr/bin/env python
"""GPU check of the Lightning callback under NeMo 2 (issue 23), not collected by pytest: what
tests/test_nemo.py cannot run on CPU (MegatronStrategy's training step moves its logged step
to CUDA; megatron-core's optimizers keep their loss scale there).

    python tests/gpu/run_nemo.py [--steps 4] [--json OUT.json]      # in the NeMo env (make venv-nemo)

Skips cleanly (exit 0, "SKIP: ...") without CUDA or NeMo. Otherwise, on one GPU: NeMo's
``nl.Trainer`` + ``MegatronStrategy`` (TP=1, nccl) + ``llm.GPTModel`` (a tiny GPT, bf16 mixed
precision, megatron-core's Adam) + ``MockDataModule``, ``DeltaPublishCallback(publish_initial,
every_n_steps=1, dtype=bfloat16)``; a recorder callback copies ``megatron_snapshot`` after every
optimizer step; a plain CPU receiver (``Follower``) then pulls every version and must equal the
recorded weights bit for bit. (A resume needs NeMo's checkpoint layout and is not covered here.)

Prints one line per check; ``--json`` writes the figures. Exit 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        import torch
        if not torch.cuda.is_available():
            print("SKIP: no CUDA device")
            return 0
        import lightning.pytorch as pl
        from megatron.core.optimizer import OptimizerConfig
        from nemo import lightning as nl
        from nemo.collections import llm
    except ImportError as e:
        print(f"SKIP: {e}")
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from nemo_dcr.integrations import DeltaPublishCallback
    from nemo_dcr.integrations.megatron import megatron_snapshot
    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.follower import Follower

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    root = tempfile.mkdtemp(prefix="dcr-nemo-gpu-")
    snaps: dict = {}

    class Recorder(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            snaps[trainer.global_step] = megatron_snapshot(pl_module, device="cpu")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snaps[trainer.global_step] = megatron_snapshot(pl_module, device="cpu")

    class Tok:
        vocab_size = 128
        eos_id = 0

    cfg = llm.GPTConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, seq_length=64,
                        init_method_std=0.02, bf16=True, params_dtype=torch.bfloat16, vocab_size=128,
                        make_vocab_size_divisible_by=128)
    model = llm.GPTModel(cfg, tokenizer=Tok(), optim=nl.MegatronOptimizerModule(
        config=OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True)))
    data = llm.MockDataModule(seq_length=64, tokenizer=Tok(), micro_batch_size=2, global_batch_size=2,
                              num_train_samples=1000, num_workers=0)
    cb = DeltaPublishCallback(root, publish_initial=True, dtype="bfloat16")
    figures: dict = {}
    ok = True
    try:
        trainer = nl.Trainer(accelerator="gpu", devices=1, max_steps=a.steps, callbacks=[Recorder(), cb],
                             strategy=nl.MegatronStrategy(tensor_model_parallel_size=1, ckpt_async_save=False),
                             plugins=nl.MegatronMixedPrecision(precision="bf16-mixed"), logger=False,
                             enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(model, data)
        figures["published"] = dict(cb.last_published)
        print(f"fit: published up to version {cb.last_published['version']} (step {cb.last_published['step']}), "
              f"joint={cb.loop.joint}")
        ok = cb.last_published["version"] == a.steps
        tensors0, _ = snaps[0]
        recv = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in tensors0.items()}
        f = Follower(LocalStore(root), recv)
        for v, step in enumerate(sorted(snaps)):
            f.sync(v)
            want = {n: t.to(torch.bfloat16) for n, t in snaps[step][0].items()}
            bad = [n for n in want if not torch.equal(recv[n].view(torch.int16), want[n].view(torch.int16))]
            print(f"version {v} (step {step}): {'OK' if not bad else 'MISMATCH ' + str(bad[:3])}")
            ok = ok and not bad
    except Exception:
        traceback.print_exc()
        ok = False
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"ok": ok, **figures}, fh, indent=1)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
