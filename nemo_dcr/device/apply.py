"""Receiver side of the device path: apply decoded changes in place where the tensor lives.

The host decodes (``codec``; O(changes) output), only positions, pre-image and new bits move
to the device, and ``apply_`` checks every pre-image before it writes anything: a receiver that
does not hold the base the delta was made against is refused with nothing changed.
"""
from __future__ import annotations

import torch

from nemo_dcr.device import kernels
from nemo_dcr.device.diff import BLOCK, _need_kernels, bits
from nemo_dcr.errors import DcrError
from nemo_dcr.state.statedigest import StateDigest, changes_contrib


class PreImageMismatch(DcrError):
    """The target does not hold the expected pre-image at some changed position."""


def apply_(target: torch.Tensor, pos: torch.Tensor, new: torch.Tensor, pre: torch.Tensor,
           block: int = BLOCK) -> None:
    """``target[pos] = new`` in place (raw bits), if and only if ``target[pos] == pre`` (raw bits)
    at every position. ``pos``: strictly increasing int64 flat positions; ``new``/``pre``: bits
    of the target's element width (any dtype of that width), all on the target's device."""
    _need_kernels()
    if not target.is_contiguous():
        raise DcrError("the device apply needs a contiguous target")
    w = target.element_size()
    pos = pos.reshape(-1)
    new, pre = new.reshape(-1), pre.reshape(-1)
    if pos.dtype != torch.int64:
        raise DcrError(f"positions must be int64, got {pos.dtype}")
    if new.element_size() != w or pre.element_size() != w:
        raise DcrError(f"values must have {w}-byte elements")
    if not (pos.numel() == new.numel() == pre.numel()):
        raise DcrError(f"{pos.numel()} positions, {new.numel()} new values, {pre.numel()} pre-images")
    if any(t.device != target.device for t in (pos, new, pre)):
        raise DcrError("positions and values must be on the target's device")
    if not (pos.is_contiguous() and new.is_contiguous() and pre.is_contiguous()):
        pos, new, pre = pos.contiguous(), new.contiguous(), pre.contiguous()  # O(changes)
    k, n = pos.numel(), target.numel()
    if k == 0:
        return
    tb, nb, pb = bits(target), bits(new), bits(pre)
    # one host sync for all the checks: range, strictly increasing (so distinct), pre-images
    bad = torch.zeros(1, dtype=torch.int32, device=target.device)
    kernels.preimage_check_kernel[(-(-k // block),)](tb, pos.clamp(0, max(n - 1, 0)), pb, k, bad, BLOCK=block)
    flags = torch.stack([(pos.min() < 0) | (pos.max() >= n), (pos[1:] <= pos[:-1]).any(), bad[0] > 0]).tolist()
    if flags[0]:
        raise DcrError(f"a change position is out of range for {n} elements")
    if flags[1]:
        raise DcrError("change positions are not strictly increasing")
    if flags[2]:
        first = int(pos[(tb[pos] != pb).nonzero()[0, 0]])
        raise PreImageMismatch(f"{int(bad.item())} of {k} changed elements do not hold the expected "
                               f"pre-image (first at position {first}): the target is not the delta's base")
    kernels.scatter_kernel[(-(-k // block),)](tb, pos, nb, k, BLOCK=block)


def digest_change(name: str, dtype, global_shape, global_idx: torch.Tensor, pre: torch.Tensor,
                  new: torch.Tensor, definition: int = 1) -> StateDigest:
    """The O(changes) state-digest update (of ``definition``) of applying ``new`` over ``pre`` at
    canonical ``global_idx`` (``new_digest = old_digest + digest_change(...)``), computed with
    ``state/statedigest.changes_contrib`` where the tensors are (its torch ops run on any
    device), so only 4 lanes come back to the host."""
    return (changes_contrib(name, dtype, global_shape, global_idx, new, definition=definition)
            - changes_contrib(name, dtype, global_shape, global_idx, pre, definition=definition))
