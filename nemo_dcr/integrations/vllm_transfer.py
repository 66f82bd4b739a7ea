"""nemo-dcr as a vLLM weight-transfer backend: ``weight_transfer_config={"backend": "dcr"}``.

vLLM (0.32) drives RL weight updates through a registry of transfer engines
(``vllm/distributed/weight_transfer/``). Both halves are here:

* **Inference side** (``DcrWeightTransferEngine``, built in every worker after the model is loaded):
  the driver calls the workers' ``init_weight_transfer_engine(init_info)``,
  ``start_weight_update()``, ``update_weights(update_info)`` and ``finish_weight_update()`` (plain
  dicts, through ``collective_rpc``, ``LLM``/``AsyncLLM`` methods of the same names, or the HTTP
  routes of ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``: ``/init_weight_transfer_engine``,
  ``/update_weights``, ...). Here "receiving" is a store update: ``init_info`` is ``{"store": url,
  "version": v or None, "check_every": 0, "name_map": None, "reset_kv_cache": True}``
  (``dcr_init``'s arguments), ``update_info`` is ``{"version": v or None}`` (None: the store's
  newest). Everything else is the worker extension's (``DcrWorkerExtension``): where each
  published element lands (probed from the model's loader), plain copies and per-layer rebuild,
  the TP group's checks and gathers. ``finish_weight_update`` zeroes the KV cache memory after an
  update changed the weights (``reset_kv_cache``, as ``refit`` does; pause generation with mode
  ``abort`` or ``wait`` first, vLLM's default: requests kept across the update would lose their
  cache; with ``keep``, pass ``reset_kv_cache: false``).
* **Trainer side** (``DcrTrainerWeightTransferEngine``, ``DcrTrainerInitInfo``): what a trainer
  written against vLLM's ``WeightTransferTrainerFactory.trainer_init(init_info, client=...,
  source=...)`` / ``send_weights()`` API calls. ``send_weights`` publishes the source's weights to
  the store as the next version (a delta against the last) with a :class:`~nemo_dcr.sync.
  publisher.Publisher`, then drives the inference side through the client (HTTP, Ray or any
  object with the four methods): start, ``update_weights({"version": v})``, finish with
  ``weight_version=str(v)``, so ``/weight_info`` reports the store's version. Switching a trainer
  from NCCL to ``dcr`` is a change of init info.

Registration: :func:`~nemo_dcr.integrations.vllm_worker.register_weight_transfer` adds the ``dcr``
backend to both registries (this module is imported only when vLLM builds an engine); it runs in
every vLLM process through the ``vllm.general_plugins`` entry point when nemo-dcr is installed, and
whenever the worker extension module is imported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from nemo_dcr.errors import DcrError
from nemo_dcr.sync.publisher import Publisher

from .vllm_worker import DcrWorkerExtension


@dataclass
class DcrInitInfo(WeightTransferInitInfo):
    """``dcr_init``'s arguments: the store to follow and the version the engine holds (None: the
    first update reads a keyframe); ``reset_kv_cache``: zero the KV cache when an update changed
    the weights (at ``finish_weight_update``)."""

    store: str
    version: int | None = None
    check_every: int = 0
    name_map: dict | None = None
    reset_kv_cache: bool = True


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
        self.reset_kv_cache = True
        self._changed = False

    def init_transfer_engine(self, init_info: DcrInitInfo) -> None:
        self.reset_kv_cache = bool(init_info.reset_kv_cache)
        self.receiver.dcr_init(init_info.store, init_info.version, init_info.check_every, init_info.name_map)

    def start_weight_update(self) -> None:
        self._changed = False

    def finish_weight_update(self) -> None:
        if self._changed and self.reset_kv_cache:
            self.receiver.dcr_reset_kv_cache()
        self._changed = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class also synchronises the accelerator (its transfers may be asynchronous);
        # a store update has finished writing and rebuilding when it returns
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: DcrUpdateInfo) -> None:
        if getattr(self.receiver, "_dcr_loader", None) is None:
            raise ValueError("dcr weight transfer: call init_weight_transfer_engine({'store': url, ...}) first")
        before = self.receiver.dcr_version()
        try:
            after = self.receiver.dcr_update(None, update_info.version)
        except Exception:
            self._changed = True  # a failed update may have written
            raise
        self._changed = self._changed or after != before

    def version(self) -> int | None:
        return self.receiver.dcr_version()

    def shutdown(self) -> None:
        pass


# ---------------------------------------------------------------------------- trainer side
@dataclass
class DcrTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``dcr`` backend: the store the trainer publishes to (every
    option of :class:`~nemo_dcr.sync.publisher.Publisher` in ``publisher``) and what the inference
    side starts from (``engine_version``: the version its weights already are, e.g. 0 when both
    sides load the same initial checkpoint and ``publish_initial`` ran; None: the first update
    reads a keyframe; ``publish_initial``: publish the source's weights now as that version, the
    checkpoint both sides start from)."""

    backend: ClassVar[str] = "dcr"

    store: str = ""
    engine_version: int | None = None
    publish_initial: bool = False
    publisher: dict = field(default_factory=dict)
    reset_kv_cache: bool = True
    dtype: str | None = "bfloat16"


class DcrTrainerWeightTransferEngine(TrainerWeightTransferEngine[DcrTrainerInitInfo]):
    """The trainer half of the ``dcr`` backend (see the module doc). Every rank calls
    ``trainer_init`` and ``send_weights`` (the source's iteration may be a collective); rank 0 (the
    sender) publishes the materialized weights and drives the inference side."""

    init_info_cls = DcrTrainerInitInfo

    def __init__(self, *, client, source: WeightSource | None = None, is_sender: bool = True,
                 init_info: DcrTrainerInitInfo | None = None):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info or DcrTrainerInitInfo(rank=0 if is_sender else 1)
        self.publisher: Publisher | None = None
        self.last_version: int | None = None

    @classmethod
    def trainer_init(cls, init_info: DcrTrainerInitInfo, *, client, source: WeightSource | None = None):
        if not init_info.store:
            raise DcrError("dcr trainer weight transfer: init_info.store is empty (the store URL to publish to)")
        if source is None:
            raise DcrError("dcr trainer weight transfer publishes a WeightSource's weights: pass source=")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if engine.is_sender:
            engine.publisher = Publisher(init_info.store, **init_info.publisher)
        if init_info.publish_initial:
            v = engine.publish(step=0)
            if engine.is_sender and init_info.engine_version is not None and v != init_info.engine_version:
                raise DcrError(f"published the initial weights as version {v}, but init_info.engine_version is "
                               f"{init_info.engine_version}: the store already holds versions")
        if engine.is_sender:
            engine.client.init_weight_transfer_engine({
                "store": init_info.store, "version": init_info.engine_version,
                "reset_kv_cache": init_info.reset_kv_cache})
        return engine

    def publish(self, step: int | None = None) -> int:
        """Publish the source's weights as the next version (sender only); returns its number."""
        assert self.source is not None
        dtype = getattr(torch, self.init_info.dtype) if self.init_info.dtype else None
        tensors = {}
        for name, t in self.source:
            t = t.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            if self.is_sender:
                tensors[name] = t.to("cpu").contiguous()
        if not self.is_sender:
            return -1
        assert self.publisher is not None
        res = self.publisher.publish(tensors, step=step)
        self.last_version = res.version
        return res.version

    def send_weights(self, step: int | None = None) -> None:
        v = self.publish(step)
        if not self.is_sender:
            return
        self.client.start_weight_update()
        self.client.update_weights({"version": v})
        self.client.finish_weight_update(weight_version=str(v))


__all__ = ["DcrInitInfo", "DcrUpdateInfo", "DcrWeightTransferEngine", "DcrTrainerInitInfo",
           "DcrTrainerWeightTransferEngine"]
