"""Where a receiver holds part of a canonical tensor as a strided view: found from element pairs.

A receiver that learns element by element where each canonical element of a tensor lands in its
own storage (the vLLM receiver probes the engine's loader: :mod:`nemo_dcr.integrations.vllm_layout`)
needs that map in the form the rest of nemo-dcr reads: a ``ShardSpec`` (a box of the canonical
tensor, in an index shape where it is one) and a strided view of the storage whose row-major
elements are that box's. Slices, transposes, row ranges of fused layers, tensor-parallel splits
and per-head re-layouts are all of that form; :func:`factor` finds it, or says there is none (a
map that no strided view reproduces: the caller then takes another route).

The search peels dimensions off from the inside: the longest run of pairs stepping by constant
canonical and local strides is the innermost dimension; every run must repeat it; the runs'
starts are the next level's pairs. The canonical strides found, with the gaps between them, give
the index shape (each must divide the next); the result is checked element by element.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .index_map import IndexMap, ShardSpec


@dataclass(frozen=True)
class StridedPart:
    """A box of a canonical tensor (``spec``) held in a flat storage at ``offset`` with ``strides``
    (elements, one per box dimension)."""

    spec: ShardSpec
    offset: int
    strides: tuple

    def view(self, flat_owner: torch.Tensor) -> torch.Tensor:
        """The box as a view of ``flat_owner`` (a contiguous tensor holding the storage)."""
        return flat_owner.as_strided(self.spec.shape, self.strides, flat_owner.storage_offset() + self.offset)


def _peel(c: torch.Tensor, loc: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """Dimensions (size, canonical stride, local stride), innermost first, of sorted pairs."""
    dims: list[tuple[int, int, int]] = []
    while c.numel() > 1:
        dc, dl = int(c[1] - c[0]), int(loc[1] - loc[0])
        if dc <= 0 or dl < 0:
            return None
        ok = ((c[1:] - c[:-1]) == dc) & ((loc[1:] - loc[:-1]) == dl)
        bad = (~ok).nonzero()
        run = int(bad[0, 0]) + 1 if bad.numel() else c.numel()
        if c.numel() % run:
            return None
        cb, lb = c.view(-1, run), loc.view(-1, run)
        if run > 1 and not (bool(((cb - cb[:, :1]) == (cb[0] - cb[0, 0])).all())
                            and bool(((lb - lb[:, :1]) == (lb[0] - lb[0, 0])).all())):
            return None
        dims.append((run, dc, dl))
        c, loc = cb[:, 0].contiguous(), lb[:, 0].contiguous()
    return dims


def factor(canonical: torch.Tensor, local: torch.Tensor, global_shape: Sequence[int]) -> StridedPart | None:
    """The strided part holding canonical flat positions ``canonical`` (distinct) at local flat
    positions ``local`` (same order), of a tensor of ``global_shape``; None when no strided view
    of one storage holds exactly these pairs in row-major order (or there are none)."""
    g = tuple(int(s) for s in global_shape)
    n = math.prod(g)
    if canonical.numel() == 0 or n == 0:
        return None
    order = torch.argsort(canonical)
    c, loc = canonical[order].to(torch.int64), local[order].to(torch.int64)
    dims = _peel(c, loc)
    if dims is None:
        return None
    c0, l0 = int(c[0]), int(loc[0])
    # the index shape: the canonical strides of the dims found, and the gaps between them
    strides_found = {cs: (size, ls) for size, cs, ls in dims}
    if len(strides_found) != len(dims):
        return None
    marks = sorted(set(strides_found) | {1}, reverse=True)
    if marks[0] > n:
        return None
    full = [n] + marks
    shape, box_o, box_s, lstr = [], [], [], []
    for hi, lo in zip(full, full[1:]):
        if hi % lo:
            return None
        extent = hi // lo
        if extent == 1 and lo not in strides_found:
            continue
        size, ls = strides_found.get(lo, (1, 0))
        off = (c0 // lo) % extent
        if off + size > extent:
            return None
        shape.append(extent)
        box_o.append(off)
        box_s.append(size)
        lstr.append(ls)
    if not shape:  # a single element of a 1-element tensor
        shape, box_o, box_s, lstr = [1], [0], [1], [0]
    if math.prod(shape) != n:
        return None
    spec = ShardSpec.of(g, box_o, box_s, index_shape=tuple(shape))
    part = StridedPart(spec, l0, tuple(lstr))
    if spec.index_shape is not None:
        part = _in_global_shape(part) or part
    # check element by element: canonical positions and local positions of the view's elements
    m = spec.numel
    if m != c.numel():
        return None
    glob = IndexMap(spec).to_global(torch.arange(m, dtype=torch.int64))
    if not torch.equal(glob, c):
        return None
    idx = torch.arange(m, dtype=torch.int64)
    lpos = torch.zeros(m, dtype=torch.int64)
    rem = idx
    for size, st in zip(reversed(box_s), reversed(lstr)):
        lpos += (rem % size) * st
        rem = rem // size
    if not torch.equal(lpos + l0, loc):
        return None
    return part


def factor_pieces(canonical: torch.Tensor, local: torch.Tensor, global_shape: Sequence[int],
                  max_pieces: int = 64) -> list[StridedPart] | None:
    """Like :func:`factor`, where one strided view does not hold the pairs but a few do: a fused
    weight whose loader regroups rows per kv head (Falcon's query_key_value: the queries of every
    group, then the keys, then the values) lands as one box per part. Read in local order, a box's
    canonical positions rise and fall only as its own dimensions wrap; the pieces are the runs of
    rising positions, joined again wherever the join still factors (a transposed box is one piece
    of many runs). None where more than ``max_pieces`` runs, or a run, do not factor."""
    whole = factor(canonical, local, global_shape)
    if whole is not None:
        return [whole]
    if canonical.numel() == 0:
        return None
    order = torch.argsort(local)
    c, loc = canonical[order].to(torch.int64), local[order].to(torch.int64)
    cuts = ((c[1:] < c[:-1]).nonzero()[:, 0] + 1).tolist()
    bounds = [0] + cuts + [c.numel()]
    if len(bounds) - 1 > max_pieces:
        return None
    pieces: list[StridedPart] = []
    lo = bounds[0]
    for hi, nxt in zip(bounds[1:], bounds[2:] + [None]):
        if nxt is not None and factor(c[lo:nxt], loc[lo:nxt], global_shape) is not None:
            continue  # the next run joins this piece
        part = factor(c[lo:hi], loc[lo:hi], global_shape)
        if part is None:
            return None
        pieces.append(part)
        lo = hi
    return pieces


def _in_global_shape(part: StridedPart) -> StridedPart | None:
    """The same part as a box of the canonical shape itself, where its view reshapes without a
    copy (fewer index shapes to carry and compare)."""
    spec = part.spec.in_shape(part.spec.global_shape)
    if spec is None:
        return None
    probe = torch.empty(0, device="meta").as_strided(part.spec.shape, part.strides)  # strides only
    try:
        v = probe.view(spec.shape)
    except RuntimeError:
        return None
    return StridedPart(spec, part.offset, tuple(v.stride()))


__all__ = ["StridedPart", "factor", "factor_pieces"]
