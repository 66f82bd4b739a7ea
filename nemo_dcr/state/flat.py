"""Flat, bit-level access to a tensor of any strides, one bounded range at a time.

Contiguous tensors are read through views (no copy). Non-contiguous tensors are read and
written through computed multi-indices, so a chunk costs scratch proportional to the chunk,
never to the tensor.
"""
from __future__ import annotations

import torch

from nemo_dcr.state.dtypes import int_view


class FlatAccess:
    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.bits = int_view(t)
        self.numel = t.numel()
        self.contiguous = t.is_contiguous()
        # as_strided, not view(-1): a contiguous tensor with a size-1 dim may carry any stride
        # there (e.g. buf[1::2] of one element), and a flat view must have unit stride
        self._flat = self.bits.as_strided((self.numel,), (1,)) if self.contiguous else None
        self._shape = tuple(t.shape)

    def _unravel(self, idx: torch.Tensor):
        out, rem = [], idx
        for n in reversed(self._shape):
            out.append(torch.remainder(rem, n))
            rem = torch.div(rem, n, rounding_mode="floor")
        return tuple(reversed(out))

    def read(self, start: int, end: int) -> torch.Tensor:
        """Bits of flat range [start, end) as a 1-D contiguous tensor (a view when possible)."""
        if self._flat is not None:
            return self._flat[start:end]
        if self.bits.dim() == 0:
            return self.bits.reshape(1)[start:end]
        idx = torch.arange(start, end, dtype=torch.int64)
        return self.bits[self._unravel(idx)]

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        if self._flat is not None:
            # index_select, not self._flat[idx]: advanced indexing costs ~3x more per element
            # on CPU (bench/kernels.py's applies gather and scatter ~1 % of a shard)
            return self._flat.index_select(0, idx) if idx.dim() == 1 else self._flat[idx]
        if self.bits.dim() == 0:
            return self.bits.reshape(1)[idx]
        return self.bits[self._unravel(idx)]

    def scatter(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` at flat ``idx`` in place."""
        if self._flat is not None:
            if idx.dim() == 1 and idx.dtype == torch.int64 and values.dtype == self._flat.dtype \
                    and values.shape == idx.shape:
                # scatter_, not self._flat[idx] = values (index_put_): ~4x less per element on CPU;
                # the positions written are distinct, so which duplicate wins never arises
                self._flat.scatter_(0, idx, values)
            else:
                self._flat[idx] = values
        elif self.bits.dim() == 0:
            if idx.numel():
                self.bits.fill_(values[-1])
        else:
            self.bits.index_put_(self._unravel(idx), values)
