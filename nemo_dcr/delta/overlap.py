"""The receiver memory a delta writes in place, claimed before the first write.

Two names of the receiver's mapping can be one memory: a module's ``state_dict()`` lists tied
weights under both names (``lm_head.weight``, ``model.embed_tokens.weight``). A delta that writes
both would have its chunks of the two entries run on two workers at once over the same bits: the
second reads bits the first is writing, and a chunk that fails its pre-image check writes its
old bits back over the first one's writes. So ``apply`` claims each written tensor's memory
before its first write and refuses a second claim on the same bytes, naming both tensors
(an ``apply`` refused so changed nothing; an ``apply_stream``, before the refused segment).
This project's own snapshots and receivers name tied weights once
(``integrations.snapshot.module_tensors``).

Views of one storage that interleave without sharing a byte (the columns of a matrix, split)
are not refused: where two spans overlap and neither view is dense, views of runs a common
stride apart are compared arithmetically, and any other layouts byte by byte.
"""
from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable

import torch

from nemo_dcr.errors import AliasedWriteError

MARKS_MAX = 64 << 20  # the longest byte buffer ``share_bytes`` marks two views in


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes from ``t``'s first element to the end of its last (None: it holds none)."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    es, lo = t.element_size(), t.data_ptr()
    if t.is_contiguous():
        return lo, lo + es * t.numel()
    return lo, lo + es * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 1))


def _dense(t: torch.Tensor) -> bool:
    """Every byte of ``t``'s span is one of its elements', each once (in some order of its dims)."""
    if t.is_contiguous():
        return True
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1),
                        key=lambda d: d[1]):
        if st != expected:
            return False
        expected *= n
    return True


def _marks(t: torch.Tensor, lo: int, m: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a view of ``m``, which stands for the memory from address ``lo`` on."""
    es = t.element_size()
    return m.as_strided(tuple(t.shape) + (es,), tuple(s * es for s in t.stride()) + (1,), t.data_ptr() - lo)


def _rows(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``t`` as ``(rows, row stride, run)`` in bytes, where it is runs of adjacent elements a
    fixed stride apart (a column block of a matrix, every k-th element); None otherwise."""
    es = t.element_size()
    dims: list[list[int]] = []
    for n, st in zip(t.shape, t.stride(), strict=True):
        if n == 1:
            continue
        if st == 0:
            return None  # an expanded view: one element at several places
        if dims and dims[-1][1] == st * n:  # contiguous with the dim before: one dim
            dims[-1] = [dims[-1][0] * n, st]
        else:
            dims.append([n, st])
    if len(dims) == 1:
        return dims[0][0], dims[0][1] * es, es
    if len(dims) == 2 and dims[1][1] == 1:
        return dims[0][0], dims[0][1] * es, dims[1][0] * es
    return None


def _rows_meet(pa: int, ra: tuple[int, int, int], pb: int, rb: tuple[int, int, int]) -> bool:
    """Rows ``[pa + i*S, pa + i*S + La)``, ``i < na``, and ``[pb + j*S, pb + j*S + Lb)``, ``j < nb``
    (one stride ``S > 0``) meet where ``-Lb < d + k*S < La`` for ``d = pb - pa`` and some
    ``k = j - i`` in ``[-(na-1), nb-1]``."""
    (na, stride, la), (nb, _, lb) = ra, rb
    d = pb - pa
    k_lo = (-lb - d) // stride + 1   # the least k with k*S > -Lb - d
    k_hi = -((d - la) // stride) - 1  # the greatest k with k*S < La - d
    return max(k_lo, -(na - 1)) <= min(k_hi, nb - 1)


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have a byte of memory in common."""
    if a.device != b.device:
        return False
    sa, sb = _span(a), _span(b)
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False
    # a dense view is one run (of any stride: it has one row)
    ra = (1, 0, sa[1] - sa[0]) if _dense(a) else _rows(a)
    rb = (1, 0, sb[1] - sb[0]) if _dense(b) else _rows(b)
    if ra is not None and rb is not None:
        stride = max(ra[1], rb[1])
        if stride == 0:
            return True  # two runs whose spans meet
        if ra[1] in (0, stride) and rb[1] in (0, stride):  # the usual interleaving: arithmetic, no memory
            return _rows_meet(sa[0], (ra[0], stride, ra[2]), sb[0], (rb[0], stride, rb[2]))
    # any other layout: the bytes of each marked in a buffer as long as both spans, or, where
    # that is long, the longer view taken apart along its outer dim (parts whose spans miss the
    # other view's return at once)
    lo, hi = min(sa[0], sb[0]), max(sa[1], sb[1])
    if hi - lo > MARKS_MAX:
        if sa[1] - sa[0] < sb[1] - sb[0]:
            a, b = b, a
        dim = next(i for i, n in enumerate(a.shape) if n > 1)  # one exists: a is not dense
        return any(share_bytes(part, b) for part in a.unbind(dim))
    m = torch.zeros(hi - lo, dtype=torch.uint8)
    _marks(a, lo, m).fill_(1)
    return bool(_marks(b, lo, m).any())


def _key(name: str, t: torch.Tensor, span: tuple[int, int]) -> tuple:
    return name, t.device, span, tuple(t.shape), tuple(t.stride())


class Claims:
    """The memory claimed so far by the tensors a delta writes in place, by name. ``claim``
    refuses a tensor sharing a byte with one claimed under another name. Thread-safe: the
    parts of a version streamed at once claim from their own threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._starts: list[tuple[int, int]] = []  # (span start, order claimed), sorted
        self._held: list[tuple[tuple[int, int], str, torch.Tensor]] = []  # by order claimed
        self._longest = 0  # the longest span: nothing starting further back reaches a new one
        # what is held already, by name: a tensor's later segments (and a version's retry) claim
        # it again, and a second entry for it would lengthen every later scan
        self._seen: set = set()

    def claim(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Claim each ``(name, tensor)``; all of them, or none and ``AliasedWriteError``."""
        with self._lock:
            kept, longest = len(self._held), self._longest
            try:
                for name, t in named:
                    span = _span(t)
                    if span is None:
                        continue
                    key = _key(name, t, span)
                    if key in self._seen:
                        continue
                    other = self._holder(span, t, name)
                    if other is not None:
                        raise AliasedWriteError(
                            f"{other} and {name} share memory in the receiver (tied weights under two names?), "
                            f"and this delta writes both; refused before writing {name}. Publish such a tensor "
                            f"under one name (nemo_dcr.integrations.module_tensors takes each storage once), "
                            f"or give the receiver each memory under one name.")
                    bisect.insort(self._starts, (span[0], len(self._held)))
                    self._held.append((span, name, t))
                    self._seen.add(key)
                    self._longest = max(self._longest, span[1] - span[0])
            except BaseException:
                self._seen.difference_update(_key(n, u, sp) for sp, n, u in self._held[kept:])
                del self._held[kept:]
                self._starts = [s for s in self._starts if s[1] < kept]
                self._longest = longest
                raise

    def _holder(self, span: tuple[int, int], t: torch.Tensor, name: str) -> str | None:
        i = bisect.bisect_left(self._starts, (span[1],))
        while i > 0:
            i -= 1
            start, k = self._starts[i]
            if start + self._longest <= span[0]:
                return None
            s, other, u = self._held[k]
            if other != name and s[1] > span[0] and share_bytes(t, u):
                return other
        return None
