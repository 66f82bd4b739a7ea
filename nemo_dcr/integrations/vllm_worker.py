"""vLLM integration: refit a running vLLM engine from a nemo-dcr store, in place.

    from vllm import LLM
    from nemo_dcr.integrations.vllm_worker import refit

    llm = LLM(model="/ckpt/initial", dtype="bfloat16",
              worker_extension_cls="nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension")
    refit(llm, "s3://bucket/run1")     # = llm.collective_rpc("dcr_update", args=(store,)), then
                                       #   llm.reset_prefix_cache() if the weights changed

``DcrWorkerExtension`` is mixed into every vLLM worker (vLLM's ``worker_extension_cls``); inside
a worker ``self.model_runner.model`` is the engine's ``torch.nn.Module``. The extension keeps a
``RolloutLoader`` over the worker's own part of the weights and writes each version into the
engine's parameter storage in place (CUDA graphs and compiled kernels keep their pointers).

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

Not handled: pipeline parallelism (a stage lacks the other stages' layers), quantized weights
(FP8, AWQ, ... are not the published BF16 bits), LoRA extra vocabulary, expert-parallel MoE
layers (``FusedMoE`` packs experts into one parameter: TODO, a per-expert row mapping like the
one for ``qkv_proj``).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch

from nemo_dcr.errors import DcrError
from nemo_dcr.state.index_map import ShardSpec

from .rollout import RolloutLoader

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


def vllm_tensors(model: torch.nn.Module, tp_rank: Optional[int] = None, tp_size: Optional[int] = None,
                 packed: Optional[Mapping[str, list]] = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, ShardSpec]]:
    """The engine's weights as (published name -> view into the engine's parameter, ShardSpec).

    Works on any ``nn.Module``; vLLM's parallel layers are recognised by class name (so nothing
    from vLLM is imported). ``tp_rank``/``tp_size`` default to the layer's own attributes, then
    to vLLM's TP group, then to an unsharded model."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or packed or DEFAULT_PACKED)
    modules = dict(model.named_modules())
    tensors: Dict[str, torch.Tensor] = {}
    shards: Dict[str, ShardSpec] = {}

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
        data = p.data
        cls = type(mod).__name__ if mod is not None else ""
        parent, _, leaf = mod_name.rpartition(".")
        subs = packed.get(leaf)
        base = f"{parent}." if parent else ""
        if cls == "QKVParallelLinear" and pname in ("weight", "bias"):
            r, n = _tp(mod, tp_rank, tp_size)
            hs = int(mod.head_size)
            vhs = int(getattr(mod, "v_head_size", hs) or hs)
            nq, nkv = int(mod.num_heads), int(mod.num_kv_heads)
            tq, tkv = int(mod.total_num_heads), int(mod.total_num_kv_heads)
            rep = int(getattr(mod, "num_kv_head_replicas", 1) or 1)
            names = subs or ["q_proj", "k_proj", "v_proj"]
            q, k, v = nq * hs, nkv * hs, nkv * vhs
            kv_shard = r // rep
            put(f"{base}{names[0]}.{pname}", *_rows(data, 0, q, r * q, tq * hs))
            put(f"{base}{names[1]}.{pname}", *_rows(data, q, k, kv_shard * k, tkv * hs))
            put(f"{base}{names[2]}.{pname}", *_rows(data, q + k, v, kv_shard * v, tkv * vhs))
        elif cls == "MergedColumnParallelLinear" and pname in ("weight", "bias"):
            r, n = _tp(mod, tp_rank, tp_size)
            sizes = [int(s) for s in mod.output_sizes]
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
        elif cls == "FusedMoE":
            raise DcrError(f"{full}: vLLM's fused MoE experts are not mapped yet (see the module doc)")
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

    def dcr_init(self, store: str, version: Optional[int] = None, check_every: int = 0,
                 name_map: Optional[dict] = None) -> Optional[int]:
        """Start following ``store``. ``version``: the version the engine's weights already are
        (e.g. 0 when vLLM loaded the trainer's initial checkpoint and the trainer published it
        with ``publish_initial``); checked against the store's digest. None: the first
        ``dcr_update`` downloads a keyframe. Returns the version held."""
        model = self.model_runner.model
        tensors, shards = vllm_tensors(model)
        self._dcr_store = store
        self._dcr_loader = RolloutLoader(store, tensors, shards, group=_tp_group(), name_map=name_map,
                                         check_every=check_every, version=version)
        return self._dcr_loader.version

    def dcr_update(self, store: Optional[str] = None, version: Optional[int] = None) -> Optional[int]:
        """Bring the weights to the newest (or given) version; returns the version held."""
        loader = getattr(self, "_dcr_loader", None)
        if loader is None or (store is not None and store != self._dcr_store):
            if store is None:
                raise DcrError("dcr_update: no store yet; pass its URL (or call dcr_init first)")
            self.dcr_init(store)
            loader = self._dcr_loader
        return loader.update(version)

    def dcr_version(self) -> Optional[int]:
        loader = getattr(self, "_dcr_loader", None)
        return loader.version if loader is not None else None

    def dcr_check(self) -> Optional[int]:
        """Recompute the whole state's digest (O(model)); raises if the weights are not the version held."""
        self._dcr_loader.check()
        return self._dcr_loader.version

    def dcr_fingerprint(self) -> Dict[str, str]:
        """Per published tensor (this worker's part): a BLAKE2b digest of its bits, for tests."""
        from nemo_dcr.state.digest import tensor_digest

        tensors, _ = vllm_tensors(self.model_runner.model)
        return {k: tensor_digest(v.detach().cpu()) for k, v in sorted(tensors.items())}


def refit(llm, store: str, version: Optional[int] = None) -> Optional[int]:
    """Driver side: update every worker of ``llm`` (a ``vllm.LLM`` started with
    ``worker_extension_cls="nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension"``), then reset the
    prefix cache if the weights changed (cached KV blocks were computed with the old weights).
    Returns the version every worker now holds."""
    before = llm.collective_rpc("dcr_version")
    after = llm.collective_rpc("dcr_update", args=(store, version))
    if len(set(after)) != 1:
        raise DcrError(f"vLLM workers hold different versions after the update: {after}")
    if list(after) != list(before):
        llm.reset_prefix_cache()
    return after[0]


__all__ = ["DcrWorkerExtension", "vllm_tensors", "refit", "DEFAULT_PACKED"]
