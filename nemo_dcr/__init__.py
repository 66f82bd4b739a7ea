"""nemo-dcr: bit-exact delta-compressed weight refit for reinforcement learning.

Layers, lower to higher (a module imports only from its own layer or lower ones; the map with one
line per subpackage is in docs/design.md):

* ``state``: dtypes, flat element access, canonical index maps, tensor and state digests
* ``codec``: the container format and the chunk codings (reference + native C kernel)
* ``delta``: diff / apply / inspect over named tensors
* ``stores``: object stores (local directory, S3)
* ``sync``: versions, joint commit, Publisher / Follower, retention, process groups
* ``checkpoint``: safetensors checkpoints, file-level diff/apply, checkpoint publish/pull
* ``integrations``: Lightning, Megatron-core, Hugging Face, vLLM (``nemo_dcr.callbacks``)
* ``cli``: the ``nemo-dcr`` command and the demo job
"""
__version__ = "0.1.0"

from nemo_dcr import _moved

_moved.install()

from nemo_dcr.errors import BaseMismatchError, DcrError, DeltaFormatError, PartialApplyError, TargetMismatchError  # noqa: E402

# The rest is resolved at first use: ``import nemo_dcr`` stays cheap (no torch) for processes that
# need only part of it, such as a relay or ``nemo-dcr --help``.
_LAZY = {
    "IndexMap": "nemo_dcr.state.index_map", "ShardSpec": "nemo_dcr.state.index_map",
    "DeltaReader": "nemo_dcr.codec.format",
    "ApplyReport": "nemo_dcr.delta", "apply": "nemo_dcr.delta", "diff": "nemo_dcr.delta",
    "inspect": "nemo_dcr.delta.stats",
    "state_digest": "nemo_dcr.state.digest", "tensor_digest": "nemo_dcr.state.digest",
    "Publisher": "nemo_dcr.sync.publisher", "Follower": "nemo_dcr.sync.follower",
}

__all__ = [
    "__version__", "diff", "apply", "inspect", "ApplyReport", "DeltaReader", "IndexMap", "ShardSpec",
    "DcrError", "DeltaFormatError", "BaseMismatchError", "TargetMismatchError", "PartialApplyError",
    "tensor_digest", "state_digest", "Publisher", "Follower",
]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
