"""Byte planes: the k values of width w are stored as w planes of k bytes, least significant
byte first. Bytes of the same significance sit together, which zstd compresses far better
(the high byte of a small BF16 update is almost always 0 under XOR).

Both ways run in the C library where it is loaded (``csrc/dcr_planes.c``: one pass, no
temporaries; the join ~70x faster than numpy's strided copy on 2 MiB of BF16, the split ~4x
faster than the torch passes below), else the reference here: the same bytes."""
from __future__ import annotations

import numpy as np
import torch

from nemo_dcr.codec import native
from nemo_dcr.errors import DeltaFormatError
from nemo_dcr.state.dtypes import INT_VIEW
from nemo_dcr.state.runs import Runs, copy_runs


def split(values: torch.Tensor, use_native: bool | None = None):
    """values: 1-D integer tensor -> plane-major little-endian bytes (bytes-like: a memoryview
    of a fresh buffer where the C library made them, bytes from the reference)."""
    w = values.element_size()
    v = values.contiguous().reshape(-1)
    lib = native.lib() if use_native is not False and v.numel() else None
    if lib is not None:
        out = torch.empty(w * v.numel(), dtype=torch.uint8)
        if lib.dcr_planes_split(v.data_ptr(), v.numel(), w, out.data_ptr()) == 0:
            return memoryview(out.numpy().data)
    if w == 1:
        return v.view(torch.uint8).numpy().tobytes()
    # plane p is (v >> 8p) & 0xFF, vectorised shifts into a (w, k) uint8 tensor: 2.5x faster than
    # numpy's transposing copy of the (k, w) byte view, which in turn is ~70x faster than torch's
    # (element by element)
    out = torch.empty(w, v.numel(), dtype=torch.uint8)
    for p in range(w):
        out[p] = torch.bitwise_and(torch.bitwise_right_shift(v, 8 * p) if p else v, 0xFF)
    return out.numpy().tobytes()


def join(raw, k: int, w: int, use_native: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``split``: ``raw`` (bytes-like, read-only is fine) -> k values of w bytes,
    in a new tensor, or written into ``out`` (contiguous, k elements of w bytes, on the host:
    a receiver's own range) and returned."""
    if len(raw) != k * w:
        raise DeltaFormatError(f"value stream has {len(raw)} bytes, expected {k} x {w}")
    if out is not None and (out.numel() != k or out.element_size() != w or not out.is_contiguous()
                            or out.device.type != "cpu"):
        raise ValueError(f"join into a tensor of {out.numel()} x {out.element_size()} bytes on {out.device} "
                         f"(contiguous: {out.is_contiguous()}); {k} x {w} on the host wanted")
    if k == 0:
        return torch.empty(0, dtype=INT_VIEW[w]) if out is None else out
    lib = native.lib() if use_native is not False else None
    if lib is not None:
        dst = torch.empty(k, dtype=INT_VIEW[w]) if out is None else out
        _, src = native.buffer_address(raw)
        if lib.dcr_planes_join(src, k, w, dst.data_ptr()) == 0:
            if out is not None:  # written behind torch's back: its version counter says so, as a copy_ would
                torch.autograd.graph.increment_version(out)
            return dst
    # numpy's transposing copy (see split); np.array always copies, so the result is writable
    # even where raw is read-only bytes
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(w, k)
    vals = torch.from_numpy(np.array(planes.T, order="C").reshape(-1)).view(INT_VIEW[w])
    return vals if out is None else out.copy_(vals.view(out.dtype))


def join_runs(raw, k: int, w: int, dst: torch.Tensor, runs: Runs, use_native: bool | None = None) -> None:
    """The values of ``raw`` (``join``'s: w planes of k bytes) that ``runs`` name, each written
    where its run says: value ``cstart[i] + j`` to ``dst[lstart[i] + j]`` (``dst``: 1-D,
    contiguous, w-byte elements on the host; ``state/runs.copy_runs``' geometry). One C call
    (``dcr_planes_join_runs``), no join of the whole stream into a temporary; the reference joins
    it and copies the runs. A run outside ``raw`` or ``dst``: ``IndexError``, nothing written."""
    if len(raw) != k * w:
        raise DeltaFormatError(f"value stream has {len(raw)} bytes, expected {k} x {w}")
    if dst.element_size() != w or not dst.is_contiguous() or dst.dim() != 1 or not dst.is_cpu:
        raise ValueError(f"join_runs into a {dst.dim()}-D tensor of {dst.element_size()}-byte elements on "
                         f"{dst.device} (contiguous: {dst.is_contiguous()}); 1-D, {w} bytes, on the host wanted")
    if not len(runs):
        return
    lib = native.lib() if use_native is not False else None
    if lib is not None:
        _, src = native.buffer_address(raw)
        c, loc, n = runs.addresses
        if lib.dcr_planes_join_runs(src, k, w, dst.data_ptr(), dst.numel(), c, loc, n, len(runs)) == 0:
            torch.autograd.graph.increment_version(dst)  # written behind torch's back, as in ``join``
            return
    # refused in C (or no C): the same checks, then the reference
    ends = (runs.cstart + runs.length, runs.lstart + runs.length)
    if min(runs.cstart.min(), runs.lstart.min(), runs.length.min()) < 0 or ends[0].max() > k \
            or ends[1].max() > dst.numel():
        raise IndexError(f"runs outside their tensors ({k} and {dst.numel()} elements)")
    copy_runs(dst, join(raw, k, w, use_native=use_native).view(dst.dtype), runs)
