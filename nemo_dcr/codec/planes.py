"""Byte planes: the k values of width w are stored as w planes of k bytes, least significant
byte first. Bytes of the same significance sit together, which zstd compresses far better
(the high byte of a small BF16 update is almost always 0 under XOR)."""
from __future__ import annotations

import numpy as np
import torch

from nemo_dcr.errors import DeltaFormatError
from nemo_dcr.state.dtypes import INT_VIEW


def split(values: torch.Tensor) -> bytes:
    """values: 1-D integer tensor -> plane-major little-endian bytes."""
    w = values.element_size()
    v = values.contiguous().reshape(-1)
    if w == 1:
        return v.view(torch.uint8).numpy().tobytes()
    # plane p is (v >> 8p) & 0xFF, vectorised shifts into a (w, k) uint8 tensor: 2.5x faster than
    # numpy's transposing copy of the (k, w) byte view, which in turn is ~70x faster than torch's
    # (element by element); this runs on every value stream, a keyframe's whole model among them
    out = torch.empty(w, v.numel(), dtype=torch.uint8)
    for p in range(w):
        out[p] = torch.bitwise_and(torch.bitwise_right_shift(v, 8 * p) if p else v, 0xFF)
    return out.numpy().tobytes()


def join(raw: bytes, k: int, w: int) -> torch.Tensor:
    if len(raw) != k * w:
        raise DeltaFormatError(f"value stream has {len(raw)} bytes, expected {k} x {w}")
    if k == 0:
        return torch.empty(0, dtype=INT_VIEW[w])
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(w, k)
    # numpy's transposing copy (see split); np.array always copies, so the result is writable
    # even where raw is read-only bytes
    return torch.from_numpy(np.array(planes.T, order="C").reshape(-1)).view(INT_VIEW[w])
