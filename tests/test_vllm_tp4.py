"""Tensor parallelism above the kv head count, with the real engine: Qwen2 (4 query heads, 2 kv
heads) on 4 CPU workers, so each kv head is held by two workers (vLLM replicates kv heads when
TP exceeds their number, as TP=8 does for a 4-kv-head model). The receiver group applies each
replicated region on the lowest worker holding it and sends it to the other; before, the workers
of the two pairs disagreed on the source of one group-wide broadcast and the refit hung.

One engine on v0 is refitted to v2 and compared with a fresh engine started on v2: every engine
tensor on every worker, tokens and logprobs (``vm.assert_same_engine``), each request by itself
on a zeroed KV cache (``vm.Observed(..., alone=True)``, as for ``vm.ALONE``'s families). Batched,
this model's outputs at TP=4 on an AVX2-only AMD host (Zen 3) varied between two rounds of the
same engine, fresh or refitted, from the second digit of a logprob on, while every engine tensor
was equal; one request at a time both engines agreed to the bit in both rounds (docs/results.md,
"Format version 4, eighth turn"). Runs in the vLLM venv (``make test-vllm``); ~3 min on 2 cores
(two engines of 4 workers each)."""
from __future__ import annotations

from dcr_testing import vllm_models as vm

vm.require_vllm()

from nemo_dcr.integrations.vllm_worker import refit  # noqa: E402


def test_tp4_with_kv_heads_replicated_over_worker_pairs(tmp_path):
    ck = vm.chain("qwen2", tmp_path / "ck", rate=0.01)
    store = vm.store_of(tmp_path / "store", ck)
    a, b = vm.engine(ck[0], tp=4), None
    try:
        b = vm.engine(ck[2], tp=4)
        fresh_b = vm.Observed(b, True)
        assert a.collective_rpc("dcr_init", args=(store, 0)) == [0, 0, 0, 0]
        assert refit(a, store, 1) == 1
        assert refit(a, store) == 2
        assert a.collective_rpc("dcr_check") == [2, 2, 2, 2]  # the state digest, each region once
        refit_a = vm.Observed(a, True)
    finally:
        vm.shutdown(a, b)  # side by side
    vm.assert_same_engine(refit_a, fresh_b, "qwen2 TP=4: v0 refitted to v2")
