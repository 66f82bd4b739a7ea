"""nemo-dcr as a vLLM weight-transfer backend: ``weight_transfer_config={"backend": "dcr"}``.

vLLM (0.32) drives RL weight updates through a registry of transfer engines
(``vllm/distributed/weight_transfer/factory.py``, ``WeightTransferEngineFactory``): the engine
named by ``weight_transfer_config.backend`` is built in every worker after the model is loaded
(``Worker.load_model``), and the driver calls the workers' ``init_weight_transfer_engine(init_info)``,
``start_weight_update()``, ``update_weights(update_info)`` and ``finish_weight_update()`` (plain
dicts, through ``collective_rpc`` or ``AsyncLLM``'s methods of the same names).

Here "receiving" is a store update: ``init_info`` is ``{"store": url, "version": v or None,
"check_every": 0, "name_map": None}`` (what ``dcr_init`` takes), ``update_info`` is ``{"version":
v or None}`` (None: the store's newest). Everything else is the worker extension's: the same
mapping onto vLLM's layers, plain copies and per-layer rebuild, the TP group's checks and gathers
(``DcrWorkerExtension``). ``start``/``finish_weight_update`` do nothing: each
update rebuilds the layers it changed before it returns.

What this path does not do, and ``refit(llm, store)`` does: pause the scheduler and drop the KV
cache computed with the old weights (vLLM's weight-transfer flow leaves that to the caller: pause
generation, or call ``llm.reset_prefix_cache()`` after ``finish_weight_update``); and collect every
worker's outcome (vLLM's executor stops at the first worker that raises).

Registration: :func:`~nemo_dcr.integrations.vllm_worker.register_weight_transfer` adds the ``dcr``
backend to vLLM's registry (this module is imported only when vLLM builds the engine); it runs in
every vLLM process through the ``vllm.general_plugins`` entry point when nemo-dcr is installed, and
whenever the worker extension module is imported (``worker_extension_cls=...DcrWorkerExtension``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .vllm_worker import DcrWorkerExtension


@dataclass
class DcrInitInfo(WeightTransferInitInfo):
    """``dcr_init``'s arguments: the store to follow and the version the engine holds (None: the
    first update reads a keyframe)."""

    store: str
    version: int | None = None
    check_every: int = 0
    name_map: dict | None = None


@dataclass
class DcrUpdateInfo(WeightTransferUpdateInfo):
    """The version to bring the weights to (None: the store's newest)."""

    version: int | None = None


@dataclass
class _Runner:
    model: torch.nn.Module


class _Receiver(DcrWorkerExtension):
    """The worker extension's receiver over the model vLLM hands the transfer engine."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any):
        self.model_runner = _Runner(model)
        self.vllm_config = vllm_config


class DcrWeightTransferEngine(WeightTransferEngine):
    init_info_cls = DcrInitInfo
    update_info_cls = DcrUpdateInfo
    supports_draft_weight_update = False  # one store, one model

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.receiver = _Receiver(model, vllm_config)

    def init_transfer_engine(self, init_info: DcrInitInfo) -> None:
        self.receiver.dcr_init(init_info.store, init_info.version, init_info.check_every, init_info.name_map)

    def start_weight_update(self) -> None:
        pass  # nothing to prepare: an update rebuilds the layers it changed itself

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class also synchronises the accelerator (its transfers may be asynchronous);
        # a store update has finished writing and rebuilding when it returns
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DcrUpdateInfo) -> None:
        if getattr(self.receiver, "_dcr_loader", None) is None:
            raise ValueError("dcr weight transfer: call init_weight_transfer_engine({'store': url, ...}) first")
        self.receiver.dcr_update(None, update_info.version)

    def version(self) -> int | None:
        return self.receiver.dcr_version()

    def shutdown(self) -> None:
        pass


__all__ = ["DcrInitInfo", "DcrUpdateInfo", "DcrWeightTransferEngine"]
