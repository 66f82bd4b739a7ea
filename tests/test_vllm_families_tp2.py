"""Tensor parallelism 2 (two CPU workers, vLLM's gloo TP group) with the real engine, for an MLA +
MoE model (DeepSeek-V2), an MoE model with a shared expert and a padded vocabulary (Qwen2-MoE) and a
head-interleaved fused QKV (Bloom): each worker's part of every published tensor is where vLLM's
own loader put it (probed on each worker: fused rows split per rank, experts' intermediate
dimension halved, Bloom's heads split so each worker's q, k and v rows are a box only of the finer
(heads, 3, head_dim) index shape).

As in test_vllm_families.py, two engines per family, on v0 and v2, started the default way, each
refitted to the other's version (both with ``refit``) and compared with the other as it started:
every engine tensor on both workers, tokens and logprobs. The stores use the default encoding
(``classes`` where it pays): a ``classes`` chunk decodes only against the whole base chunk, which a
worker holding half a tensor lacks; the two workers gather their bits of those chunks over vLLM's
TP group (nemo_dcr/sync/chunk_gather.py), so TP engines need no larger ``portable`` deltas (checked
below). Runs in the vLLM venv (``make test-vllm``).
"""
from __future__ import annotations

import pytest

from dcr_testing import vllm_models as vm

vm.require_vllm()

from nemo_dcr.codec.chunk import CLASSES  # noqa: E402
from nemo_dcr.codec.format import DeltaReader  # noqa: E402
from nemo_dcr.integrations.vllm_worker import refit  # noqa: E402
from nemo_dcr.stores import open_store  # noqa: E402
from nemo_dcr.sync.versions import read_head, read_manifest  # noqa: E402


def _uses_classes(store_url: str) -> bool:
    store = open_store(store_url)
    m = read_manifest(store, read_head(store)[0].manifest)
    return any(c.enc == CLASSES for p in m.parts
               for e in DeltaReader.open(store.get(p.key)).header.tensors for c in e.chunks)


@pytest.mark.parametrize("kind", ["deepseek_v2", "qwen2_moe", "bloom"])
def test_tp2_refit_equals_a_fresh_engine(kind, tmp_path):
    ck = vm.chain(kind, tmp_path / "ck", rate=0.01)
    up = vm.store_of(tmp_path / "up", ck)
    down = vm.store_of(tmp_path / "down", ck[::-1])
    assert _uses_classes(up) and _uses_classes(down)  # chunks the workers decode together
    a, b = vm.engine(ck[0], tp=2), None
    try:
        b = vm.engine(ck[2], tp=2)
        alone = kind in vm.ALONE
        fresh_a, fresh_b = vm.Observed(a, alone), vm.Observed(b, alone)
        assert fresh_a.gen[0] != fresh_b.gen[0]
        for llm, store in ((a, up), (b, down)):
            assert llm.collective_rpc("dcr_init", args=(store, 0)) == [0, 0]
            vm.greedy(llm, vm.OTHER)
            assert refit(llm, store, 1) == 1  # a chain: one version, then the next on top
            assert refit(llm, store) == 2
            assert llm.collective_rpc("dcr_check") == [2, 2]  # the whole state's digest, across both workers
        layouts = a.collective_rpc("dcr_layout")
        refit_a, refit_b = vm.Observed(a, alone), vm.Observed(b, alone)
    finally:
        vm.shutdown(a, b)  # side by side
    vm.assert_same_engine(refit_a, fresh_b, f"{kind} TP=2: v0 refitted to v2")
    vm.assert_same_engine(refit_b, fresh_a, f"{kind} TP=2: v2 refitted to v0")
    for lay in layouts:
        assert lay["reload"] == {}, lay
    if kind == "bloom":
        assert all(lay["index_shapes"] for lay in layouts)
