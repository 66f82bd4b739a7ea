"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism, HSDP): this rank's shards
in canonical coordinates, read from the DTensor's own placements, with no all-gather.

    locals_, shards = local_shards(module_tensors(model))       # trainer: each block once
    locals_, shards = local_shards(module_tensors(model), main_only=False)   # receiver: every block held

A DTensor's global shape is its ``.shape``; the block this rank holds is ``to_local()`` (for
FSDP2, a view of the rank's unpadded shard of the flat parameter) and where it sits comes from
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, the call
``torch.distributed.checkpoint`` makes for its chunk metadata, so anything DCP can save is
published the same way: ``Shard(d)`` on any number of mesh dimensions, uneven last shards (and
the empty shards of ranks past the end, which publish nothing), ``_StridedShard`` as FSDP2 + TP
makes it. ``Replicate()`` on a mesh dimension means every coordinate along it holds the same
block: the trainer publishes it from coordinate 0 only (``main_only``), as DCP's save keeps one
copy; a receiver holds it on every coordinate and ``RolloutLoader`` refreshes the copies from
the lowest group rank after each update. ``Partial()`` (a pending reduction: the local tensor
is not the value) raises ``DcrError``.

Tensors that are not DTensors (FSDP2 does not shard buffers; a module's unsharded parameters)
are the same on every rank: with ``main_only`` they are kept on global rank 0 only.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from nemo_dcr.errors import DcrError
from nemo_dcr.state.index_map import ShardSpec


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # a torch build without distributed
        return None
    return DTensor


def is_dtensor(t) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def has_dtensors(tensors) -> bool:
    """True when any tensor of ``tensors`` (a mapping, or a module's parameters and buffers) is a DTensor."""
    if isinstance(tensors, torch.nn.Module):
        values = list(tensors.parameters()) + list(tensors.buffers())
    else:
        values = list(tensors.values())
    return any(is_dtensor(t) for t in values)


def _main_rank() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def shard_of(name: str, t) -> tuple[torch.Tensor, ShardSpec, bool]:
    """``(local block, where it sits in the global tensor, main)`` for one DTensor. ``main``:
    this rank is coordinate 0 along every mesh dimension the tensor is replicated on (the one
    copy a trainer publishes)."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, tuple(t.placements)
    if any(isinstance(p, Partial) for p in placements):
        raise DcrError(f"{name}: a DTensor with a Partial placement ({placements}) holds a partial sum, not the "
                       "weights; redistribute it to Shard/Replicate before publishing")
    local = t.to_local()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise DcrError(f"{name}: the local tensor's shape {tuple(local.shape)} is not the block its placements "
                       f"{placements} give on this rank ({tuple(shape)})")
    coord = mesh.get_coordinate()
    if coord is None:
        raise DcrError(f"{name}: this rank is not part of the tensor's device mesh {mesh}")
    main = all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))
    return local, ShardSpec.of(t.shape, offsets, shape), main


def local_shards(tensors: Mapping[str, torch.Tensor], main_only: bool = True
                 ) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """``(tensors, shards)`` with every DTensor replaced by this rank's block of it (a view of
    the live local tensor, no copy) and its ``ShardSpec``. ``main_only=True`` (a trainer, whose
    ranks' blocks must cover each tensor exactly once): replicated blocks only where this rank
    is their first holder, plain tensors on global rank 0 only, empty blocks left out.
    ``main_only=False`` (a receiver): every block this rank holds, and every plain tensor."""
    out: dict[str, torch.Tensor] = {}
    shards: dict[str, ShardSpec] = {}
    first = _main_rank()
    for name, t in tensors.items():
        if not is_dtensor(t):
            if first or not main_only:
                out[name] = t
            continue
        local, spec, main = shard_of(name, t)
        if spec.numel == 0 or (main_only and not main):
            continue
        out[name] = local
        if not spec.is_full:
            shards[name] = spec
    return out, shards


__all__ = ["is_dtensor", "has_dtensors", "shard_of", "local_shards"]
