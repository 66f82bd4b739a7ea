"""The real vLLM engine on a Qwen2-style model: qkv bias, tied embeddings (vLLM's lm_head computes
from a packed copy of the embedding), a vocabulary vLLM pads (500 -> 512 rows).

Refitted v0 -> v1 -> v2 through ``refit(llm, store)`` without a known start version (the first
update reads the keyframe); at v2 greedy tokens and logprobs equal a fresh engine's on v2's
checkpoint, and every tensor's bits equal the trainer's. Runs in the vLLM venv (``make test-vllm``).
"""
from __future__ import annotations

from dcr_testing import vllm_models as vm

vm.require_vllm()

from nemo_dcr.integrations.vllm_worker import refit  # noqa: E402
from nemo_dcr.state.digest import tensor_digest  # noqa: E402
from nemo_dcr.sync.publisher import Publisher  # noqa: E402


def test_qwen2_refit_chain(tmp_path):
    model = vm.tiny_model("qwen2")
    store = str(tmp_path / "store")
    pub = Publisher(store)
    states = []
    for v in range(3):
        if v:
            vm.perturb(model, v)
        vm.save(model, str(tmp_path / f"v{v}"))
        state = vm.hf_state(model)
        assert "model.layers.0.self_attn.q_proj.bias" in state and "lm_head.weight" not in state
        states.append({k: tensor_digest(t) for k, t in state.items()})
        assert pub.publish(state, step=v).version == v

    llm = vm.engine(str(tmp_path / "v0"))
    try:
        start = vm.greedy(llm)
        for v in (1, 2):
            assert refit(llm, store, v) == v
            assert llm.collective_rpc("dcr_fingerprint")[0] == states[v]
            kept = llm.collective_rpc("dcr_fingerprint", args=(True,))[0]
            assert "model.embed_tokens.weight" in kept and all(states[v][k] == d for k, d in kept.items())
        got = vm.greedy(llm)
        assert llm.collective_rpc("dcr_check") == [2]
    finally:
        vm.shutdown(llm)
    assert got != start
    assert got == vm.fresh_greedy(str(tmp_path / "v2"))
