"""The real vLLM engine with tensor parallelism 2 (two CPU workers, vLLM's gloo TP group), on a
tiny Qwen2-MoE: layer 0 a dense MLP (``gate_up_proj`` column-, ``down_proj`` row-parallel), layer 1
MoE (4 experts in vLLM's ``RoutedExperts``, each rank holding its half of every expert's
intermediate dimension: ``w13_weight`` rows, ``w2_weight`` columns) with a gated shared expert; qkv
bias, kv heads split over the ranks, a padded vocabulary. The store holds the checkpoint's Hugging
Face names (``model.layers.1.mlp.experts.E.gate_proj.weight``, ...).

* The default encoding: a ``classes`` chunk decodes only against the whole base chunk, which a TP
  worker holding half a tensor lacks. Every worker finds that out before the first write: the
  refit raises the same ``DcrError`` and the engine keeps version 0 bit for bit (it used to raise
  ``PartialApplyError`` after tensors had changed).
* ``encoding='portable'``: refitted to v1, greedy tokens and logprobs equal a fresh TP=2 engine's
  on v1's checkpoint, and ``dcr_check`` verifies the whole state across both workers.
Runs in the vLLM venv (``make test-vllm``).
"""
from __future__ import annotations

import pytest

from dcr_testing import vllm_models as vm

vm.require_vllm()

from nemo_dcr.codec.chunk import CLASSES  # noqa: E402
from nemo_dcr.codec.format import DeltaReader  # noqa: E402
from nemo_dcr.errors import DcrError  # noqa: E402
from nemo_dcr.integrations.vllm_worker import refit  # noqa: E402
from nemo_dcr.stores import open_store  # noqa: E402
from nemo_dcr.sync.publisher import Publisher  # noqa: E402
from nemo_dcr.sync.versions import read_head, read_manifest  # noqa: E402


def _uses_classes(store_url: str) -> bool:
    store = open_store(store_url)
    m = read_manifest(store, read_head(store)[0].manifest)
    return any(c.enc == CLASSES for p in m.parts
               for e in DeltaReader.open(store.get(p.key)).header.tensors for c in e.chunks)


def test_tp2_refit(tmp_path):
    model = vm.tiny_model("qwen2_moe")
    auto, portable = str(tmp_path / "auto"), str(tmp_path / "portable")
    pubs = {auto: Publisher(auto), portable: Publisher(portable, encoding="portable")}
    for v in range(2):
        if v:
            vm.perturb(model, v, rate=0.01)
        state = vm.saved_state(vm.save(model, str(tmp_path / f"v{v}")))
        for pub in pubs.values():
            assert pub.publish(state, step=v).version == v
    assert _uses_classes(auto) and not _uses_classes(portable)

    llm = vm.engine(str(tmp_path / "v0"), tp=2)
    try:
        start = vm.greedy(llm)
        assert llm.collective_rpc("dcr_init", args=(auto, 0)) == [0, 0]
        bits0 = llm.collective_rpc("dcr_fingerprint")
        # every published tensor has a part on each worker (the shared-expert gate, norms: whole)
        assert set(bits0[0]) == set(bits0[1]) == set(state)
        assert {"model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight",
                "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate_proj.weight"} <= set(state)
        with pytest.raises(DcrError, match="cannot decode the update") as e:
            refit(llm, auto)
        assert "nothing was written" in str(e.value) and "Partial" not in type(e.value).__name__
        assert llm.collective_rpc("dcr_version") == [0, 0]
        assert llm.collective_rpc("dcr_fingerprint") == bits0
        assert llm.collective_rpc("dcr_check") == [0, 0]
        assert vm.greedy(llm) == start

        assert llm.collective_rpc("dcr_init", args=(portable, 0)) == [0, 0]
        assert refit(llm, portable) == 1
        assert llm.collective_rpc("dcr_check") == [1, 1]
        got = vm.greedy(llm)
    finally:
        vm.shutdown(llm)
    assert got != start
    assert got == vm.fresh_greedy(str(tmp_path / "v1"), tp=2)
