"""nemo-dcr: bit-exact delta-compressed weight refit for reinforcement learning."""
__version__ = "0.1.0"

from .errors import BaseMismatchError, DcrError, DeltaFormatError, PartialApplyError, TargetMismatchError  # noqa: E402
from .index_map import IndexMap, ShardSpec  # noqa: E402
from .format import DeltaReader  # noqa: E402
from .delta import ApplyReport, apply, diff  # noqa: E402
from .stats import inspect  # noqa: E402
from .digest import state_digest, tensor_digest  # noqa: E402

__all__ = [
    "__version__", "diff", "apply", "inspect", "ApplyReport", "DeltaReader", "IndexMap", "ShardSpec",
    "DcrError", "DeltaFormatError", "BaseMismatchError", "TargetMismatchError", "PartialApplyError",
    "tensor_digest", "state_digest",
]
