"""Framework integrations, importable as ``nemo_dcr.callbacks``.

* ``DeltaPublishCallback`` (``publish.py``): Lightning callback, trainer side.
* ``DeltaPublishTrainerCallback`` (``hf_trainer.py``): Hugging Face ``Trainer`` (and TRL) callback.
  Both drive ``PublishLoop`` (``publish_loop.py``).
* ``RolloutLoader`` (``rollout.py``): rollout side, any ``torch.nn.Module`` or dict of tensors.
* ``DcrWorkerExtension``, ``refit``, ``refit_async`` (``vllm_worker.py``): vLLM (where each published
  element lands: ``vllm_layout.py``, probed from the model's own loader).
* ``module_snapshot``, ``module_tensors``, ``SnapshotFn`` (``snapshot.py``).
* ``megatron_snapshot``, ``is_megatron_module`` (``megatron.py``): Megatron-core models.

Names are resolved lazily, so importing one integration never imports another's framework
(a vLLM worker does not need Lightning, a trainer does not need vLLM).
"""
import importlib

_EXPORTS = {
    "DeltaPublishCallback": "publish",
    "DeltaPublishError": "publish",
    "DeltaPublishTrainerCallback": "hf_trainer",
    "PublishLoop": "publish_loop",
    "RolloutLoader": "rollout",
    "DcrWorkerExtension": "vllm_worker",
    "refit": "vllm_worker",
    "refit_async": "vllm_worker",
    "module_snapshot": "snapshot",
    "module_tensors": "snapshot",
    "module_views": "snapshot",
    "SnapshotFn": "snapshot",
    "megatron_snapshot": "megatron",
    "is_megatron_module": "megatron",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
