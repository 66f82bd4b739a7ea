"""The dtypes nemo-dcr accepts and the integer views it diffs them through.

Diffs are always taken on raw bits: every tensor is viewed as the unsigned/signed integer
type of the same width, so NaN payloads, -0.0 and subnormals are changes like any other.
"""
import torch

from nemo_dcr.errors import DcrError

# name in the delta header -> torch dtype
DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "uint32": torch.uint32,
    "int64": torch.int64,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}

# element size in bytes -> integer dtype used for bit operations
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return NAMES[dtype]
    except KeyError:
        raise DcrError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise DcrError(f"unknown dtype name {name!r}") from None


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # (torch >= 2.1; making an empty tensor to ask cost ~2 us per call)


def int_view(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` (any strides) as the integer dtype of the same width. No copy."""
    dtype_name(t.dtype)
    return t.view(INT_VIEW[t.element_size()])
