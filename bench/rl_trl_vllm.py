"""The RL loop with a real RL library and a real engine: TRL's ``GRPOTrainer`` trains a tiny
Llama (or Qwen2) on CPU; its rollouts come from a stock vLLM engine, refitted by nemo-dcr after
every optimizer step instead of the library's own weight sync; every version the engine serves is
read back and compared with the trainer's BF16 bits.

    make test-trl                                    # builds the TRL venv, runs tests/test_trl_vllm.py
    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD ~/.cache/nemo-dcr/venv-trl-1.16.0/bin/python \\
        bench/rl_trl_vllm.py --steps 30 [--model qwen2] [--json FILE]

How the pieces meet (TRL 1.16, vLLM-CPU 0.32):

* TRL generates through ``rollout_func`` (its seam for custom rollouts): before sampling, if the
  trainer has stepped since the last batch, the trainer's BF16 weights are published as the next
  version (``Publisher``, the machinery ``DeltaPublishCallback`` runs) and the engine is refitted
  (``refit(llm, store)``); then the engine samples the group of completions per prompt with their
  log-probabilities. The version the engine holds is read back (``dcr_raw_bits``) and compared
  with the trainer's own BF16 bits.
* In the same run a second stock engine (the baseline engine; it serves nothing) takes the same
  weights, each step, the two dense ways:
  - *push*: every parameter handed to the engine (``collective_rpc("reload_weights",
    weights_iterator=...)``, vLLM's in-place reload), which is what TRL's own colocate sync does:
    TRL 1.16's ``sync_weights`` itself calls ``model.load_weights`` on the engine's model, and on
    vLLM-CPU that fails (``'Parameter' object has no attribute 'weight_loader'``: the linear layers
    were repacked into oneDNN handles after loading), so vLLM's reload API stands in for it;
  - *reload*: the trainer saves the BF16 weights as a safetensors checkpoint and the engine
    reloads it from disk (``reload_weights(weights_path=...)``).
  After both, the baseline engine's greedy tokens must equal the refitted engine's.

The task: prompts of 6 random tokens; the verifiable reward is the share of completion tokens
drawn from a target set (an eighth of the vocabulary, token ids from 100 on).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

PROMPT_LEN = 6
EXT = "nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension"


#: model sizes: ``tiny`` (0.4M parameters: the test), ``small`` (16M: the timing table in docs/results.md)
SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096),
}


def target(vocab: int) -> range:
    """The reward's target tokens: an eighth of the vocabulary."""
    return range(100, 100 + vocab // 8)


def checkpoint(kind: str, size: str, path: str) -> str:
    """A random-init Hugging Face model saved in BF16 with a word-level tokenizer (``t0``,
    ``t1``, ...): no hub access needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    common = dict(SIZES[size], max_position_embeddings=256, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    cfg = LlamaConfig(tie_word_embeddings=False, **common) if kind == "llama" else \
        Qwen2Config(tie_word_embeddings=True, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t1", eos_token="t2", pad_token="t0",
                            unk_token="t0").save_pretrained(path)
    return path


def engine(path: str, extension: bool):
    from vllm import LLM
    kw = {"worker_extension_cls": EXT} if extension else {}
    return LLM(model=path, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=64,
               block_size=32, seed=0, enable_prefix_caching=True, **kw)


def greedy(llm, prompts) -> list:
    from vllm import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reward_func(vocab: int):
    want = target(vocab)

    def reward(completions, completion_ids, **kwargs) -> list[float]:
        """The share of completion tokens in the target set."""
        return [sum(t in want for t in ids) / max(1, len(ids)) for ids in completion_ids]

    return reward


def bits(tensors: dict) -> dict[str, bytes]:
    from nemo_dcr.state.dtypes import int_view
    return {k: int_view(v.detach().cpu().contiguous()).numpy().tobytes() for k, v in tensors.items()}


class Refit:
    """After each optimizer step (once per generation batch): publish the trainer's BF16 weights,
    refit the serving engine, check its bits; then the two dense baselines on the other engine."""

    def __init__(self, llm, baseline, store: str, initial: str, workdir: str, log=print):
        from nemo_dcr.sync.publisher import Publisher
        self.llm, self.baseline, self.store, self.workdir, self.log = llm, baseline, store, workdir, log
        self.initial = initial  # the checkpoint both engines started on (its config for the dense reload)
        self.publisher = Publisher(store)
        self.step: int | None = None
        self.rows: list[dict] = []
        self.probe = [[(7 * i + 3 * j) % 400 + 3 for j in range(PROMPT_LEN)] for i in range(4)]

    def __call__(self, model, step: int) -> None:
        if step == self.step:
            return
        from safetensors.torch import save_file

        from nemo_dcr.integrations import module_snapshot, refit

        state = module_snapshot(model, dtype="bfloat16")[0]  # the trainer's BF16 bits, Hugging Face names
        t0 = time.perf_counter()
        res = self.publisher.publish(state, step=step)
        t1 = time.perf_counter()
        held = refit(self.llm, self.store)  # the first one reads the keyframe
        t2 = time.perf_counter()
        if held != res.version:
            raise RuntimeError(f"the engine holds version {held}, not {res.version}")
        served = self.llm.collective_rpc("dcr_raw_bits")[0]
        want = bits(state)
        if served != want:
            bad = sorted(k for k in want if served.get(k) != want[k])
            raise RuntimeError(f"version {res.version}: the engine's bits differ from the trainer's in {bad[:5]}")
        row = {"step": step, "version": res.version, "change_rate": res.change_rate, "delta_bytes": res.delta_bytes,
               "dense_bytes": sum(v.numel() * v.element_size() for v in state.values()),
               "publish_s": t1 - t0, "refit_s": t2 - t1, "dcr_s": t2 - t0, "bit_exact": True}
        if self.baseline is not None:
            # push: every parameter, as the trainer holds it (what TRL's sync hands the engine)
            params = [(n, p.detach()) for n, p in model.named_parameters()]
            t3 = time.perf_counter()
            self.baseline.collective_rpc(_push(params))
            self.baseline.reset_prefix_cache()
            t4 = time.perf_counter()
            ckpt = os.path.join(self.workdir, "dense")
            if not os.path.exists(ckpt):
                import shutil
                shutil.copytree(self.initial, ckpt,
                                ignore=shutil.ignore_patterns("*.safetensors"))
            save_file(state, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
            self.baseline.collective_rpc("reload_weights", kwargs={"weights_path": ckpt})
            self.baseline.reset_prefix_cache()
            t5 = time.perf_counter()
            same = greedy(self.llm, self.probe) == greedy(self.baseline, self.probe)
            if not same:
                raise RuntimeError(f"version {res.version}: the baseline engine's greedy tokens differ from the "
                                 "refitted engine's")
            row.update(push_s=t4 - t3, reload_s=t5 - t4, same_tokens=same)
        self.rows.append(row)
        self.step = step
        self.log(f"  [sync] step {step:>3}: version {res.version:>3} ({100 * res.change_rate:5.1f} % changed, "
                 f"{res.delta_bytes:,} B of {row['dense_bytes']:,}) publish {1e3 * row['publish_s']:6.1f} ms + refit "
                 f"{1e3 * row['refit_s']:6.1f} ms, bit-exact"
                 + (f"; push {1e3 * row['push_s']:6.1f} ms, reload {1e3 * row['reload_s']:6.1f} ms"
                    if "push_s" in row else ""))


def _push(params: list):
    """A function for ``collective_rpc``: each worker reloads ``params`` in place (vLLM's
    ``reload_weights``). It goes to the worker pickled, tensors and all (vLLM sends a function
    with VLLM_ALLOW_INSECURE_SERIALIZATION=1; tensors given as arguments reach it as lists)."""
    def push(worker):
        worker.reload_weights(weights_iterator=iter(params))
    return push


def rollout_func(llm, refit: Refit, max_tokens: int):
    """TRL's ``rollout_func``: refit after a step, then one completion per prompt (TRL's batch
    already holds each prompt ``num_generations`` times) with the sampled tokens' log-probabilities."""
    from vllm import SamplingParams

    def fn(prompts: list, trainer) -> dict:
        refit(trainer.model, trainer.state.global_step)
        # the prompts are "t<id>" words by construction (``run``): their ids read off directly. The
        # word-level tokenizer saved with the checkpoint is not what transformers 5's AutoTokenizer
        # loads for a qwen2 model type (it builds a Qwen2Tokenizer from the vocabulary: 6 words -> 1-2
        # ids), and a 1-token prompt crashes vLLM-CPU's attention on AMX (SIGILL, a stock engine too)
        ids = [[int(w[1:]) for w in p.split()] for p in prompts]
        seed = 1000 * trainer.state.global_step
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=seed + i)
                  for i in range(len(ids))]
        outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        completion_ids = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
        return {"prompt_ids": ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return fn


def run(steps: int = 30, kind: str = "llama", size: str = "tiny", workdir: str | None = None, baseline: bool = True,
        lr: float = 1e-3,
        prompts_per_step: int = 4, group: int = 8, max_tokens: int = 8, log=print) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
    if baseline:  # the push baseline hands the worker a function (see _push)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="dcr-trl-")
    path = checkpoint(kind, size, os.path.join(workdir, "initial"))
    vocab = SIZES[size]["vocab_size"]
    llm = ref = None
    try:
        t_start = time.perf_counter()
        llm = engine(path, extension=True)
        ref = engine(path, extension=False) if baseline else None
        log(f"engines started in {time.perf_counter() - t_start:.0f} s")
        refit = Refit(llm, ref, os.path.join(workdir, "store"), path, workdir, log)
        g = torch.Generator().manual_seed(0)
        data = [" ".join(f"t{int(i)}" for i in torch.randint(3, vocab, (PROMPT_LEN,), generator=g))
                for _ in range(steps * prompts_per_step)]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # fp32 master weights
        cfg = GRPOConfig(output_dir=os.path.join(workdir, "trl"), per_device_train_batch_size=prompts_per_step * group,
                         num_generations=group, max_completion_length=max_tokens, max_steps=steps,
                         learning_rate=lr, lr_scheduler_type="constant", beta=0.0, logging_steps=1,
                         report_to="none", use_cpu=True, seed=0,
                         save_strategy="no", disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_func(vocab), args=cfg,
                              train_dataset=Dataset.from_dict({"prompt": data}),
                              processing_class=AutoTokenizer.from_pretrained(path),
                              rollout_func=rollout_func(llm, refit, max_tokens))
        t0 = time.perf_counter()
        trainer.train()
        refit(trainer.model, trainer.state.global_step)  # the last step's version, served and checked too
        train_s = time.perf_counter() - t0
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    finally:
        for e in (llm, ref):
            if e is not None:
                e.llm_engine.engine_core.shutdown()
        if own:
            import shutil
            shutil.rmtree(workdir, ignore_errors=True)
    return {"model": kind, "size": size, "parameters": sum(p.numel() for p in model.parameters()), "steps": steps,
            "lr": lr, "rewards": rewards, "versions": refit.rows, "train_s": train_s,
            "trl": _version("trl"), "vllm": _version("vllm"), "transformers": _version("transformers")}


def _version(pkg: str) -> str:
    from importlib.metadata import version
    return version(pkg if pkg != "vllm" else "vllm-cpu")


def table(result: dict) -> str:
    """Median per-step seconds the engine waits for weights, each way (step 0, the initial
    keyframe, left out)."""
    rows = [r for r in result["versions"] if r["step"] > 0]
    if not rows:
        return "(no steps)"

    def med(key):
        return statistics.median(r[key] for r in rows)

    dense = med("dense_bytes")
    lines = ["| way the engine gets the weights | per-step wait, median s | bytes moved per step (median) |",
             "|---|---|---|",
             f"| nemo-dcr: publish + `refit` (delta, verified) | {med('dcr_s'):.3f} "
             f"(publish {med('publish_s'):.3f} + refit {med('refit_s'):.3f}) | {med('delta_bytes'):,.0f} |"]
    if "push_s" in rows[0]:
        lines += [f"| push every parameter in memory (TRL's sync, through vLLM's `reload_weights`) | "
                  f"{med('push_s'):.3f} | {2 * dense:,.0f} (fp32 parameters) |",
                  f"| dense reload: save safetensors, engine reloads from disk | {med('reload_s'):.3f} "
                  f"| {dense:,.0f} |"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", choices=("llama", "qwen2"), default="llama")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--no-baseline", action="store_true", help="no second engine, no dense timings")
    p.add_argument("--json", metavar="FILE", help="also write the result (rewards, per-version rows) as JSON")
    a = p.parse_args(argv)
    res = run(a.steps, a.model, a.size, baseline=not a.no_baseline, lr=a.lr)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)  # (runs/ in a fresh clone)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    r = res["rewards"]
    k = max(1, len(r) // 3)
    print(f"\nreward {sum(r[:k]) / k:.3f} over the first {k} steps -> {sum(r[-k:]) / k:.3f} over the last {k}; "
          f"{len(res['versions'])} versions served, each bit-exact to the trainer's BF16 weights; "
          f"TRL {res['trl']}, vllm-cpu {res['vllm']}, transformers {res['transformers']}\n")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
