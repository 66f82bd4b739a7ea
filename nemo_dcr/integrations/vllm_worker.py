"""vLLM integration: refit a running vLLM engine from a nemo-dcr store, in place.

    from vllm import LLM
    from nemo_dcr.integrations.vllm_worker import refit

    llm = LLM(model="/ckpt/initial", dtype="bfloat16",
              worker_extension_cls="nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension")
    refit(llm, "s3://bucket/run1")     # = llm.collective_rpc("dcr_update", args=(store,)), then
                                       #   llm.reset_prefix_cache() if the weights changed

The same receiver is also vLLM's weight-transfer backend ``dcr`` (``weight_transfer_config=
{"backend": "dcr"}``, driven by vLLM's ``init_weight_transfer_engine`` / ``update_weights`` calls,
also over HTTP by ``vllm serve``: :mod:`nemo_dcr.integrations.vllm_transfer`), and ``AsyncLLM``
takes it the same way (:func:`refit_async`).

``DcrWorkerExtension`` is mixed into every vLLM worker (vLLM's ``worker_extension_cls``); inside a
worker ``self.model_runner.model`` is the engine's ``torch.nn.Module``. Where each published
element lands is not written down per model family: the model's own ``load_weights`` is run once on
probe tensors (:mod:`nemo_dcr.integrations.vllm_layout`), which gives every published tensor's
place in the layers' loaded-format tensors on this worker (slices, transposes, fused row ranges,
per-head re-layouts, padded vocabularies, tensor-parallel splits: strided views, written
O(changes)), or says that the loader computes from it (then it is kept whole and loaded again
when it changes). The receiver writes into plain loaded-format copies of the layers vLLM processes
after loading and rebuilds each layer whose copy changed with its own processing, then the
attention layers that read them (MLA's absorbed weights): :mod:`nemo_dcr.integrations.vllm_engine`.
After a refit the engine's whole state (every parameter and buffer it computes from, derived ones
included) is what a fresh engine on the version's checkpoint holds (``dcr_engine_state``).

``refit`` pauses the engine's scheduler, updates every worker, drops the KV cache computed with the
old weights (requests in flight are preempted and recomputed with the new weights; the reset is
checked), then resumes: the weights and the cache change together.

A ``classes`` chunk decodes only against the whole base chunk, which a TP worker holding part of a
tensor lacks: the workers of the TP group gather their bits of such chunks (one exchange per
version over the gloo TP group), and each decodes and checks them before the first write
(:mod:`nemo_dcr.sync.chunk_gather`); a chunk the group together does not hold is refused by every
worker with the same ``DcrError`` before anything is written.

Names: the trainer publishes the names of the checkpoint the engine was started on (what
``DeltaPublishCallback`` publishes for an HF model); ``name_map`` (published -> checkpoint name)
covers a trainer whose names differ.

Not handled: pipeline parallelism (refused at ``dcr_init``), quantized weights (FP8, AWQ, ... are
not the published BF16 bits: the probe reports such tensors as computed and they are reloaded
whole), LoRA adapters.
"""
from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import torch

from nemo_dcr.errors import DcrError

from .rollout import RolloutLoader
from .vllm_types import ModelRunner

_log = logging.getLogger(__name__)

def _tp_group():
    """vLLM's gloo group of this worker's TP ranks (None outside vLLM); refuses pipeline parallelism."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    except Exception:  # noqa: BLE001
        return None
    try:
        if get_pp_group().world_size > 1:
            raise DcrError("nemo-dcr refit does not support vLLM pipeline parallelism yet (a stage holds only "
                           "some layers)")
        return get_tp_group().cpu_group
    except DcrError:
        raise
    except Exception:  # noqa: BLE001 - distributed state not initialised (tests, CPU)
        return None


class DcrWorkerExtension:
    """Methods vLLM mixes into each worker (``worker_extension_cls``); call them with
    ``llm.collective_rpc(name, args=...)`` (every worker runs them together)."""

    if TYPE_CHECKING:  # provided by the vLLM worker this class is mixed into
        model_runner: ModelRunner

    def _dcr_engine_weights(self, from_checkpoint: bool, group):
        """The engine's weights in loaded format (probing the model's loader once per model)."""
        from .vllm_engine import EngineWeights
        from .vllm_layout import checkpoint_layout, probe_layout

        model = self.model_runner.model
        config = getattr(self, "vllm_config", None)
        old = getattr(self, "_dcr_engine", None)
        if old is not None and old.model is model:
            layout, published = old.layout, old.published
        else:
            path = getattr(getattr(config, "model_config", None), "model", None)
            if path is None:
                raise DcrError("dcr_init: the worker has no vLLM config naming the checkpoint it was started on")
            published = checkpoint_layout(str(path))
            layout = probe_layout(model, published)
        refused = {n: why for n, why in layout.reload.items() if any("load_weights failed" in w for w in why)}
        if refused:
            name, why = sorted(refused.items())[0]
            raise DcrError(f"the engine's loader cannot take {len(refused)} published tensor(s), e.g. {name!r}: "
                           f"{why[0]}; nothing was changed")
        mine = set(layout.gathered) | set(layout.reload)
        held = mine if group is None else set().union(*_all_gather(group, sorted(mine)))
        if old is not None and old.model is model and not from_checkpoint:
            return old  # plain copies of the same engine: what it computes from now
        return EngineWeights(model, config, from_checkpoint=from_checkpoint, published=published, layout=layout,
                             held_elsewhere=held)

    def dcr_init(self, store: str, version: int | None = None, check_every: int = 0,
                 name_map: dict | None = None) -> int | None:
        """Start following ``store``. ``version``: the version the engine's weights already are
        (e.g. 0 when vLLM loaded the trainer's initial checkpoint and the trainer published it
        with ``publish_initial``); checked against the store's digest (the layers vLLM processed
        are read back from the checkpoint the engine was started on). None: the first
        ``dcr_update`` downloads a keyframe. Returns the version held."""
        from nemo_dcr.stores import open_reader
        from nemo_dcr.sync.signing import verifying

        group = _tp_group()
        engine = self._dcr_engine_weights(version is not None, group)
        self._dcr_store = store
        self._dcr_engine = engine
        try:
            # HEAD and manifests verified with the trusted keys in the environment
            self._dcr_loader = RolloutLoader(verifying(open_reader(store) if isinstance(store, str) else store),
                                             engine.tensors, engine.shards, group=group,
                                             name_map=name_map, check_every=check_every, version=version,
                                             staging=False, follower_options={"on_write": engine.on_write})
        finally:
            engine.rebuild_changed()
        return self._dcr_loader.version

    def dcr_update(self, store: str | None = None, version: int | None = None) -> int | None:
        """Bring the weights to the newest (or given) version; returns the version held. Every
        chunk is decoded and checked by every worker before the first write (``classes`` chunks
        of a tensor held in part: with the base chunk gathered over the TP group); the layers
        whose weights changed are rebuilt into what the engine computes from, even after a failure
        (the engine then computes from what the follower holds, which it knows is in between)."""
        loader = getattr(self, "_dcr_loader", None)
        if loader is None or (store is not None and store != self._dcr_store):
            if store is None:
                raise DcrError("dcr_update: no store yet; pass its URL (or call dcr_init first)")
            self.dcr_init(store)
            loader = self._dcr_loader
        try:
            return loader.update(version)
        finally:
            self._dcr_engine.rebuild_changed()

    def dcr_update_outcome(self, store: str | None = None, version: int | None = None) -> dict:
        """``dcr_update``, its error returned rather than raised: vLLM's executor stops reading
        replies at the first worker that raises and the others' replies answer the next call,
        so ``refit`` collects every worker's outcome this way."""
        try:
            return {"version": self.dcr_update(store, version)}
        except Exception as e:  # noqa: BLE001 - handed to the driver, raised there
            if not isinstance(e, DcrError):  # not one of ours: where it came from is in the worker's log
                _log.warning("dcr_update failed in this worker", exc_info=True)
            return {"version": self.dcr_version(), "error": f"{type(e).__name__}: {e}"}

    def _dcr_receiver(self) -> DcrWorkerExtension:
        """Who follows the store in this worker: this extension, or the ``dcr`` weight-transfer
        backend (:mod:`.vllm_transfer`) when the engine was updated the vLLM way."""
        if getattr(self, "_dcr_loader", None) is None:
            other = getattr(getattr(self, "weight_transfer_engine", None), "receiver", None)
            if isinstance(other, DcrWorkerExtension):
                return other
        return self

    def dcr_version(self) -> int | None:
        loader = getattr(self._dcr_receiver(), "_dcr_loader", None)
        return loader.version if loader is not None else None

    def dcr_check(self) -> int | None:
        """Recompute the whole state's digest (O(model)); raises if the weights are not the version held."""
        loader = self._dcr_receiver()._dcr_loader
        loader.check()
        return loader.version

    def dcr_manifest_key(self) -> str | None:
        """The store key of the manifest of the version held (None: no version)."""
        loader = getattr(self._dcr_receiver(), "_dcr_loader", None)
        m = loader.follower.manifest if loader is not None else None
        return m.key if m is not None else None

    def dcr_layout(self) -> dict:
        """Where the published tensors land on this worker, by kind (:meth:`EngineLayout.describe`)."""
        engine = getattr(self._dcr_receiver(), "_dcr_engine", None)
        if engine is None:
            from .vllm_layout import checkpoint_layout, probe_layout
            path = self.vllm_config.model_config.model  # type: ignore[attr-defined]
            return probe_layout(self.model_runner.model, checkpoint_layout(str(path))).describe()
        return engine.layout.describe()

    def _dcr_readback(self, engine_only: bool = False) -> dict:
        """Per published tensor (this worker's part): the tensor its bits are read back from: the
        engine's own tensor where it keeps it in loaded format, the copy it was rebuilt from
        otherwise (``engine_only``: only the former)."""
        engine = getattr(self._dcr_receiver(), "_dcr_engine", None)
        if engine is None:
            raise DcrError("no nemo-dcr receiver in this worker yet: call dcr_init first")
        out = {}
        for name in sorted(engine.tensors):
            k = engine.kernel_view(name)
            if k is not None:
                out[name] = k
            elif not engine_only:
                out[name] = engine.tensors[name]
        return out

    def dcr_fingerprint(self, engine_only: bool = False) -> dict[str, str]:
        """Per published tensor (this worker's part): a BLAKE2b digest of its bits, for tests
        (read back as :meth:`_dcr_readback` says)."""
        from nemo_dcr.state.digest import tensor_digest
        return {k: tensor_digest(v.detach().cpu().contiguous()) for k, v in self._dcr_readback(engine_only).items()}

    def dcr_raw_bits(self, engine_only: bool = False) -> dict[str, bytes]:
        """Per published tensor (this worker's part): its raw bits (the integer view's bytes, read
        back as :meth:`_dcr_readback` says), for harnesses that compare with their own ground truth."""
        from nemo_dcr.state.dtypes import int_view
        return {k: int_view(v.detach().cpu().contiguous()).numpy().tobytes()
                for k, v in self._dcr_readback(engine_only).items()}

    def dcr_reset_kv_cache(self, fill: float = 0.0) -> int:
        """Zero this worker's KV cache memory, as a fresh engine's is; returns the bytes zeroed
        (``fill``: another value, for tests that show what reads the cache).

        Only when no request holds KV blocks (``refit`` preempts them first): then nothing
        computed with the old weights is read after an update, as in a fresh engine (vLLM-CPU's
        MLA decode reads KV beyond a request's own: its batch neighbours', docs/design.md).
        Reproducer: tests/repro/vllm_cpu_mla_stale_kv.py."""
        seen: set = set()
        n = 0
        found: list = list(getattr(self.model_runner, "kv_caches", None) or [])
        for mod in self.model_runner.model.modules():  # each attention layer's view of its cache
            kv = getattr(mod, "kv_cache", None)
            if kv is not None:
                found.append(kv)
        flat: list = []
        while found:
            c = found.pop()
            if isinstance(c, (list, tuple)):
                found.extend(c)
            elif isinstance(c, torch.Tensor) and c.numel():
                flat.append(c)
        with torch.no_grad():
            for t in flat:
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                if key in seen:
                    continue
                seen.add(key)
                if fill == 0.0:
                    t.zero_()
                elif t.is_floating_point():
                    t.fill_(fill)
                n += t.numel() * t.element_size()
        return n

    def dcr_engine_state(self) -> dict[str, str]:
        """A digest of every tensor this worker's engine computes from (``engine_state``): what a
        refitted engine and a fresh one on the same checkpoint must agree on."""
        return engine_state(self.model_runner.model)


def _all_gather(group, obj) -> list:
    import torch.distributed as dist
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def engine_state(model: torch.nn.Module, skip: tuple = ("kv_cache",)) -> dict[str, str]:
    """Digest (dtype, shape, BLAKE2b of the raw bytes) of every tensor the engine computes from:
    each module's parameters and buffers, and the tensors its attributes hold, also inside the
    helper objects vLLM hangs on layers (attention implementations, quant methods: MLA's absorbed
    ``W_UK_T``/``W_UV``, a kernel's packed copy of a weight), keyed by module path and attribute.
    The KV cache is skipped (it is not computed from the weights until a request runs). Opaque
    kernel handles (``torch.ScriptObject``, e.g. oneDNN's packed weights) cannot be read: they are
    listed as ``opaque`` (the tokens and logprobs compare what they compute)."""
    out: dict[str, str] = {}
    seen: set[int] = set()

    def dig(t: torch.Tensor) -> str:
        t = t.detach()
        t = (t.cpu() if t.device.type != "cpu" else t).contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return f"{t.dtype}{tuple(t.shape)}:" + hashlib.blake2b(raw, digest_size=16).hexdigest()

    def walk(obj, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict):
            return
        for k in sorted(d):
            v = d[k]
            if k in ("_parameters", "_buffers", "_modules") or any(x in k for x in skip):
                continue
            p = f"{path}.{k}"
            if isinstance(v, torch.Tensor):
                if id(v) not in seen:
                    seen.add(id(v))
                    out[p] = dig(v)
            elif isinstance(v, torch.nn.Module) or isinstance(v, type):
                continue
            elif isinstance(v, torch.ScriptObject):
                out[p] = "opaque"
            elif isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    if isinstance(x, torch.Tensor) and id(x) not in seen:
                        seen.add(id(x))
                        out[f"{p}[{i}]"] = dig(x)
            elif hasattr(v, "__dict__") and type(v).__module__.startswith("vllm"):
                walk(v, p, depth + 1)

    for mname, mod in model.named_modules():
        for k, v in list(mod._parameters.items()) + list(mod._buffers.items()):
            if v is not None and not any(x in k for x in skip):
                out[f"{mname}.{k}"] = dig(v)
                seen.add(id(v))
        walk(mod, mname, 0)
    return out


def _engine_call(llm, method: str, *args):
    """A method of vLLM's engine core (the scheduler's process), from the driver."""
    core = llm.llm_engine.engine_core
    if hasattr(core, "call_utility"):  # the engine core in its own process
        return core.call_utility(method, *args)
    return getattr(core.engine_core, method)(*args)  # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)


class _Outcome:
    """What every worker said after an update: the version they hold, or why they failed."""

    def __init__(self, before: list, outcomes: list[dict]):
        self.after = [o["version"] for o in outcomes]
        self.failed = [(rank, o["error"]) for rank, o in enumerate(outcomes) if "error" in o]
        self.changed = bool(self.failed) or list(self.after) != list(before)  # a failed update may have written

    def result(self) -> int | None:
        if self.failed:
            raise DcrError(f"refit failed on {len(self.failed)} of {len(self.after)} vLLM workers: "
                           + "; ".join(f"worker {r}: {msg}" for r, msg in self.failed))
        if len(set(self.after)) != 1:
            raise DcrError(f"vLLM workers hold different versions after the update: {self.after}")
        return self.after[0]


def _check_reset(ok: bool) -> None:
    if not ok:
        raise DcrError("vLLM did not reset its prefix cache after the weights changed; KV blocks computed "
                       "with the old weights could be reused")


def refit(llm, store: str, version: int | None = None) -> int | None:
    """Driver side: update every worker of ``llm`` (a ``vllm.LLM`` started with
    ``worker_extension_cls="nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension"``) so that the
    weights and the KV cache change together: the scheduler is paused (no step runs while the
    weights change), every worker updates, then, if the weights changed (or an update failed part
    way), the running requests are preempted, the prefix cache is reset (checked) and the KV cache
    memory is zeroed, as a fresh engine's is (``dcr_reset_kv_cache``: vLLM-CPU's MLA decode reads
    the contents of KV slots it does not own, see docs/design.md), and the scheduler resumes.
    Requests in flight continue from their tokens so far, recomputed with the new weights.
    Returns the version every worker now holds."""
    _engine_call(llm, "pause_scheduler", "keep", False)
    try:
        before = llm.collective_rpc("dcr_version")
        out = _Outcome(before, llm.collective_rpc("dcr_update_outcome", args=(store, version)))
        if out.changed:
            _check_reset(llm.reset_prefix_cache(reset_running_requests=True))
            llm.collective_rpc("dcr_reset_kv_cache")
        return out.result()
    finally:
        _engine_call(llm, "resume_scheduler")


async def refit_async(engine, store: str, version: int | None = None) -> int | None:
    """:func:`refit` for an ``AsyncLLM`` (what verl, NeMo-RL and SkyRL embed), started with the same
    ``worker_extension_cls``: generation is paused with its requests kept, every worker updates,
    the running requests are preempted and recomputed with the new weights, the prefix cache is
    reset and the KV cache zeroed, and generation resumes. Requests submitted meanwhile wait."""
    await engine.pause_generation(mode="keep", clear_cache=False)
    try:
        before = await engine.collective_rpc("dcr_version")
        out = _Outcome(before, await engine.collective_rpc("dcr_update_outcome", args=(store, version)))
        if out.changed:
            _check_reset(await engine.reset_prefix_cache(reset_running_requests=True))
            await engine.collective_rpc("dcr_reset_kv_cache")
        return out.result()
    finally:
        await engine.resume_generation()


#: the name of nemo-dcr's backend in vLLM's weight-transfer registry (:mod:`.vllm_transfer`)
WEIGHT_TRANSFER_BACKEND = "dcr"


def register_weight_transfer() -> None:
    """Add the ``dcr`` backend to vLLM's weight-transfer registries (``weight_transfer_config=
    {"backend": "dcr"}`` on the inference side, ``WeightTransferTrainerFactory.trainer_init(
    DcrTrainerInitInfo(...))`` on the trainer side), lazily: :mod:`nemo_dcr.integrations.vllm_transfer`
    is imported when vLLM builds the engine. The ``vllm.general_plugins`` entry point; also run when
    this module is imported (vLLM imports it in every worker for ``worker_extension_cls``, before the
    model is loaded and the transfer engine built). Without vLLM it does nothing."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    where = "nemo_dcr.integrations.vllm_transfer"
    try:
        WeightTransferEngineFactory.register_engine(WEIGHT_TRANSFER_BACKEND, where, "DcrWeightTransferEngine")
    except ValueError:  # registered already in this process
        pass
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        WeightTransferTrainerFactory.register_engine(WEIGHT_TRANSFER_BACKEND, where, "DcrTrainerWeightTransferEngine")
    except (ImportError, ValueError):  # an older vLLM without the trainer half, or registered already
        pass


register_weight_transfer()

__all__ = ["DcrWorkerExtension", "engine_state", "refit", "refit_async",
           "WEIGHT_TRANSFER_BACKEND", "register_weight_transfer"]
