"""The vLLM objects the integration reads, as structural types.

vLLM is untyped and optional (it is not installed where the project is type-checked), and the
integration only ever reads a few attributes of its worker, model and layers; these protocols say
which, so mypy checks the integration's use of them without importing vLLM. They describe vLLM
0.32's objects; a layer is matched to one by its class name before it is cast (vLLM's classes are
never imported).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch


class ModelRunner(Protocol):
    """``worker.model_runner``: the engine's model on this worker."""

    model: torch.nn.Module


class Worker(Protocol):
    """A vLLM worker (``self`` inside a ``worker_extension_cls``)."""

    model_runner: ModelRunner


class LoadableModel(Protocol):
    """A vLLM model: routes checkpoint tensors (``(name, tensor)`` pairs) to its layers."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


class QuantMethod(Protocol):
    """A layer's ``quant_method``: turns loaded checkpoint-format parameters into what the kernels use."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None: ...


class ProcessedLayer(Protocol):
    """A layer vLLM processes after loading (linears, embeddings, MoE)."""

    quant_method: QuantMethod


class TpStatusLayer(Protocol):
    """A layer that re-derives its parameters' TP attributes after processing (vLLM's linears)."""

    def update_param_tp_status(self) -> None: ...


class QKVLayer(Protocol):
    """``QKVParallelLinear``: this rank's query heads, then its key and value heads, fused in rows."""

    head_size: int
    num_heads: int
    num_kv_heads: int
    total_num_heads: int
    total_num_kv_heads: int


class MergedLayer(Protocol):
    """``MergedColumnParallelLinear``: several column-parallel layers fused in rows (whole sizes)."""

    output_sizes: Sequence[int]


__all__ = ["ModelRunner", "Worker", "LoadableModel", "QuantMethod", "ProcessedLayer", "TpStatusLayer", "QKVLayer",
           "MergedLayer"]
