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
    b = values.contiguous().view(torch.uint8).numpy().reshape(-1, w)
    # numpy's transposing copy, not torch's: torch copies a (k, w) uint8 transpose element by
    # element (~70x slower than numpy for BF16), and this runs on every value stream
    return np.ascontiguousarray(b.T).tobytes()


def join(raw: bytes, k: int, w: int) -> torch.Tensor:
    if len(raw) != k * w:
        raise DeltaFormatError(f"value stream has {len(raw)} bytes, expected {k} x {w}")
    if k == 0:
        return torch.empty(0, dtype=INT_VIEW[w])
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(w, k)
    # numpy's transposing copy (see split); np.array always copies, so the result is writable
    # even where raw is read-only bytes
    return torch.from_numpy(np.array(planes.T, order="C").reshape(-1)).view(INT_VIEW[w])
