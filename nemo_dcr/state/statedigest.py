"""A digest of a whole model state that does not depend on how the state is sharded.

``digest(state) = sum over tensors n, over elements i of contrib(n, i, bits)  (mod p)``,
computed in ``LANES`` independent lanes modulo the prime ``P = 2**31 - 1``. Because it is a
plain sum over canonical elements:

* the partial digests of the shards of a state add up (per lane, mod ``P``) to the digest of
  the unsharded state, whatever the sharding: a trainer with 4 shards and a receiver with 1 or 2
  compute the same value (``allreduce_digest`` adds them across ranks);
* it updates from the changed elements alone: ``D_new = D_old - changes_contrib(old bits) +
  changes_contrib(new bits)``, in O(changes).

Per lane ``l``, for tensor ``n`` (its name, dtype name and global shape hashed with BLAKE2b
into per-tensor keys ``s1, s2, t_l, K_l, C_l``) and the element at canonical flat index ``i``
with raw bits ``x`` (its integer view, unsigned, split into 16-bit limbs ``x_0..x_{m-1}``,
``m <= 4``; one 8-bit limb for 1-byte types):

    u         = mix(mix(lo32(i) ^ s1) ^ s2 ^ hi32(i))      keyed 32-bit index permutation
    r_l(n, i) = clamp(mix(u ^ t_l) >> 1, 1, P - 1)          weight in [1, P)
    v_l(x)    = C_l + x_0 + x_1*K_l + x_2*K_l**2 + x_3*K_l**3           (mod P)
    contrib_l = r_l(n, i) * v_l(x)                                       (mod P)

where ``mix`` is a 32-bit xorshift-multiply avalanche (multipliers < 2**31). That is definition
1, what every manifest and header holds. Definition 2 (``definition=2`` on every function below;
no format version writes it yet) weighs element ``i`` by ``r_l(n, i >> 10) * g_l(i & 1023) mod P``,
its block's definition-1 weight times a fixed table's entry (``table2``): the mixes once a block
of 1024, one product per lane and limb an element, ~3x faster (docs/format.md, "Definition 2").

Two implementations compute it: ``_kernel`` below (torch ops; the reference, and the fallback
without a C compiler or with ``NEMO_DCR_NATIVE=0``) and ``dcr_sd_contrib`` in
csrc/dcr_classes.c (vectorised, 12-35x faster in bench/kernels.py, ranges spread over the
worker threads), which the tests hold to the reference bit for bit on every dtype.
``backend()`` says which runs.

All arithmetic is on non-negative int64 values that provably stay below 2**63 (products of a
value < 2**32 and a constant < 2**31; of a weight < 2**31 and a limb < 2**16 summed over at
most 2**15 terms); nothing relies on signed overflow. See docs/format.md, "State digest
(sharding-independent)", for what is and is not guaranteed. Not a cryptographic hash.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nemo_dcr.codec import native
from nemo_dcr.errors import DcrError
from nemo_dcr.state.dtypes import INT_VIEW, dtype_from_name, dtype_name, int_view, itemsize
from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.state.index_map import IndexMap, ShardSpec
from nemo_dcr.util.parallel import in_jobs, ordered_map

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

P = (1 << 31) - 1  # Mersenne prime modulus of every lane
LANES = 4
CHUNK = 1 << 20  # elements processed per step (bounds scratch memory)
_BLOCK = 1 << 15  # terms < 2**47 summed before a reduction: 2**15 * 2**47 = 2**62
#: changes up to which ``change_contrib``'s C call keeps the GIL (``native.held``; ~50 us here):
#: one chunk's changes at ~1 % of a 4M-element chunk, summed on an apply's worker
HELD_CHANGES = 1 << 15
_E_RANGE = -8  # dcr_sd_change_in: an index outside the tensor
_M32 = 0xFFFFFFFF
# odd multipliers < 2**31, so (h < 2**32) * F < 2**63
_F1 = 0x7FEB352D
_F2 = 0x31848BAB
_PERSON = b"nemo-dcr-sd-v1"
#: tensors whose keys are kept (``_keys``, ``_native_keys``): ~2.4 KB each, so ~150 MB at most. A
#: diff or apply asks for a tensor's keys once per chunk, and its tensor digests' keys once more:
#: a model of more tensors than the cache holds (4096 before: a mixture of experts, a trainer
#: rank's shards of one) missed on every call, ~90 us of BLAKE2b and modular powers each
KEYS_CACHED = 1 << 16
_HEX_WIDTH = 8  # hex digits per lane (P < 16**8)
#: the definitions of an element's weight (docs/format.md, "State digest"): 1 mixes every
#: element's index; 2 mixes each block of ``BLOCK2`` indices' number once and multiplies its
#: weight by a fixed table's entry for the element's place in the block (``table2``)
DEFINITIONS = (1, 2)
BLOCK2 = 1 << 10
_G0 = 0x9E3779B9  # definition 2's table: g_l(j) = weight(mix(j ^ _G0), _GT[l])
_GT = (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1)


# ----------------------------------------------------------------------------- value object

@dataclass(frozen=True)
class StateDigest:
    """A state digest: ``LANES`` integers in [0, P), and the definition of the weights they were
    summed with (``DEFINITIONS``). Add/subtract partial digests of one definition freely; two of
    different definitions are refused (their sum means nothing, and would not be caught later:
    it is just another number). The text form (``hex``) does not say the definition: what holds
    the text (its format version) does."""

    lanes: tuple
    definition: int = 1

    def __post_init__(self):
        lanes = tuple(int(v) for v in self.lanes)
        if len(lanes) != LANES or any(not 0 <= v < P for v in lanes):
            raise DcrError(f"invalid state digest lanes {self.lanes!r}")
        checked_definition(self.definition)
        object.__setattr__(self, "lanes", lanes)

    @classmethod
    def zero(cls, definition: int = 1) -> StateDigest:
        return cls((0,) * LANES, definition)

    @classmethod
    def _of(cls, lanes: tuple, definition: int = 1) -> StateDigest:
        """Lanes known to be LANES Python ints in [0, P) (reduced here, or the C kernel's output),
        unchecked: the follower sums one of these per applied chunk."""
        d = object.__new__(cls)
        object.__setattr__(d, "lanes", lanes)
        object.__setattr__(d, "definition", definition)
        return d

    def _mixed(self, other: StateDigest) -> DcrError:
        return DcrError(f"a state digest of definition {self.definition} and one of definition "
                        f"{other.definition} cannot be added or subtracted")

    def __add__(self, other: StateDigest) -> StateDigest:
        if not isinstance(other, StateDigest):
            return NotImplemented
        if other.definition != self.definition:  # (inline: a follower adds one of these a chunk)
            raise self._mixed(other)
        return StateDigest._of(tuple([(a + b) % P for a, b in zip(self.lanes, other.lanes)]), self.definition)

    def __sub__(self, other: StateDigest) -> StateDigest:
        if not isinstance(other, StateDigest):
            return NotImplemented
        if other.definition != self.definition:
            raise self._mixed(other)
        return StateDigest._of(tuple([(a - b) % P for a, b in zip(self.lanes, other.lanes)]), self.definition)

    def __neg__(self) -> StateDigest:
        return StateDigest(tuple((-a) % P for a in self.lanes), self.definition)

    def hex(self) -> str:
        """Fixed-width lowercase hex: 8 digits per lane, lane 0 first (32 characters)."""
        return "".join(f"{v:0{_HEX_WIDTH}x}" for v in self.lanes)

    @classmethod
    def from_hex(cls, s: str, definition: int = 1) -> StateDigest:
        if not isinstance(s, str) or len(s) != _HEX_WIDTH * LANES:
            raise DcrError(f"state digest must be {_HEX_WIDTH * LANES} hex digits, got {s!r}")
        try:
            lanes = tuple(int(s[k:k + _HEX_WIDTH], 16) for k in range(0, len(s), _HEX_WIDTH))
        except ValueError:
            raise DcrError(f"state digest is not hex: {s!r}") from None
        return cls(lanes, definition)

    @classmethod
    def sum_hex(cls, texts: Iterable[str], definition: int = 1) -> StateDigest:
        """The sum of digests in their text form (``from_hex`` of each, added) in one numpy pass:
        a version-4 publisher's state digest is the sum of its tensors' digests, thousands of
        them, and one ``from_hex`` and ``+`` each took ~5 us (20 ms for 4096 tensors)."""
        texts = list(texts)
        width = _HEX_WIDTH * LANES
        bad = next((s for s in texts if not isinstance(s, str) or len(s) != width), None)
        if bad is not None:
            raise DcrError(f"state digest must be {width} hex digits, got {bad!r}")
        try:
            raw = bytes.fromhex("".join(texts))
        except ValueError:
            raise DcrError("state digest is not hex") from None
        lanes = np.frombuffer(raw, dtype=">u4").reshape(-1, LANES)  # 8 hex digits a lane, lane 0 first
        if bool((lanes >= P).any()):
            raise DcrError("invalid state digest lanes (not below P)")
        total = lanes.astype(np.uint64).sum(axis=0)  # < 2**31 * 2**32 terms: no overflow
        return cls(tuple(int(v) % P for v in total), definition)

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"StateDigest({self.hex()!r})" if self.definition == 1 else \
            f"StateDigest({self.hex()!r}, definition={self.definition})"


# ----------------------------------------------------------------------------- per-tensor keys

@dataclass(frozen=True)
class _Keys:
    s1: int  # 32-bit keys of the shared index permutation
    s2: int
    t: tuple  # per lane, 32-bit key of the lane's weight mix
    kpow: tuple  # per lane: (1, K, K**2, K**3) mod P, K in [2, P) distinct across lanes
    c: tuple  # per lane offset in [1, P): an all-zero tensor still contributes
    hi: bool  # some canonical index is >= 2**32
    definition: int = 1  # the weights' definition (DEFINITIONS): the C kernels' last argument


_NATIVE_RANGE = 1 << 23  # elements per native call: the unit spread over the worker threads
#: elements per job of many small ranges summed in one call (``many_contrib``): 1M, so that two
#: workers share a keyframe of small tensors' sums evenly, each job ~2 ms of C
MANY_JOB = 1 << 20
#: elements of a shard's runs (``IndexMap.rows``) from which its ranges are summed run by run: below
#: it an index per element costs less than the kernel's set-up for each run (docs/results.md,
#: twenty-eighth turn)
RUN_MIN = 4


def one_range(numel: int) -> bool:
    """Whether a tensor of ``numel`` elements is summed in one range: on one thread, whatever
    the workers (its digest may then as well run beside other work)."""
    return numel <= _NATIVE_RANGE


def checked_definition(definition) -> int:
    """``definition`` if it is one of ``DEFINITIONS``; ``DcrError`` otherwise."""
    if type(definition) is not int or definition not in DEFINITIONS:
        raise DcrError(f"state digest definition {definition!r} is not supported "
                       f"(this build knows {', '.join(map(str, DEFINITIONS))})")
    return definition


def _keys(name: str, dtype: str, global_shape: tuple, definition: int = 1) -> _Keys:
    """The keys of tensor ``name`` (its dtype name, global shape) under ``definition``: the same
    for both definitions, which differ in how an index's weight is made from them."""
    keys = _keys1(name, dtype, global_shape)
    return keys if definition == 1 and type(definition) is int else _keys2(keys, checked_definition(definition))


@functools.lru_cache(maxsize=KEYS_CACHED)
def _keys2(keys: _Keys, definition: int) -> _Keys:
    return dataclasses.replace(keys, definition=definition)


@functools.lru_cache(maxsize=KEYS_CACHED)
def _keys1(name: str, dtype: str, global_shape: tuple) -> _Keys:
    ident = json.dumps([name, dtype, list(global_shape)]).encode()
    counter = 0
    while True:
        d = hashlib.blake2b(ident + counter.to_bytes(4, "little"), digest_size=64, person=_PERSON).digest()
        words = [int.from_bytes(d[k:k + 4], "little") for k in range(0, 64, 4)]
        t = words[2:2 + LANES]
        ks = [2 + w % (P - 2) for w in words[2 + LANES:2 + 2 * LANES]]
        cs = [1 + w % (P - 1) for w in words[2 + 2 * LANES:2 + 3 * LANES]]
        if len(set(ks)) == LANES:  # distinct K per lane: the single-change guarantee needs it
            break
        counter += 1
    kpow = tuple(tuple(pow(k, j, P) for j in range(4)) for k in ks)
    return _Keys(words[0], words[1], tuple(t), kpow, tuple(cs), math.prod(global_shape) > (1 << 32))


# ----------------------------------------------------------------------------- kernel

def _fmix(h: torch.Tensor) -> torch.Tensor:
    """In-place 32-bit avalanche mix of values in [0, 2**32); every product < 2**63."""
    h.bitwise_xor_(h >> 16)
    h.mul_(_F1).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 15)
    h.mul_(_F2).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 16)
    return h


def _limbs(bits: torch.Tensor):
    """Unsigned 16-bit limbs (8-bit for 1-byte types) of integer-view bits, as int64."""
    w = bits.element_size()
    x = bits.to(torch.int64)  # sign-extends int16/int32; masks below recover the raw bits
    if w == 1:
        return [x.bitwise_and_(0xFF)]
    return [(x >> (16 * j)).bitwise_and_(0xFFFF) for j in range(w // 2)]


def _blocksum(x: torch.Tensor) -> int:
    """sum(x) mod P for int64 x with 0 <= x < 2**47, never holding a partial sum >= 2**62."""
    n = x.numel()
    k = n - n % _BLOCK
    s = 0
    if k:
        s = int(x[:k].view(-1, _BLOCK).sum(1).remainder_(P).sum())
    if k < n:
        s += int(x[k:].sum())
    return s % P


def _kernel(keys: _Keys, gidx: torch.Tensor, bits: torch.Tensor) -> list:
    """Per-lane sum of contributions (mod P) of elements at canonical ``gidx`` with ``bits``.

    ``gidx``: 1-D int64, at most ``CHUNK`` long; ``bits``: 1-D integer view of the same length.
    """
    n = gidx.numel()
    assert n <= CHUNK and bits.numel() == n
    if n == 0:
        return [0] * LANES
    limbs = _limbs(bits)
    blocked = keys.definition == 2
    at = gidx >> 10 if blocked else gidx  # definition 2 weighs the block's number (BLOCK2 = 2**10)
    # keyed 32-bit permutation of the index (a bijection while i < 2**32), shared by the lanes
    base = _fmix(at.bitwise_and(_M32).bitwise_xor_(keys.s1))
    base.bitwise_xor_(keys.s2)
    if keys.hi:
        base.bitwise_xor_(at >> 32)
    _fmix(base)
    out = []
    for lane in range(LANES):
        h = _fmix(base.bitwise_xor(keys.t[lane]))
        r = h.bitwise_right_shift_(1).clamp_(1, P - 1)  # weight in [1, P), never 0
        if blocked:  # times the table's entry for the place in the block: < 2**62, in [1, P) again
            r = r.mul_(_table2_on(gidx.device)[lane][gidx & (BLOCK2 - 1)]).remainder_(P)
        kp = keys.kpow[lane]
        acc = keys.c[lane] * (int(r.sum()) % P)  # r.sum() < 2**31 * 2**20
        for j, limb in enumerate(limbs):
            acc += kp[j] * _blocksum(r * limb)  # r * limb < 2**47
        out.append(acc % P)
    return out


@functools.lru_cache(maxsize=1)
def _table2() -> torch.Tensor:
    """Definition 2's table, ``LANES`` rows of ``BLOCK2`` weights in [1, P) (int64), the same for
    every tensor: ``g_l(j) = clamp(mix(mix(j ^ G0) ^ GT_l) >> 1, 1, P - 1)``."""
    u = _fmix(torch.arange(BLOCK2, dtype=torch.int64).bitwise_xor_(_G0))
    return torch.stack([_fmix(u.bitwise_xor(t)).bitwise_right_shift_(1).clamp_(1, P - 1) for t in _GT])


@functools.lru_cache(maxsize=8)
def _table2_on(device: torch.device) -> torch.Tensor:
    """``_table2`` where the reference sums (a GPU's copy made once, not once a chunk)."""
    return _table2().to(device)


def table2() -> np.ndarray:
    """Definition 2's table as the C kernels hold it (the reference's where there is none)."""
    lib = native.lib()
    if lib is None:
        return _table2().numpy().astype(np.uint32)
    out = np.zeros((LANES, BLOCK2), dtype=np.uint32)
    lib.dcr_sdb_table(out.ctypes.data)
    return out


@functools.lru_cache(maxsize=KEYS_CACHED)
def _native_keys(keys: _Keys):
    """The keys as the C arrays ``dcr_sd_contrib`` takes (kept alive by the cache)."""
    t = (ctypes.c_uint32 * LANES)(*keys.t)
    kp = (ctypes.c_uint64 * (4 * LANES))(*[v for lane in keys.kpow for v in lane])
    c = (ctypes.c_uint64 * LANES)(*keys.c)
    return t, kp, c


def _native_kernel(lib, keys: _Keys, bits: torch.Tensor, start: int = 0, gidx: torch.Tensor | None = None) -> list:
    """``_kernel`` in C: ``bits`` contiguous; canonical indices ``gidx`` (int64, contiguous) or,
    when None, ``start + k`` for element ``k``. Any length (the C loop reduces in blocks)."""
    t, kp, c = _native_keys(keys)
    out = (ctypes.c_uint64 * LANES)()
    rc = lib.dcr_sd_contrib(bits.data_ptr(), bits.element_size(), gidx.data_ptr() if gidx is not None else None,
                            start, bits.numel(), keys.s1, keys.s2, t, kp, c, out, keys.definition)
    if rc != 0:
        raise DcrError(f"state digest kernel failed ({rc})")
    return list(out)


def backend() -> str:
    """``"native"`` (the C kernel) or ``"reference"`` (torch ops): what computes the digest here."""
    return "native" if native.lib() is not None else "reference"


def _add(acc: list, lanes: list) -> list:
    return [(a + b) % P for a, b in zip(acc, lanes)]


def _as_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    if bits.element_size() != width:
        raise DcrError(f"bits have {bits.element_size()}-byte elements, dtype needs {width}")
    if bits.dtype != INT_VIEW[width]:
        bits = bits.view(INT_VIEW[width])
    return bits


# ----------------------------------------------------------------------------- public API

def tensor_contrib(name: str, tensor: torch.Tensor, spec: ShardSpec | None = None, *,
                   workers: int | None = None, definition: int = 1) -> StateDigest:
    """Partial state digest of a local tensor, or of a shard of tensor ``name`` placed by ``spec``.

    ``spec`` None means the whole tensor. Any strides are fine; memory beyond the tensor is
    O(CHUNK) (O(workers * 8M elements) with the C kernel, whose ranges run on ``workers``
    threads). Summing this over a set of shards that covers every canonical element exactly once
    gives the digest of the whole tensor. ``definition``: of the weights (``DEFINITIONS``).
    """
    return _sum_pieces([_pieces(name, tensor, spec, definition)], workers, definition)


def state_contrib(tensors: Mapping[str, torch.Tensor],
                  shards: Mapping[str, ShardSpec] | None = None, *, workers: int | None = None,
                  definition: int = 1) -> StateDigest:
    """Sum of ``tensor_contrib`` over ``tensors``; ``shards`` maps names to their ShardSpec
    (a name missing from it is a whole tensor). Every tensor is checked before any is read, and
    the ranges of all of them share the ``workers`` threads: a model's tensors are mostly under
    one range (8M elements), and summed one tensor after another they ran on one thread."""
    shards = shards or {}
    checked_definition(definition)
    runs, pieces = [], []
    for name, t in tensors.items():
        run = _one_run(name, t, shards.get(name))
        if run is not None:
            runs.append(run)
        else:
            pieces.append(_pieces(name, t, shards.get(name), definition))
    return _sum_pieces(pieces, workers, definition) + _sum_runs(runs, workers, definition)


def _run_start(imap: IndexMap) -> int | None:
    """The canonical index of a region's first element where the region is one run of its
    tensor (the whole tensor: 0; a row shard: its offset), else None (a run a row, or less)."""
    return 0 if imap.identity else imap.run_offset


def _checked_shard(name: str, tensor: torch.Tensor, spec: ShardSpec | None) -> ShardSpec:
    """``tensor``'s shard (None: the whole tensor), checked with its dtype before any is read."""
    dtype_name(tensor.dtype)  # a dtype the digest does not know: refused here
    spec = ShardSpec.full(tensor.shape) if spec is None else spec
    spec.validate()
    if tuple(spec.shape) != tuple(tensor.shape):
        raise DcrError(f"{name}: tensor shape {tuple(tensor.shape)} != shard shape {spec.shape}")
    return spec


def _one_run(name: str, tensor: torch.Tensor, spec: ShardSpec | None) -> tuple | None:
    """``many_contrib``'s range for a tensor summed whole in one call (contiguous, on the host,
    at most one native range, one run of the canonical tensor: a whole tensor, a row shard), its
    shard checked first; None for the others (``_pieces``)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() > _NATIVE_RANGE \
            or native.lib() is None:
        return None
    spec = _checked_shard(name, tensor, spec)
    imap = IndexMap(spec)
    offset = _run_start(imap)
    if offset is None:
        return None
    return name, tensor.dtype, tuple(spec.global_shape), int_view(tensor).reshape(-1), offset


def _sum_runs(runs: list, workers: int | None, definition: int) -> StateDigest:
    """The sum of ``many_contrib``'s ranges ``runs``, in jobs of up to ``MANY_JOB`` elements, each
    prepared on the calling thread and summed in one C call on the workers: the workers summing a
    small tensor each at a time took the GIL from each other at every tensor (a state of 4096
    tensors of 32K BF16: 265 ms, twice one tensor of the same elements)."""
    acc = [0] * LANES
    jobs = (many_contrib(job, definition=definition) for job in in_jobs(runs, lambda r: r[3].numel(), MANY_JOB))
    for digests in ordered_map(lambda run: run(), jobs, workers):
        for d in digests:
            acc = _add(acc, d.lanes)
    return StateDigest(tuple(acc), definition)


def _pieces(name: str, tensor: torch.Tensor, spec: ShardSpec | None, definition: int):
    """-> (the function summing one range of ``tensor``'s elements, the ranges' starts, whether
    they run on the worker threads), the tensor and its shard checked first. The C kernel's
    ranges are ``_NATIVE_RANGE`` elements, spread over the threads; the torch reference's are
    ``CHUNK`` elements, on the calling thread (torch's own ops use the cores)."""
    spec = _checked_shard(name, tensor, spec)
    keys = _keys(name, dtype_name(tensor.dtype), tuple(spec.global_shape), definition)
    imap = IndexMap(spec)
    fa = FlatAccess(tensor)
    lib = native.lib() if tensor.device.type == "cpu" else None
    if lib is not None:
        # a shard that is one run of the canonical tensor (or the whole of it) needs no index
        # array: the kernel counts the canonical index itself
        run = _run_start(imap)
        if run is None:
            _, gstart, length = imap.rows()
            if length >= RUN_MIN:
                return _run_pieces(lib, keys, fa, gstart, length)

        def part(s):
            e = min(s + _NATIVE_RANGE, fa.numel)
            bits = fa.read(s, e).contiguous()
            if run is not None:
                return _native_kernel(lib, keys, bits, start=run + s)
            gidx = imap.to_global(torch.arange(s, e, dtype=torch.int64)).contiguous()
            return _native_kernel(lib, keys, bits, gidx=gidx)

        return part, range(0, fa.numel, _NATIVE_RANGE), True

    def ref(s):
        e = min(s + CHUNK, fa.numel)
        gidx = imap.to_global(torch.arange(s, e, dtype=torch.int64, device=tensor.device))
        return _kernel(keys, gidx, fa.read(s, e))

    return ref, range(0, fa.numel, CHUNK), False


def _run_pieces(lib, keys: _Keys, fa: FlatAccess, gstart: torch.Tensor, length: int):
    """``_pieces``' answer for a shard held as runs of ``length`` elements, consecutive in its
    local order, run ``r`` at the canonical indices from ``gstart[r]`` (``IndexMap.rows``: a
    column shard holds one per row): ranges of whole runs, each summed by one
    ``dcr_sd_contrib_runs`` call with the counting kernel. An index per element, made with torch
    and read back by the kernel, took ~10x as long (a TP=2 receiver's full digest of its column
    shards: docs/results.md, twenty-eighth turn)."""
    per = max(1, _NATIVE_RANGE // length) * length  # elements of a range: whole runs
    gstart = gstart.contiguous()
    t, kp, c = _native_keys(keys)

    def part(s):
        e = min(s + per, fa.numel)
        bits = fa.read(s, e).contiguous()
        out = (ctypes.c_uint64 * LANES)()
        rc = lib.dcr_sd_contrib_runs(bits.data_ptr(), bits.element_size(), gstart[s // length:].data_ptr(),
                                     (e - s) // length, length, keys.s1, keys.s2, t, kp, c, out, keys.definition)
        if rc != 0:
            raise DcrError(f"state digest kernel failed ({rc})")
        return list(out)

    return part, range(0, fa.numel, per), True


def _sum_pieces(pieces: list, workers: int | None, definition: int) -> StateDigest:
    """The sum of every range of ``pieces`` (``_pieces``' answers), in any order (a sum mod P)."""
    acc = [0] * LANES
    for fn, starts, threaded in pieces:
        if not threaded:
            for s in starts:
                acc = _add(acc, fn(s))
    for lanes in ordered_map(_sum_batch, _batches(pieces), workers):
        acc = _add(acc, lanes)
    return StateDigest(tuple(acc), definition)


def _batches(pieces: list):
    """The threaded ranges of ``pieces`` in jobs of up to ``_NATIVE_RANGE`` elements: a small
    tensor's range joins its neighbours'. One job per range made a model of 4096 tensors of 32K
    elements 4096 jobs of ~50 us each, and the pool's hand-offs cost more than that."""
    ranges = ((fn, s, min(s + starts.step, starts.stop) - s) for fn, starts, threaded in pieces if threaded
              for s in starts)
    for job in in_jobs(ranges, lambda r: r[2], _NATIVE_RANGE):
        yield [(fn, s) for fn, s, _ in job]


def _sum_batch(batch: list) -> list:
    acc = [0] * LANES
    for fn, s in batch:
        acc = _add(acc, fn(s))
    return acc


def range_contrib(name: str, dtype: torch.dtype | str, global_shape: Sequence[int], bits: torch.Tensor,
                  start: int = 0, *, definition: int = 1) -> StateDigest:
    """Contribution of the elements of tensor ``name`` at the canonical flat indices ``start``,
    ``start + 1``, ... holding ``bits`` (one run: no index array is made or read)."""
    dt = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    shape = tuple(int(s) for s in global_shape)
    b = _as_bits(bits.reshape(-1), itemsize(dt))
    if start < 0 or start + b.numel() > math.prod(shape):
        raise DcrError(f"{name}: elements {start}..{start + b.numel()} out of range for shape {list(shape)}")
    keys = _keys(name, dtype_name(dt), shape, definition)
    lib = native.lib() if b.device.type == "cpu" else None
    if lib is not None:
        return StateDigest(tuple(_native_kernel(lib, keys, b.contiguous(), start=start)), definition)
    acc = [0] * LANES
    for s in range(0, b.numel(), CHUNK):
        e = min(s + CHUNK, b.numel())
        acc = _add(acc, _kernel(keys, torch.arange(start + s, start + e, dtype=torch.int64, device=b.device),
                                b[s:e]))
    return StateDigest(tuple(acc), definition)


def many_contrib(ranges: Sequence[tuple[str, torch.dtype | str, Sequence[int], torch.Tensor, int]], *,
                 definition: int = 1) -> Callable[[], list[StateDigest]]:
    """``range_contrib(name, dtype, global_shape, bits, start)`` of each range, prepared now
    (keys, checks, pointers) and summed when the returned function is called: with the C kernel
    in one call for them all (``dcr_sd_contrib_many``), so that a worker summing many small
    tensors gives the GIL up once, not once a tensor to a thread encoding or writing them
    (``delta/diff.py``'s ``_digests_ahead``, ``WrittenDigest.total``)."""
    lib = native.lib()
    checked_definition(definition)
    prepared = []
    for name, dtype, global_shape, bits, start in ranges:
        dt = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
        shape = tuple(int(x) for x in global_shape)
        b = _as_bits(bits.reshape(-1), itemsize(dt))
        if start < 0 or start + b.numel() > math.prod(shape):
            raise DcrError(f"{name}: elements {start}..{start + b.numel()} out of range for shape {list(shape)}")
        prepared.append((name, dt, shape, b, start))
    if lib is None or any(p[3].device.type != "cpu" for p in prepared):
        return lambda: [range_contrib(*p, definition=definition) for p in prepared]
    prepared = [(name, dt, shape, b.contiguous(), start) for name, dt, shape, b, start in prepared]
    n = len(prepared)
    keys = [_keys(name, dtype_name(dt), shape, definition) for name, dt, shape, _, _ in prepared]
    defn = keys[0].definition if keys else definition  # (what the keys are of: every C call takes that)
    args: list[np.ndarray] = [
        np.array([p[3].data_ptr() for p in prepared], dtype=np.uint64),
        np.array([p[3].element_size() for p in prepared], dtype=np.int32),
        np.array([p[3].numel() for p in prepared], dtype=np.int64),
        np.array([p[4] for p in prepared], dtype=np.int64),
        np.array([k.s1 for k in keys], dtype=np.uint32),
        np.array([k.s2 for k in keys], dtype=np.uint32),
        np.array([k.t for k in keys], dtype=np.uint32).reshape(-1),
        np.array([v for k in keys for lane in k.kpow for v in lane], dtype=np.uint64),
        np.array([k.c for k in keys], dtype=np.uint64).reshape(-1)]

    def run() -> list[StateDigest]:
        out = np.zeros(LANES * n, dtype=np.uint64)
        rc = lib.dcr_sd_contrib_many(n, *(a.ctypes.data for a in args), out.ctypes.data, defn)
        if rc != 0:
            raise DcrError(f"state digest kernel failed ({rc})")
        _ = prepared  # the tensors stay alive until the kernel has read them
        return [StateDigest(tuple(int(v) for v in out[LANES * i:LANES * (i + 1)]), definition) for i in range(n)]

    return run


def region_contrib(name: str, dtype: torch.dtype | str, imap: IndexMap, bits: torch.Tensor,
                   start: int = 0, *, definition: int = 1) -> StateDigest:
    """Contribution of the elements ``start``, ``start + 1``, ... in the own flat order of a
    region of tensor ``name`` placed by ``imap`` (a shard's map), holding ``bits``: one call of
    ``range_contrib`` where the region is one run of the canonical tensor (the whole tensor, a
    row shard); else run by run (a column shard: a run a row), the whole runs in one
    ``dcr_sd_contrib_runs`` call and a run cut by ``start`` or the end alone; an index per
    element only without the C kernel or where runs are shorter than ``RUN_MIN``. What a
    writer sums a chunk of a region with, where its elements sit in the state."""
    gshape = tuple(imap.spec.global_shape)
    offset = _run_start(imap)
    if offset is not None:
        return range_contrib(name, dtype, gshape, bits, start + offset, definition=definition)
    dt = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    b = _as_bits(bits.reshape(-1), itemsize(dt))
    end = start + b.numel()
    if start < 0 or end > imap.numel:
        raise DcrError(f"{name}: elements {start}..{end} out of range for its region of {imap.numel}")
    if end == start:
        return StateDigest.zero(definition)
    length = imap.run_length
    lib = native.lib() if b.device.type == "cpu" else None
    if lib is None or length < RUN_MIN:
        gidx = imap.to_global(torch.arange(start, end, dtype=torch.int64, device=b.device))
        return changes_contrib(name, dt, gshape, gidx, b, definition=definition)
    r0, r1 = start // length, -(-end // length)  # the runs the elements touch
    gst = imap.to_global(torch.arange(r0, r1, dtype=torch.int64) * length).contiguous()
    acc = StateDigest.zero(definition)
    lo = min(end, (r0 + 1) * length) if start % length else start  # the first whole run's start
    if lo > start:
        acc = acc + range_contrib(name, dt, gshape, b[:lo - start], int(gst[0]) + start % length,
                                  definition=definition)
    hi = max(lo, end - end % length)  # the whole runs' end
    if hi > lo:
        keys = _keys(name, dtype_name(dt), gshape, definition)
        t, kp, c = _native_keys(keys)
        runs = b[lo - start:hi - start].contiguous()
        out = (ctypes.c_uint64 * LANES)()
        rc = lib.dcr_sd_contrib_runs(runs.data_ptr(), runs.element_size(), gst[lo // length - r0:].data_ptr(),
                                     (hi - lo) // length, length, keys.s1, keys.s2, t, kp, c, out, keys.definition)
        if rc != 0:
            raise DcrError(f"state digest kernel failed ({rc})")
        acc = acc + StateDigest._of(tuple(out), definition)
    if end > hi:
        acc = acc + range_contrib(name, dt, gshape, b[hi - start:], int(gst[hi // length - r0]),
                                  definition=definition)
    return acc


def _out_of_range(idx: torch.Tensor, numel: int) -> bool:
    """Whether an index of ``idx`` (int64, 1-D, not empty) is outside [0, numel)."""
    h = native.held() if idx.device.type == "cpu" and idx.is_contiguous() else None
    if h is not None:
        # in C, keeping the GIL: aminmax and its two values each gave it up, three waits a chunk
        # on the apply's workers (docs/results.md, eighteenth turn)
        lo, hi = ctypes.c_int64(), ctypes.c_int64()
        if h.dcr_i64_range(idx.data_ptr(), idx.numel(), ctypes.byref(lo), ctypes.byref(hi)) == 0:
            return lo.value < 0 or hi.value >= numel
    lo_t, hi_t = torch.aminmax(idx)  # one pass, where min() and max() were two
    return int(lo_t) < 0 or int(hi_t) >= numel


def _checked(name: str, dtype: torch.dtype | str, global_shape: Sequence[int], global_idx: torch.Tensor,
             *bits: torch.Tensor, definition: int = 1) -> tuple:
    """-> (keys, int64 indices, integer-view bits...) of ``changes_contrib``'s arguments, checked."""
    dt = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    dname = dtype_name(dt)
    shape = tuple(int(s) for s in global_shape)
    numel = math.prod(shape)
    # (reshape, view and to only where they change something: each is a torch call that gives
    # the GIL up, and this runs once per chunk on the apply's workers)
    idx = global_idx if global_idx.dim() == 1 else global_idx.reshape(-1)
    if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise DcrError(f"{name}: global indices must be an integer tensor, got {idx.dtype}")
    if idx.dtype != torch.int64:
        idx = idx.to(torch.int64)
    out = []
    for b in bits:
        b = _as_bits(b if b.dim() == 1 else b.reshape(-1), itemsize(dt))
        if b.numel() != idx.numel():
            raise DcrError(f"{name}: {idx.numel()} indices but {b.numel()} values")
        out.append(b)
    if idx.numel() and _out_of_range(idx, numel):
        raise DcrError(f"{name}: global index out of range for shape {list(shape)}")
    return (_keys(name, dname, shape, definition), idx, *out)


def changes_contrib(name: str, dtype: torch.dtype | str, global_shape: Sequence[int],
                    global_idx: torch.Tensor, bits: torch.Tensor, *, definition: int = 1) -> StateDigest:
    """Contribution of the elements of tensor ``name`` at canonical flat ``global_idx`` holding
    ``bits`` (a tensor of ``dtype`` or of its integer view). Indices must be distinct.

    Update a digest after a sparse change with
    ``D + changes_contrib(..., idx, new_bits) - changes_contrib(..., idx, old_bits)``
    (``change_contrib`` computes that difference in one pass).
    """
    keys, idx, b = _checked(name, dtype, global_shape, global_idx, bits, definition=definition)
    acc = [0] * LANES
    lib = native.lib() if b.device.type == "cpu" and idx.device.type == "cpu" else None
    if lib is not None:
        return StateDigest(tuple(_native_kernel(lib, keys, b.contiguous(), gidx=idx.contiguous())), definition)
    for s in range(0, idx.numel(), CHUNK):
        acc = _add(acc, _kernel(keys, idx[s:s + CHUNK], b[s:s + CHUNK]))
    return StateDigest(tuple(acc), definition)


def change_contrib(name: str, dtype: torch.dtype | str, global_shape: Sequence[int], global_idx: torch.Tensor,
                   old: torch.Tensor, new: torch.Tensor, *, definition: int = 1) -> StateDigest:
    """How the digest moves when the elements at ``global_idx`` go from ``old`` to ``new`` bits:
    ``changes_contrib(..., new) - changes_contrib(..., old)``, which it equals exactly. The C
    kernel (``dcr_sd_change``) weighs each index once for both sides: the index weights are most
    of a contribution's cost, so a change costs about half of the two calls."""
    fast = _change_fast(name, dtype, global_shape, global_idx, old, new, definition)
    return fast if fast is not None else _change_general(name, dtype, global_shape, global_idx, old, new, definition)


def _change_general(name, dtype, global_shape, global_idx, old, new, definition: int = 1) -> StateDigest:
    """``change_contrib`` for what ``_fast_args`` does not take: any shape, device and index type."""
    keys, idx, o, n = _checked(name, dtype, global_shape, global_idx, old, new, definition=definition)
    lib = native.lib() if n.device.type == o.device.type == idx.device.type == "cpu" else None
    if lib is None:  # the reference: the two sides' contributions
        return (changes_contrib(name, dtype, global_shape, idx, n, definition=definition)
                - changes_contrib(name, dtype, global_shape, idx, o, definition=definition))
    if not idx.numel():
        return StateDigest.zero(definition)
    t, kp, _ = _native_keys(keys)
    out = (ctypes.c_uint64 * LANES)()
    n, o, idx = n.contiguous(), o.contiguous(), idx.contiguous()
    if idx.numel() <= HELD_CHANGES:
        lib = native.held() or lib
    rc = lib.dcr_sd_change(n.data_ptr(), o.data_ptr(), n.element_size(), idx.data_ptr(), 0, n.numel(),
                           keys.s1, keys.s2, t, kp, out, keys.definition)
    if rc != 0:
        raise DcrError(f"state digest kernel failed ({rc})")
    return StateDigest._of(tuple(out), definition)  # the kernel's lanes are in [0, P)


@functools.lru_cache(maxsize=KEYS_CACHED)
def _prepared(name: str, dtype: torch.dtype | str, global_shape: tuple, definition: int) -> tuple:
    """-> (keys, their C arrays, numel, element width) of one tensor: what ``_checked`` and
    ``_native_keys`` work out from the arguments, kept for the next chunk of the same tensor."""
    dt = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    shape = tuple(int(s) for s in global_shape)
    keys = _keys(name, dtype_name(dt), shape, definition)
    t, kp, _ = _native_keys(keys)
    return keys, t, kp, math.prod(shape), itemsize(dt)


def _fast_args(name, dtype, global_shape, idx, old, new, definition: int = 1) -> tuple | None:
    """(the GIL-keeping library, ``dcr_sd_change_in``'s arguments but the last) for a chunk's
    changes as diff and apply report them (1-D contiguous host tensors, int64 indices, at most
    ``HELD_CHANGES``), with ``change_contrib``'s checks in fewer calls; None for anything else
    (the general path). A model of many small tensors makes a call or two per tensor, and
    ``_checked``'s conversions were half of one (docs/results.md, twenty-third turn)."""
    k = idx.numel()
    if not (0 < k <= HELD_CHANGES and type(global_shape) in (tuple, torch.Size) and idx.dtype == torch.int64
            and idx.dim() == old.dim() == new.dim() == 1 and old.numel() == k and new.numel() == k
            and idx.is_cpu and old.is_cpu and new.is_cpu  # (.device makes an object: 4x the time)
            and idx.is_contiguous() and old.is_contiguous() and new.is_contiguous()):
        return None
    h = native.held()
    if h is None:
        return None
    keys, t, kp, numel, w = _prepared(name, dtype, global_shape, definition)
    if old.element_size() != w or new.element_size() != w:
        return None  # (the general path says what is wrong)
    return h, (new.data_ptr(), old.data_ptr(), w, idx.data_ptr(), k, numel, keys.s1, keys.s2, t, kp), keys.definition


def _fast_rc(rc: int, name: str, global_shape) -> None:
    if rc == _E_RANGE:
        raise DcrError(f"{name}: global index out of range for shape {list(global_shape)}")
    if rc != 0:
        raise DcrError(f"state digest kernel failed ({rc})")


def _change_fast(name, dtype, global_shape, idx, old, new, definition: int = 1) -> StateDigest | None:
    """``change_contrib`` in one C call where ``_fast_args`` allows; None otherwise."""
    a = _fast_args(name, dtype, global_shape, idx, old, new, definition)
    if a is None:
        return None
    out = (ctypes.c_uint64 * LANES)()
    _fast_rc(a[0].dcr_sd_change_in(*a[1], out, a[2]), name, global_shape)
    return StateDigest._of(tuple(out), definition)


class RunningSum:
    """A StateDigest summed from parts reported from any thread. A chunk's change
    (``add_change``: ``change_contrib``'s arguments) goes straight into lanes held in C memory,
    by a C call that keeps the GIL (``native.held``), so no two run at once: one call a chunk, no
    digest object and no lock (a diff or apply of many small tensors makes one or two a tensor:
    docs/results.md, twenty-fourth turn). Other parts (``add``) are summed under a lock, and must
    be of the same ``definition``."""

    def __init__(self, start: StateDigest | None = None, *, definition: int = 1):
        self.definition = checked_definition(definition)
        # (a start of the other definition is refused by the addition, as any part would be)
        self._parts = StateDigest.zero(definition) + (start if start is not None else StateDigest.zero(definition))
        self._acc = (ctypes.c_uint64 * LANES)()  # lanes in [0, P): dcr_sd_change_acc keeps them so
        self._lock = threading.Lock()

    def add_change(self, name, dtype, global_shape, global_idx, old, new) -> None:
        a = _fast_args(name, dtype, global_shape, global_idx, old, new, self.definition)
        if a is None:  # (the general path: _fast_args' checks are not made a second time)
            self.add(_change_general(name, dtype, global_shape, global_idx, old, new, self.definition))
        else:
            _fast_rc(a[0].dcr_sd_change_acc(*a[1], self._acc, a[2]), name, global_shape)

    def add(self, part: StateDigest) -> None:
        with self._lock:
            self._parts = self._parts + part

    @property
    def total(self) -> StateDigest:
        with self._lock:  # (the C adds keep the GIL: the lanes are read between two of them)
            return self._parts + StateDigest._of(tuple(self._acc), self.definition)


class ChangeDigest:
    """The change of a state digest, summed from the ``on_change(name, dtype, global_shape,
    global_idx, old, new)`` calls of ``diff``/``apply`` (from any thread; see
    ``delta/changes.py``): ``+ contrib(new)`` for elements that are now there, ``- contrib(old)``
    for elements that were. ``old`` None: the elements are new (an added tensor, or the new side
    of a reshape/re-type); ``new`` None: they are gone (a removed tensor, or the old side).

        change = ChangeDigest()
        diff(base, target, on_change=change)        # or apply(..., on_change=change)
        new_digest = old_digest + change.total

    ``definition``: of the weights, the old digest's.
    """

    def __init__(self, *, definition: int = 1):
        self._sum = RunningSum(definition=definition)

    @property
    def total(self) -> StateDigest:
        return self._sum.total

    def __call__(self, name, dtype, global_shape, global_idx, old, new) -> None:
        if new is not None and old is not None:
            self._sum.add_change(name, dtype, global_shape, global_idx, old, new)
        elif new is not None:
            self._sum.add(changes_contrib(name, dtype, global_shape, global_idx, new, definition=self._sum.definition))
        elif old is not None:
            self._sum.add(-changes_contrib(name, dtype, global_shape, global_idx, old, definition=self._sum.definition))


class WrittenDigest:
    """The state digest of what an apply writes, summed chunk by chunk as each is written: on the
    worker that wrote it, from the tensor's memory while the chunk is in that core's caches. A
    keyframe writes every element a receiver holds once, so this is then the receiver's whole
    state digest, with no pass over the model after the last chunk (a 64M-element BF16 keyframe:
    ~110 ms of CPU, 55 ms on two cores, after the last byte). ``complete`` turns False where a
    chunk was written another way (or found written already), and the caller sums the state
    whole instead; ``elements`` counts what was summed, which the caller compares with what it
    holds. Only a state that holds the target's bits can match its digest, so a match is the
    check a whole pass makes (docs/format.md, "State digest"). ``definition``: of the weights."""

    def __init__(self, *, definition: int = 1):
        self._sum = RunningSum(definition=definition)
        self._lock = threading.Lock()
        self.elements = 0
        self.complete = True
        self._later: list = []  # small chunks to sum at the end: (name, dtype, region_map, bits, start)

    def add(self, name: str, dtype: torch.dtype, region_map: IndexMap, bits: torch.Tensor, start: int,
            later: bool = False) -> None:
        """The elements ``start``, ... of a region of tensor ``name`` (placed by ``region_map``)
        now hold ``bits``. ``later``: summed when ``total`` is asked for, with the others added
        so, in jobs of up to ``_NATIVE_RANGE`` elements over the workers (``bits``, a view of
        the receiver's tensor, must still be its memory then). For the chunks an apply writes on
        the calling thread (``codec.chunk.light``, a keyframe's of small tensors): summed there
        one by one, they kept the other core idle (a keyframe sync of 4096 tensors of 32K BF16
        spent ~220 of ~900 ms so; docs/results.md, "Format version 4, fifth turn"). Else summed
        now, on the thread that wrote the chunk, while it is in that core's caches."""
        n = bits.numel()
        if later:
            with self._lock:
                self.elements += n
                self._later.append((name, dtype, region_map, bits, start))
            return
        part = region_contrib(name, dtype, region_map, bits, start, definition=self.definition)
        with self._lock:
            self.elements += n
        self._sum.add(part)

    @property
    def definition(self) -> int:
        return self._sum.definition

    def give_up(self) -> None:
        self.complete = False

    @property
    def total(self) -> StateDigest:
        with self._lock:
            later, self._later = self._later, []
        if later:
            self._sum.add(_sum_later(later, self.definition))
        return self._sum.total


def _sum_later(later: list, definition: int) -> StateDigest:
    """``WrittenDigest``'s deferred chunks, summed over the workers: a chunk of a region that is one
    run of the canonical tensor (a whole tensor, a row shard) in jobs of up to ``MANY_JOB``
    elements, each prepared on the calling thread and summed in one C call (``many_contrib``);
    summed a chunk at a time, the two workers took the GIL from each other at every chunk, and a
    keyframe sync of 4096 tensors of 32K BF16 spent ~310 of its ~1000 ms there. The others (a
    column shard's chunks) as ``_pieces`` are."""
    runs, other = [], []
    for name, dtype, imap, bits, start in later:
        if not bits.numel():
            continue
        offset = _run_start(imap)
        if offset is not None:
            runs.append((name, dtype, tuple(imap.spec.global_shape), bits, start + offset))
        else:
            other.append(_later_piece(name, dtype, imap, bits, start, definition))
    summed = _sum_pieces(other, None, definition) if other else StateDigest.zero(definition)
    return summed + _sum_runs(runs, None, definition)


def _later_piece(name: str, dtype: torch.dtype, region_map: IndexMap, bits: torch.Tensor, start: int,
                 definition: int):
    """A deferred chunk of ``WrittenDigest`` as one of ``_pieces``' answers: one range, threaded."""
    n = bits.numel()
    return (lambda _s: region_contrib(name, dtype, region_map, bits, start, definition=definition).lanes), \
        range(0, n, n), True


def allreduce_digest(d: StateDigest, group: ProcessGroup | None = None) -> StateDigest:
    """Sum the ranks' partial digests with ``torch.distributed.all_reduce`` (every rank gets the
    total). Lanes are < 2**31, so an int64 sum is exact for up to 2**32 ranks."""
    import torch.distributed as dist

    device: str | torch.device = "cpu"
    if "nccl" in str(dist.get_backend(group)).lower():
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(d.lanes, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return StateDigest(tuple(int(v) % P for v in t.cpu().tolist()), d.definition)
