"""The small base/target pair the delta fuzzers mutate (tests/test_fuzz_delta.py and bench/fuzz.py):
every chunk coding (classes, xor/add, overwrite), a removed, an added and an unchanged tensor, and
special values (-0.0, NaN, inf)."""
from __future__ import annotations

import torch


def fuzz_states() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(1)
    base = {
        "bf": torch.randn(40, 20, generator=g).to(torch.bfloat16),  # classes chunks (C kernel)
        "f32": torch.randn(300, generator=g),
        "i8": torch.randint(-100, 100, (50,), generator=g, dtype=torch.int8),
        "gone": torch.ones(4, dtype=torch.float16),
        "same": torch.arange(10, dtype=torch.int32),
    }
    target = {k: v.clone() for k, v in base.items() if k != "gone"}
    target["bf"].view(-1)[::7] = (target["bf"].view(-1)[::7].float() * 1.01).to(torch.bfloat16)
    target["f32"][::5] += 0.5
    target["i8"][3:9] = 7
    target["new"] = torch.tensor([0.0, -0.0, float("nan"), float("inf")], dtype=torch.float16)
    return base, target
