"""The receiver memory a delta writes in place, claimed before the first write.

Two names of the receiver's mapping can be one memory: a module's ``state_dict()`` lists tied
weights under both names (``lm_head.weight``, ``model.embed_tokens.weight``). A delta that writes
both would have its chunks of the two entries run on two workers at once over the same bits: the
second reads bits the first is writing, and a chunk that fails its pre-image check writes its
old bits back over the first one's writes. So ``apply`` claims each written tensor's memory
before its first write and refuses a second claim on the same bytes, naming both tensors, with
nothing changed. (This project's own snapshots and receivers name tied weights once:
``integrations.snapshot.module_tensors``.)

Views of one storage that interleave without sharing a byte (the columns of a matrix, split)
are not refused: where two spans overlap and either view has gaps, the bytes each covers are
marked and compared.
"""
from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable

import torch

from nemo_dcr.errors import AliasedWriteError


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes from ``t``'s first element to the end of its last (None: it holds none)."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    es, lo = t.element_size(), t.data_ptr()
    if t.is_contiguous():
        return lo, lo + es * t.numel()
    return lo, lo + es * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 1))


def _dense(t: torch.Tensor, span: tuple[int, int]) -> bool:
    """Every byte of the span is one of ``t``'s (no gaps between its elements)."""
    return span[1] - span[0] == t.numel() * t.element_size()


def _marks(t: torch.Tensor, lo: int, m: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a view of ``m``, which stands for the memory from address ``lo`` on."""
    es = t.element_size()
    return m.as_strided(tuple(t.shape) + (es,), tuple(s * es for s in t.stride()) + (1,), t.data_ptr() - lo)


def share_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have a byte of memory in common."""
    if a.device != b.device:
        return False
    sa, sb = _span(a), _span(b)
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False
    if _dense(a, sa) or _dense(b, sb):
        return True  # one covers its whole span, and the other has a byte inside it
    lo, hi = min(sa[0], sb[0]), max(sa[1], sb[1])
    m = torch.zeros(hi - lo, dtype=torch.uint8)
    _marks(a, lo, m).fill_(1)
    return bool(_marks(b, lo, m).any())


class Claims:
    """The memory claimed so far by the tensors a delta writes in place, by name. ``claim``
    refuses a tensor sharing a byte with one claimed under another name. Thread-safe: the
    parts of a version streamed at once claim from their own threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._starts: list[tuple[int, int]] = []  # (span start, order claimed), sorted
        self._held: list[tuple[tuple[int, int], str, torch.Tensor]] = []  # by order claimed
        self._longest = 0  # the longest span: nothing starting further back reaches a new one

    def claim(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Claim each ``(name, tensor)``; all of them, or none and ``AliasedWriteError``."""
        with self._lock:
            kept, longest = len(self._held), self._longest
            try:
                for name, t in named:
                    span = _span(t)
                    if span is None:
                        continue
                    other = self._holder(span, t, name)
                    if other is not None:
                        raise AliasedWriteError(
                            f"{other} and {name} share memory in the receiver (tied weights under two names?), "
                            f"and this delta writes both; refused before writing either. Publish such a tensor "
                            f"under one name (nemo_dcr.integrations.module_tensors takes each storage once), "
                            f"or give the receiver each memory under one name.")
                    bisect.insort(self._starts, (span[0], len(self._held)))
                    self._held.append((span, name, t))
                    self._longest = max(self._longest, span[1] - span[0])
            except BaseException:
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
