"""The "classes" chunk coding: positions and values modelled on what the receiver already holds.

Under Adam-style updates whether a floating-point value changes depends mostly on its exponent
(the ulp it would have to cross), and a change is almost always one step in the format's
monotone order. Both sides know the base, so both can put every element of a chunk in the
*class* of its base value's exponent field and code each class on its own. The exponent is
clamped to the chunk's class range (``class_range``: exponents with very few changes at either
end are merged into the nearest busier one; the decoder reads the range off the table's first
and last rows), which keeps the classes the kernel must count per element to ~15:

* positions: per class, the ranks (among the elements of that class, in index order) of the
  changed elements, as gaps, Rice-coded with a per-class parameter;
* values: the difference ``d = key(new) - key(old)`` of ``ordered.py``: its sign as one raw bit,
  then per class which changes have ``|d| >= 2`` (Rice-coded gaps in the class's change list)
  and ``|d| - 2`` for those (Rice-coded).

Rice code of ``v`` with parameter ``k``: ``q = v >> k``; ``q < 32``: ``q`` zero bits, a one bit,
the ``k`` low bits of ``v``; else 32 zero bits and ``v`` in 48 bits. Bits are packed least
significant first; each stream ends with zero padding to a byte. The parameter is the cheapest
of ``bitlength(sum // count) - 2 .. + 1`` within [0, 31] (the smallest on a tie).

The per-class table (class, changes, kp, bigs, kb, ke) goes in the chunk header. This module is
the reference that defines the bytes; ``csrc/dcr_classes.c`` produces the same bytes faster and
is used when it builds (``native.py``). Only floating-point dtypes of 1, 2 or 4 bytes.
"""
from __future__ import annotations

import array
import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr.codec import native
from nemo_dcr.codec.ordered import key, to_bits, unkey, unsigned
from nemo_dcr.errors import DcrError, DeltaFormatError

MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
QMAX, ESC_BITS = 32, 48
ROW = 6  # class, changes, kp, bigs, kb, ke
_ERRORS = {-1: "bad class table", -2: "stream truncated or malformed", -3: "stream has trailing bits",
           -4: "position rank out of range", -5: "value out of range", -6: "out of memory", -7: "bad arguments",
           -9: "chunk checksum mismatch"}
E_CRC = -9  # dcr_cls_decode_streams_many: a chunk fails its CRC-32


def error_name(rc: int) -> str:
    """What a classes kernel's return code says."""
    return _ERRORS.get(rc, str(rc))


class RankPastClass(DeltaFormatError):
    """Streams that decode, but a rank runs past its class's members in the base they are
    located against (``locate``): for a checksum-valid chunk, the base held is not its base.
    ``call``: which call of a ``_many`` function it was found in (None: not one)."""

    def __init__(self, message: str, call: int | None = None):
        super().__init__(message)
        self.call = call


def applicable(dtype: torch.dtype) -> bool:
    return dtype in MANTISSA


def _classes(u: torch.Tensor, w: int, mant: int) -> torch.Tensor:
    return (u & ((1 << (8 * w - 1)) - 1)) >> mant


def context(bits: torch.Tensor, rows, mant: int) -> torch.Tensor:
    """What the decoder of a chunk with class table ``rows`` reads from base bits ``bits`` (an
    integer view) besides the bits at the changed positions: each element's class, clamped to the
    table's range, as ``class - lo`` (uint8; 0 for a table without rows)."""
    if not rows:
        return torch.zeros(bits.numel(), dtype=torch.uint8, device=bits.device)
    lo, hi = rows[0][0], rows[-1][0]
    return (_classes(unsigned(bits), bits.element_size(), mant).clamp(lo, hi) - lo).to(torch.uint8)


# ----------------------------------------------------------------------------- Rice, reference

def choose_k(v: torch.Tensor) -> int:
    s, count = int(v.sum()), v.numel()
    k0 = (s // count).bit_length()
    best, bestc = -1, 0
    for k in range(max(k0 - 2, 0), min(k0 + 1, 31) + 1):
        q = v >> k
        c = int(torch.where(q < QMAX, q + 1 + k, QMAX + ESC_BITS).sum())
        if best < 0 or c < bestc:
            best, bestc = k, c
    return best


def _rice_fields(v: torch.Tensor, k: int):
    q = v >> k
    esc = q >= QMAX
    f1 = torch.where(esc, torch.zeros_like(v), torch.ones_like(v) << q.clamp(max=QMAX - 1))
    l1 = torch.where(esc, torch.full_like(v, QMAX), q + 1)
    f2 = torch.where(esc, v, v & ((1 << k) - 1))
    l2 = torch.where(esc, torch.full_like(v, ESC_BITS), torch.full_like(v, k))
    return torch.stack([f1, f2], 1).reshape(-1), torch.stack([l1, l2], 1).reshape(-1)


def _pack(fields) -> bytes:
    if not fields:
        return b""
    vals = torch.cat([f[0] for f in fields])
    lens = torch.cat([f[1] for f in fields])
    total = int(lens.sum())
    if total == 0:
        return b""
    starts = torch.cumsum(lens, 0) - lens
    fid = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    j = torch.arange(total) - starts[fid]
    bits = ((vals[fid] >> j) & 1).to(torch.uint8).numpy()
    return np.packbits(bits, bitorder="little").tobytes()


class _Reader:
    def __init__(self, buf: bytes, what: str):
        self.bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")
        self.ones = np.flatnonzero(self.bits)
        self.pos, self.n, self.what, self.len = 0, self.bits.size, what, len(buf)

    def _fail(self, why):
        raise DeltaFormatError(f"classes {self.what} stream: {why}")

    def get(self, length: int) -> int:
        if self.pos + length > self.n:
            self._fail("truncated")
        v = int((self.bits[self.pos:self.pos + length].astype(np.uint64) << np.arange(length, dtype=np.uint64)).sum())
        self.pos += length
        return v

    def rice(self, k: int) -> int:
        i = int(np.searchsorted(self.ones, self.pos))
        q = int(self.ones[i]) - self.pos if i < self.ones.size else QMAX
        if q < QMAX:
            self.pos += q + 1
            return (q << k) | self.get(k)
        if self.pos + QMAX > self.n:
            self._fail("truncated")
        self.pos += QMAX
        return self.get(ESC_BITS)

    def done(self):
        if (self.pos + 7) // 8 != self.len or self.bits[self.pos:].any():
            self._fail("trailing bits")


# ----------------------------------------------------------------------------- reference codec

def _by_class(ec: torch.Tensor, lo: int, hi: int):
    """``ec``: each element's class, clamped to [lo, hi] -> (the elements sorted by class, in index
    order within one: a stable sort; where each class lo..hi+1 starts in that order). The
    coding's ranks are places in this order, counted from the class's start."""
    members = torch.argsort(ec, stable=True)
    return members, torch.searchsorted(ec[members], torch.arange(lo, hi + 2, device=ec.device))


def place(old: torch.Tensor, new: torch.Tensor, mant: int):
    """Where each change of a chunk sits in the coding: -> (positions, their clamped classes,
    their ranks among the chunk's elements of that class), or None when nothing changed."""
    w = new.element_size()
    uo, un = unsigned(old), unsigned(new)
    n = uo.numel()
    exp = _classes(uo, w, mant)
    idx = torch.nonzero(uo != un).squeeze(1)
    k = idx.numel()
    if k == 0:
        return None
    lo, hi = class_range(exp[idx], k)
    cls = exp.clamp(lo, hi)
    order, first = _by_class(cls, lo, hi)
    inv = torch.empty(n, dtype=torch.int64)
    inv[order] = torch.arange(n)
    return idx, cls[idx], inv[idx] - first[cls[idx] - lo]


def encode_reference(old: torch.Tensor, new: torch.Tensor, mant: int):
    """old/new: 1-D integer views of one chunk. -> (k, table rows, position bytes, value bytes)."""
    placed = place(old, new, mant)
    if placed is None:
        return 0, [], b"", b""
    idx, cls, rank = placed
    return encode_ranked_reference(cls, rank, unsigned(old)[idx], unsigned(new)[idx], new.element_size())


def encode_ranked_reference(c_ch: torch.Tensor, rank: torch.Tensor, uo: torch.Tensor, un: torch.Tensor, w: int):
    """The coding of one chunk's changes once each is placed: ``c_ch`` its (clamped) class,
    ``rank`` its rank among the chunk's elements of that class, ``uo``/``un`` its unsigned old
    and new bits, all 1-D int64 in position order. -> (k, rows, position bytes, value bytes).
    What ``encode_reference`` ends with; the device path (``nemo_dcr/device``) finds the
    classes and ranks on the GPU and calls ``encode_ranked`` on the host with O(changes) data."""
    k = c_ch.numel()
    if k == 0:
        return 0, [], b"", b""
    idx = torch.arange(k)
    o = torch.argsort(c_ch, stable=True)
    c_ch, rank, idx = c_ch[o], rank[o], idx[o]
    mask, sign = (1 << (8 * w)) - 1, 1 << (8 * w - 1)
    d = (key(un[idx], w, True) - key(uo[idx], w, True)) & mask
    neg = (d & sign) != 0
    mag = torch.where(neg, mask + 1 - d, d)
    pos_fields, val_fields, big_fields, rows = [], [(neg.to(torch.int64), torch.ones(k, dtype=torch.int64))], [], []
    classes, counts = torch.unique_consecutive(c_ch, return_counts=True)
    a = 0
    for c, kc in zip(classes.tolist(), counts.tolist()):
        r = rank[a:a + kc]
        gaps = r.clone()
        gaps[1:] = r[1:] - r[:-1] - 1
        kp = choose_k(gaps)
        pos_fields.append(_rice_fields(gaps, kp))
        m = mag[a:a + kc]
        bj = torch.nonzero(m >= 2).squeeze(1)
        kb = ke = 0
        if bj.numel():
            bg = bj.clone()
            bg[1:] = bj[1:] - bj[:-1] - 1
            kb = choose_k(bg)
            ex = m[bj] - 2
            ke = choose_k(ex)
            big_fields += [_rice_fields(bg, kb), _rice_fields(ex, ke)]
        rows.append([c, kc, kp, bj.numel(), kb, ke])
        a += kc
    return k, rows, _pack(pos_fields), _pack(val_fields + big_fields)


def class_range(changed_exp: torch.Tensor, k: int):
    """The chunk's class range [lo, hi]: the lowest and highest exponent with at least
    max(4, k >> 8) changes (if none has, the lowest and highest with any); exponents outside are
    merged into the nearest end."""
    ke = torch.bincount(changed_exp, minlength=256)
    strong = torch.nonzero(ke >= max(4, k >> 8)).squeeze(1)
    some = strong if strong.numel() else torch.nonzero(ke).squeeze(1)
    return int(some.min()), int(some.max())


def _check_table(rows, w: int, mant: int, k: int):
    # (no generator expressions: this runs for every chunk of every apply, on the GIL)
    nc = 1 << (8 * w - 1 - mant)
    prev, total = -1, 0
    for row in rows:
        if type(row) not in (list, tuple) or len(row) != ROW:
            raise DeltaFormatError("classes table row is not 6 integers")
        c, kc, kp, bc, kb, ke = row
        if type(c) is not int or type(kc) is not int or type(kp) is not int or type(bc) is not int \
                or type(kb) is not int or type(ke) is not int:
            raise DeltaFormatError("classes table row is not 6 integers")
        if not (prev < c < nc and 1 <= kc <= k - total and 0 <= bc <= kc and 0 <= kp <= 31 and 0 <= kb <= 31
                and 0 <= ke <= 31):
            raise DeltaFormatError(f"bad classes table row {row}")
        prev, total = c, total + kc
    if total != k:
        raise DeltaFormatError(f"classes table holds {total} changes, header says {k}")


def decode_streams_reference(rows, pos: bytes, val: bytes, k: int, n: int, w: int, mant: int):
    """The two streams of a classes chunk of ``n`` elements, decoded without the base: -> (each
    change's class, its rank among the chunk's elements of that class, its difference
    ``key(new) - key(old)`` mod 2**(8w)), int64, in class order (the table's rows in turn, each
    class's changes by rank). Everything is checked but whether each rank is below its class's
    member count, which needs the base (``locate`` does it)."""
    mask, sign = (1 << (8 * w)) - 1, 1 << (8 * w - 1)
    _check_table(rows, w, mant, k)
    pr, vr = _Reader(pos, "position"), _Reader(val, "value")
    neg = [vr.get(1) for _ in range(k)]
    out_c, out_r, out_d, a = [], [], [], 0
    for c, kc, kp, bc, kb, ke in rows:
        acc = -1
        for _ in range(kc):
            acc += 1 + pr.rice(kp)
            if acc >= n:
                raise DeltaFormatError("classes position rank out of range")
            out_r.append(acc)
        mags = [1] * kc
        at = -1
        bigs = []
        for _ in range(bc):
            g = vr.rice(kb)
            if g >= kc - at - 1:
                raise DeltaFormatError("classes value: big change past the class's changes")
            at += 1 + g
            bigs.append(at)
        for j in bigs:
            m = vr.rice(ke) + 2
            if m > sign or (not neg[a + j] and m == sign):
                raise DeltaFormatError("classes value out of range")
            mags[j] = m
        out_d += [(mask + 1 - m) & mask if neg[a + j] else m for j, m in enumerate(mags)]
        out_c += [c] * kc
        a += kc
    pr.done()
    vr.done()
    return (torch.tensor(out_c, dtype=torch.int64), torch.tensor(out_r, dtype=torch.int64),
            torch.tensor(out_d, dtype=torch.int64))


def locate(uo: torch.Tensor, rows, cls: torch.Tensor, rank: torch.Tensor, d: torch.Tensor, w: int, mant: int):
    """``place``'s inverse: decoded streams (``decode_streams``) against the base chunk's
    unsigned bits ``uo`` -> (positions, increasing; new unsigned bits at them). Torch ops on
    whatever device the tensors are (the device receiver's path too): each change is the
    ``rank``-th member of its class in ``_by_class``'s order."""
    if rank.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=uo.device), uo[:0].clone()
    lo, hi = rows[0][0], rows[-1][0]
    members, first = _by_class(_classes(uo, w, mant).clamp(lo, hi), lo, hi)
    at = first[cls - lo] + rank
    if bool((at >= first[cls - lo + 1]).any()):
        raise RankPastClass("classes position rank out of range")
    idx = members[at]
    o = torch.argsort(idx)
    idx, d = idx[o], d[o]
    return idx, new_values(uo[idx], d, w)


def _run_elements(start: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs (``start[r]``, ``length[r]`` elements) -> (each element's index, its run), in turn."""
    run_of = torch.repeat_interleave(torch.arange(start.numel(), device=start.device), length)
    first = torch.cumsum(length, 0) - length
    return start[run_of] + torch.arange(run_of.numel(), device=start.device) - first[run_of], run_of


def _runs_of(base: torch.Tensor, start: np.ndarray, length: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    """(runs, classes) of a runs call, its arguments checked (numpy: a chunk's runs are a few
    dozen numbers, where each torch call costs more than the check)."""
    if base.dim() != 1 or start.ndim != 1 or start.shape != length.shape or not 0 <= lo <= hi <= 255 \
            or start.dtype != np.int64 or length.dtype != np.int64:
        raise DcrError("runs of a base: a 1-D base, as many int64 starts as lengths, 0 <= lo <= hi <= 255")
    if start.size and ((start < 0).any() or (length < 0).any() or (start + length > base.numel()).any()):
        raise DcrError("a run outside its base")
    return start.size, hi - lo + 1


def run_counts(base: torch.Tensor, start: np.ndarray, length: np.ndarray, lo: int, hi: int, mant: int,
               use_native: bool | None = None) -> np.ndarray:
    """The class counts of runs of ``base`` (a 1-D integer view of bits, anywhere; run ``r``:
    ``length[r]`` elements from ``start[r]``): per run, its elements of each class ``lo..hi``
    (clamped to that range, as a chunk's table clamps them) -> uint32 ``[runs, hi - lo + 1]``. What
    a receiver rank holding part of a chunk tells its group (``sync/chunk_gather.py``)."""
    runs, nc = _runs_of(base, start, length, lo, hi)
    lib = native.lib() if use_native is not False and base.is_cpu else None
    if lib is None:
        if use_native and base.is_cpu:
            raise DcrError(f"C kernels unavailable: {native.build_error}")
        at, run_of = _run_elements(torch.from_numpy(start).to(base.device), torch.from_numpy(length).to(base.device))
        ctx = _classes(unsigned(base[at]), base.element_size(), mant).clamp(lo, hi) - lo
        n = torch.bincount(run_of * nc + ctx, minlength=runs * nc)
        return n.cpu().numpy().astype(np.uint32).reshape(runs, nc)
    base = base.contiguous()
    out = np.empty((runs, nc), dtype=np.uint32)
    rc = lib.dcr_cls_run_counts(_ptr(base), base.numel(), base.element_size(), mant, lo, hi, start.ctypes.data,
                                length.ctypes.data, runs, out.ctypes.data)
    if rc:
        raise DcrError(f"class counts of runs failed in the C kernel: {_ERRORS.get(rc, rc)}")
    return out


def run_select(base: torch.Tensor, start: np.ndarray, length: np.ndarray, lo: int, hi: int, mant: int,
               run: np.ndarray, cls: np.ndarray, within: np.ndarray, use_native: bool | None = None) -> np.ndarray:
    """``run_counts``' runs, and per request ``j`` a run, a class (``- lo``) and a place: the
    offset in run ``run[j]`` of its ``within[j]``-th element (from 0) of class ``lo + cls[j]`` ->
    int64, in the requests' order. ``RankPastClass``: a run holds fewer elements of a class than
    asked for (the counts the requests were placed by were not of these bits)."""
    runs, nc = _runs_of(base, start, length, lo, hi)
    run, cls, within = (np.ascontiguousarray(x, dtype=np.int64) for x in (run, cls, within))
    k = run.size
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if (run < 0).any() or (run >= runs).any() or (cls < 0).any() or (cls >= nc).any() or (within < 0).any():
        raise DcrError("a request outside the runs or their classes")
    lib = native.lib() if use_native is not False and base.is_cpu else None
    if lib is None:
        if use_native and base.is_cpu:
            raise DcrError(f"C kernels unavailable: {native.build_error}")
        dev = base.device
        at, run_of = _run_elements(torch.from_numpy(start).to(dev), torch.from_numpy(length).to(dev))
        group = run_of * nc + _classes(unsigned(base[at]), base.element_size(), mant).clamp(lo, hi) - lo
        order = torch.argsort(group, stable=True)  # each (run, class) group's elements in index order
        size = torch.bincount(group, minlength=runs * nc)
        g, v = torch.from_numpy(run * nc + cls).to(dev), torch.from_numpy(within).to(dev)
        if bool((v >= size[g]).any()):
            raise RankPastClass("a run holds fewer elements of a class than asked for")
        el = order[(torch.cumsum(size, 0) - size)[g] + v].cpu().numpy()  # its place among all the runs' elements
        return el - (np.cumsum(length) - length)[run]
    sort = np.lexsort((within, cls, run))  # the kernel's order
    srun, scls, swithin = run[sort], cls[sort], within[sort]
    got = np.empty(k, dtype=np.int64)
    base = base.contiguous()
    rc = lib.dcr_cls_run_select(_ptr(base), base.numel(), base.element_size(), mant, lo, hi, start.ctypes.data,
                                length.ctypes.data, runs, srun.ctypes.data, scls.ctypes.data, swithin.ctypes.data, k,
                                got.ctypes.data)
    if rc == -4:
        raise RankPastClass("a run holds fewer elements of a class than asked for")
    if rc:
        raise DcrError(f"elements of runs by class failed in the C kernel: {_ERRORS.get(rc, rc)}")
    out = np.empty(k, dtype=np.int64)
    out[sort] = got
    return out


@dataclass(frozen=True)
class RunCall:
    """One chunk's runs on one rank's bits, for ``run_counts_many`` / ``run_select_many``: as
    ``run_counts``' arguments (``base`` a 1-D integer view of bits; run ``r``: ``length[r]``
    elements from ``start[r]``; classes ``lo..hi``; ``mant`` mantissa bits)."""

    base: torch.Tensor
    start: np.ndarray
    length: np.ndarray
    lo: int
    hi: int
    mant: int


def _many(calls: Sequence[RunCall]) -> tuple[np.ndarray, ...]:
    """The calls' arguments as the C kernels' arrays (each base contiguous: the kernels read it at
    its address), checked as ``_runs_of`` checks one call's ->
    (bases, their lengths, widths, mantissas, lo, hi, run offsets, starts, lengths, runs per call)."""
    if any(c.base.dim() != 1 or not c.base.is_contiguous() or not 0 <= c.lo <= c.hi <= 255 or c.start.ndim != 1
           or c.start.shape != c.length.shape for c in calls):
        raise DcrError("runs of a base: a 1-D contiguous base, as many int64 starts as lengths, 0 <= lo <= hi <= 255")
    nruns = np.array([c.start.size for c in calls], dtype=np.int64)
    start = np.concatenate([c.start for c in calls]).astype(np.int64, copy=False) if calls else nruns
    length = np.concatenate([c.length for c in calls]).astype(np.int64, copy=False) if calls else nruns
    nbase = np.array([c.base.numel() for c in calls], dtype=np.int64)
    if start.size and ((start < 0).any() or (length < 0).any() or (start + length > np.repeat(nbase, nruns)).any()):
        raise DcrError("a run outside its base")
    off = offsets(nruns)
    i32 = np.int32
    return (np.array([_ptr(c.base) for c in calls], dtype=np.int64), nbase,
            np.array([c.base.element_size() for c in calls], dtype=i32), np.array([c.mant for c in calls], dtype=i32),
            np.array([c.lo for c in calls], dtype=i32), np.array([c.hi for c in calls], dtype=i32), off, start, length,
            nruns)


def _native_many(calls: Sequence[RunCall], use_native: bool | None):
    """The library where every call's base is on the host and it is wanted, else None."""
    if use_native is False or not all(c.base.is_cpu for c in calls):
        return None
    lib = native.lib()
    if lib is None and use_native:
        raise DcrError(f"C kernels unavailable: {native.build_error}")
    return lib


def run_counts_many(calls: Sequence[RunCall], use_native: bool | None = None) -> np.ndarray:
    """``run_counts`` of every call, one after another in one uint32 array (call ``i``'s
    ``[runs, classes]`` counts flattened, then call ``i + 1``'s): one C call for all of them (a
    version's chunks held in part, thousands on an FSDP trainer's shards)."""
    lib = _native_many(calls, use_native)
    if lib is None:
        got = [run_counts(c.base, c.start, c.length, c.lo, c.hi, c.mant, use_native=use_native).reshape(-1)
               for c in calls]
        return np.concatenate(got) if got else np.empty(0, dtype=np.uint32)
    bases, nbase, w, mant, lo, hi, off, start, length, nruns = args = _many(calls)
    cnt_off = offsets(nruns * (hi - lo + 1))
    out = np.empty(int(cnt_off[-1]), dtype=np.uint32)
    failed = np.zeros(1, dtype=np.int64)
    rc = lib.dcr_cls_run_counts_many(len(calls), *(a.ctypes.data for a in args[:-1]), cnt_off.ctypes.data,
                                     out.ctypes.data, failed.ctypes.data)
    if rc:
        raise DcrError(f"class counts of runs failed in the C kernel (call {int(failed[0])}): {_ERRORS.get(rc, rc)}")
    return out


def _request_order(call: np.ndarray, run: np.ndarray, cls: np.ndarray, within: np.ndarray) -> np.ndarray | None:
    """The requests in the kernel's order: by call, run, class and place; None where they are in
    it already (a chunk each rank holds one run of, as a row shard: its requests come in stream
    order, by class, places increasing). Else one stable sort by (call, run, class) leaves each
    group's places in order (several times faster than ``lexsort``, which sorts any order and is
    the fallback)."""
    if call.size and int(call[-1]) < 1 << 22 and int(run.max()) < 1 << 33:  # (cls < 256: checked)
        key = (call << 41) | (run << 8) | cls
        if not (key[1:] < key[:-1]).any() and _places_increase(key, within):
            return None
        o = np.argsort(key, kind="stable")
        if _places_increase(key[o], within[o]):
            return o
    return np.lexsort((within, cls, run, call))


def _places_increase(key: np.ndarray, within: np.ndarray) -> bool:
    """Whether, among requests of equal ``key`` next to each other, the places increase."""
    return not ((key[1:] == key[:-1]) & (within[1:] <= within[:-1])).any()


def run_select_many(calls: Sequence[RunCall], requests: np.ndarray, run: np.ndarray, cls: np.ndarray,
                    within: np.ndarray, use_native: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``run_select`` of every call: call ``i``'s requests are the next ``requests[i]`` of ``run``
    (numbered in its own runs), ``cls`` and ``within``, in any order -> (each request's offset in
    its run, the base bits found there, zero-extended to uint32), in the requests' order. One C
    call for all of them. ``RankPastClass`` as ``run_select``."""
    run, cls, within = (np.ascontiguousarray(x, dtype=np.int64) for x in (run, cls, within))
    requests = np.asarray(requests, dtype=np.int64)
    k = run.size
    if requests.shape != (len(calls),) or (requests < 0).any() or int(requests.sum()) != k \
            or cls.size != k or within.size != k:
        raise DcrError("requests of runs: one count per call, adding up to the requests")
    lib = _native_many(calls, use_native)
    if lib is None:
        offs, held, q = [np.empty(0, np.int64)], [np.empty(0, np.uint32)], 0
        for c, m in zip(calls, requests.tolist()):
            o = run_select(c.base, c.start, c.length, c.lo, c.hi, c.mant, run[q:q + m], cls[q:q + m],
                           within[q:q + m], use_native=use_native)
            at = torch.from_numpy(c.start[run[q:q + m]] + o).to(c.base.device)
            offs.append(o)
            held.append(unsigned(c.base[at]).cpu().numpy().astype(np.uint32))
            q += m
        return np.concatenate(offs), np.concatenate(held)
    bases, nbase, w, mant, lo, hi, off, start, length, nruns = args = _many(calls)
    call = np.repeat(np.arange(len(calls)), requests)
    if k and ((run < 0).any() or (run >= nruns[call]).any() or (cls < 0).any() or (cls > (hi - lo)[call]).any()
              or (within < 0).any()):
        raise DcrError("a request outside the runs or their classes")
    req_off = offsets(requests)
    sort = _request_order(call, run, cls, within)
    srun, scls, swithin = (run, cls, within) if sort is None else (run[sort], cls[sort], within[sort])
    got, found = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.uint32)
    failed = np.zeros(1, dtype=np.int64)
    rc = lib.dcr_cls_run_select_many(len(calls), *(a.ctypes.data for a in args[:-1]), req_off.ctypes.data,
                                     srun.ctypes.data, scls.ctypes.data, swithin.ctypes.data, got.ctypes.data,
                                     found.ctypes.data, failed.ctypes.data)
    if rc == -4:
        raise RankPastClass(f"a run holds fewer elements of a class than asked for (call {int(failed[0])})",
                            int(failed[0]))
    if rc:
        raise DcrError(f"elements of runs by class failed in the C kernel (call {int(failed[0])}): "
                       f"{_ERRORS.get(rc, rc)}")
    if sort is None:
        return got, found
    out, bits = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.uint32)
    out[sort], bits[sort] = got, found
    return out, bits


def place_many(counts: Sequence[np.ndarray], order: Sequence[np.ndarray], changes: np.ndarray, cls: np.ndarray,
               rank: np.ndarray, use_native: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Chunks' changes to the runs holding them, from the runs' class counts (what a receiver group
    gathers, ``sync/chunk_gather.py``): call ``i``'s ``counts[i]`` (``[runs, classes]``, unsigned,
    any width), ``order[i]`` its runs' rows in chunk order, and its ``changes[i]`` changes, the
    next ones of ``cls`` (from the chunk's lo) and ``rank`` (among the chunk's elements of that
    class, in chunk order) -> per change, its run (in chunk order) and its place among that run's
    elements of its class. ``RankPastClass`` (``call``: the chunk) where a class is out of range or
    a rank past its class's members: the counts are not of the chunk's base. One C call for all
    of them (a version's chunks, thousands from an FSDP trainer's shards)."""
    changes = np.asarray(changes, dtype=np.int64)
    cls, rank = (np.ascontiguousarray(x, dtype=np.int64) for x in (cls, rank))
    if len(counts) != len(order) or changes.shape != (len(counts),) or (changes < 0).any() \
            or int(changes.sum()) != cls.size or rank.size != cls.size \
            or any(n.ndim != 2 or o.shape != (n.shape[0],) for n, o in zip(counts, order)):
        raise DcrError("placing changes: per call its [runs, classes] counts, its runs' order and how many changes")
    R = np.array([n.shape[0] for n in counts], dtype=np.int64)
    C = np.array([n.shape[1] for n in counts], dtype=np.int64)
    lib = native.lib() if use_native is not False else None
    if lib is None:
        if use_native:
            raise DcrError(f"C kernels unavailable: {native.build_error}")
        return _place_reference(counts, order, changes, cls, rank, R, C)
    flat = np.concatenate([n.reshape(-1) for n in counts] or [np.empty(0, np.uint32)], dtype=np.uint32)
    ords = np.concatenate([np.empty(0, np.int64)] + list(order)).astype(np.int64, copy=False)
    run_off, cnt_off, chg_off = (offsets(x) for x in (R, R * C, changes))
    run, within = np.empty(cls.size, dtype=np.int64), np.empty(cls.size, dtype=np.int64)
    failed = np.zeros(1, dtype=np.int64)
    rc = lib.dcr_cls_place_many(len(counts), run_off.ctypes.data, C.ctypes.data, cnt_off.ctypes.data, flat.ctypes.data,
                                flat.size, ords.ctypes.data, chg_off.ctypes.data, cls.ctypes.data, rank.ctypes.data,
                                run.ctypes.data, within.ctypes.data, failed.ctypes.data)
    if rc == -4:
        raise RankPastClass(f"a change past its class's members in its runs (call {int(failed[0])})", int(failed[0]))
    if rc:
        raise DcrError(f"placing changes failed in the C kernel (call {int(failed[0])}): {_ERRORS.get(rc, rc)}")
    return run, within


def offsets(sizes: np.ndarray) -> np.ndarray:
    """Sizes -> where each starts, and the total last (int64)."""
    out = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def _place_reference(counts, order, changes, cls, rank, R, C) -> tuple[np.ndarray, np.ndarray]:
    """``place_many`` in numpy: each chunk's class counts as columns (one per class, its runs in
    chunk order) laid end to end, one cumulative sum over all of them (nondecreasing, so one
    search places every change, offset by what the columns before its own hold)."""
    share = np.repeat(np.arange(len(counts)), changes)
    f = np.concatenate([np.empty(0, np.int64)] + [n[o].T.ravel() for n, o in zip(counts, order)]).astype(np.int64)
    col_at = offsets(np.repeat(R, C))  # where each column starts
    g = offsets(f)  # g[x]: the members in the columns' runs before run x
    before = np.append(g[col_at[:-1]], 0)  # (a 0 column for a class out of range)
    total = np.append(g[col_at[1:]] - g[col_at[:-1]], 0)  # each column's members
    col = offsets(C)[share] + cls
    bad = (cls < 0) | (cls >= C[share]) | (rank < 0)
    col[bad] = col_at.size - 1
    bad |= rank >= total[col]
    if bad.any():
        i = int(share[np.argmax(bad)])
        raise RankPastClass(f"a change past its class's members in its runs (call {i})", i)
    at = np.searchsorted(g, before[col] + rank, side="right") - 1  # the last run whose members before are <= it
    return at - col_at[col], before[col] + rank - g[at]


def new_values(uo: torch.Tensor, d: torch.Tensor, w: int) -> torch.Tensor:
    """The new unsigned bits of changes from their old unsigned bits and decoded differences (the
    value stream codes each as a difference in the format's monotone order)."""
    return unkey((key(uo, w, True) + d) & ((1 << (8 * w)) - 1), w, True)


def new_bits_host(old: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``new_values`` on the host: ``old`` the changes' bits as the unsigned integers of their
    width (numpy), ``d`` their decoded differences (int64, mod 2**(8w)) -> the new bits, same
    dtype. In the width's own arithmetic (the monotone key is ``~u`` for a negative value, the
    sign bit set for a positive one): a receiver group puts a version's changes together at once,
    where torch's int64 passes took ~30 ms for 0.67M changes."""
    sign = old.dtype.type(1 << (8 * old.dtype.itemsize - 1))
    k = np.where(old & sign, ~old, old | sign)
    k += d.astype(old.dtype)  # (wraps mod 2**(8w): d is one already)
    return np.where(k & sign, k ^ sign, ~k)


def decode_reference(old: torch.Tensor, rows, pos: bytes, val: bytes, k: int, mant: int):
    """-> (positions in the chunk, increasing; new bits at them)."""
    w = old.element_size()
    uo = unsigned(old)
    cls, rank, d = decode_streams_reference(rows, pos, val, k, uo.numel(), w, mant)
    if k == 0:
        return torch.empty(0, dtype=torch.int64), old[:0].clone()
    idx, un = locate(uo, rows, cls, rank, d, w, mant)
    return idx, to_bits(un, w).view(old.dtype)


def decode_streams(rows, pos: bytes, val: bytes, k: int, n: int, w: int, mant: int,
                   use_native: bool | None = None, table_checked: bool = False):
    """As ``decode_streams_reference``, with the C kernel when it is available. ``table_checked``
    as ``decode``'s (a receiver group decodes thousands of small chunks' streams a version)."""
    lib = native.lib() if use_native is not False else None
    if lib is None:
        if use_native:
            raise DcrError(f"C kernels unavailable: {native.build_error}")
        return decode_streams_reference(rows, pos, val, k, n, w, mant)
    if not table_checked:
        _check_table(rows, w, mant, k)
    table = _table(rows)
    if rows and len(table) != ROW * len(rows):  # (the kernel reads ROW a row: never past the table)
        raise DeltaFormatError("classes table row is not 6 integers")
    out = [_out(k, torch.int64) for _ in range(3)]  # (numpy's: torch.empty gives the GIL up, _out says)
    rc = lib.dcr_cls_decode_streams(n, w, mant, _addr(table), len(rows), bytes(pos), len(pos), bytes(val), len(val), k,
                                    *(_ptr(t) for t in out))
    if rc:
        raise DeltaFormatError(f"classes chunk does not decode: {_ERRORS.get(rc, rc)}")
    return tuple(out)


# ----------------------------------------------------------------------------- dispatch

def _table(rows) -> array.array:
    """The class table as the int64 array the kernels read (pass ``_addr`` of it; the caller
    keeps it alive): an ``array`` costs a quarter of a torch tensor of the same 6 x rows to
    make, once per chunk."""
    return array.array("q", [v for row in rows for v in row] or [0])


def _addr(a: array.array) -> int:
    return a.buffer_info()[0]


_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
       torch.uint8: np.uint8}


def _out(k: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor for a kernel to fill, made by numpy where it has the dtype:
    ``torch.empty`` gives the GIL up (and takes it back) even for a few bytes, three times a
    chunk on the apply's workers, each a wait on a busy machine (docs/results.md, eighteenth turn)."""
    npt = _NP.get(dtype)
    return torch.from_numpy(np.empty(k, dtype=npt)) if npt is not None else torch.empty(k, dtype=dtype)


def _ptr(t: torch.Tensor) -> int:
    # the C kernel dereferences this on the host: a device pointer must never reach it
    # (is_cpu: .device makes an object, four times the time, four times a chunk)
    if not t.is_cpu:
        raise DcrError(f"the classes C kernel reads host memory; got a tensor on {t.device} "
                       "(decode_streams + locate run where the tensor is)")
    return t.data_ptr()


class _EncodeOut:
    """``dcr_cls_encode``'s out-arguments, made once per thread: making them (a class table, eight
    ctypes values and their references) for every chunk was a fifth of a small chunk's encode
    (docs/results.md, twenty-third turn)."""

    def __init__(self):
        self.table = np.empty(256 * ROW, dtype=np.int64)  # every row the kernel may fill
        self.table_addr = self.table.ctypes.data
        self.ntab, self.plen, self.vlen = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        self.pp, self.vp, self.ip, self.op, self.np_ = (ctypes.c_void_p() for _ in range(5))
        self.ptrs = (self.pp, self.vp, self.ip, self.op, self.np_)
        self.refs = tuple(ctypes.byref(v) for v in (self.ntab, self.pp, self.plen, self.vp, self.vlen, self.ip,
                                                    self.op, self.np_))


_tls = threading.local()


def _encode_out() -> _EncodeOut:
    o = getattr(_tls, "enc", None)
    if o is None:
        o = _tls.enc = _EncodeOut()
    return o


def encode(old: torch.Tensor, new: torch.Tensor, mant: int, use_native: bool | None = None,
           with_changes: bool = False, write_base: bool = False):
    """As ``encode_reference``, with the C kernel when it is available. ``with_changes``: the
    changes come back too, as three more items: their positions (increasing), old and new bits
    (the kernel gathers them while its scan has them in cache). ``write_base``: ``old`` (contiguous,
    the caller's memory) ends equal to ``new``: the kernel writes each change's new bits into it
    once it has read them, while they are in cache; on an error nothing is written."""
    if write_base and not old.is_contiguous():
        raise DcrError("classes encode: write_base needs a contiguous base (a copy would be written)")
    lib = native.lib() if use_native is not False else None
    if lib is None:
        if use_native:
            raise DcrError(f"C kernels unavailable: {native.build_error}")
        out = encode_reference(old, new, mant)
        if not with_changes and not write_base:
            return out
        idx = torch.nonzero(old != new).squeeze(1)
        changes = (idx, old[idx], new[idx])
        if write_base and idx.numel():
            old.scatter_(0, idx, changes[2])
        return out + changes if with_changes else out
    old, new = old.contiguous(), new.contiguous()
    w = new.element_size()
    o = _encode_out()
    k = lib.dcr_cls_encode_wb(_ptr(old), _ptr(new), new.numel(), w, mant, o.table_addr, *o.refs,
                              _ptr(old) if write_base else None)
    if k < 0:
        raise DcrError(f"classes encode failed in the C kernel: {_ERRORS.get(k, k)}")
    if write_base and k:  # written behind torch's back: its version counter says so, as decode's
        torch.autograd.graph.increment_version(old)
    try:
        plen, vlen = o.plen.value, o.vlen.value
        pos = ctypes.string_at(o.pp, plen) if plen else b""
        val = ctypes.string_at(o.vp, vlen) if vlen else b""
        if with_changes:
            idx, ov, nv = _out(k, torch.int64), _out(k, new.dtype), _out(k, new.dtype)
            if k:
                ctypes.memmove(idx.data_ptr(), o.ip, 8 * k)
                ctypes.memmove(ov.data_ptr(), o.op, w * k)
                ctypes.memmove(nv.data_ptr(), o.np_, w * k)
    finally:
        for ptr in o.ptrs:
            lib.dcr_free(ptr)
            ptr.value = None  # (freed: not to be freed again should the next call fail before setting it)
    rows = o.table[: o.ntab.value * ROW].reshape(-1, ROW).tolist()
    return (int(k), rows, pos, val, idx, ov, nv) if with_changes else (int(k), rows, pos, val)


def encode_ranked(c_ch: torch.Tensor, rank: torch.Tensor, uo: torch.Tensor, un: torch.Tensor, w: int,
                  mant: int, use_native: bool | None = None):
    """As ``encode_ranked_reference``, with the C kernel when it is available (the tail of
    ``dcr_cls_encode``, on the changes alone)."""
    lib = native.lib() if use_native is not False else None
    if lib is None:
        if use_native:
            raise DcrError(f"C kernels unavailable: {native.build_error}")
        return encode_ranked_reference(c_ch, rank, uo, un, w)
    k = c_ch.numel()
    c_ch, rank = c_ch.to(torch.int64).contiguous(), rank.to(torch.int64).contiguous()
    ov, nv = to_bits(uo, w).contiguous(), to_bits(un, w).contiguous()  # w bytes per change
    table = torch.empty(256 * ROW, dtype=torch.int64)
    ntab, plen, vlen = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    pp, vp = ctypes.c_void_p(), ctypes.c_void_p()
    r = lib.dcr_cls_encode_ranked(_ptr(c_ch), _ptr(rank), _ptr(ov), _ptr(nv), k, w, mant, _ptr(table),
                                  ctypes.byref(ntab), ctypes.byref(pp), ctypes.byref(plen), ctypes.byref(vp),
                                  ctypes.byref(vlen))
    if r < 0:
        raise DcrError(f"classes encode failed in the C kernel: {_ERRORS.get(r, r)}")
    try:
        pos = ctypes.string_at(pp, plen.value) if plen.value else b""
        val = ctypes.string_at(vp, vlen.value) if vlen.value else b""
    finally:
        lib.dcr_free(pp)
        lib.dcr_free(vp)
    if k == 0:
        return 0, [], b"", b""
    return k, table[: ntab.value * ROW].reshape(-1, ROW).tolist(), pos, val


def decode(old: torch.Tensor, rows, pos: bytes, val: bytes, k: int, mant: int, use_native: bool | None = None,
           with_old: bool = False, into: bool = False, offset: int = 0, table_checked: bool = False):
    """As ``decode_reference``, with the C kernel when it is available. ``with_old``: the base
    bits at the changed positions come back too, as a third item (what a receiver's pre-image
    check hashes; the kernel's scan reads them anyway, so the caller need not gather them).

    ``into`` (implies ``with_old``): the new bits are also written into ``old`` itself (1-D,
    contiguous: the receiver's own bits of the chunk), each as the scan passes it, while the bits
    around it are in the cache; a scatter afterwards found the chunk out of L2. Raising,
    it leaves ``old`` as it was. A caller whose checks of the old bits then fail writes them back
    (``(idx, new, held)``: ``held`` at ``idx``).

    ``offset`` is added to the positions that come back (a chunk's start: its positions in the
    tensor; the kernel adds it as it writes them, so the caller makes no second array).

    ``table_checked``: ``rows`` are a ``ChunkEntry``'s, checked when it was made (``header.py``'s
    parse, or the encoder's own table), so the C path does not check them a second time (~3 us
    of a small chunk's apply; the kernel checks every row's numbers again in any case)."""
    if into:
        if not old.is_contiguous() or old.dim() != 1:
            raise DcrError("a classes chunk decodes into a 1-D contiguous base only")
        with_old = True
    lib = native.lib() if use_native is not False else None
    if lib is None:
        if use_native:
            raise DcrError(f"C kernels unavailable: {native.build_error}")
        idx, new = decode_reference(old, rows, pos, val, k, mant)
        before = old[idx]
        if into:
            old[idx] = new
        if offset:
            idx = idx + offset
        return (idx, new, before) if with_old else (idx, new)
    w = old.element_size()
    if not table_checked:
        _check_table(rows, w, mant, k)
    old = old.contiguous()
    table = _table(rows)
    if rows and len(table) != ROW * len(rows):  # (the kernel reads ROW a row: never past the table)
        raise DeltaFormatError("classes table row is not 6 integers")
    idx = _out(k, torch.int64)
    out = _out(k, old.dtype)
    held = _out(k, old.dtype) if with_old else None
    kernel = lib.dcr_cls_decode_into if into else lib.dcr_cls_decode_old
    rc = kernel(_ptr(old), old.numel(), w, mant, _addr(table), len(rows), bytes(pos), len(pos),
                bytes(val), len(val), k, _ptr(idx), _ptr(out),
                _ptr(held) if held is not None else None, int(offset))  # the kernel only reads the streams
    if rc:
        raise DeltaFormatError(f"classes chunk does not decode: {_ERRORS.get(rc, rc)}")
    if into:  # written behind torch's back: its version counter says so, as a scatter_ would (the
        # rollout loader's replicas and a vLLM worker's rebuilt layers go by it)
        torch.autograd.graph.increment_version(old)
    return (idx, out, held) if held is not None else (idx, out)
