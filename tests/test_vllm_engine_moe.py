"""The real vLLM engine on a tiny Mixtral (MoE): experts packed in ``FusedMoE``/``RoutedExperts``
(``w13_weight[e]`` = [w1 rows; w3 rows], ``w2_weight[e]``), prepacked in place by vLLM-CPU's MoE
kernel, and a router (``gate``) repacked like every linear.

The store holds the checkpoint's own Hugging Face names (``model.layers.N.block_sparse_moe.experts.
E.w1/w2/w3.weight``, ``...block_sparse_moe.gate.weight``), what a trainer publishes after the
Megatron->HF mapping. v0 and two updates that each train a subset of the experts (and the router of
one layer) are refitted into an engine started on v0; at v2 its greedy tokens and logprobs equal a
fresh engine's on v2's checkpoint and every published tensor's bits equal the trainer's. One refitted
and one fresh engine (~40 s each here). Runs in the vLLM venv (``make test-vllm``).
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from dcr_testing import vllm_models as vm

vm.require_vllm()

from nemo_dcr.integrations.vllm_worker import refit  # noqa: E402
from nemo_dcr.state.digest import tensor_digest  # noqa: E402
from nemo_dcr.sync.publisher import Publisher  # noqa: E402

EXPERTS = 4
# (layer, expert) pairs trained by each update; the others keep their bits
TRAINED = {1: [(0, 1), (1, 3)], 2: [(0, 1), (0, 2), (1, 0)]}


def tiny_mixtral(path: str, seed: int = 0) -> dict:
    """A tiny random-init Mixtral saved with ``save_pretrained`` (bf16); returns its checkpoint
    tensors (the HF names vLLM loads)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        num_local_experts=EXPERTS, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():  # spread the small random init so that generations differ by version
        for p in model.parameters():
            p.mul_(4.0)
    vm.save(model, path)
    return load_file(os.path.join(path, "model.safetensors"))


def train_experts(state: dict, step: int) -> dict:
    """A trainer-like update of some experts only (every element of theirs may move) and of the
    router of layer ``step % 2``; everything else keeps its bits."""
    g = torch.Generator().manual_seed(2000 + step)
    out = dict(state)
    names = [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
             for layer, e in TRAINED[step] for w in ("w1", "w2", "w3")]
    names.append(f"model.layers.{step % 2}.block_sparse_moe.gate.weight")
    for k in names:
        t = state[k]
        mask = torch.rand(t.shape, generator=g) < 0.3
        noise = (torch.randn(t.shape, generator=g) * 0.5).to(t.dtype)
        out[k] = torch.where(mask, t + noise, t).contiguous()
    return out


def save_state(src: str, dst: str, state: dict) -> str:
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_mixtral_refit_experts(tmp_path):
    v0 = str(tmp_path / "v0")
    state = tiny_mixtral(v0)
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in state
    assert json.load(open(os.path.join(v0, "config.json")))["num_local_experts"] == EXPERTS
    store = str(tmp_path / "store")
    pub = Publisher(store)
    states, path = [], v0
    for v in range(3):
        if v:
            state = train_experts(state, v)
            path = save_state(v0, str(tmp_path / f"v{v}"), state)
        states.append({k: tensor_digest(t) for k, t in state.items()})
        assert pub.publish(state, step=v).version == v
    changed = {k for k in states[2] if states[2][k] != states[0][k]}
    assert "model.layers.1.block_sparse_moe.experts.0.w2.weight" in changed
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" not in changed

    llm = vm.engine(v0)
    try:
        start = vm.greedy(llm)
        assert llm.collective_rpc("dcr_init", args=(store, 0)) == [0]  # plain copies read from v0's checkpoint
        assert llm.collective_rpc("dcr_fingerprint")[0] == states[0]
        for v in (1, 2):
            assert refit(llm, store, v) == v
            assert llm.collective_rpc("dcr_fingerprint")[0] == states[v]  # every expert, gate and up rows apart
        # the engine's own parameters, where it keeps checkpoint format (norms, embeddings, lm_head);
        # the experts (prepacked in place) and the linears (oneDNN handles) are read from their plain copies
        kept = llm.collective_rpc("dcr_fingerprint", args=(True,))[0]
        assert "model.norm.weight" in kept and all(states[2][k] == d for k, d in kept.items())
        assert not any(".experts." in k for k in kept)
        got = vm.greedy(llm)
        assert llm.collective_rpc("dcr_check") == [2]
    finally:
        vm.shutdown(llm)
    assert got != start
    assert got == vm.fresh_greedy(path)
