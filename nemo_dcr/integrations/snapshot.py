"""Snapshots: which tensors of a model are published, and a private copy of them.

    tensors, shards = module_snapshot(model)              # any torch.nn.Module: whole tensors
    tensors, shards = take_snapshot(model)                # Megatron models: their local shards

A module with DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism) is snapshotted
as this rank's blocks of them in canonical coordinates (``integrations/dtensor.py``), each block
from one rank; such a snapshot is published jointly by every rank, like a Megatron model's.

Names are the module's ``state_dict`` names (parameters and persistent buffers), so a receiver
built from the same model class names its tensors the same way. A tensor reachable under two
names (tied weights, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) is taken once,
under the first name ``state_dict`` lists; :func:`module_tensors` applies the same rule on the
receiving side. ``*._extra_state`` entries (Transformer Engine metadata) are not weights and are
left out.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nemo_dcr.errors import DcrError
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.util.memory import host_copy

from .dtensor import has_dtensors, is_dtensor, local_shards

#: ``fn(module) -> (tensors, shards)``: ``tensors`` a dict of name -> *private* CPU tensor (the
#: trainer goes on changing its own right after the call), ``shards`` name -> ShardSpec for the
#: tensors that are a shard of a larger canonical tensor ({} when every tensor is whole).
SnapshotFn = Callable[[Any], tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]]


def parse_dtype(dtype) -> torch.dtype | None:
    """None, a torch.dtype, or its name ("bfloat16", "torch.bfloat16", "bf16", "fp16", "fp32")."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name)
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise DcrError(f"dtype must name a floating-point torch dtype (e.g. 'bfloat16'), not {dtype!r}")
    return dt


def _alias_key(t: torch.Tensor):
    if is_dtensor(t):  # its storage is the local block's (a DTensor's own has no data pointer)
        t = t.to_local()  # type: ignore[attr-defined]
    if t.device.type == "meta" or t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's live tensors (no copy) by ``state_dict`` name: parameters and persistent
    buffers, each storage region once (tied weights under their first name). The values are
    ``.data`` of the parameters: writing into them in place changes the live model. DTensor
    parameters are returned as DTensors (:func:`module_views` gives their local blocks)."""
    out: dict[str, torch.Tensor] = {}
    seen = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or name.endswith("._extra_state") or name == "_extra_state":
            continue
        data = t.data
        key = _alias_key(data)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        out[name] = data
    return out


def copy_tensors(tensors: Mapping[str, torch.Tensor], dtype=None) -> dict[str, torch.Tensor]:
    """A private CPU copy; floating-point tensors cast to ``dtype`` when one is given. On huge
    pages (``util/memory.py``): a copy is made at every step, into memory the last one freed,
    and faulted in 4 KiB at a time otherwise (a 1 GiB model: ~280 ms per step, ~120 ms so)."""
    dt = parse_dtype(dtype)
    return {name: host_copy(t, dt if dt is not None and t.is_floating_point() else None)
            for name, t in tensors.items()}


def module_views(module: torch.nn.Module, main_only: bool = False
                 ) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """``(tensors, shards)``: :func:`module_tensors` with each DTensor as this rank's local
    block (a live view) and its place in the global tensor (see ``dtensor.local_shards``;
    ``main_only=False``, a receiver's view: every block this rank holds)."""
    return local_shards(module_tensors(module), main_only=main_only)


def module_snapshot(module: torch.nn.Module, dtype=None) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """A private CPU copy (``.detach().to("cpu", copy=True)``) of the module's parameters and
    persistent buffers, by ``state_dict`` name; every tensor whole (``shards == {}``), except
    for DTensor parameters (FSDP2, TP): there each rank copies its own blocks, each block from
    one rank only (plain tensors from global rank 0), with their ``ShardSpec``s; no all-gather.
    ``dtype`` (e.g. ``"bfloat16"``): publish floating-point tensors in that dtype, as the
    rollout engine holds them (the trainer's own tensors are not changed; a cast is per
    element, so a cast shard is the shard of the cast tensor)."""
    tensors = module_tensors(module)
    if not any(is_dtensor(t) for t in tensors.values()):
        return copy_tensors(tensors, dtype), {}
    local, shards = local_shards(tensors, main_only=True)
    return copy_tensors(local, dtype), shards


def _megatron():
    """integrations/megatron.py, if it is there and importable (megatron-core installed)."""
    try:
        from . import megatron
    except ImportError:
        return None
    if not hasattr(megatron, "is_megatron_module") or not hasattr(megatron, "megatron_snapshot"):
        return None
    return megatron


def is_megatron(module) -> bool:
    if "megatron.core" not in sys.modules:  # no Megatron model without it: don't import it for nothing
        return False
    m = _megatron()
    if m is None:
        return False
    try:
        return bool(m.is_megatron_module(module))
    except Exception:
        return False


def is_sharded(module, snapshot_fn: SnapshotFn | None = None) -> bool:
    """Whether every rank publishes its own part of the model jointly (a ``snapshot_fn``, a
    Megatron model, DTensor parameters) rather than global rank 0 the whole replicated module."""
    return snapshot_fn is not None or is_megatron(module) or (
        isinstance(module, torch.nn.Module) and has_dtensors(module))


def take_snapshot(module, snapshot_fn: SnapshotFn | None = None, dtype=None):
    """-> (tensors, shards, sharded): ``snapshot_fn(module)`` when given, else the Megatron
    snapshot for a Megatron model (integrations/megatron.py), else :func:`module_snapshot`.
    ``sharded`` (see :func:`is_sharded`) is False only for a plain module, whose tensors every
    data-parallel rank holds whole (one rank publishes them); snapshots of other kinds (DTensor
    modules included) are published jointly by every rank."""
    if snapshot_fn is not None:
        tensors, shards = snapshot_fn(module)
        sharded = True
    elif is_megatron(module):
        m = _megatron()
        if hasattr(m, "force_param_sync"):  # a collective: every rank snapshots at the same step
            m.force_param_sync(module)
        tensors, shards = m.megatron_snapshot(module)
        sharded = True
    else:
        tensors, shards = module_snapshot(module, dtype)
        return tensors, shards, has_dtensors(module)
    if dtype is not None:
        dt = parse_dtype(dtype)
        tensors = {k: (v.to(dt) if v.is_floating_point() and v.dtype != dt else v) for k, v in tensors.items()}
    return dict(tensors), dict(shards or {}), sharded


__all__ = ["SnapshotFn", "module_snapshot", "module_tensors", "module_views", "copy_tensors", "take_snapshot",
           "is_megatron", "is_sharded", "parse_dtype"]
