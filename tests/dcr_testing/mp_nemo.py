"""Worker processes for tests/test_nemo.py: the Lightning callback under NeMo 2's own stack on
CPU, over gloo: ``nemo.lightning.Trainer`` with ``MegatronStrategy`` (TP=2), NeMo's
``llm.GPTModel`` (its ``configure_model`` builds the megatron-core GPTModel) and the
``MegatronParallel`` wrapper and Megatron DDP the strategy puts around it.

As far as CPU allows: the strategy's ``training_step`` moves a logged step counter to CUDA
(``torch.tensor(..., pin_memory=True).to("cuda")``), so no optimizer step runs here; the
callback publishes the initial weights (``publish_initial``) at ``on_train_start``, jointly from
both TP ranks, and training stops there (``trainer.should_stop``, Lightning's own early stop).
tests/gpu/run_nemo.py runs the rest (optimizer steps, a resume) on a GPU. Each rank writes its
Megatron shards (``megatron_snapshot``) as the reference. ``cpu_shim`` (dcr_testing/mp_megatron)
covers megatron-core's CUDA calls on a CPU model; NeMo's ``init_model_parallel`` also opens a
CUDA stream, which the shim makes a no-op context here.
"""
from __future__ import annotations

import contextlib
import datetime
import os

import torch

TIMEOUT = datetime.timedelta(seconds=60)
VOCAB = 128


class _Tok:
    """What llm.GPTModel / MockDataModule read of a tokenizer (no download)."""
    vocab_size = VOCAB
    eos_id = 0


def _shim():
    from dcr_testing.mp_megatron import cpu_shim
    cpu_shim()
    torch.cuda.Stream = lambda *a, **k: None
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


def _publish_initial(rank, world, spec, res):
    import lightning.pytorch as pl
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm

    from nemo_dcr.integrations import DeltaPublishCallback
    from nemo_dcr.integrations.megatron import megatron_snapshot

    class StopAtStart(pl.Callback):
        """Record the model NeMo built, then stop before the first (CUDA-only) training step."""

        def on_train_start(self, trainer, pl_module):
            tensors, shards = megatron_snapshot(pl_module)
            torch.save({n: (t, shards.get(n)) for n, t in tensors.items()},
                       os.path.join(spec["refs"], f"rank{rank}.pt"))
            res["megatron_parallel"] = type(trainer.strategy.model).__name__
            res["module"] = type(pl_module.module).__name__
            trainer.should_stop = True

    cfg = llm.GPTConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
                        use_cpu_initialization=True, init_method_std=0.02, bf16=False, params_dtype=torch.float32,
                        vocab_size=VOCAB, make_vocab_size_divisible_by=VOCAB)
    opt = nl.MegatronOptimizerModule(config=OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False, fp16=False))
    model = llm.GPTModel(cfg, tokenizer=_Tok(), optim=opt)
    data = llm.MockDataModule(seq_length=32, tokenizer=_Tok(), micro_batch_size=2, global_batch_size=2,
                              num_train_samples=16, num_workers=0)
    cb = DeltaPublishCallback(spec["store"], publish_initial=True, dtype="bfloat16", background=False)
    # setup_optimizers=False: megatron-core's optimizers put their loss scale on CUDA (and no step runs here)
    strategy = nl.MegatronStrategy(tensor_model_parallel_size=world, process_group_backend="gloo",
                                   ckpt_async_save=False, replace_progress_bar=False, setup_optimizers=False)
    trainer = nl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=2,
                         callbacks=[StopAtStart(), cb], logger=False, enable_checkpointing=False,
                         limit_val_batches=0, num_sanity_val_steps=0, plugins=nl.MegatronMixedPrecision(precision="32"))
    trainer.fit(model, data)
    res["published"] = cb.last_published
    res["joint"] = cb.loop.joint
    res["global_step"] = trainer.global_step


SCENARIOS = {"initial": _publish_initial}


def main(rank: int, world: int, port: int, spec: dict, scenario: str, out: str) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    # NeMo's strategy joins the group itself, through Lightning's environment variables
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    from dcr_testing.procs import run_rank
    run_rank(rank, world, None, out, lambda res: SCENARIOS[scenario](rank, world, spec, res), TIMEOUT,
             prepare=_shim)
