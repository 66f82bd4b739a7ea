"""What a vLLM worker computes from, kept in loaded format and pushed into the engine per changed layer.

vLLM loads a checkpoint in two steps: the model's ``load_weights`` puts each checkpoint tensor into
the layers' parameters (*loaded format*: :mod:`.vllm_layout` finds where, by probing it), then
``process_weights_after_loading`` turns them into what the kernels compute from: each layer's
``quant_method`` (vLLM-CPU repacks every linear weight into a oneDNN handle and empties
``layer.weight``; the lm_head computes from a packed copy; MoE layers prepack their experts in
place; GPU builds quantize on load or shuffle for fused kernels), then every attention layer's own
processing, which may read other layers (MLA absorbs ``kv_b_proj`` into ``W_UK_T``/``W_UV``).
Writing into the parameters after that fails (nothing is there) or silently changes nothing.

So the receiver keeps what vLLM's own in-place reload (``vllm/model_executor/model_loader/
reload/``) rebuilds from:

* every layer with a processing step gets a *plain* host copy of its tensors in loaded format (the
  shapes and dtypes vLLM recorded before processing); tied tensors share one copy;
* layers without one (norms) compute from their tensors as loaded: those are written in place;
* published tensors the loader computes from, or places in no few strided forms, are kept whole
  (``whole``) and fed to the model's ``load_weights`` again when they changed;
* a published tensor that lands in several boxes (Falcon's fused QKV regrouped per kv head) is
  kept whole for the follower, and each chunk it writes there is scattered into the boxes too
  (``on_write``, O(changes)).

The follower writes the deltas into those (O(changes), bit for bit: no value is reserved as
"unchanged"). Then :meth:`EngineWeights.rebuild_changed` takes the layers whose inputs changed, as
vLLM's reload does: restores them to loaded format (meta, then materialized), copies the plain
values in, runs ``load_weights`` for the whole tensors that changed, runs each layer's own
``process_weights_after_loading`` and copies the results into the kernel tensors' original storage
(CUDA graphs keep their pointers; attributes such as a new oneDNN handle replace the old ones);
then every attention layer whose processing reads a changed layer (the layers below it in the
module tree: an MLA layer holds its ``kv_b_proj``) is processed again, as vLLM's
``finalize_layerwise_reload`` does.

Where the plain copies come from: the checkpoint the engine was started on, read with vLLM's own
loader and the model's own ``load_weights`` into the materialized layers, when the caller says the
engine holds a known version; otherwise they start from the kernel tensors that are still in
loaded format (others from zeros and the values the loader writes itself, such as a padded
vocabulary's zero rows) and the first update reads a keyframe. Host memory: one copy of the layers
with a processing step, plus the whole tensors.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import cast

import torch

from nemo_dcr.errors import DcrError
from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.state.index_map import IndexMap, ShardSpec

from .vllm_layout import EngineLayout, Published, checkpoint_layout, probe_layout
from .vllm_types import LoadableModel, ProcessedLayer, TpStatusLayer, Worker

log = logging.getLogger("nemo_dcr.callbacks")


def _reload_api():
    """vLLM's layerwise reload pieces (what ``reload_weights`` uses); imported inside the worker."""
    from vllm.model_executor.model_loader.reload import layerwise, meta, utils
    return layerwise, meta, utils


def _has_quant_processing(module: torch.nn.Module) -> bool:
    qm = getattr(module, "quant_method", None)
    return qm is not None and callable(getattr(qm, "process_weights_after_loading", None))


def _is_attention(module: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:  # no vLLM: nothing is an attention layer with deferred processing
        return False
    return bool(is_deferred_attention_layer(module))


#: layers whose processing repacks tensors in place (same shape and dtype, another layout):
#: vLLM-CPU's MoE prepacks ``w13_weight``/``w2_weight`` into its grouped-GEMM layout. Their plain
#: copies are never taken from the kernel tensors, nor read back from them.
MOE_CLASSES = ("FusedMoE", "RoutedExperts")


class EngineWeights:
    """The worker's weights in loaded format, and how to push changed ones into the engine.

    ``tensors`` / ``shards`` are what the follower writes: per published name, a view into a plain
    copy, into a layer's own tensor, or a whole copy of the published tensor; :meth:`rebuild_changed`
    pushes what changed since the last call into the engine."""

    def __init__(self, model: torch.nn.Module, vllm_config=None, *, from_checkpoint: bool = True,
                 published: Mapping[str, Published] | None = None, layout: EngineLayout | None = None,
                 held_elsewhere: Iterable[str] | None = None):
        self.model = model
        self.vllm_config = vllm_config
        mc = getattr(vllm_config, "model_config", None)
        self.model_dtype = getattr(mc, "dtype", None)
        if published is None:
            path = getattr(mc, "model", None)
            if path is None:
                raise DcrError("no published layout: pass published= (name -> shape, dtype) or a vLLM config")
            published = checkpoint_layout(str(path))
        self.published = dict(published)
        self.layout = layout if layout is not None else probe_layout(model, self.published)
        self.modules = dict(model.named_modules())
        # processing steps: quant methods (own tensors), attention layers (their subtree)
        self.processed = {n for n, m in self.modules.items() if _has_quant_processing(m)}
        self.attention = [n for n, m in self.modules.items() if _is_attention(m)]
        # the kernel tensor of each slot, and one plain copy per kernel tensor (ties share one)
        self.kernel: dict[str, torch.Tensor] = {}
        for key, slot in self.layout.slots.items():
            t = self._live(slot.module, slot.tensor)
            if t is not None:
                self.kernel[key] = t
        self.plain: dict[int, torch.Tensor] = {}
        self.slot_plain: dict[str, torch.Tensor] = {}   # slot -> the tensor the follower writes
        self.owners: dict[int, list[str]] = {}           # plain copy (kernel id) -> modules rebuilt from it
        need_disk: set[str] = set()
        for key, slot in self.layout.slots.items():
            if slot.module not in self.processed:
                continue
            k = self.kernel.get(key)
            kid = id(k) if k is not None else id(slot)
            self.owners.setdefault(kid, [])
            if slot.module not in self.owners[kid]:
                self.owners[kid].append(slot.module)
            if kid not in self.plain:
                dtype = slot.dtype  # the loaded format's (a bias the processing widened: vllm_layout._loaded_dtype)
                with torch.inference_mode(False):
                    copy = torch.zeros(slot.shape, dtype=dtype, device="cpu")
                const = self.layout.constants.get(key)
                if const is not None:
                    copy.view(-1)[const[0]] = const[1].to(dtype)
                self.plain[kid] = copy
            # the checkpoint the engine started on is the only sure source of loaded-format values:
            # processing may keep a tensor's shape and dtype and still change it (MoE prepacking)
            need_disk.add(slot.module)
            self.slot_plain[key] = self.plain[kid]
        for key in self.layout.slots:
            if key not in self.slot_plain and key in self.kernel:
                self.slot_plain[key] = self.kernel[key]  # no processing: written in place
        self.needs_keyframe = bool(need_disk) and not from_checkpoint
        # published tensors kept whole: the loader computes from them (``whole``), or no rank of the
        # engine loads them (``unloaded``: kept for the state digest only)
        self.whole: dict[str, torch.Tensor] = {}
        self.unloaded: dict[str, torch.Tensor] = {}
        self.pieced: dict[str, torch.Tensor] = {}       # several boxes: a whole copy the follower writes
        self.pieces: dict[str, list] = {}                # ... and (StridedPart, its view's FlatAccess, IndexMap)
        self._written: set[str] = set()                  # pieced names on_write reported since the rebuild
        for n in sorted(self.layout.reload):
            self.whole[n] = self._zeros(n)
        if held_elsewhere is not None:
            for n in sorted(self.layout.unused - set(held_elsewhere)):
                self.unloaded[n] = self._zeros(n)
        for n in sorted(self.layout.gathered):
            ps = self.layout.pieces(n)
            if len(ps) > 1:
                self.pieced[n] = self._zeros(n)
                self.pieces[n] = [(p.part, FlatAccess(p.part.view(self.slot_plain[p.slot])), IndexMap(p.spec))
                                  for p in ps]
        if from_checkpoint and (need_disk or self.whole or self.unloaded or self.pieced):
            self._read_checkpoint(sorted(need_disk))
        self.tensors, self.shards = self._follower_view()
        self._seen = self._versions()

    # ------------------------------------------------------------------ mapping
    def _zeros(self, name: str) -> torch.Tensor:
        p = self.published[name]
        with torch.inference_mode(False):
            return torch.zeros(p.shape, dtype=p.dtype, device="cpu")

    def _live(self, module: str, tensor: str) -> torch.Tensor | None:
        mod = self.modules.get(module)
        t = None if mod is None else (mod._parameters.get(tensor) if tensor in mod._parameters
                                      else mod._buffers.get(tensor))
        return t

    @staticmethod
    def _same_format(slot, k: torch.Tensor, dtype: torch.dtype) -> bool:
        return tuple(k.shape) == tuple(slot.shape) and k.dtype == dtype \
            and (k.numel() > 0 or math.prod(slot.shape) == 0)

    def _follower_view(self) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
        tensors: dict[str, torch.Tensor] = {}
        shards: dict[str, ShardSpec] = {}
        for p in self.layout.placements:
            if p.name in self.pieced:
                continue
            base = self.slot_plain.get(p.slot)
            if base is None:
                raise DcrError(f"{p.name}: the engine holds no tensor {p.slot} to write it into")
            if not base.is_contiguous():
                raise DcrError(f"{p.slot}: the engine's tensor is not contiguous; nemo-dcr writes into it by strides")
            tensors[p.name] = p.part.view(base)
            if not p.spec.is_full or p.spec.index_shape is not None:
                shards[p.name] = p.spec
        tensors.update(self.whole)
        tensors.update(self.unloaded)
        tensors.update(self.pieced)
        return tensors, shards

    def on_write(self, name: str, glob: torch.Tensor, new: torch.Tensor | None) -> None:
        """The follower wrote ``new`` at canonical positions ``glob`` of ``name``: for a pieced
        tensor, into its boxes too (from the apply's worker threads: disjoint positions)."""
        pieces = self.pieces.get(name)
        if pieces is None or new is None:
            return
        self._written.add(name)
        for _part, fa, imap in pieces:
            local, mask = imap.to_local(glob)
            if local.numel():
                fa.scatter(local, new[mask])

    def _copy_pieces(self) -> None:
        """Pieced tensors that changed without ``on_write`` (a replica broadcast from another rank of
        the group): copied into their boxes whole."""
        for n, whole in self.pieced.items():
            if whole._version == self._seen.get(("pieced", n)) or n in self._written:
                continue
            for part, fa, _imap in self.pieces[n]:
                box = whole.reshape(part.spec.box_shape)[
                    tuple(slice(o, o + k) for o, k in zip(part.spec.offsets, part.spec.shape))]
                fa.tensor.copy_(box)
        self._written.clear()

    def data_of(self, name: str) -> torch.Tensor | None:
        """The tensor the follower writes for published ``name`` (None: not held on this worker)."""
        return self.tensors.get(name)

    def plain_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return self.plain.get(id(p))

    def _versions(self) -> dict[tuple[str, object], int]:
        out: dict[tuple[str, object], int] = {("plain", k): t._version for k, t in self.plain.items()}
        out.update({("whole", n): t._version for n, t in self.whole.items()})
        out.update({("pieced", n): t._version for n, t in self.pieced.items()})
        return out

    # ------------------------------------------------------------------ initial values
    @torch.no_grad()
    def _read_checkpoint(self, modules: list[str]) -> None:
        """Plain values of layers whose kernel form lost them, and the whole tensors, read from the
        checkpoint the engine was started on with vLLM's own loader and the model's own ``load_weights``."""
        if self.vllm_config is None:
            raise DcrError("the engine repacked its weights and no vLLM config is at hand to read the checkpoint; "
                           "start with dcr_init(store) (no version): the first update reads a keyframe")
        from vllm.model_executor.model_loader import get_model_loader

        loader = get_model_loader(self.vllm_config.load_config)
        if not hasattr(loader, "get_all_weights"):
            raise DcrError(f"vLLM's {type(loader).__name__} cannot re-read the checkpoint; start with "
                           "dcr_init(store) (no version): the first update reads a keyframe")
        whole = {**self.whole, **self.unloaded, **self.pieced}

        def weights():
            for name, t in loader.get_all_weights(self.vllm_config.model_config, self.model):
                if name in whole:
                    whole[name].copy_(t)
                yield name, t

        # every weight is routed as at load time; layers not restored receive the values they were
        # loaded with (the same checkpoint)
        with self._as_at_load(), self._restored(modules):
            cast(LoadableModel, self.model).load_weights(weights())
            self._copy(modules, into_layers=False)

    # ------------------------------------------------------------------ rebuild
    def _restored(self, modules: Iterable[str]):
        """Context: ``modules`` in loaded format (materialized, vLLM's reload functions); on exit the
        kernel tensors are put back (unchanged if the body did not copy into them)."""
        import contextlib

        layerwise, meta, utils = _reload_api()
        infos = []

        @contextlib.contextmanager
        def ctx():
            try:
                for name in modules:
                    mod = self.modules[name]
                    info = layerwise.get_layerwise_info(mod)
                    info.kernel_tensors = utils.get_layer_params_buffers(mod)
                    info.kernel_non_persistent_buffers = set(mod._non_persistent_buffers_set)
                    infos.append((mod, info))
                    meta.restore_layer_on_meta(mod, info)
                    meta.materialize_layer(mod, info)
                yield infos
            finally:
                for mod, info in infos:
                    if info.kernel_tensors is not None:
                        layerwise._place_kernel_tensors(mod, info)
                    info.reset()
        return ctx()

    def _copy(self, modules: Iterable[str], *, into_layers: bool) -> None:
        """Between the plain copies and the restored (loaded-format) tensors of ``modules``: into
        the layers before a rebuild, back into the copies after ``load_weights`` wrote the layers."""
        _, _, utils = _reload_api()
        for name in modules:
            for tname, t in utils.get_layer_tensors(self.modules[name]).items():
                plain = self.slot_plain.get(f"{name}.{tname}" if name else tname)
                if plain is None or plain is t:
                    continue
                if into_layers:
                    t.data.copy_(plain)
                elif tuple(plain.shape) == tuple(t.shape):
                    plain.copy_(t.detach())

    def changed(self) -> tuple[list[str], list[str]]:
        """(modules whose plain copies changed, whole tensors that changed) since the last rebuild."""
        mods: list[str] = []
        for kid, t in self.plain.items():
            if t._version != self._seen.get(("plain", kid)):
                for m in self.owners.get(kid, []):
                    if m not in mods:
                        mods.append(m)
        names = [n for n, t in self.whole.items() if t._version != self._seen.get(("whole", n))]
        return mods, names

    @torch.no_grad()
    def rebuild_changed(self) -> int:
        """Push what changed into the engine (see the module doc); returns how many layers were
        processed again."""
        self._copy_pieces()
        mods, names = self.changed()
        for n in names:  # the layers the whole tensors' loader writes are rebuilt with them
            for key in self.layout.writes.get(n, ()):
                m = self.layout.slots[key].module
                if m in self.processed and m not in mods:
                    mods.append(m)
        rebuilt = self.rebuild(mods, names) if (mods or names) else 0
        self._seen = self._versions()
        return rebuilt

    def _as_at_load(self):
        """Context: torch's default dtype the model's, as vLLM's loader has it while it loads and
        processes (a tensor a layer's processing makes with the default dtype, e.g. the empty
        ``kv_b_proj.weight`` vLLM-CPU's AMX MLA leaves, is then the fresh engine's)."""
        import contextlib
        if self.model_dtype is None:
            return contextlib.nullcontext()
        from vllm.utils.torch_utils import set_default_torch_dtype
        return set_default_torch_dtype(self.model_dtype)

    @torch.no_grad()
    def rebuild(self, modules: list[str], names: list[str] = ()) -> int:  # type: ignore[assignment]
        """vLLM's layerwise reload over ``modules`` with the plain copies as the loaded weights and
        the whole tensors ``names`` loaded again; then the attention layers reading them."""
        with self._as_at_load():
            return self._rebuild(modules, names)

    def _rebuild(self, modules: list[str], names) -> int:
        layerwise, _, _ = _reload_api()
        with self._restored(modules) as infos:
            self._copy(modules, into_layers=True)
            if names:
                cast(LoadableModel, self.model).load_weights([(n, self.whole[n]) for n in names])
                self._copy(modules, into_layers=False)
            for mod, info in infos:
                if hasattr(mod, "_already_called_process_weights_after_loading"):
                    delattr(mod, "_already_called_process_weights_after_loading")
                _process(mod)
                if hasattr(mod, "update_param_tp_status"):
                    cast(TpStatusLayer, mod).update_param_tp_status()
                _keep_consumed(mod, info)
                layerwise._copy_and_restore_kernel_tensors(mod, info)
        done = set(modules)
        touched = {id(self.modules[m]) for m in modules}
        attn = 0
        for name in self.attention:
            layer = self.modules[name]
            if any(id(m) in touched for m in layer.modules()):
                layer.process_weights_after_loading(self.model_dtype)
                done.add(name)
                attn += 1
        return len(modules) + attn

    # ------------------------------------------------------------------ read-back
    def kernel_view(self, name: str) -> torch.Tensor | None:
        """Published ``name``'s part as the engine itself holds it, where its kernel tensor is still
        in loaded format (a norm, an embedding the processing kept); None otherwise."""
        for p in self.layout.placements:
            if p.name != name or name in self.pieced:
                continue
            k = self.kernel.get(p.slot)
            slot = self.layout.slots[p.slot]
            if k is None or self.slot_plain.get(p.slot) is k:
                return p.part.view(k) if k is not None and k.is_contiguous() else None
            if not self._same_format(slot, k, slot.dtype) \
                    or type(self.modules[slot.module]).__name__ in MOE_CLASSES:
                return None
            return p.part.view(k) if k.is_contiguous() else None
        return None


def _keep_consumed(mod: torch.nn.Module, info) -> None:
    """Before the processed tensors are copied into the kernel tensors: a kernel tensor of another
    shape than what the layer's processing gives was replaced at load time by a later layer that
    consumed it (vLLM-CPU's AMX MLA packs ``kv_b_proj.weight`` into its own ``W_UK``/``W_UV`` and
    frees it: an empty tensor). That layer is rebuilt after this one and reads the tensor again,
    so the processed tensor itself is kept (nothing to copy into), and that layer frees it again."""
    params, buffers = info.kernel_tensors
    for kind in (params, buffers):
        for name, k in list(kind.items()):
            new = getattr(mod, name, None)
            if isinstance(new, torch.Tensor) and tuple(new.shape) != tuple(k.shape):
                kind[name] = new


def _process(mod: torch.nn.Module) -> None:
    """The layer's ``process_weights_after_loading``, as at load time.

    A fused MoE method that already built its kernel (``moe_kernel``) treats a second call as a
    weight update: it shuffles the weights into the kernel format but skips the experts' own
    preparation (``moe_kernel.fused_experts.process_weights_after_loading``), which on vLLM-CPU
    prepacks ``w13_weight``/``w2_weight`` into the grouped-GEMM layout the kernel reads, so the
    kernel would read unpacked values as packed. The layer was just restored to loaded format,
    so that preparation is run here, as the first call ran it."""
    qm = cast(ProcessedLayer, mod).quant_method
    kernel = getattr(qm, "moe_kernel", None)
    qm.process_weights_after_loading(mod)
    if kernel is not None and getattr(qm, "moe_kernel", None) is kernel:
        prep = getattr(getattr(kernel, "fused_experts", None), "process_weights_after_loading", None)
        if callable(prep):
            prep(mod)


def engine_weights(worker: Worker, from_checkpoint: bool = True) -> EngineWeights:
    """The ``EngineWeights`` of a vLLM worker (``self`` inside the worker extension)."""
    return EngineWeights(worker.model_runner.model, getattr(worker, "vllm_config", None),
                         from_checkpoint=from_checkpoint)


__all__ = ["EngineWeights", "engine_weights", "MOE_CLASSES"]
