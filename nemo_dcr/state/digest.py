"""Digests of raw tensor bits.

* ``tensor_digest`` -- ``"sha256:"`` + the first 128 bits (hex) of SHA-256 over dtype name,
  shape and the little-endian bytes of the tensor in row-major order, hashed one bounded range
  at a time (non-contiguous tensors are never copied whole). SHA-256 runs on the CPU's SHA
  instructions (2.6x BLAKE2b on the bench machine). Digests without a prefix are the earlier
  BLAKE2b-128 ones; ``tensor_digest_like`` computes a digest in the algorithm of a given one, so
  old deltas still verify.
* ``values_digest`` -- BLAKE2b-64 of a 1-D bit tensor; the per-chunk pre/post image checks.
* ``state_digest`` -- BLAKE2b-128 over the sorted (name, tensor digest) list of a whole state.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

import torch

from nemo_dcr.state.dtypes import dtype_name
from nemo_dcr.state.flat import FlatAccess

HASH_RANGE = 1 << 22  # elements hashed per update


def _bytes(bits: torch.Tensor):
    # .cpu(): a device tensor (the device path's snapshot) is hashed one bounded range at a time
    return bits.contiguous().view(torch.uint8).cpu().numpy().data


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class RunningDigest:
    """``tensor_digest`` of ``t`` fed front to back: ``advance(end)`` hashes the flat elements up
    to ``end`` (those must be final by then), ``hexdigest()`` the rest and returns the digest.
    ``apply`` hashes each range as soon as the chunks before it are written, on the calling
    thread while the workers apply the next chunks: the target check then overlaps the writes
    instead of being a second pass after them (same bytes hashed, same digest)."""

    def __init__(self, t: torch.Tensor, algo: str = "sha256"):
        self._h: _Hasher  # sha256 and blake2b share no base class, only these two methods
        if algo == "sha256":
            self._h, self._prefix = hashlib.sha256(), "sha256:"
        elif algo == "blake2b":
            self._h, self._prefix = hashlib.blake2b(digest_size=16), ""
        else:
            raise ValueError(f"unknown tensor digest {algo!r}")
        self._h.update(f"{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        self._fa = FlatAccess(t)
        self._done = 0

    def advance(self, end: int) -> None:
        end = min(end, self._fa.numel)
        for s in range(self._done, end, HASH_RANGE):
            self._h.update(_bytes(self._fa.read(s, min(s + HASH_RANGE, end))))
        self._done = max(self._done, end)

    def hexdigest(self) -> str:
        self.advance(self._fa.numel)
        return self._prefix + self._h.hexdigest()[:32]


def algo_of(ref: str) -> str:
    """The algorithm a stored tensor digest was made with (no prefix: the earlier BLAKE2b)."""
    return "sha256" if ref.startswith("sha256:") else "blake2b"


def tensor_digest(t: torch.Tensor, algo: str = "sha256") -> str:
    return RunningDigest(t, algo).hexdigest()


def tensor_digest_like(t: torch.Tensor, ref: str) -> str:
    """``tensor_digest`` of ``t`` in the algorithm ``ref`` was made with (to compare with it)."""
    return tensor_digest(t, algo_of(ref))


def values_digest(bits: torch.Tensor) -> str:
    return hashlib.blake2b(_bytes(bits), digest_size=8).hexdigest()


def state_digest(digests: Mapping[str, str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name].encode() + b"\n")
    return h.hexdigest()
