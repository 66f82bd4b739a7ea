"""Fixed index maps between a shard's local flat index and the canonical flat index.

A tensor has a canonical name, dtype and *global* shape. A shard held by one rank is a
hyper-rectangle of it: ``offsets`` into the global tensor and a ``shape`` (as megatron-core's
ShardedTensor describes it with global_offset / local_shape). ``IndexMap`` is built once per
shard; it maps local flat indices to canonical flat indices and back, vectorised.

Dimensions are collapsed first: an inner dimension the shard covers completely merges with
the one outside it, so a row-sharded matrix becomes a single contiguous run and the common
maps are one multiply-add per element.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_dcr.errors import DcrError


@dataclass(frozen=True)
class ShardSpec:
    """Where a local tensor sits in its canonical (global) tensor.

    ``global_shape`` is the canonical tensor's shape (what the publisher published). ``offsets``
    and ``shape`` are a box in ``index_shape`` when given, else in ``global_shape``. An index
    shape is another shape of the same number of elements read in the same row-major order: a
    receiver whose part of the tensor is a box only in a finer view of it (a vLLM worker holding
    the query rows of every head of a fused, head-interleaved QKV weight: rows split as
    ``(heads, 3, head_dim)``) describes it there. Canonical flat positions are the same in every
    index shape, so the index maps, the state digest and the deltas never see the difference."""

    global_shape: tuple
    offsets: tuple
    shape: tuple
    index_shape: tuple | None = None

    @classmethod
    def full(cls, shape: Sequence[int]) -> ShardSpec:
        shape = tuple(int(s) for s in shape)
        return cls(shape, (0,) * len(shape), shape)

    @classmethod
    def of(cls, global_shape, offsets=None, shape=None, index_shape=None) -> ShardSpec:
        g = tuple(int(s) for s in global_shape)
        box = tuple(int(s) for s in index_shape) if index_shape is not None else g
        o = tuple(int(s) for s in offsets) if offsets is not None else (0,) * len(box)
        s = tuple(int(x) for x in shape) if shape is not None else box
        spec = cls(g, o, s, None if box == g else box)
        spec.validate()
        return spec

    @property
    def box_shape(self) -> tuple:
        """The shape ``offsets`` and ``shape`` are a box of (``index_shape`` or ``global_shape``)."""
        return self.index_shape if self.index_shape is not None else self.global_shape

    def validate(self) -> None:
        g, o, s = self.box_shape, self.offsets, self.shape
        if self.index_shape is not None and math.prod(self.index_shape) != math.prod(self.global_shape):
            raise DcrError(f"index shape {self.index_shape} does not hold the {math.prod(self.global_shape)} "
                           f"elements of global shape {self.global_shape}")
        if not (len(g) == len(o) == len(s)):
            raise DcrError(f"shard rank mismatch: global {g}, offsets {o}, shape {s}")
        for gi, oi, si in zip(g, o, s):
            if gi < 0 or oi < 0 or si < 0 or oi + si > gi:
                raise DcrError(f"shard {s} at offsets {o} does not fit in global shape {g}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_full(self) -> bool:
        return self.shape == self.box_shape

    def in_shape(self, box_shape: Sequence[int]) -> ShardSpec | None:
        """The same elements as a box of ``box_shape`` (same canonical tensor), or None where they
        are no box there."""
        box_shape = tuple(int(x) for x in box_shape)
        if box_shape == self.box_shape:
            return self
        if math.prod(box_shape) != math.prod(self.global_shape):
            return None
        if self.is_full:
            return ShardSpec(self.global_shape, (0,) * len(box_shape), box_shape,
                             None if box_shape == self.global_shape else box_shape)
        moved = reshape_box(self.box_shape, self.offsets, self.shape, box_shape)
        if moved is None:
            return None
        return ShardSpec(self.global_shape, moved[0], moved[1], None if box_shape == self.global_shape else box_shape)

    def contains(self, other: ShardSpec) -> bool:
        if self.global_shape != other.global_shape:
            return False
        if self.is_full:
            return True
        o = other.in_shape(self.box_shape)
        return o is not None and all(
            so <= oo and oo + os_ <= so + ss
            for so, ss, oo, os_ in zip(self.offsets, self.shape, o.offsets, o.shape)
        )

    def overlaps(self, other: ShardSpec) -> bool:
        """Whether the two hold a common element (when one is no box in the other's index shape:
        assumed, the element-wise maps sort it out)."""
        if self.numel == 0 or other.numel == 0:
            return False
        o = other.in_shape(self.box_shape)
        if o is None:
            return True
        return all(ao < bo + bs and bo < ao + as_
                   for ao, as_, bo, bs in zip(self.offsets, self.shape, o.offsets, o.shape))

    def slices_of(self, inner: ShardSpec) -> tuple:
        """Slices that cut ``inner`` out of a local tensor laid out as ``self``."""
        if not self.contains(inner):
            raise DcrError(f"{inner} is not inside {self}")
        i = inner.in_shape(self.box_shape)
        assert i is not None  # contains() moved it already
        return tuple(slice(io - so, io - so + isz) for so, io, isz in zip(self.offsets, i.offsets, i.shape))

    def view_of(self, tensor: torch.Tensor, inner: ShardSpec) -> torch.Tensor:
        """``inner``'s elements of a local ``tensor`` laid out as ``self``, shaped as ``inner``
        (a copy where the index shapes differ: the row-major order is the same)."""
        part = tensor[self.slices_of(inner)]
        return part if tuple(part.shape) == tuple(inner.shape) else part.reshape(inner.shape)

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "shape": list(self.shape)}


def reshape_box(shape: Sequence[int], offsets: Sequence[int], size: Sequence[int],
                new_shape: Sequence[int]) -> tuple[tuple, tuple] | None:
    """A box of ``shape`` as a box of ``new_shape`` (same element count, row-major): (offsets,
    size) there, or None where its elements are no box of ``new_shape``.

    Both shapes are refined to their common refinement (every dimension boundary of either), the
    box is split there (a range splits when it lies inside one outer step or covers whole inner
    runs), then merged into ``new_shape``'s dimensions (a range merges when the inner ones are
    whole or the outer one is a single step)."""
    shape, new_shape = tuple(int(x) for x in shape), tuple(int(x) for x in new_shape)
    n = math.prod(shape)
    if n != math.prod(new_shape) or n == 0:
        return None
    if any(int(x) == 0 for x in size):  # no element: the empty box
        return (0,) * len(new_shape), (0,) * len(new_shape)
    # strides of each dimension; the refinement's strides are the union of both shapes'
    a, b = _strides(shape), _strides(new_shape)
    marks = sorted(set(a) | set(b) | {n}, reverse=True)  # n: the outermost boundary
    for hi, lo in zip(marks, marks[1:]):
        if hi % lo:
            return None  # no common refinement (e.g. (2, 3) and (3, 2))
    fine = [marks[i] // marks[i + 1] for i in range(len(marks) - 1)]  # sizes, outer first
    fstr = marks[1:]
    # split: each dim of ``shape`` covers the fine dims whose strides lie in [its stride, its extent)
    fo: list[int] = []
    fs: list[int] = []
    for d, st in enumerate(a):
        ext = st * shape[d]
        dims = [i for i, s in enumerate(fstr) if st <= s < ext]
        o, s = int(offsets[d]), int(size[d])
        if not dims:  # a dimension of size 1
            continue
        sizes = [fine[i] for i in dims]
        parts = _split_range(o, s, sizes)
        if parts is None:
            return None
        for po, ps in parts:
            fo.append(po)
            fs.append(ps)
    # merge into ``new_shape``'s dims
    out_o, out_s = [], []
    for d, st in enumerate(b):
        ext = st * new_shape[d]
        dims = [i for i, s in enumerate(fstr) if st <= s < ext]
        if not dims:  # a dimension of size 1
            out_o.append(0)
            out_s.append(1)
            continue
        merged = _merge_ranges([(fo[i], fs[i]) for i in dims], [fine[i] for i in dims])
        if merged is None:
            return None
        out_o.append(merged[0])
        out_s.append(merged[1])
    return tuple(out_o), tuple(out_s)


def _split_range(o: int, s: int, sizes: list[int]) -> list[tuple[int, int]] | None:
    """Range [o, o+s) of a dimension of ``prod(sizes)`` as one range per sub-dimension (outer
    first), or None."""
    if len(sizes) == 1:
        return [(o, s)]
    inner = math.prod(sizes[1:])
    if s == 0:
        return [(0, 0)] * len(sizes)
    if o // inner == (o + s - 1) // inner:  # inside one step of the outer sub-dimension
        rest = _split_range(o % inner, s, sizes[1:])
        return None if rest is None else [(o // inner, 1)] + rest
    if o % inner == 0 and s % inner == 0:  # whole steps
        return [(o // inner, s // inner)] + [(0, x) for x in sizes[1:]]
    return None


def _merge_ranges(parts: list[tuple[int, int]], sizes: list[int]) -> tuple[int, int] | None:
    """Ranges of sub-dimensions (outer first) as one range of their product, or None."""
    o, s = parts[-1]
    inner = sizes[-1]
    for (po, ps), size in zip(reversed(parts[:-1]), reversed(sizes[:-1])):
        if ps == 0 or s == 0:
            return 0, 0
        if s != inner and ps != 1:  # the inner part is not whole: only one outer step may be taken
            return None
        o, s = po * inner + o, ps * s if s == inner else s
        inner *= size
    return o, s


def _collapse(g, o, s):
    """Merge each dim with the one inside it when the inner one is fully covered."""
    gg: list[int] = []
    oo: list[int] = []
    ss: list[int] = []
    for gi, oi, si in zip(reversed(g), reversed(o), reversed(s)):
        if gg and ss[-1] == gg[-1]:
            # the dim inside is full: fold this dim into it
            inner_g = gg[-1]
            gg[-1] = gi * inner_g
            oo[-1] = oi * inner_g
            ss[-1] = si * inner_g
        else:
            gg.append(gi)
            oo.append(oi)
            ss.append(si)
    return tuple(reversed(gg)), tuple(reversed(oo)), tuple(reversed(ss))


class IndexMap:
    """local flat index <-> canonical flat index for one shard."""

    def __init__(self, spec: ShardSpec):
        self.spec = spec
        try:
            derived = _derived(spec)
        except TypeError:  # a spec of lists, not tuples (unhashable): worked out, not kept
            derived = _derived.__wrapped__(spec)
        (self.numel, self._g, self._o, self._s, self.identity, self.run_offset, self._gstrides,
         self._lstrides, self._glob_base) = derived

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        local = local.to(torch.int64)
        if self.identity:
            return local
        if self.run_offset is not None:
            return local + self.run_offset
        return _small(self._global_of, local)

    def _global_of(self, p):
        """The general map, in operators numpy arrays and torch tensors share (``_small``). As
        the sum over dimensions of (q_d + o_d) * G_d, written as p + sum of q_d * (G_d - L_d) + a
        constant (the last dimension's term is 0): a column shard's map is four operators, where
        the sum term by term was eight (``to_global`` of a chunk's 164 changes: 8.5 -> 6.0 us)."""
        out = p + self._glob_base
        last = len(self._s) - 1
        for d in range(last):
            q = p // self._lstrides[d]
            if d:
                q %= self._s[d]
            q *= self._gstrides[d] - self._lstrides[d]
            out += q
        return out

    @property
    def run_length(self) -> int:
        """The length of the runs ``rows`` cuts the shard into (its collapsed last dimension)."""
        return self._s[-1] if self._s else 1

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The shard as runs consecutive in both its local and the canonical flat order: its
        collapsed rows (a whole tensor or a row shard is one run, a column shard one per row) ->
        (each run's local start, its canonical start, the runs' length), increasing. What chunks
        are mapped to shards with, per run rather than per element (``state/runs.py``)."""
        length = self.run_length
        if self.numel == 0:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty, 1
        local = torch.arange(0, self.numel, length, dtype=torch.int64)
        return local, self.to_global(local), length

    def held_to_local(self, glob: torch.Tensor) -> torch.Tensor:
        """Local indices of canonical ones known to lie in this shard (its own changes, found in
        the tensor that holds it): ``to_local`` without the mask, which on a whole tensor or a run
        was most of a small tensor's publish with shard specs (~28 us a chunk; docs/results.md,
        twenty-fourth turn). An index outside it is then out of the local tensor's bounds, which
        the write that uses it refuses."""
        if self.identity:
            return glob
        if self.run_offset is not None:
            return glob - self.run_offset
        return self.to_local(glob)[0]

    def to_local(self, glob: torch.Tensor):
        """Return (local indices of the held elements, boolean mask of which inputs are held)."""
        glob = glob.to(torch.int64)
        if self.identity:
            mask = (glob >= 0) & (glob < self.numel)
            return glob[mask], mask
        if self.run_offset is not None:
            local = glob - self.run_offset
            mask = (local >= 0) & (local < self.numel)
            return local[mask], mask
        return _small(self._local_of, glob)

    def _local_of(self, rem):
        """``to_local``'s general map, in operators numpy arrays and torch tensors share (``_small``)."""
        out = mask = None
        for d, (ls, gs, off, sz) in enumerate(zip(self._lstrides, self._gstrides, self._o, self._s)):
            if d == len(self._s) - 1:
                q = rem
            else:
                q = rem // gs
                rem = rem - q * gs
            q = q - off
            held = (q >= 0) & (q < sz)
            mask = held if mask is None else mask & held
            out = q * ls if out is None else out + q * ls
        assert out is not None and mask is not None  # (not identity: at least one dimension)
        return out[mask], mask


SMALL = 1 << 14  # below this many indices on the host, the general maps run on numpy arrays


def _small(f, idx: torch.Tensor):
    """``f`` (a general map, written in operators both share) on ``idx``: through numpy for a few
    indices on the host, where each operator costs a third of torch's (a chunk's changes: ~16
    against ~42 us for a column shard's 160; docs/results.md, twenty-fifth turn); torch else."""
    if idx.is_cpu and idx.numel() <= SMALL and idx.dim() == 1:
        out = f(idx.numpy())
        return tuple(torch.from_numpy(o) for o in out) if isinstance(out, tuple) else torch.from_numpy(out)
    return f(idx)


@functools.lru_cache(maxsize=1 << 16)
def _derived(spec: ShardSpec) -> tuple:
    """What an ``IndexMap`` of ``spec`` works out, once per spec: a sync or publish makes a map
    or two per tensor, and a model of thousands of small tensors (a mixture of experts) made them
    again every time (docs/results.md, twenty-third turn). A spec that does not validate raises
    (and is not kept)."""
    spec.validate()
    g, o, s = _collapse(spec.box_shape, spec.offsets, spec.shape)
    identity = spec.is_full or (len(s) <= 1 and (not o or o[0] == 0) and s == g)
    # A shard whose collapsed form is 1-D is a single contiguous run of the canonical tensor.
    run_offset = o[0] if len(s) == 1 else None
    gstrides = _strides(g)
    glob_base = sum(off * gs for off, gs in zip(o, gstrides))  # the shard's first element's canonical index
    return spec.numel, g, o, s, identity, run_offset, gstrides, _strides(s), glob_base


def _strides(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))
