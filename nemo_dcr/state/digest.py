"""Digests of raw tensor bits.

* ``tensor_digest`` -- ``"blake3:"`` + the first 128 bits (hex) of BLAKE3 over dtype name, shape
  and the little-endian bytes of the tensor in row-major order, hashed one bounded range at a
  time (non-contiguous tensors are never copied whole). A digest names the algorithm it was made
  with, and ``tensor_digest_like`` computes one in the algorithm of a given one, so deltas written
  earlier still verify: ``"sha256:"`` (SHA-256, format version 1) and no prefix (BLAKE2b-128, the
  first deltas), over the same bytes. BLAKE3 is ~3x SHA-256 on one core (SIMD over 1 KiB
  chunks, where SHA-256 is one sequential chain) and splits a large range over threads
  (``THREADS``); it is a 256-bit cryptographic hash like SHA-256, so the check is as strong.
* ``values_digest`` -- 64 bits of BLAKE3 (format version 2) or BLAKE2b-64 (version 1) of a 1-D bit
  tensor: the per-chunk pre/post image checks. The delta's format version says which
  (``codec/versions.py``); a chunk entry carries it as ``values_algo``.
* ``state_digest`` -- BLAKE2b-128 over the sorted (name, tensor digest) list of a whole state
  (O(tensors), not O(elements)).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import blake3
import numpy as np
import torch

from nemo_dcr.state.dtypes import dtype_name
from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.state.index_map import IndexMap, ShardSpec

HASH_RANGE = 1 << 22  # elements hashed per update
TENSOR_ALGOS = ("blake3", "sha256", "blake2b", "sd", "sdn", "sdb")  # what a tensor digest may be made with
VALUES_ALGOS = ("blake3", "blake2b")  # what a chunk's pre/post image digest may be made with
_PREFIX = {"blake3": "blake3:", "sha256": "sha256:", "blake2b": "", "sd": "sd:", "sdn": "sdn:", "sdb": "sdb:"}
#: ``"sd"`` (format version 3): the state digest (state/statedigest.py) of the tensor alone, as
#: a whole tensor named ``""`` -- keyed by its dtype and shape, its elements at their flat indices.
#: ``"sdn"`` (format version 4): the tensor's (or region's) share of the state digest itself --
#: keyed by its name, dtype and global shape, its elements at their canonical indices -- so the
#: tensor digests of a state add up to its state digest and a writer sums each element once.
#: ``"sdb"`` (format version 5): ``"sdn"`` under the state digest's definition 2 (blocked weights,
#: ~3x cheaper to sum over a whole tensor: docs/format.md, "Definition 2: blocked weights").
#: All are plain sums over elements, so ``diff`` updates them from the changed elements alone
#: (``SumKey``); checksums, not cryptographic hashes (docs/format.md, "Digests").
SUMMED = ("sd", "sdn", "sdb")
#: the state digest definition (``statedigest.DEFINITIONS``) each summed digest's weights are of
DEFINITION = {"sd": 1, "sdn": 1, "sdb": 2}
#: the summed digests keyed by the tensor's name and place, so that a state's add up to its state digest
NAMED = ("sdn", "sdb")
SUM_NAME = ""
#: BLAKE3 threads (``max_threads``) for a tensor digest that is a pass of its own (``tensor_digest``:
#: a receiver's base check before the first write, a verification): 2 threads hash a large range
#: ~1.8-2x faster than one on idle cores (docs/results.md, "BLAKE3 digests"). Digests that run
#: beside the chunk work (``diff``'s digest jobs on the worker pool, ``apply``'s ``RunningDigest``
#: beside the chunk writers) hash on one thread: the cores are busy already, and measured there
#: a second thread gained nothing. A threaded hasher starts its own pool (~60 us), so tensors
#: under THREADED_MIN bytes are hashed on one thread.
THREADS = 2
THREADED_MIN = 4 << 20


#: integer views numpy reads as they are (a float view goes through torch's uint8 view)
_NUMPY_BITS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _bytes(bits: torch.Tensor | np.ndarray):
    if isinstance(bits, np.ndarray):  # (the bits of a receiver group's chunks, placed in numpy)
        return np.ascontiguousarray(bits).reshape(-1).view(np.uint8).data
    if bits.is_cpu and bits.dtype in _NUMPY_BITS and not bits.requires_grad:  # (is_cpu: .device makes an object)
        # numpy's byte view, not torch's: torch's view gives the GIL up, once per chunk's
        # pre-image on the apply's workers (docs/results.md, eighteenth turn); same bytes
        return bits.contiguous().numpy().reshape(-1).view(np.uint8).data
    # .cpu(): a device tensor (the device path's snapshot) is hashed one bounded range at a time
    return bits.contiguous().view(torch.uint8).cpu().numpy().data


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> Any: ...  # (blake3's returns the hasher)

    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class Place:
    """Where a tensor's elements sit in the state: the tensor's ``name`` and ``spec``, the region
    of the global tensor they are (None: the whole tensor). An ``"sdn"`` digest is keyed by it;
    the other algorithms hash the bits alone and ignore it."""

    name: str
    spec: ShardSpec | None = None


class SumKey:
    """What a summed tensor digest (``SUMMED``) of a tensor is keyed by and where its elements
    count: ``"sd"``, the name ``""``, the tensor's own dtype and shape, its flat indices;
    ``"sdn"`` and ``"sdb"``, ``place``'s name and global shape, the canonical indices of its
    region; and the definition of the weights (``DEFINITION``). One implementation of the sums
    every writer and reader of them makes."""

    def __init__(self, algo: str, dtype: torch.dtype, shape, place: Place | None = None):
        if algo not in SUMMED:
            raise ValueError(f"{algo!r} is not a summed tensor digest (those are {', '.join(SUMMED)})")
        self.algo, self.dtype, self.prefix = algo, dtype, _PREFIX[algo]
        self.definition = DEFINITION[algo]
        #: the region's map where its flat indices are not its canonical ones (None: they are; a
        #: whole tensor's map is not made: a diff makes a key for each of thousands of tensors)
        self.imap: IndexMap | None = None
        self.spec: ShardSpec | None = None  # where the region sits ("sdn"; None: the whole tensor)
        self.name, self.shape = SUM_NAME, tuple(shape)
        if algo in NAMED:
            if place is None:
                raise ValueError(f"an {algo!r} tensor digest is keyed by the tensor's name and place: none given")
            spec = place.spec
            if spec is not None and tuple(spec.shape) != self.shape:
                raise ValueError(f"{place.name}: tensor shape {self.shape} != its region's {tuple(spec.shape)}")
            if spec is not None:
                # (keyed by the global shape even where a whole region is another index shape)
                self.spec, self.shape = spec, tuple(spec.global_shape)
                if not spec.is_full:
                    self.imap = IndexMap(spec)
            self.name = place.name

    def range(self, bits: torch.Tensor, start: int):
        """The share (a StateDigest) of the flat elements ``start``, ... holding ``bits``."""
        from nemo_dcr.state.statedigest import range_contrib, region_contrib
        if self.imap is None:
            return range_contrib(self.name, self.dtype, self.shape, bits, start, definition=self.definition)
        return region_contrib(self.name, self.dtype, self.imap, bits, start, definition=self.definition)

    def at(self, idx: torch.Tensor, gidx: torch.Tensor | None = None) -> tuple[str, torch.dtype, tuple, torch.Tensor]:
        """``(name, dtype, shape, indices)``: the first arguments of the state digest's change
        functions (``statedigest.change_contrib``, ``RunningSum.add_change``) for the elements at
        flat ``idx`` (``gidx``: their canonical indices, where the caller has them already)."""
        if self.imap is not None:
            idx = gidx if gidx is not None else self.imap.to_global(idx)
        return self.name, self.dtype, self.shape, idx

    def parse(self, digest: str):
        """The StateDigest a digest of this algorithm holds."""
        if algo_of(digest) != self.algo:
            raise ValueError(f"{digest!r} is not an {self.algo!r} tensor digest")
        return sum_of(digest)

    def zero(self):
        """The StateDigest of no elements, of this key's definition."""
        from nemo_dcr.state.statedigest import StateDigest
        return StateDigest.zero(self.definition)

    def text(self, total) -> str:
        """The digest of a StateDigest ``total``, as written."""
        return self.prefix + total.hex()


def _sum_text(digest: str) -> str:
    """The state digest's text a summed tensor digest (``SUMMED``) holds, its prefix off."""
    algo = algo_of(digest)
    if algo not in SUMMED:
        raise ValueError(f"{digest!r} is not a summed tensor digest")
    return digest[len(_PREFIX[algo]):]


def sum_of(digest: str):
    """The StateDigest a summed tensor digest holds (of its algorithm's definition)."""
    from nemo_dcr.state.statedigest import StateDigest
    return StateDigest.from_hex(_sum_text(digest), DEFINITION[algo_of(digest)])


def sum_of_all(digests: Iterable[str], definition: int = 1):
    """The sum (a StateDigest of ``definition``) of summed tensor digests, in one pass
    (``StateDigest.sum_hex``). ``ValueError`` for a digest of another definition: a sum of
    digests of two definitions is just another number, which no later check could tell from a
    wrong state."""
    from nemo_dcr.state.statedigest import StateDigest
    texts = []
    for d in digests:
        algo = algo_of(d)
        if DEFINITION.get(algo) != definition:
            raise ValueError(f"{d!r} is not a summed tensor digest of definition {definition}")
        texts.append(d[len(_PREFIX[algo]):])
    return StateDigest.sum_hex(texts, definition)


class RunningDigest:
    """``tensor_digest`` of ``t`` fed front to back: ``advance(end)`` hashes the flat elements up
    to ``end`` (those must be final by then), ``hexdigest()`` the rest and returns the digest.
    ``apply`` hashes each range as soon as the chunks before it are written, on the calling
    thread while the workers apply the next chunks: the target check then overlaps the writes
    instead of being a second pass after them (same bytes hashed, same digest). ``threads``:
    BLAKE3's, for a large tensor (one by default: the workers keep the cores busy). ``place``:
    where ``t`` sits (``Place``), for an ``"sdn"`` digest."""

    def __init__(self, t: torch.Tensor, algo: str = "blake3", threads: int = 1, place: Place | None = None):
        self._h: _Hasher | None = None  # the hashers share no base class, only these two methods
        self._sum = None  # a summed digest's running sum (StateDigest)
        self._fa = FlatAccess(t)
        self._done = 0
        self._prefix = _PREFIX.get(algo, "")
        if algo in SUMMED:
            self._key = SumKey(algo, t.dtype, t.shape, place)
            self._sum = self._key.zero()
            return
        if algo == "blake3":
            big = t.numel() * t.element_size() >= THREADED_MIN
            self._h = blake3.blake3(max_threads=max(1, threads) if big else 1)
        elif algo == "sha256":
            self._h = hashlib.sha256()
        elif algo == "blake2b":
            self._h = hashlib.blake2b(digest_size=16)
        else:
            raise ValueError(f"unknown tensor digest algorithm {algo!r} (known: {', '.join(TENSOR_ALGOS)})")
        self._h.update(f"{dtype_name(t.dtype)}|{list(t.shape)}|".encode())

    def advance(self, end: int) -> None:
        end = min(end, self._fa.numel)
        for s in range(self._done, end, HASH_RANGE):
            bits = self._fa.read(s, min(s + HASH_RANGE, end))
            if self._sum is not None:
                self._sum = self._sum + self._key.range(bits, s)
            else:
                assert self._h is not None
                self._h.update(_bytes(bits))
        self._done = max(self._done, end)

    def hexdigest(self) -> str:
        self.advance(self._fa.numel)
        if self._sum is not None:
            return self._key.text(self._sum)
        assert self._h is not None
        return self._prefix + self._h.hexdigest()[:32]


class MovedSumDigest:
    """A tensor's summed digest moved from a known one (``start``: the digest of the bits it
    held before, checked) by the changes written since, reported from any thread: O(changes)
    where ``RunningDigest`` hashes every element again. ``advance`` and ``hexdigest`` as
    ``RunningDigest``'s, so ``apply`` checks a target either way."""

    def __init__(self, start: str, dtype: torch.dtype, shape, place: Place | None = None):
        from nemo_dcr.state.statedigest import RunningSum
        self._key = SumKey(algo_of(start), dtype, shape, place)
        self._sum = RunningSum(self._key.parse(start), definition=self._key.definition)

    def advance(self, end: int) -> None:
        pass  # nothing to hash: the changes came with ``change``

    def change(self, idx: torch.Tensor, old: torch.Tensor, new: torch.Tensor, gidx: torch.Tensor | None = None) -> None:
        """The elements at flat ``idx`` (canonical ``gidx``, where known) went from ``old`` to ``new`` bits."""
        self._sum.add_change(*self._key.at(idx.cpu(), None if gidx is None else gidx.cpu()), old.cpu(), new.cpu())

    def replace(self, start: int, old: torch.Tensor, new: torch.Tensor) -> None:
        """The flat elements from ``start`` went from ``old`` to ``new`` bits (a dense range)."""
        self._sum.add(self._key.range(new, start) - self._key.range(old, start))

    def hexdigest(self) -> str:
        return self._key.text(self._sum.total)


def algo_of(ref: str) -> str:
    """The algorithm a stored tensor digest was made with (no prefix: the earlier BLAKE2b).
    ``ValueError`` for a prefix this build does not know: such a digest cannot be checked, and
    guessing would report a wrong base where the delta is only newer than the reader."""
    for algo, prefix in _PREFIX.items():
        if prefix and ref.startswith(prefix):
            return algo
    if ":" not in ref:
        return "blake2b"
    raise ValueError(f"unknown tensor digest algorithm {ref.split(':', 1)[0]!r} in {ref!r} "
                     f"(this build checks {', '.join(TENSOR_ALGOS)})")


def tensor_digest(t: torch.Tensor, algo: str = "blake3", threads: int | None = None,
                  place: Place | None = None) -> str:
    """The digest of ``t`` in one pass; ``threads``: BLAKE3's (default ``THREADS``); ``place``:
    where ``t`` sits, for an ``"sdn"`` digest (``Place``). A CUDA
    tensor's BLAKE3 digest is computed on its device where triton is installed
    (``device/blake3.py``: 16 bytes cross, not the tensor)."""
    if algo in SUMMED:  # the state digest kernel, its ranges over the worker threads
        from nemo_dcr.state.statedigest import tensor_contrib
        key = SumKey(algo, t.dtype, t.shape, place)
        return key.text(tensor_contrib(key.name, t, key.spec, workers=threads, definition=key.definition))
    if algo == "blake3" and t.is_cuda:
        from nemo_dcr.device import kernels  # the optional device layer, above this one: only when asked
        if kernels.available():
            from nemo_dcr.device.blake3 import tensor_digest as on_device
            return on_device(t)
    return RunningDigest(t, algo, THREADS if threads is None else threads).hexdigest()


def tensor_digest_like(t: torch.Tensor, ref: str, place: Place | None = None) -> str:
    """``tensor_digest`` of ``t`` (at ``place``) in the algorithm ``ref`` was made with (to compare with it)."""
    return tensor_digest(t, algo_of(ref), place=place)


def values_digest(bits: torch.Tensor | np.ndarray, algo: str = "blake3") -> str:
    """64 bits (hex) of ``algo`` over the bytes of ``bits`` (a tensor, or a numpy array of an
    integer view); ``algo`` as the delta's format
    version says (``ChunkEntry.values_algo``). One chunk's values: hashed on the calling thread
    (the chunks of a tensor are on the worker threads already)."""
    if algo == "blake3":
        return blake3.blake3(_bytes(bits)).hexdigest(length=8)
    if algo == "blake2b":
        return hashlib.blake2b(_bytes(bits), digest_size=8).hexdigest()
    raise ValueError(f"unknown values digest algorithm {algo!r} (known: {', '.join(VALUES_ALGOS)})")


def state_digest(digests: Mapping[str, str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name].encode() + b"\n")
    return h.hexdigest()
