"""The host memory of model-sized work: model-sized buffers on huge pages, download buffers
faulted in ahead of their writer, and freed memory handed back to the system after the large
transient work of a keyframe."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from nemo_dcr.util.parallel import standing

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching their bytes
PREFAULT_MIN = 4 << 20  # smaller buffers fault in faster than a helper thread starts
PREFAULT_STEP = 2 << 20  # bytes faulted in per call; between calls the helper skips what the writer reached


def release_freed_memory() -> None:
    """Give the memory freed after a keyframe back to the system: glibc keeps what its worker
    threads freed (download buffers, dense chunks and their compressed copies) in their arenas,
    and the resident size stayed far above what the process holds (issue 25: a follower at ~2x
    the model after a keyframe sync, 540 MB -> 337 MB for a 0.1 GB model; a publisher at 1.23x
    the model beyond its snapshot after its first keyframe of 0.25 GiB, 1.04x trimmed). Takes a
    few ms (5-6 ms at 0.25 GiB). Nothing on other C libraries."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``: ~1 ms), or None."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def host_empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.empty_like(t, dtype=dtype, device="cpu")`` (same strides where ``t``'s are
    dense), its memory advised to be backed by transparent huge pages before anything touches
    it, as PyTorch's own ``THP_MEM_ALLOC_ENABLE`` does for every large allocation.

    For copies made again and again (a trainer's copy of its model at every step): each is
    otherwise faulted in 4 KiB at a time. A 1 GiB model in 32 MB tensors took ~280 ms per step
    to copy, ~120 ms on huge pages. Not for a buffer made once: on this project's VM the first
    huge pages of a process cost more than small ones (that copy's first step: 1.2 s against
    0.3 s), so a follower's tensors and the publisher's own snapshot stay on small pages
    (docs/results.md, issue 25's tenth turn). Only where the kernel's THP mode is ``madvise`` or
    ``always``; ``NEMO_DCR_HUGE_PAGES=0`` turns it off."""
    out = torch.empty_like(t, dtype=dtype, device="cpu")
    advise_huge_pages(out)
    return out


def host_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A private host copy of ``t`` (as ``t.detach().to(device="cpu", dtype=dtype, copy=True)``)
    on huge pages (``host_empty_like``)."""
    return host_empty_like(t, dtype).copy_(t.detach())


def advise_huge_pages(t: torch.Tensor) -> None:
    """Advise the whole huge pages inside ``t``'s storage (none for a storage under 2 MiB);
    nothing where that cannot be done. Call it before the storage is first written."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu":
        return
    s = t.untyped_storage()
    p, n = s.data_ptr(), s.nbytes()
    lo, hi = -(-p // HUGE_PAGE) * HUGE_PAGE, (p + n) // HUGE_PAGE * HUGE_PAGE
    if hi > lo:
        madvise(lo, hi - lo, _MADV_HUGEPAGE)  # an error (no THP in this kernel) changes nothing


@functools.cache
def _madvise():
    """libc's ``madvise``, where huge pages are on offer and not turned off, or None."""
    if os.environ.get("NEMO_DCR_HUGE_PAGES", "1") == "0":
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
    except OSError:
        return None
    return _libc_madvise()


@functools.cache
def _libc_madvise():
    """libc's ``madvise`` on Linux, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class PrefaultedBuffer:
    """A writable anonymous mapping of ``size`` bytes (``view``: a memoryview of it) whose pages
    a helper thread faults in ahead of the writer, where Linux can (``MADV_POPULATE_WRITE``).

    Why: a follower's download is copied into a fresh buffer as it arrives, and each first write
    to a 4 KiB page is a page fault on the copying thread: ~2.5 us a page on this project's VM,
    52-63 ms of a 64M BF16 keyframe sync's ~90 ms fetch, with the apply workers waiting on the
    fetch (docs/results.md, "Format version 3, sixteenth turn"). Faulted in by the helper,
    a range at a time on a core the fetch leaves idle, those faults leave the critical path.
    Huge pages were no help for a buffer made once (``host_empty_like``).

    The populate never changes a byte (bytes written already stay as they are), so the helper
    and the writer need no lock: ``written()`` (how far the writer is) only lets the helper skip
    what the writer faulted in itself. The helper holds the mapping until it ends (so its range
    is never another mapping's) and ends at the end of the buffer, at ``stop()``, or at once
    where the kernel does not know the advice. It runs on the process's standing threads
    (``util/parallel.standing``), as a sync's downloads do: a thread started per buffer made the
    download thread, the sync's critical path, wait for it to run. ``helper``: its Future (None:
    no helper)."""

    def __init__(self, size: int, written: Callable[[], int] | None = None):
        self._map = mmap.mmap(-1, size)
        self.view = memoryview(self._map)
        self._stop = threading.Event()
        self.helper: Future | None = None
        madvise = _libc_madvise()
        if madvise is None or size < PREFAULT_MIN:
            return
        c = ctypes.c_char.from_buffer(self._map)
        addr = ctypes.addressof(c)
        del c  # (an export would keep the mapping from being closed)
        self.helper = standing(self._run, madvise, addr, size, self._map, written)

    def _run(self, madvise, addr: int, size: int, held: mmap.mmap, written) -> None:
        pos = 0
        while pos < size and not self._stop.is_set():
            if written is not None:  # what the writer reached, it faulted in itself
                pos = max(pos, -(-written() // mmap.PAGESIZE) * mmap.PAGESIZE)
                if pos >= size:
                    break
            n = min(PREFAULT_STEP, size - pos)
            if madvise(addr + pos, n, _MADV_POPULATE_WRITE) != 0:
                break  # EINVAL: a kernel before 5.14; the writer faults its pages as before
            pos += n
        del held

    def stop(self) -> None:
        """End the helper early (a download given up: no need to fault in the rest)."""
        self._stop.set()
