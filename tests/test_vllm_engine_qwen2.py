"""The real vLLM engine on a Qwen2-style model: qkv bias, tied embeddings (vLLM's lm_head computes
from a packed copy of the embedding), a vocabulary vLLM pads (500 -> 512 rows).

Updated v0 -> v1 -> v2 the vLLM way: the engine is started with ``weight_transfer_config={"backend":
"dcr"}`` (nemo-dcr's backend in vLLM's weight-transfer registry) and driven through vLLM's own worker
calls (``init_weight_transfer_engine`` without a known start version: the first update reads the
keyframe; ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, then
``reset_prefix_cache``). The other real-engine modules drive ``refit(llm, store)``. At every version
every tensor's bits equal the trainer's (read back from the engine where it keeps them); at v2 greedy
tokens and logprobs equal a fresh engine's on v2's checkpoint. Runs in the vLLM venv (``make test-vllm``).
"""
from __future__ import annotations

from dcr_testing import vllm_models as vm

vm.require_vllm()

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

    llm = vm.engine(str(tmp_path / "v0"), weight_transfer_config={"backend": "dcr"})
    try:
        start = vm.greedy(llm)
        llm.collective_rpc("init_weight_transfer_engine", args=({"store": store},))
        assert llm.collective_rpc("dcr_version") == [None]
        for v in (1, 2):
            llm.collective_rpc("start_weight_update")
            llm.collective_rpc("update_weights", args=({"version": v},))
            llm.collective_rpc("finish_weight_update")
            assert llm.reset_prefix_cache()
            assert llm.collective_rpc("dcr_version") == [v]
            assert llm.collective_rpc("dcr_fingerprint")[0] == states[v]
            kept = llm.collective_rpc("dcr_fingerprint", args=(True,))[0]
            assert "model.embed_tokens.weight" in kept and all(states[v][k] == d for k, d in kept.items())
        got = vm.greedy(llm)
        assert llm.collective_rpc("dcr_check") == [2]
    finally:
        vm.shutdown(llm)
    assert got != start
    assert got == vm.fresh_greedy(str(tmp_path / "v2"))
