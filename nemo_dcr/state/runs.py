"""A shard's part of a chunk as runs: positions consecutive in both the chunk's (its region's flat
order) and the shard's local order. A row of a column-split tensor is one run, a row shard's part
of a chunk one in all, so what maps a chunk to a receiver is O(runs), not O(elements): a receiver
group's ``classes`` decode (``sync/chunk_gather.py``) and a dense chunk written into a receiver that
holds its region in part (``delta/apply.py``) work from them. Host-side numpy: a chunk's runs are
a few numbers to a few thousand.

The geometry: ``IndexMap.rows`` gives a shard's runs (its collapsed rows), increasing in canonical
order; a chunk's runs on a shard are its region's runs cut to the chunk, intersected with the
shard's (``held_runs``; both increase in canonical order, so one search each)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dcr.codec import native
from nemo_dcr.state.dtypes import INT_VIEW
from nemo_dcr.state.index_map import IndexMap, ShardSpec

__all__ = ["NO_RUNS", "Runs", "answering", "chunk_runs", "copy_runs", "expand", "gather_runs", "held_runs",
           "shard_rows"]


@dataclass(frozen=True)
class Runs:
    """Runs of consecutive positions of one chunk that one shard holds: run ``i`` is the chunk's
    positions ``[cstart[i], cstart[i] + length[i])``, at local flat indices ``[lstart[i], ...)``
    of the shard's tensor; in chunk order (int64 arrays)."""

    cstart: np.ndarray
    lstart: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.cstart)

    @functools.cached_property
    def total(self) -> int:
        """Positions in all (worked out once: a kept layout's runs are asked per chunk, and a
        numpy sum was ~3 us of a receiver group's ~25 us a chunk in finding what it shares)."""
        return int(self.length.sum())

    @functools.cached_property
    def addresses(self) -> tuple[int, int, int]:
        """The three arrays' addresses, for a C call (contiguous int64; they live as long as this
        object): worked out once, as a kept layout's runs are (``chunk_runs``) asked for per chunk."""
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (self.cstart, self.lstart, self.length)]
        object.__setattr__(self, "_kept", arrays)  # (what the addresses point into)
        return arrays[0].ctypes.data, arrays[1].ctypes.data, arrays[2].ctypes.data


NO_RUNS = Runs(*(np.empty(0, dtype=np.int64) for _ in range(3)))

Rows = tuple  # (local starts, canonical starts: int64 arrays, length): IndexMap.rows on the host


def _kept_or_worked(kept, work, *key):
    """``kept(*key)`` (an lru_cache of ``work``), or ``work(*key)`` where the key cannot be kept:
    a spec of lists, not tuples, is unhashable. (The cache's own hash says so: a ``hash`` first
    hashed every key twice, ~2 us of a chunk's lookup. A TypeError of ``work`` itself is raised
    again by the second call.)"""
    try:
        return kept(*key)
    except TypeError:
        return work(*key)


def _rows(spec: ShardSpec) -> Rows:
    lt, gt, length = IndexMap(spec).rows()
    local, glob = lt.numpy(), gt.numpy()
    local.flags.writeable = glob.flags.writeable = False  # (shared by every caller: kept)
    return local, glob, length


_rows_kept = functools.lru_cache(maxsize=1 << 12)(_rows)


def shard_rows(spec: ShardSpec) -> Rows:
    """``IndexMap.rows`` of the shard, as numpy arrays (read-only), worked out once per layout (a
    model's tensors share a few; a keyframe's copy into a receiver's shards asks per chunk)."""
    return _kept_or_worked(_rows_kept, _rows, spec)


def _held(region: ShardSpec, start: int, n: int, spec: ShardSpec) -> Runs:
    runs = held_runs(shard_rows(region), start, n, shard_rows(spec))
    for a in (runs.cstart, runs.lstart, runs.length):
        a.flags.writeable = False  # (shared by every caller: kept)
    return runs


_held_kept = functools.lru_cache(maxsize=1 << 10)(_held)


def chunk_runs(region: ShardSpec, start: int, n: int, spec: ShardSpec) -> Runs:
    """``held_runs`` of chunk ``[start, start + n)`` of ``region`` by the shard ``spec`` (read-only
    arrays), worked out once per layout: the entries of a version share a few (every layer's shard
    of one shape on one rank), so most chunks' runs are a lookup, in a receiver group's decode and
    in a keyframe's copy into a receiver's shards alike (~130 us a chunk worked out)."""
    return _kept_or_worked(_held_kept, _held, region, start, n, spec)


def _cut(rows: Rows, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A shard's rows cut to its local flat range ``[lo, hi)`` (not empty) -> (local starts,
    canonical starts, lengths)."""
    local, glob, length = rows
    i, j = lo // length, (hi - 1) // length + 1
    ls, gs = local[i:j].copy(), glob[i:j].copy()
    ends = ls + length
    ends[-1] = min(int(ends[-1]), hi)
    gs[0] += lo - ls[0]
    ls[0] = lo
    return ls, gs, ends - ls


def held_runs(region: Rows, start: int, n: int, rows: Rows) -> Runs:
    """The runs of chunk ``[start, start + n)`` of an entry's region (its rows) that a shard
    (its rows) holds: the two sets of runs intersected in canonical order, where both increase."""
    bl, bg, bn = rows
    if not len(bl):
        return NO_RUNS
    al, ag, an = _cut(region, start, start + n)
    aend = ag + an
    first = np.searchsorted(bg, ag - bn, side="right")  # the first shard run ending past each chunk run's start
    last = np.searchsorted(bg, aend, side="left")  # past the last starting before its end
    cnt = np.maximum(last - first, 0)
    total = int(cnt.sum())
    if not total:
        return NO_RUNS
    ai = np.repeat(np.arange(len(al)), cnt)
    bi = first[ai] + np.arange(total) - (np.cumsum(cnt) - cnt)[ai]
    lo, hi = np.maximum(ag[ai], bg[bi]), np.minimum(aend[ai], bg[bi] + bn)
    keep = hi > lo
    ai, bi, lo, hi = ai[keep], bi[keep], lo[keep], hi[keep]
    return Runs(al[ai] - start + (lo - ag[ai]), bl[bi] + (lo - bg[bi]), hi - lo)


def expand(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Runs -> the index of each of their elements, in turn."""
    first = np.cumsum(length) - length
    return np.repeat(start - first, length) + np.arange(int(length.sum()), dtype=np.int64)


def answering(held: dict[int, Runs], n: int, disjoint: bool) -> dict[int, Runs]:
    """The runs of a chunk of ``n`` positions each rank of a group answers for, from the runs it
    holds: its own where no two ranks' shards overlap (``disjoint``), else the positions no lower
    rank holds (several ranks holding the same elements: replicas)."""
    if disjoint:
        return dict(held)
    covered = np.zeros(n, dtype=bool)
    out = {}
    for rank in sorted(held):
        h = held[rank]
        c, local = expand(h.cstart, h.length), expand(h.lstart, h.length)
        own = ~covered[c]
        covered[c] = True
        c, local = c[own], local[own]
        if c.size:  # as runs again, split where either order jumps
            cut = np.flatnonzero((np.diff(c) != 1) | (np.diff(local) != 1)) + 1
            starts = np.concatenate(([0], cut))
            out[rank] = Runs(c[starts], local[starts], np.diff(np.concatenate((starts, [c.size]))))
    return out


def gather_runs(src: torch.Tensor, runs: Runs) -> torch.Tensor:
    """The inverse of ``copy_runs``: a new 1-D tensor of ``runs.total`` elements whose positions
    ``cstart[i] : + length[i]`` hold ``src[lstart[i] : + length[i]]`` (a chunk's bits gathered
    from a receiver's memory that holds all of it: the positions cover ``[0, total)``)."""
    out = torch.empty(runs.total, dtype=src.dtype, device=src.device)
    if not _c_copy(out, src, runs, gather=True):
        copy_runs(out, src, Runs(runs.lstart, runs.cstart, runs.length))
    return out


def _c_copy(dst: torch.Tensor, src: torch.Tensor, runs: Runs, gather: bool = False) -> bool:
    """``copy_runs`` (or its inverse) in one C call (``dcr_copy_runs``) for host tensors; False
    where the library is not there (or the tensors are not on the host): the caller copies.
    ``IndexError`` for runs outside either tensor, nothing copied."""
    lib = native.lib()
    if lib is None or not (dst.is_cpu and src.is_cpu) or dst.element_size() != src.element_size():
        return False
    c, loc, n = runs.addresses
    to, frm = (c, loc) if gather else (loc, c)
    if lib.dcr_copy_runs(dst.data_ptr(), dst.numel(), src.data_ptr(), src.numel(), dst.element_size(), to, frm, n,
                         len(runs)):
        raise IndexError(f"runs outside their tensors ({dst.numel()} and {src.numel()} elements)")
    torch.autograd.graph.increment_version(dst)  # (written behind torch's back: see copy_runs)
    return True


def copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: Runs) -> None:
    """``dst[lstart[i] : + length[i]] = src[cstart[i] : + length[i]]`` for every run (``dst``,
    ``src``: 1-D contiguous, one element size). On the host one C call (``dcr_copy_runs``: a
    chunk's 256 runs cost ~50 us of numpy calls); without the library, through numpy: the runs
    between the first and the last, where they are alike (one length, one step in each order: a
    box's full rows), as one strided copy, others one by one (a chunk's copy is ~100 KB on an
    apply worker, where torch's copy split it over its own threads as well, and with a TP
    engine's workers on the same cores a copy waited ~1 ms for a descheduled helper:
    docs/results.md, twenty-sixth turn)."""
    n = len(runs)
    if n == 0:
        return
    if _c_copy(dst, src, runs):
        return
    c, loc, ln = runs.cstart, runs.lstart, runs.length
    mid = slice(1, n - 1)
    alike = n > 3 and (ln[mid] == ln[1]).all() and (np.diff(c[mid]) == c[2] - c[1]).all() \
        and (np.diff(loc[mid]) == loc[2] - loc[1]).all()
    each = [0, n - 1] if alike else range(n)
    if not (dst.is_cpu and src.is_cpu):
        if alike:
            shape = (n - 2, int(ln[1]))
            dst.as_strided(shape, (int(loc[2] - loc[1]), 1), dst.storage_offset() + int(loc[1])).copy_(
                src.as_strided(shape, (int(c[2] - c[1]), 1), src.storage_offset() + int(c[1])))
        for i in each:
            dst[int(loc[i]):int(loc[i] + ln[i])].copy_(src[int(c[i]):int(c[i] + ln[i])])
        return
    view = INT_VIEW[dst.element_size()]
    d, s = dst.view(view).numpy(), src.view(view).numpy()
    if alike:
        shape = (n - 2, int(ln[1]))
        for at, size in ((loc, d.size), (c, s.size)):  # (numpy's as_strided checks no bounds: here)
            if min(at[1], at[n - 2]) < 0 or max(at[1], at[n - 2]) + shape[1] > size:
                raise IndexError(f"runs outside their tensors ({size} elements)")
        w, as_strided = d.itemsize, np.lib.stride_tricks.as_strided
        np.copyto(as_strided(d[int(loc[1]):], shape, (int(loc[2] - loc[1]) * w, w)),
                  as_strided(s[int(c[1]):], shape, (int(c[2] - c[1]) * w, w)))
    for i in each:
        d[int(loc[i]):int(loc[i] + ln[i])] = s[int(c[i]):int(c[i] + ln[i])]
    # written behind torch's back: its version counter says so, as copy_ would (the rollout
    # loader's replicas and a vLLM worker's rebuilt layers go by it)
    torch.autograd.graph.increment_version(dst)
