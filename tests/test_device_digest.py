"""The BLAKE3 tensor digest computed where the tensor is (nemo_dcr/device/blake3.py, issue 24:
the device path's last O(model) device-to-host copy was the delta header's tensor digests),
against the ``blake3`` package through ``state.digest.tensor_digest``, under TRITON_INTERPRET=1
on CPU tensors: one chunk (the root inside it), a partial second chunk, an odd chunk carried up
the tree, several programs per launch, and a non-contiguous float tensor. (The interpreter runs
the 7 rounds of 16 blocks op by op, ~10 s of CPU a digest: few, chosen cases; tests/gpu/run_gpu.py
hashes large tensors on a GPU.)"""
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from nemo_dcr.device import kernels  # noqa: E402
from nemo_dcr.device.blake3 import tensor_digest  # noqa: E402
from nemo_dcr.state.digest import tensor_digest as host_digest  # noqa: E402

if not kernels.interpreted():
    pytest.skip("nemo_dcr.device.kernels was imported without TRITON_INTERPRET=1", allow_module_level=True)


def _bytes(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("n, lanes", [
    (0, 64),       # the prefix alone: one chunk of one short block, the root
    (1100, 64),    # two chunks: the tensor's first bytes share chunk 0 with the prefix
    (4200, 2),     # five chunks (the last short), two per program: several programs, a chunk
                   # carried up two levels
])
def test_device_digest_is_blake3(n, lanes):
    t = _bytes(n, n)
    assert tensor_digest(t, lanes=lanes) == host_digest(t, "blake3")


def test_device_digest_of_other_dtypes_and_strides():
    x = _bytes(4 * 600, 1).view(torch.float32).view(20, 30)
    x[0, 0], x[0, 1], x[0, 2] = float("nan"), -0.0, float("inf")
    y = x.t()  # not contiguous: hashed in row-major order of its own shape (and its dtype's name)
    assert tensor_digest(y) == host_digest(y, "blake3") != host_digest(y.contiguous().view(torch.int32), "blake3")
