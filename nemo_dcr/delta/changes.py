"""What ``on_change`` sees: every element a diff or an apply changes, and whole tensors that leave.

``on_change(name, dtype, global_shape, global_idx, old_bits, new_bits)`` is called from worker
threads with integer-view bits at canonical flat indices. ``old_bits`` is None for elements of a
tensor that did not exist before (added, or the new side of a reshape/re-type); ``new_bits`` is
None for elements of a tensor that no longer exists (removed, or the old side of a reshape/re-type).
An incremental state digest (``statedigest.ChangeDigest``) subtracts the old and adds the new.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.state.index_map import IndexMap, ShardSpec
from nemo_dcr.state.statedigest import CHUNK

#: ``on_change(name, dtype, global_shape, global_idx, old_bits, new_bits)``; see the module doc.
#: (A runtime alias, not an annotation: ``X | None`` here is evaluated at import time, which Python 3.10 allows.)
OnChange = Callable[[str, torch.dtype, tuple, torch.Tensor, torch.Tensor | None, torch.Tensor | None], None]


def spec_of(tensor: torch.Tensor, spec: ShardSpec | None) -> ShardSpec:
    """Where ``tensor`` sits: ``spec`` if it describes this tensor, else the whole tensor."""
    if spec is None or tuple(spec.shape) != tuple(tensor.shape):
        return ShardSpec.full(tensor.shape)
    return spec


def report_gone(name: str, tensor: torch.Tensor, spec: ShardSpec | None,
                on_change: OnChange | None) -> None:
    """Tell ``on_change`` that every element of ``tensor`` (placed by ``spec``) leaves the state,
    one bounded range at a time."""
    if on_change is None:
        return
    spec = spec_of(tensor, spec)
    imap, fa = IndexMap(spec), FlatAccess(tensor)
    for s in range(0, fa.numel, CHUNK):
        e = min(s + CHUNK, fa.numel)
        gidx = imap.to_global(torch.arange(s, e, dtype=torch.int64))
        on_change(name, tensor.dtype, spec.global_shape, gidx, fa.read(s, e).clone(), None)
