"""Inputs for the device-path kernels (tests/test_device_kernels.py, tests/gpu/run_device_kernels.py):
a base tensor holding every kind of special bit pattern, and a live tensor with a given share
of changed elements, most of them the one- or two-step moves an optimizer makes, some arbitrary
bit patterns, NaN-payload changes and -0.0 <-> +0.0 swaps."""
import torch

from nemo_dcr.codec.ordered import key, to_bits, unkey, unsigned
from nemo_dcr.state.dtypes import INT_VIEW

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.float64)
MANT = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def _rand_bits(n, w, g):
    return to_bits(torch.randint(0, 1 << min(8 * w, 62), (n,), generator=g), min(w, 4)) if w <= 4 else \
        torch.randint(-(1 << 62), 1 << 62, (n,), generator=g, dtype=torch.int64)


def make_pair(dtype: torch.dtype, n: int, rate: float, seed: int = 0, device="cpu"):
    """-> (base, live): two contiguous 1-D tensors of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    w = dtype.itemsize
    iv = INT_VIEW[w]
    if dtype == torch.bool:
        base = torch.rand(n, generator=g) < 0.5
        live = base.clone()
        idx = torch.randperm(n, generator=g)[: round(rate * n)]
        live[idx] = ~live[idx]
        return base.to(device), live.to(device)
    if dtype.is_floating_point and w <= 4 and w > 1:
        base = (torch.randn(n, generator=g) * 0.02).to(dtype)
        b = base.view(iv)
        mant = MANT[dtype]
        expall = ((1 << (8 * w - 1 - mant)) - 1) << mant
        m = torch.randint(0, 1 << mant, (n,), generator=g)
        sgn = torch.randint(0, 2, (n,), generator=g) << (8 * w - 1)
        specials = [
            (expall | (m | 1)) | sgn,                      # NaN, assorted payloads and signs
            torch.full((n,), expall), torch.full((n,), expall) | (1 << (8 * w - 1)),  # +-inf
            torch.full((n,), 1 << (8 * w - 1)), torch.zeros(n, dtype=torch.int64),     # -0.0, +0.0
            m | sgn,                                       # subnormals
        ]
        which = torch.randint(0, 40, (n,), generator=g)    # ~15 % special
        u = unsigned(b)
        for j, s in enumerate(specials):
            u = torch.where(which == j, s, u)
        base = to_bits(u, w).view(dtype)
    else:  # ints, fp8 (every byte is some value), float64: arbitrary bits
        base = _rand_bits(n, w, g).view(dtype) if w > 1 else torch.randint(0, 256, (n,), generator=g,
                                                                            dtype=torch.uint8).view(dtype)
    bb = base.view(iv)
    lb = bb.clone()
    k = round(rate * n)
    idx = torch.randperm(n, generator=g)[:k]
    kind = torch.randint(0, 10, (k,), generator=g)
    if w <= 4:
        u = unsigned(bb[idx])
        if dtype.is_floating_point:
            step = torch.tensor([1, -1, 2, -2, 1, -1, 5])[torch.randint(0, 7, (k,), generator=g)]
            kk = (key(u, w, True) + step) & ((1 << (8 * w)) - 1)
            moved = unkey(kk, w, True)
        else:
            moved = (u + 1 + torch.randint(0, 3, (k,), generator=g)) & ((1 << (8 * w)) - 1)
        rnd = unsigned(_rand_bits(k, w, g))
        sign = 1 << (8 * w - 1)
        swap = u ^ sign  # -0.0 <-> +0.0 for zeros; a sign flip (a NaN payload's sign too) otherwise
        newu = torch.where(kind < 7, moved, torch.where(kind < 9, rnd, swap))
        lb[idx] = to_bits(newu, w).view(iv)
    else:
        lb[idx] = bb[idx] ^ (1 + torch.randint(0, 1 << 20, (k,), generator=g))
    return base.to(device), lb.view(dtype).to(device)
