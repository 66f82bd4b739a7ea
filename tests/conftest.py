import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparison."""
    from nemo_dcr.dtypes import int_view
    return int_view(t)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert torch.equal(bits(a), bits(b)), f"{what}: bits differ"


def zeros_like(state):
    """A receiver's starting tensors: same names, dtypes and shapes, all zero."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


def assert_state(recv, state):
    """Same names, and every tensor bit-identical."""
    assert sorted(recv) == sorted(state)
    for k in state:
        assert_bits_equal(recv[k], state[k], k)


@pytest.fixture
def nemo_dcr_cmd():
    """The installed console script, next to the running interpreter."""
    exe = os.path.join(os.path.dirname(sys.executable), "nemo-dcr")
    assert os.path.exists(exe), "nemo-dcr console script not installed in this environment"
    return exe


# The S3 server and the store fixtures, shared by every module (one moto server per session).
from stores_fixtures import make_s3_store, moto_s3, store  # noqa: E402,F401
