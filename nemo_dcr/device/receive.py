"""Receiver side of the device path: apply a delta to tensors that live on the device, moving
only the changes.

    d = apply_delta_(tensors, blob)        # tensors: name -> CUDA tensor, changed in place
    state_digest = state_digest + d        # O(changes) state-digest update (sync/follower)

The host decodes each chunk (``codec/chunk.decode_chunk``, O(changes) output); positions and
values go to the device; the bits held there are gathered (O(changes)) and checked against the
chunk's pre-image digest — every chunk of every tensor before the first write, so a receiver
that does not hold the delta's base is refused with nothing changed; then ``apply.apply_``
scatters the new bits in place (its own pre-image check on raw bits comes free). The return
value is the state-digest change (``apply.digest_change``), computed from the changes alone.

Scope (the rest goes through the reference ``delta.apply``): whole tensors held whole, entries
of kind ``delta`` with every chunk written once. A ``classes`` chunk decodes against the whole
base chunk, so that chunk's base bits come to the host (O(chunk)): the per-class select that
turns ranks back into positions is not a device kernel yet.
"""
from __future__ import annotations

from typing import Mapping

import torch

from nemo_dcr.codec.chunk import CLASSES, decode_chunk
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.codec.header import TensorKind
from nemo_dcr.delta.apply import new_bits
from nemo_dcr.device.apply import apply_, digest_change
from nemo_dcr.device.diff import bits
from nemo_dcr.errors import BaseMismatchError, DcrError
from nemo_dcr.state.digest import values_digest
from nemo_dcr.state.statedigest import StateDigest


def _plan(reader: DeltaReader, tensors: Mapping[str, torch.Tensor]):
    """Decode and check every chunk -> [(name, positions, pre-image, new bits) on the device]."""
    out = []
    for e in reader.header.tensors:
        if e.kind == TensorKind.REMOVED or not e.chunks:
            continue
        t = tensors.get(e.name)
        if e.kind != TensorKind.DELTA or t is None:
            raise DcrError(f"{e.name}: a {e.kind.value} entry: the device apply takes deltas of tensors held")
        if t.dtype != e.torch_dtype or tuple(t.shape) != tuple(e.shape) or tuple(e.region.shape) != tuple(e.shape):
            raise DcrError(f"{e.name}: the device apply takes whole tensors of the entry's dtype and shape")
        if not t.is_contiguous():
            raise DcrError(f"{e.name}: the device apply needs a contiguous tensor")
        tb = bits(t)
        for c in e.chunks:
            base = tb[c.start:c.end].cpu() if c.enc == CLASSES else None  # O(chunk): see the module note
            idx, vals = decode_chunk(c, reader.payload(c), t.element_size(), base=base, dtype=t.dtype)
            pos = (idx + c.start).to(t.device)
            cur = tb[pos]
            if values_digest(cur.cpu()) != c.pre:
                raise BaseMismatchError(f"{e.name}: chunk at element {c.start} does not match its base")
            new = new_bits(e.name, c, t.dtype, cur, vals.to(t.device))
            out.append((e, pos, cur, new))
    return out


def apply_delta_(tensors: Mapping[str, torch.Tensor], delta) -> StateDigest:
    """Apply ``delta`` (bytes, a path or a DeltaReader) in place; every chunk is decoded and its
    pre-image checked before the first write. -> the state-digest change (O(changes))."""
    reader = DeltaReader.open(delta)
    planned = _plan(reader, tensors)
    d = StateDigest.zero()
    for e, pos, cur, new in planned:
        apply_(tensors[e.name], pos, new, cur)
        d = d + digest_change(e.name, e.torch_dtype, tuple(e.shape), pos, cur, new)
    return d
