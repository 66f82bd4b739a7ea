"""Megatron-core models: which local shards a rank publishes, in canonical coordinates.

    force_param_sync(model)                       # every rank: finish the distributed optimizer's all-gather
    tensors, shards = megatron_snapshot(model)    # this rank's main-replica shards, private CPU copies
    publisher.publish(tensors, shards)

``model`` is one model chunk or a list of chunks (virtual pipeline stages), each a
``megatron.core`` ``MegatronModule`` (GPTModel, ...) possibly wrapped in Megatron's
``DistributedDataParallel`` / ``Float16Module``, or something that holds one under ``.module``
or ``.model`` (a Lightning module, NeMo's ``MegatronParallel``, which is a ``ModuleList`` of
chunks): see :func:`model_chunks`.

Canonical coordinates come from the model's own ``sharded_state_dict()`` (the description
Megatron's distributed checkpointing saves from), so a receiver with another TP/PP/EP layout,
or none, names and places every element the same way:

* **names** are the ShardedTensor keys. By default the snapshot asks for
  ``metadata={"singleton_local_shards": True}`` (megatron-core >= 0.14): every key is per layer
  (``decoder.layers.3.self_attention.linear_qkv.weight``, global layer index), per expert
  (``...experts.experts.5.linear_fc2.weight``), and gated-MLP ``linear_fc1`` is split into its
  ``..._w`` (gate) and ``..._v`` (up) halves, each TP-sharded by rows. With it, every key is
  *one* rectangle on the rank that holds it, which is what a delta entry is, and a receiver
  can apply in place into views of its own parameters (``megatron_snapshot(copy=False)``).
* With ``singleton_local_shards=False`` (Megatron's stacked layout: one key per module type,
  a leading layer axis, ``prepend_axis_num``) a rank holds several blocks of one key (one per
  local layer; two per local ``linear_fc1`` with TP > 1: gate rows and up rows). Blocks that
  together tile one rectangle (consecutive layers of a pipeline stage, consecutive local
  experts) are published as that rectangle (a copy; no in-place views); blocks that do not
  (``linear_fc1`` with TP > 1, interleaved virtual-pipeline layers) raise ``DcrError``.
  Names differ between the two layouts: trainer and receivers must use the same one.
* **offsets/shapes** are ``global_offset``/``global_shape``; a prepended axis (stacked layers
  or experts) is a leading dimension of size 1 in the local shape.
* **replicas**: exactly one rank owns each canonical block: entries whose ``replica_id`` is not
  the main replica (``is_main_replica``: the other TP ranks of a replicated layer norm, every
  data-parallel rank but the first, the tied output layer on the last pipeline stage) are left
  out. A rank may therefore publish nothing; it still joins the publish.
* **ShardedObject** entries (``_extra_state``: Transformer Engine / fp8 metadata, not weights),
  ``LocalNonpersistentObject`` and any other non-tensor values are skipped.
  ``ShardedTensorFactory`` entries (gated-MLP ``linear_fc1``, grouped-GEMM experts) are built
  (``apply_factories``) and their ShardedTensors taken like the others. A ShardedTensor with a
  ``flattened_range`` (a flat slice of a block, as old distributed-optimizer checkpoints made;
  megatron-core 0.16 no longer constructs them) is not a rectangle and raises ``DcrError``.

The snapshot's ``shards`` dict is built once per model (and ``metadata``) and returned again,
the same object, on every later call while the parameters stay where they are: the index maps
do not change from step to step. When every entry is a view of a live parameter (the default
singleton layout of GPTModel), later calls also skip ``sharded_state_dict()`` and copy straight
from the cached views; the cache is dropped if any parameter's storage moves.

Receivers with a Megatron layout follow into ``megatron_snapshot(model, copy=False)`` (views of
their own parameters, each block once) and then call :func:`sync_replicas` to copy every block
from its main replica to the other ranks holding it (TP-replicated layer norms, data-parallel
copies). :func:`check_cover` checks that the ranks' blocks cover every tensor exactly once.

Megatron's distributed optimizer (``use_distributed_optimizer=True``) updates each data-parallel
rank's slice of the BF16 parameter buffer; with ``overlap_param_gather=True`` the all-gather
that brings the other slices is deferred to the next forward pass, so at the end of a step a
rank's parameters are partly stale. :func:`force_param_sync` does what Megatron does before it
saves a checkpoint (``disable_forward_pre_hook(param_sync=True)`` ->
``DistributedDataParallel.start_param_sync(force_sync=True)``): a synchronous all-gather (or a
wait on the one already in flight). It is a collective over each data-parallel group: call it
on every rank, before the snapshot. Megatron-FSDP (``use_megatron_fsdp``) is not supported.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nemo_dcr.errors import DcrError
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.util.memory import host_copy

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

DEFAULT_METADATA = {"singleton_local_shards": True}
_MAX_DEPTH = 8


# ----------------------------------------------------------------------------- finding the chunks

def _mcore():
    """megatron.core pieces, or None when megatron-core is not installed."""
    try:
        from megatron.core.transformer.module import Float16Module, MegatronModule
    except Exception:  # not installed, or broken: then nothing is a Megatron module
        return None
    wrappers: list = [Float16Module]
    try:
        from megatron.core.distributed.data_parallel_base import _BaseDataParallel
        wrappers.append(_BaseDataParallel)
    except Exception:
        pass
    wrappers.append(torch.nn.parallel.DistributedDataParallel)
    return MegatronModule, tuple(wrappers)


def _children(obj):
    """What a non-Megatron wrapper holds its model under: ``.module``, then ``.model``."""
    for attr in ("module", "model"):
        try:
            inner = getattr(obj, attr, None)
        except Exception:
            inner = None
        if inner is not None and inner is not obj:
            yield inner


def model_chunks(model) -> list[Any]:
    """The Megatron model chunks in ``model``, outermost wrapper kept (for
    :func:`force_param_sync`), in order:

    * a list / tuple / ``torch.nn.ModuleList`` (virtual-pipeline chunks; NeMo's
      ``MegatronParallel`` is a ``ModuleList``): the chunks found in each element;
    * a ``MegatronModule`` (GPTModel, or Megatron's DDP / Float16Module around one): itself;
    * anything else (a Lightning module, a user wrapper): what its ``.module``, else its
      ``.model`` attribute holds, searched the same way (at most 8 levels deep).

    Returns [] when nothing Megatron is found."""
    mc = _mcore()
    if mc is None:
        return []
    megatron_module, _ = mc

    def find(obj, depth):
        if depth > _MAX_DEPTH or obj is None:
            return []
        if isinstance(obj, megatron_module):
            return [obj]
        if isinstance(obj, (list, tuple, torch.nn.ModuleList)):
            return [c for x in obj for c in find(x, depth + 1)]
        for inner in _children(obj):
            found = find(inner, depth + 1)
            if found:
                return found
        return []

    return find(model, 0)


def is_megatron_module(module) -> bool:
    """True when ``module`` is, or holds (see :func:`model_chunks`), megatron-core model chunks."""
    return bool(model_chunks(module))


def _wrapper_chain(chunk) -> list[Any]:
    """``chunk`` and every module it wraps, outermost first, down to the model itself."""
    mc = _mcore()
    megatron_module, wrappers = mc
    chain = [chunk]
    m = chunk
    for _ in range(_MAX_DEPTH):
        if isinstance(m, wrappers):
            m = m.module
        elif isinstance(m, megatron_module):
            return chain
        else:  # e.g. a Lightning module between Megatron's DDP and the GPTModel
            nxt = next(iter(_children(m)), None)
            if nxt is None:
                break
            m = nxt
        chain.append(m)
    if not isinstance(m, megatron_module) or isinstance(m, wrappers):
        raise DcrError(f"cannot find the Megatron model inside {type(chunk).__name__}")
    return chain


def _model_of(chunk):
    """The innermost Megatron module: the one whose ``sharded_state_dict`` names tensors
    canonically (Megatron's DDP has no ``sharded_state_dict`` of its own)."""
    return _wrapper_chain(chunk)[-1]


# ----------------------------------------------------------------------------- param sync

def _ddp_of(chunk):
    for m in _wrapper_chain(chunk):
        if callable(getattr(m, "start_param_sync", None)) and getattr(m, "ddp_config", None) is not None:
            return m
    return None


def force_param_sync(model) -> int:
    """Bring every rank's parameters up to date after a distributed-optimizer step (see the
    module docstring). A collective: call it on every rank of the trainer. No-op (returns 0)
    for chunks without Megatron's DDP, without the distributed optimizer or without
    ``overlap_param_gather``, whose parameters are complete after every step; returns the
    number of chunks synchronised."""
    n = 0
    for chunk in model_chunks(model):
        ddp = _ddp_of(chunk)
        if ddp is None:
            continue
        cfg = ddp.ddp_config
        if getattr(cfg, "use_megatron_fsdp", False):
            raise DcrError("Megatron-FSDP (use_megatron_fsdp) is not supported: its parameters are "
                           "sharded DTensors, not the rectangles megatron_snapshot publishes")
        if not (getattr(cfg, "use_distributed_optimizer", False) and getattr(cfg, "overlap_param_gather", False)):
            continue  # the optimizer step all-gathered synchronously (Megatron-LM's should_disable_forward_pre_hook)
        ddp.start_param_sync(force_sync=True)
        n += 1
    return n


# ----------------------------------------------------------------------------- snapshot

@dataclass
class _Piece:
    name: str
    spec: ShardSpec
    tensor: torch.Tensor  # detached; a view of a live parameter when ``alias``
    alias: bool
    main: bool = True


@dataclass
class _Layout:
    key: tuple
    shards: dict[str, ShardSpec]
    views: dict[str, torch.Tensor] | None  # name -> live view, when every entry is one
    sig: tuple


# first model chunk -> {(chunk ids, metadata): _Layout}; dropped with the model
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, _Layout]] = weakref.WeakKeyDictionary()


def _metadata_key(md: Mapping) -> tuple:
    return tuple(sorted((str(k), repr(v)) for k, v in md.items()))


def _storage_sig(models) -> tuple:
    """Where every parameter and buffer lives now: cached views are valid while this holds."""
    sig = []
    for m in models:
        for t in list(m.parameters()) + list(m.buffers()):
            sig.append((id(t), t.data_ptr() if t.numel() else 0, tuple(t.shape)))
    return tuple(sig)


def _live_storages(models) -> set:
    out = set()
    for m in models:
        for t in list(m.parameters()) + list(m.buffers()):
            if t.device.type != "meta" and t.numel():
                out.add((t.device, t.untyped_storage().data_ptr()))
    return out


def _pieces(models, metadata: Mapping, main_only: bool = True) -> list[_Piece]:
    from nemo_dcr.util.extras import require
    require("megatron.core", "megatron", "Megatron-core snapshots")
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    live = _live_storages(models)
    out = []
    for m in models:
        sd = m.sharded_state_dict(metadata=dict(metadata))  # Megatron adds to (mutates) metadata
        apply_factories(sd)
        for st in nested_values(sd):
            if not isinstance(st, ShardedTensor):
                continue  # ShardedObject (_extra_state), LocalNonpersistentObject, plain values
            if getattr(st, "flattened_range", None) is not None:
                raise DcrError(f"{st.key}: a ShardedTensor with a flattened_range (a flat slice of a block) "
                               "is not a rectangle and cannot be published")
            main = bool(is_main_replica(st.replica_id))
            if main_only and not main:
                continue
            if st.data is None:
                raise DcrError(f"{st.key}: sharded_state_dict gave no data")
            p = st.prepend_axis_num
            spec = ShardSpec.of(st.global_shape, st.global_offset, (1,) * p + tuple(st.local_shape))
            t = st.data.detach()
            t = t[(None,) * p] if p else t  # a view: prepended axes are leading size-1 dims
            alias = t.numel() == 0 or (t.device.type != "meta" and (t.device, t.untyped_storage().data_ptr()) in live)
            out.append(_Piece(st.key, spec, t, alias, main))
    return out


def _disjoint(a: ShardSpec, b: ShardSpec) -> bool:
    return any(ao + as_ <= bo or bo + bs <= ao for ao, as_, bo, bs in zip(a.offsets, a.shape, b.offsets, b.shape))


def _tile(name: str, pieces: Sequence[_Piece]) -> _Piece:
    """One rectangle from blocks that tile it exactly (a copy), or DcrError."""
    g = pieces[0].spec.global_shape
    if any(p.spec.global_shape != g for p in pieces):
        raise DcrError(f"{name}: blocks on this rank disagree on the global shape "
                       f"({sorted({p.spec.global_shape for p in pieces})})")
    lo = [min(p.spec.offsets[d] for p in pieces) for d in range(len(g))]
    hi = [max(p.spec.offsets[d] + p.spec.shape[d] for p in pieces) for d in range(len(g))]
    box = ShardSpec.of(g, lo, [h - lw for lw, h in zip(lo, hi)])
    ok = sum(p.spec.numel for p in pieces) == box.numel and all(
        _disjoint(a.spec, b.spec) for i, a in enumerate(pieces) for b in pieces[i + 1:])
    if not ok:
        raise DcrError(
            f"{name}: this rank holds {len(pieces)} blocks of it that do not form one rectangle "
            f"({[(p.spec.offsets, p.spec.shape) for p in pieces]}); a delta entry is one rectangle per "
            "tensor and rank. Use the per-layer layout, metadata={'singleton_local_shards': True} "
            "(megatron_snapshot's default).")
    first = pieces[0].tensor
    out = torch.empty(box.shape, dtype=first.dtype, device=first.device)
    for p in pieces:
        out[box.slices_of(p.spec)] = p.tensor
    return _Piece(name, box, out, False)


def _build(models, metadata) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec], bool]:
    by_name: dict[str, list[_Piece]] = {}
    for p in _pieces(models, metadata):
        by_name.setdefault(p.name, []).append(p)
    tensors, shards, all_alias = {}, {}, True
    for name in sorted(by_name):
        ps = by_name[name]
        p = ps[0] if len(ps) == 1 else _tile(name, ps)
        tensors[name], shards[name] = p.tensor, p.spec
        all_alias &= p.alias
    return tensors, shards, all_alias


def _private_copy(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` copied to ``device`` (None: its own); a host copy on huge pages, as every step's
    ``module_snapshot`` (util/memory.py: a copy made at every step is otherwise faulted in 4 KiB
    at a time)."""
    dev = torch.device(device if device is not None else t.device)
    return host_copy(t) if dev.type == "cpu" else t.to(dev, copy=True)


def megatron_snapshot(model, *, metadata: Mapping | None = None, copy: bool = True,
                      device="cpu") -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """This rank's part of the model in canonical coordinates: ``(tensors, shards)`` with
    ``shards[name]`` a :class:`ShardSpec` (global shape, offsets, local shape) of
    ``tensors[name]``; see the module docstring for names, replicas and layouts.

    ``metadata``: passed to ``sharded_state_dict``, over the default
    ``{"singleton_local_shards": True}``. ``copy=True``: private copies on ``device`` (None:
    each tensor's own device), safe to keep while training goes on. ``copy=False``: detached
    views of the live parameters, for a receiver that applies deltas in place (or a caller
    that copies itself); raises ``DcrError`` if an entry is not such a view (a tiled stacked
    entry, grouped-GEMM experts, whose factory makes a transposed copy).

    Call :func:`force_param_sync` first when the distributed optimizer overlaps its parameter
    all-gather."""
    chunks = model_chunks(model)
    if not chunks:
        raise DcrError(f"no Megatron model chunks in {type(model).__name__}")
    models = [_model_of(c) for c in chunks]
    md = {**DEFAULT_METADATA, **dict(metadata or {})}
    key = (tuple(id(m) for m in models), _metadata_key(md))
    sig = _storage_sig(models)
    per_model = _CACHE.setdefault(models[0], {})
    cached = per_model.get(key)
    if cached is not None and cached.sig == sig and cached.views is not None:
        tensors = cached.views
        shards = cached.shards
        aliased = True
    else:
        tensors, shards, aliased = _build(models, md)
        if cached is not None and cached.shards == shards:
            shards = cached.shards  # same layout: hand back the same (fixed) index maps
        per_model[key] = _Layout(key, shards, dict(tensors) if aliased else None, sig)
    if copy:
        with torch.no_grad():
            tensors = {n: _private_copy(t, device) for n, t in tensors.items()}
    else:
        if not aliased:
            bad = sorted(n for n, p in _aliases(tensors, models).items() if not p)
            raise DcrError(f"copy=False needs views of live parameters, but {bad[:5]}"
                           f"{' ...' if len(bad) > 5 else ''} are copies; use copy=True")
        tensors = dict(tensors)
    return tensors, shards


def _aliases(tensors: Mapping[str, torch.Tensor], models) -> dict[str, bool]:
    live = _live_storages(models)
    return {n: t.numel() == 0 or (t.device.type != "meta" and (t.device, t.untyped_storage().data_ptr()) in live)
            for n, t in tensors.items()}


# ----------------------------------------------------------------------------- receivers

def sync_replicas(model, group: ProcessGroup | None = None, *, metadata: Mapping | None = None) -> int:
    """Receiver side, after ``Follower.sync``: copy every block from the rank that holds its
    main replica to the ranks that hold other replicas of it.

    A Megatron receiver follows with ``megatron_snapshot(model, copy=False)`` views, which (like
    the trainer's snapshot) hold each replicated block once: the TP-replicated layer norms of
    TP rank 0, the dense weights of data-parallel rank 0. The other copies must be refreshed
    from those. ``group``: the receiver's process group (None: the default group); it must
    contain every replica. A collective: call it on every rank of the group. Point-to-point
    sends, in one order on every rank. Returns the number of blocks this rank sent or received."""
    import torch.distributed as dist

    chunks = model_chunks(model)
    if not chunks:
        raise DcrError(f"no Megatron model chunks in {type(model).__name__}")
    models = [_model_of(c) for c in chunks]
    md = {**DEFAULT_METADATA, **dict(metadata or {})}
    mine = {}
    for p in _pieces(models, md, main_only=False):
        if not p.alias:
            raise DcrError(f"{p.name}: not a view of a live parameter; cannot refresh it in place")
        mine[(p.name, p.spec.offsets, p.spec.shape)] = p
    world = dist.get_world_size(group)
    everyone: list[Any] = [None] * world  # filled in by all_gather_object
    dist.all_gather_object(everyone, sorted((k, p.main) for k, p in mine.items()), group=group)
    holders: dict[tuple, dict[str, list]] = {}
    for r, blocks in enumerate(everyone):
        g = dist.get_global_rank(group, r) if group is not None else r
        for k, main in blocks:
            holders.setdefault(k, {"main": [], "other": []})["main" if main else "other"].append(g)
    me = dist.get_rank()
    n = 0
    for k in sorted(holders):
        h = holders[k]
        if not h["other"]:
            continue
        if len(h["main"]) != 1:
            raise DcrError(f"{k[0]} at {k[1]}: {len(h['main'])} ranks hold its main replica ({h['main']}), expected 1")
        src = h["main"][0]
        if me == src:
            t = mine[k].tensor.contiguous()
            for dst in h["other"]:
                dist.send(t, dst, group=group)
            n += 1
        elif me in h["other"]:
            buf = torch.empty_like(mine[k].tensor, memory_format=torch.contiguous_format)
            dist.recv(buf, src, group=group)
            with torch.no_grad():
                mine[k].tensor.copy_(buf)
            n += 1
    return n


# ----------------------------------------------------------------------------- checks

def check_cover(shards_per_rank: Sequence[Mapping[str, ShardSpec]]) -> dict[str, tuple]:
    """Check that the ranks' shards (e.g. every rank's ``megatron_snapshot`` specs, gathered)
    cover each canonical tensor exactly once: same global shape everywhere, no overlaps, no
    gaps. Returns ``{name: global_shape}``; raises ``DcrError`` listing what is wrong."""
    by_name: dict[str, list[tuple[int, ShardSpec]]] = {}
    for r, shards in enumerate(shards_per_rank):
        for n, s in shards.items():
            by_name.setdefault(n, []).append((r, s))
    problems, shapes = [], {}
    for n, lst in sorted(by_name.items()):
        gs = {s.global_shape for _, s in lst}
        if len(gs) != 1:
            problems.append(f"{n}: global shapes differ across ranks {sorted(gs)}")
            continue
        g = gs.pop()
        shapes[n] = g
        for i, (ra, a) in enumerate(lst):
            for rb, b in lst[i + 1:]:
                if a.numel and b.numel and not _disjoint(a, b):
                    problems.append(f"{n}: ranks {ra} and {rb} both hold {a.offsets}+{a.shape} / {b.offsets}+{b.shape}")
        total = sum(s.numel for _, s in lst)
        if total != math.prod(g):
            problems.append(f"{n}: ranks hold {total} of its {math.prod(g)} elements")
    if problems:
        raise DcrError("shards do not cover the model exactly once:\n  " + "\n  ".join(problems[:20]))
    return shapes


__all__ = ["is_megatron_module", "model_chunks", "megatron_snapshot", "force_param_sync", "sync_replicas",
           "check_cover", "DEFAULT_METADATA"]
