"""Triton kernels of the device path. Pure kernels: shapes, launches and checks are in
``diff.py`` and ``apply.py``.

Why Triton and not CUDA C++: the same source runs on the GPU and, under ``TRITON_INTERPRET=1``,
on CPU tensors, so the kernel logic is tested against the reference on every machine (CI has no
GPU); it needs no compiler toolchain at first use; and block-level cumsum/histogram/atomics are
what these passes are made of.

Every element is compared on its integer view (``state/dtypes.INT_VIEW``), so NaN payloads,
-0.0 and subnormals are changes like any other bits.
"""
from __future__ import annotations

import os

try:  # optional: the ``gpu`` extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None


def available() -> bool:
    """Whether the kernels can run here (triton importable)."""
    return triton is not None


def interpreted() -> bool:
    """Kernels run in Triton's CPU interpreter (CPU tensors), not compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


if triton is not None:

    @triton.jit
    def _block_range(pid, n, chunk, bpc, BLOCK: tl.constexpr):
        """Block ``pid`` covers [start, end): block ``pid % bpc`` of chunk ``pid // bpc``, so
        no block straddles two chunks (ranks are counted per chunk)."""
        c = pid // bpc
        j = pid % bpc
        cstart = c.to(tl.int64) * chunk
        start = cstart + j.to(tl.int64) * BLOCK
        end = tl.minimum(tl.minimum(start + BLOCK, cstart + chunk), n)
        offs = start + tl.arange(0, BLOCK)
        return c, offs, offs < end

    @triton.jit
    def diff_compact_kernel(old_ptr, new_ptr, n, chunk, bpc,
                            pos_ptr, oldv_ptr, newv_ptr, cap, ctr_ptr, boff_ptr, bcnt_ptr,
                            BLOCK: tl.constexpr):
        """One pass over snapshot and live: each block counts its changes, reserves that many
        slots of the compact stream with one atomic add, and writes positions, old and new bits
        there in position order (block-local exclusive prefix sum). The blocks' slot ranges come
        in arrival order; (boff, bcnt) per block let the host-side wrapper put them back in
        position order in O(changes). Slots at or past ``cap`` are not written (the wrapper
        sees the counter past ``cap`` and runs again with room: nothing else was written)."""
        pid = tl.program_id(0)
        c, offs, m = _block_range(pid, n, chunk, bpc, BLOCK)
        o = tl.load(old_ptr + offs, mask=m, other=0)
        x = tl.load(new_ptr + offs, mask=m, other=0)
        ch = (o != x) & m
        ci = ch.to(tl.int32)
        cnt = tl.sum(ci, axis=0)
        off = tl.atomic_add(ctr_ptr, cnt.to(tl.int64))
        dst = off + (tl.cumsum(ci, axis=0) - 1).to(tl.int64)
        sm = ch & (dst < cap)
        tl.store(pos_ptr + dst, offs, mask=sm)
        tl.store(oldv_ptr + dst, o, mask=sm)
        tl.store(newv_ptr + dst, x, mask=sm)
        tl.store(boff_ptr + pid, off)
        tl.store(bcnt_ptr + pid, cnt)

    @triton.jit
    def _clamped_class(bits, lo, hi, W: tl.constexpr, MANT: tl.constexpr):
        """``classes._classes`` clamped to the chunk's [lo, hi], minus lo."""
        u = bits.to(tl.int64) & ((1 << (8 * W - 1)) - 1)  # drop the sign; sign extension too
        e = u >> MANT
        return (tl.minimum(tl.maximum(e, lo), hi) - lo).to(tl.int32)

    @triton.jit
    def class_rank_kernel(old_ptr, n, chunk, bpc, lohi_ptr, pos_ptr, oldv_ptr, boff_ptr, bcnt_ptr,
                          hist_ptr, within_ptr,
                          W: tl.constexpr, MANT: tl.constexpr, RB: tl.constexpr,
                          BLOCK: tl.constexpr, G: tl.constexpr):
        """Second pass, over the snapshot alone (still the pre-image: it is updated after this),
        once the chunks' class ranges are known: per block, how many elements fall in each
        clamped class (``hist``, RB bins), and for each of the block's changes how many elements
        of its class precede it inside the block (``within``). The rank of a change in its chunk
        is then the exclusive prefix of ``hist`` over the chunk's earlier blocks plus ``within``
        (done by the wrapper, O(blocks * classes + changes))."""
        pid = tl.program_id(0)
        c, offs, m = _block_range(pid, n, chunk, bpc, BLOCK)
        lo = tl.load(lohi_ptr + 2 * c)
        hi = tl.load(lohi_ptr + 2 * c + 1)
        o = tl.load(old_ptr + offs, mask=m, other=0)
        cls = _clamped_class(o, lo, hi, W, MANT)
        hist = tl.histogram(cls, RB, mask=m)
        tl.store(hist_ptr + pid.to(tl.int64) * RB + tl.arange(0, RB), hist)
        off = tl.load(boff_ptr + pid)
        cnt = tl.load(bcnt_ptr + pid)
        for g in range(0, cnt, G):
            gi = g + tl.arange(0, G)
            gm = gi < cnt
            p = tl.load(pos_ptr + off + gi, mask=gm, other=-1)
            ov = tl.load(oldv_ptr + off + gi, mask=gm, other=0)
            cc = _clamped_class(ov, lo, hi, W, MANT)
            same = (offs[None, :] < p[:, None]) & (cls[None, :] == cc[:, None]) & m[None, :]
            tl.store(within_ptr + off + gi, tl.sum(same.to(tl.int32), axis=1), mask=gm)

    @triton.jit
    def preimage_check_kernel(target_ptr, pos_ptr, pre_ptr, k, bad_ptr, BLOCK: tl.constexpr):
        """Counts the changes whose position does not hold the expected pre-image bits."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < k
        p = tl.load(pos_ptr + offs, mask=m, other=0)
        have = tl.load(target_ptr + p, mask=m, other=0)
        want = tl.load(pre_ptr + offs, mask=m, other=0)
        bad = tl.sum(((have != want) & m).to(tl.int32), axis=0)
        tl.atomic_add(bad_ptr, bad)

    @triton.jit
    def scatter_kernel(target_ptr, pos_ptr, val_ptr, k, BLOCK: tl.constexpr):
        """target[pos] = val for the k changes (positions distinct: checked by the wrapper)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < k
        p = tl.load(pos_ptr + offs, mask=m, other=0)
        tl.store(target_ptr + p, tl.load(val_ptr + offs, mask=m, other=0), mask=m)
