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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_dcr.errors import DcrError


@dataclass(frozen=True)
class ShardSpec:
    """Where a local tensor sits in its canonical (global) tensor."""

    global_shape: tuple
    offsets: tuple
    shape: tuple

    @classmethod
    def full(cls, shape: Sequence[int]) -> ShardSpec:
        shape = tuple(int(s) for s in shape)
        return cls(shape, (0,) * len(shape), shape)

    @classmethod
    def of(cls, global_shape, offsets=None, shape=None) -> ShardSpec:
        g = tuple(int(s) for s in global_shape)
        o = tuple(int(s) for s in offsets) if offsets is not None else (0,) * len(g)
        s = tuple(int(x) for x in shape) if shape is not None else g
        spec = cls(g, o, s)
        spec.validate()
        return spec

    def validate(self) -> None:
        g, o, s = self.global_shape, self.offsets, self.shape
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
        return self.shape == self.global_shape

    def contains(self, other: ShardSpec) -> bool:
        return self.global_shape == other.global_shape and all(
            so <= oo and oo + os_ <= so + ss
            for so, ss, oo, os_ in zip(self.offsets, self.shape, other.offsets, other.shape)
        )

    def slices_of(self, inner: ShardSpec) -> tuple:
        """Slices that cut ``inner`` out of a local tensor laid out as ``self``."""
        if not self.contains(inner):
            raise DcrError(f"{inner} is not inside {self}")
        return tuple(slice(io - so, io - so + isz) for so, io, isz in zip(self.offsets, inner.offsets, inner.shape))

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "shape": list(self.shape)}


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
        spec.validate()
        self.spec = spec
        self.numel = spec.numel
        g, o, s = _collapse(spec.global_shape, spec.offsets, spec.shape)
        self._g, self._o, self._s = g, o, s
        self.identity = spec.is_full or (len(s) <= 1 and (not o or o[0] == 0) and s == g)
        # A shard whose collapsed form is 1-D is a single contiguous run of the canonical tensor.
        self.run_offset = o[0] if len(s) == 1 else None
        self._gstrides = _strides(g)
        self._lstrides = _strides(s)

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        local = local.to(torch.int64)
        if self.identity:
            return local
        if self.run_offset is not None:
            return local + self.run_offset
        out = torch.zeros_like(local)
        rem = local
        for d, (ls, gs, off) in enumerate(zip(self._lstrides, self._gstrides, self._o)):
            if d == len(self._s) - 1:
                q = rem
            else:
                q = torch.div(rem, ls, rounding_mode="floor")
                rem = rem - q * ls
            out += (q + off) * gs
        return out

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
        out = torch.zeros_like(glob)
        mask = torch.ones_like(glob, dtype=torch.bool)
        rem = glob
        for d, (ls, gs, off, sz) in enumerate(zip(self._lstrides, self._gstrides, self._o, self._s)):
            if d == len(self._s) - 1:
                q = rem
            else:
                q = torch.div(rem, gs, rounding_mode="floor")
                rem = rem - q * gs
            q = q - off
            mask &= (q >= 0) & (q < sz)
            out += q * ls
        return out[mask], mask


def _strides(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))
