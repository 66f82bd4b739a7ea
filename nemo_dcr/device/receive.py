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

A ``classes`` chunk decodes against the whole base chunk. Its two streams are decoded on the
host without the base (``chunk.locate_chunk``: each change's class, rank within the class and
difference, O(changes)); those go to the device, where ``classes.locate`` turns ranks
back into positions against the base bits held there (each element's class, a stable sort by
class, a gather: torch ops, so the same code runs on the CPU in the tests). No base bits cross
to the host; the pre-image check hashes the bits at the changes (O(changes)).

A tensor sent whole (``full``: new, re-typed or reshaped) is decoded on the host and built on
the device (it is O(tensor) bytes in the delta anyway); a removed one is dropped. Scope (the
rest goes through the reference ``delta.apply``): whole tensors, held whole.
"""
from __future__ import annotations

from collections.abc import MutableMapping

import torch

from nemo_dcr.codec import classes
from nemo_dcr.codec.chunk import CLASSES, decode_chunk, locate_chunk
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.codec.header import TensorKind
from nemo_dcr.codec.versions import version
from nemo_dcr.delta.apply import new_bits
from nemo_dcr.device.apply import apply_, digest_change
from nemo_dcr.device.diff import bits
from nemo_dcr.errors import BaseMismatchError, DcrError
from nemo_dcr.state.digest import values_digest
from nemo_dcr.state.statedigest import StateDigest, changes_contrib


def _whole(reader: DeltaReader, e, device) -> torch.Tensor:
    """A tensor sent whole, decoded on the host and built on ``device``."""
    if tuple(e.region.shape) != tuple(e.shape):
        raise DcrError(f"{e.name}: the device apply takes whole tensors")
    t = torch.zeros(e.shape, dtype=e.torch_dtype)
    tb = bits(t)
    for c in e.chunks:
        idx, vals = decode_chunk(c, reader.payload(c), t.element_size(), dtype=t.dtype)
        tb[idx + c.start] = vals
    return t.to(device)


def _place(name: str, c, payload, tb: torch.Tensor, dtype: torch.dtype):
    """A ``classes`` chunk's changes against the base held in ``tb`` (where it is) -> (tensor
    positions, new bits), both on ``tb``'s device; only the decoded streams cross to it."""
    try:
        idx, new = locate_chunk(c, payload, tb[c.start:c.end], dtype)
    except classes.RankPastClass:
        # checksum-valid streams whose ranks do not fit what is held: not this base
        raise BaseMismatchError(f"{name}: chunk at element {c.start} does not match its base") from None
    return idx + c.start, new


def _all(name, t: torch.Tensor, definition: int) -> StateDigest:
    """The digest contribution of a whole tensor, from its bits where it is."""
    b = bits(t.contiguous())
    return changes_contrib(name, t.dtype, tuple(t.shape), torch.arange(b.numel(), device=b.device), b,
                           definition=definition)


def _plan(reader: DeltaReader, tensors: MutableMapping[str, torch.Tensor], device):
    """Decode and check every chunk -> ([(entry, positions, pre-image, new bits) on the device],
    {name: tensor sent whole, or None for removed})."""
    out: list = []
    whole: dict[str, torch.Tensor | None] = {}
    for e in reader.header.tensors:
        if e.kind == TensorKind.REMOVED:
            whole[e.name] = None
            continue
        if e.kind == TensorKind.FULL:
            whole[e.name] = _whole(reader, e, device)
            continue
        if not e.chunks:
            continue
        t = tensors.get(e.name)
        if t is None:
            raise DcrError(f"{e.name}: a delta for a tensor this receiver does not hold")
        if t.dtype != e.torch_dtype or tuple(t.shape) != tuple(e.shape) or tuple(e.region.shape) != tuple(e.shape):
            raise DcrError(f"{e.name}: the device apply takes whole tensors of the entry's dtype and shape")
        if not t.is_contiguous():
            raise DcrError(f"{e.name}: the device apply needs a contiguous tensor")
        tb = bits(t)
        w = t.element_size()
        for c in e.chunks:
            if c.enc == CLASSES:
                pos, new = _place(e.name, c, reader.payload(c), tb, t.dtype)
                cur = tb[pos]
            else:
                idx, vals = decode_chunk(c, reader.payload(c), w)
                pos = (idx + c.start).to(t.device)
                cur = tb[pos]
                new = new_bits(e.name, c, t.dtype, cur, vals.to(t.device))
            if values_digest(cur.cpu(), c.values_algo) != c.pre:  # O(changes) to the host
                raise BaseMismatchError(f"{e.name}: chunk at element {c.start} does not match its base")
            out.append((e, pos, cur, new))
    return out, whole


def apply_delta_(tensors: MutableMapping[str, torch.Tensor], delta, device=None) -> StateDigest:
    """Apply ``delta`` (bytes, a path or a DeltaReader) to ``tensors`` in place (tensors sent
    whole are placed on ``device``, default: where the held tensors are); every chunk is decoded
    and its pre-image checked before the first write. -> the state-digest change: O(changes)
    for the tensors in delta, O(tensor) for those sent whole or removed; of the definition the
    delta's format version sums with (``codec/versions.py``: 2 from version 5)."""
    reader = DeltaReader.open(delta)
    if device is None:
        device = next((t.device for t in tensors.values()), torch.device("cpu"))
    planned, whole = _plan(reader, tensors, device)
    defn = version(reader.version).definition
    d = StateDigest.zero(defn)
    for e, pos, cur, new in planned:
        apply_(tensors[e.name], pos, new, cur)
        d = d + digest_change(e.name, e.torch_dtype, tuple(e.shape), pos, cur, new, defn)
    for name, t in whole.items():
        if name in tensors:
            d = d - _all(name, tensors.pop(name), defn)
        if t is not None:
            tensors[name] = t
            d = d + _all(name, t, defn)
    return d
