"""Model-sized host buffers (util/memory.py): the copy of the model a trainer's callback makes
at every step, on huge pages (a copy is the copy ``.to("cpu", copy=True)`` makes, and where the
kernel offers transparent huge pages on advice, the buffer is backed by them); and a follower's
download buffer, faulted in ahead of its writer by a helper that never changes a byte."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nemo_dcr.util import memory


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold ``t``'s storage (/proc/self/smaps; the advice
    splits a mapping, so the storage spans several)."""
    s = t.untyped_storage()
    p, end = s.data_ptr(), s.data_ptr() + s.nbytes()
    inside, kb = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and p < hi
            elif inside and head == "AnonHugePages:":
                kb += int(line.split()[1])
    return kb


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.reshape(-1).to(torch.uint8)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 5, dtype=torch.float32),
    lambda: torch.randn(64, 48).to(torch.bfloat16).t(),               # transposed: strides kept
    lambda: torch.arange(6, dtype=torch.int64).expand(4, 6),          # overlapping: made dense
    lambda: torch.tensor(float("nan")).view(1)[0],                    # 0-dim
    lambda: torch.tensor([True, False, True]),
    lambda: torch.tensor([-0.0, float("inf"), 1e-45], dtype=torch.float32),
    lambda: torch.randn(4, requires_grad=True),
    lambda: torch.empty(0, 7, dtype=torch.float16),
], ids=["f32", "bf16-transposed", "expanded", "0-dim", "bool", "specials", "requires-grad", "empty"])
def test_host_copy_is_the_copy_to_makes(make):
    src = make()
    want = src.detach().to("cpu", copy=True)
    got = memory.host_copy(src)
    assert (got.dtype, got.shape, got.stride(), got.requires_grad) == (want.dtype, want.shape, want.stride(), False)
    assert torch.equal(_bits(got.contiguous()), _bits(want.contiguous()))
    if src.numel():
        assert got.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


def _buffer(nbytes: int) -> torch.Tensor:
    return memory.host_empty_like(torch.empty(nbytes, dtype=torch.uint8, device="meta"))


def test_host_empty_like_has_the_shape_and_dtype_asked():
    t = memory.host_empty_like(torch.empty(3, 4, device="meta"), torch.float16)
    assert (t.shape, t.dtype, t.device.type, t.is_contiguous()) == (torch.Size([3, 4]), torch.float16, "cpu", True)


needs_thp = pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps") or _thp_mode() not in ("madvise", "always")
    or os.environ.get("NEMO_DCR_HUGE_PAGES") == "0", reason="needs Linux with transparent huge pages on advice")


@needs_thp
def test_a_model_sized_buffer_is_on_huge_pages():
    """64 MiB: above glibc's largest mmap threshold (32 MiB), so fresh memory, not reused pages."""
    t = _buffer(64 << 20)
    t.fill_(7)
    assert _huge_kb(t) >= 2048, "the advised buffer got no huge page"
    if _thp_mode() == "madvise":  # without the advice, the kernel gives none: the advice is what did it
        plain = torch.empty(64 << 20, dtype=torch.uint8)
        plain.fill_(7)
        assert _huge_kb(plain) == 0


@needs_thp
def test_huge_pages_can_be_turned_off():
    code = ("from nemo_dcr.util import memory; import tests.test_host_memory as h; "
            "t = h._buffer(64 << 20); t.fill_(1); print(memory._madvise() is None, h._huge_kb(t))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "NEMO_DCR_HUGE_PAGES": "0"},
                         cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split()
    assert out[0] == "True"
    if _thp_mode() == "madvise":
        assert out[1] == "0"


def test_only_whole_huge_pages_inside_the_storage_are_advised(monkeypatch):
    """The advice covers the 2 MiB-aligned pages wholly inside the storage, and nothing for a
    storage with none inside (under 2 MiB, or empty)."""
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda: lambda addr, n, advice: calls.append((addr, n, advice)))
    for nbytes in (0, 4000, (2 << 20) - 1):
        memory.advise_huge_pages(torch.empty(nbytes, dtype=torch.uint8))
    assert calls == []
    t = torch.empty(9 << 20, dtype=torch.uint8)
    memory.advise_huge_pages(t)
    (addr, n, advice), = calls
    p = t.untyped_storage().data_ptr()
    assert advice == 14 and addr % memory.HUGE_PAGE == 0 and n % memory.HUGE_PAGE == 0
    assert p <= addr and addr + n <= p + (9 << 20) and n >= (9 << 20) - 2 * memory.HUGE_PAGE


PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_pages(b: memory.PrefaultedBuffer) -> int:
    """Pages of ``b``'s mapping in memory (``mincore``): the ones something faulted in."""
    import ctypes
    n = len(b.view)
    c = ctypes.c_char.from_buffer(b.view)
    addr = ctypes.addressof(c)
    del c
    vec = (ctypes.c_ubyte * (-(-n // PAGE)))()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def _prefault_supported() -> bool:
    """Whether this kernel takes MADV_POPULATE_WRITE (Linux 5.14+), asked of a mapping of its own."""
    b = memory.PrefaultedBuffer(memory.PREFAULT_MIN)
    if b.helper is None:
        return False
    b.helper.result(30)
    return _resident_pages(b) > 0


needs_prefault = pytest.mark.skipif(not sys.platform.startswith("linux") or not _prefault_supported(),
                                    reason="the kernel does not take MADV_POPULATE_WRITE (Linux 5.14+)")


@needs_prefault
def test_a_download_buffer_is_faulted_in_ahead_of_its_writer():
    size = 8 * memory.PREFAULT_STEP + 3 * PAGE  # the last step a part of one
    b = memory.PrefaultedBuffer(size, written=lambda: 0)
    assert b.helper is not None
    b.helper.result(30)
    assert b.helper.done()
    assert _resident_pages(b) == -(-size // PAGE)  # every page, none of them written by anyone
    assert bytes(b.view[:PAGE]) == bytes(PAGE) and bytes(b.view[-PAGE:]) == bytes(PAGE)
    # below PREFAULT_MIN the writer faults its pages itself: no thread is started
    small = memory.PrefaultedBuffer(memory.PREFAULT_MIN - PAGE)
    assert small.helper is None and _resident_pages(small) == 0


@needs_prefault
def test_the_helper_never_changes_what_the_writer_wrote():
    """The writer copies a download in while the helper runs: every byte written is still there,
    whichever of the two reached a page first."""
    size = 16 * memory.PREFAULT_STEP
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()
    filled = [0]
    b = memory.PrefaultedBuffer(size, written=lambda: filled[0])
    step = 64 << 10
    for n in range(0, size, step):
        b.view[n:n + step] = data[n:n + step]
        filled[0] = n + step
    assert b.helper is not None
    b.helper.result(30)
    assert bytes(b.view) == data


@needs_prefault
def test_the_helper_skips_what_the_writer_reached_and_stops_when_told():
    size = 8 * memory.PREFAULT_STEP
    b = memory.PrefaultedBuffer(size, written=lambda: size)  # the writer is at the end already
    b.view[0:1] = b"x"
    assert b.helper is not None
    b.helper.result(30)
    assert _resident_pages(b) == 1  # the writer's one page: the helper faulted none
    # told to stop while it asks how far the writer is, before its first step: that step is its last
    import threading
    asked, told = threading.Event(), threading.Event()

    def writer_at_start():
        asked.set()
        assert told.wait(30)
        return 0

    stopped = memory.PrefaultedBuffer(size, written=writer_at_start)
    assert asked.wait(30)
    stopped.stop()
    told.set()
    assert stopped.helper is not None
    stopped.helper.result(30)
    assert stopped.helper.done() and _resident_pages(stopped) == memory.PREFAULT_STEP // PAGE
