"""Byte planes: the k values of width w are stored as w planes of k bytes, least significant
byte first. Bytes of the same significance sit together, which zstd compresses far better
(the high byte of a small BF16 update is almost always 0 under XOR)."""
from __future__ import annotations

import torch

from nemo_dcr.errors import DeltaFormatError
from nemo_dcr.state.dtypes import INT_VIEW


def split(values: torch.Tensor) -> bytes:
    """values: 1-D integer tensor -> plane-major little-endian bytes."""
    w = values.element_size()
    b = values.contiguous().view(torch.uint8).reshape(-1, w)
    return b.t().contiguous().numpy().tobytes()


def join(raw: bytes, k: int, w: int) -> torch.Tensor:
    if len(raw) != k * w:
        raise DeltaFormatError(f"value stream has {len(raw)} bytes, expected {k} x {w}")
    if k == 0:
        return torch.empty(0, dtype=INT_VIEW[w])
    planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(w, k)
    # flatten first: with k == 1 the (1, w) transpose keeps stride 1 on its size-1 dim, which
    # Tensor.view(dtype) rejects for a wider dtype
    return planes.t().contiguous().reshape(-1).view(INT_VIEW[w])
