"""The real vLLM engine with tensor parallelism 2 (two CPU workers, vLLM's gloo TP group), on a
tiny Qwen2-MoE: layer 0 a dense MLP (``gate_up_proj`` column-, ``down_proj`` row-parallel), layer 1
MoE (4 experts in vLLM's ``RoutedExperts``, each rank holding its half of every expert's
intermediate dimension: ``w13_weight`` rows, ``w2_weight`` columns) with a gated shared expert; qkv
bias, kv heads split over the ranks, a padded vocabulary. The store holds the checkpoint's Hugging
Face names (``model.layers.1.mlp.experts.E.gate_proj.weight``, ...).

* The default encoding (``classes`` where it pays): a ``classes`` chunk decodes only against the
  whole base chunk, which a worker holding half a tensor lacks; the two workers gather their bits
  of those chunks over vLLM's TP group (nemo_dcr/sync/chunk_gather.py), so the refit to v1 needs no
  ``portable`` deltas (which are larger): greedy tokens and logprobs equal a fresh TP=2 engine's on
  v1's checkpoint, ``dcr_check`` verifies the whole state across both workers, and each worker's
  bits read back equal the fresh engine's, tensor by tensor. Then a second refit on top (v2, a
  chain): ``dcr_check`` again, and generation equal to a fresh TP=2 engine's on v2's checkpoint.
Runs in the vLLM venv (``make test-vllm``).
"""
from __future__ import annotations

from dcr_testing import vllm_models as vm

vm.require_vllm()

from nemo_dcr.codec.chunk import CLASSES  # noqa: E402
from nemo_dcr.codec.format import DeltaReader  # noqa: E402
from nemo_dcr.integrations.vllm_worker import refit  # noqa: E402
from nemo_dcr.stores import open_store  # noqa: E402
from nemo_dcr.sync.publisher import Publisher  # noqa: E402
from nemo_dcr.sync.versions import read_head, read_manifest  # noqa: E402


def _uses_classes(store_url: str) -> bool:
    store = open_store(store_url)
    m = read_manifest(store, read_head(store)[0].manifest)
    return any(c.enc == CLASSES for p in m.parts
               for e in DeltaReader.open(store.get(p.key)).header.tensors for c in e.chunks)


def _delta_bytes(store_url: str) -> int:
    store = open_store(store_url)
    return sum(p.size for p in read_manifest(store, read_head(store)[0].manifest).parts)


def test_tp2_refit(tmp_path):
    model = vm.tiny_model("qwen2_moe")
    auto, portable = str(tmp_path / "auto"), str(tmp_path / "portable")
    pubs = {auto: Publisher(auto), portable: Publisher(portable, encoding="portable")}
    for v in range(3):
        if v:
            vm.perturb(model, v, rate=0.01)
        state = vm.saved_state(vm.save(model, str(tmp_path / f"v{v}")))
        for pub in pubs.values():
            assert pub.publish(state, step=v).version == v
        if v == 1:
            assert _uses_classes(auto) and not _uses_classes(portable)
            assert _delta_bytes(auto) < _delta_bytes(portable)  # what TP engines had to pay before

    llm = vm.engine(str(tmp_path / "v0"), tp=2)
    try:
        start = vm.greedy(llm)
        assert llm.collective_rpc("dcr_init", args=(auto, 0)) == [0, 0]
        bits0 = llm.collective_rpc("dcr_fingerprint")
        # every published tensor has a part on each worker (the shared-expert gate, norms: whole)
        assert set(bits0[0]) == set(bits0[1]) == set(state)
        assert {"model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight",
                "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate_proj.weight"} <= set(state)
        assert refit(llm, auto, version=1) == 1
        assert llm.collective_rpc("dcr_check") == [1, 1]
        got = vm.greedy(llm)
        bits = llm.collective_rpc("dcr_fingerprint")
        kept = llm.collective_rpc("dcr_fingerprint", args=(True,))
        # a chain: the next version on top of the refitted one
        assert refit(llm, auto) == 2
        assert llm.collective_rpc("dcr_check") == [2, 2]  # the whole state's digest, across both workers
        got2 = vm.greedy(llm)
    finally:
        vm.shutdown(llm)
    assert got != start and bits != bits0 and got2 != got
    assert got2 == vm.fresh_greedy(str(tmp_path / "v2"), tp=2)
    fresh = vm.engine(str(tmp_path / "v1"), tp=2)
    try:
        assert vm.greedy(fresh) == got
        assert fresh.collective_rpc("dcr_init", args=(auto, 1)) == [1, 1]
        assert fresh.collective_rpc("dcr_fingerprint") == bits
        # read back from the engine's own parameters where it keeps them (norms, embeddings, lm_head)
        assert fresh.collective_rpc("dcr_fingerprint", args=(True,)) == kept and all(kept)
    finally:
        vm.shutdown(fresh)
