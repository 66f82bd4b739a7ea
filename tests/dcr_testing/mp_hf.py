"""Worker processes for tests/test_callback_hf.py's distributed case: a Hugging Face ``Trainer``
in 2 CPU processes (accelerate's DDP over gloo, joined through the environment variables
torchrun sets), with ``DeltaPublishTrainerCallback``. The model is replicated, so global rank 0
alone publishes; each rank writes its weights (bf16) after every step as the reference.
(FSDP2 through accelerate is GPU-only: accelerate enables its FSDP plugin for multi-GPU
distributed types, not MULTI_CPU; the DTensor path itself is tests/test_fsdp2.py.)"""
from __future__ import annotations

import os

import torch


def main(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from dcr_testing.procs import run_rank
    run_rank(rank, world, None, out, lambda res: _train(rank, spec, res), None)


def _train(rank, spec, res):
    import transformers

    from nemo_dcr.integrations import DeltaPublishTrainerCallback, module_snapshot

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.randint(3, 64, (12,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Recorder(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            torch.save(module_snapshot(model, dtype="bfloat16")[0],
                       os.path.join(spec["refs"], f"r{rank}-s{state.global_step}.pt"))

    args = transformers.TrainingArguments(output_dir=os.path.join(spec["refs"], "out"), max_steps=3, report_to="none",
                                          per_device_train_batch_size=2, use_cpu=True, ddp_backend="gloo",
                                          save_strategy="no", disable_tqdm=True, seed=0)
    cb = DeltaPublishTrainerCallback(spec["store"], dtype="bfloat16")
    t = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb, Recorder()])
    t.train()
    res.update(publishes=cb.loop.publishes, joint=cb.loop.joint, published=cb.last_published,
               world=int(t.args.world_size))
