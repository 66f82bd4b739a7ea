"""Digests of raw tensor bits.

* ``tensor_digest`` -- BLAKE2b-128 over dtype name, shape and the little-endian bytes of the
  tensor in row-major order, hashed one bounded range at a time (non-contiguous tensors are
  never copied whole).
* ``values_digest`` -- BLAKE2b-64 of a 1-D bit tensor; the per-chunk pre/post image checks.
* ``state_digest`` -- BLAKE2b-128 over the sorted (name, tensor digest) list of a whole state.
"""
from __future__ import annotations

import hashlib
from typing import Mapping

import torch

from .dtypes import dtype_name
from .flat import FlatAccess

HASH_RANGE = 1 << 22  # elements hashed per update


def _bytes(bits: torch.Tensor):
    return bits.contiguous().view(torch.uint8).numpy().data


def tensor_digest(t: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
    fa = FlatAccess(t)
    for s in range(0, fa.numel, HASH_RANGE):
        h.update(_bytes(fa.read(s, min(s + HASH_RANGE, fa.numel))))
    return h.hexdigest()


def values_digest(bits: torch.Tensor) -> str:
    return hashlib.blake2b(_bytes(bits), digest_size=8).hexdigest()


def state_digest(digests: Mapping[str, str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name].encode() + b"\n")
    return h.hexdigest()
