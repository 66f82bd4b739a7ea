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

from nemo_dcr.errors import (BaseMismatchError, DcrError, DeltaFormatError, PartialApplyError,  # noqa: E402
                             TargetMismatchError)
from nemo_dcr.state.index_map import IndexMap, ShardSpec  # noqa: E402
from nemo_dcr.codec.format import DeltaReader  # noqa: E402
from nemo_dcr.delta import ApplyReport, apply, diff  # noqa: E402
from nemo_dcr.delta.stats import inspect  # noqa: E402
from nemo_dcr.state.digest import state_digest, tensor_digest  # noqa: E402
from nemo_dcr.sync.publisher import Publisher  # noqa: E402
from nemo_dcr.sync.follower import Follower  # noqa: E402

__all__ = [
    "__version__", "diff", "apply", "inspect", "ApplyReport", "DeltaReader", "IndexMap", "ShardSpec",
    "DcrError", "DeltaFormatError", "BaseMismatchError", "TargetMismatchError", "PartialApplyError",
    "tensor_digest", "state_digest", "Publisher", "Follower",
]
