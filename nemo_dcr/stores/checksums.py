"""Object checksums: the hashes a manifest may name for a stored part (its bytes, whole).

A part's checksum is what a reader compares the downloaded bytes with before any of them is
applied, and what a signed manifest binds each part to. Two algorithms, both cryptographic and
256 bits, so a signature over the manifest is as strong with either:

* ``sha256``: manifests of format 1-3 (every release reads it);
* ``blake3``: manifests of format 4 (docs/format.md, "Versioning"). ~2.5x SHA-256's speed on one
  core here (4.3 against 1.7 GiB/s): the publisher's upload thread, a relay and a follower each
  hash every byte of every object they move, so at a keyframe that is ~15 % of either side's CPU.

Each side hashes on one thread, beside the encode or decode workers (both drop the GIL on large
buffers), so BLAKE3 runs without its own threads here.
"""
from __future__ import annotations

import hashlib
from typing import Protocol

import blake3

__all__ = ["ALGOS", "Hasher", "new", "of", "of_file"]

ALGOS = ("sha256", "blake3")


class Hasher(Protocol):
    def update(self, data, /) -> object: ...

    def hexdigest(self) -> str: ...


def new(algo: str) -> Hasher:
    """A fresh hasher of ``algo`` (one of :data:`ALGOS`; ``ValueError`` otherwise)."""
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "blake3":
        return blake3.blake3(max_threads=1)
    raise ValueError(f"unknown object checksum {algo!r} (this build knows {', '.join(ALGOS)})")


def of(algo: str, data) -> str:
    """Hex checksum of ``data`` (bytes-like) with ``algo``."""
    h = new(algo)
    h.update(data)
    return h.hexdigest()


def of_file(algo: str, path: str) -> str:
    """Hex checksum of the file at ``path`` with ``algo``, read 1 MiB at a time."""
    h = new(algo)
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()
