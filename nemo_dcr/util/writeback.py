"""Start a file's writeback while it is still being written, so that its final ``fsync`` waits
for the last few MB rather than for the whole file.

A large object written to a local disk piece by piece (a keyframe part: ~90 MB for a 64M-element
BF16 shard) sat in the page cache until the ``fsync`` that makes it durable, and that ``fsync``
then waited for all of it to reach the disk: ~40 ms after the encode's last byte on this
project's VM (docs/results.md, issue 25). Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``
queues the writeback of a range and returns; asked for each few MB as they are written, the
disk works while the next ones are encoded. It is only a hint: it guarantees nothing, the
``fsync`` still does, and where the call does not exist (other systems) or fails (a file
system without it) nothing is asked and nothing changes.
"""
from __future__ import annotations

import ctypes
import functools

KICK_EVERY = 8 << 20  # bytes written before their writeback is asked for
_SYNC_FILE_RANGE_WRITE = 2  # Linux: start writeback of the range's dirty pages, do not wait


@functools.cache
def _sync_file_range():
    """glibc's ``sync_file_range``, looked up once, or None (another C library or system)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):  # (TypeError: a system where CDLL(None) is no library)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to start writing ``length`` bytes of ``fd`` from ``offset`` to its disk,
    without waiting. True if it was asked; False where it cannot be (no such call, or the call
    failed: the bytes are then written back as they would have been)."""
    fn = _sync_file_range()
    if fn is None or length <= 0:
        return False
    return fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0  # (ctypes gives the GIL up meanwhile)


class Writeback:
    """The writeback of one file written front to back: ``wrote(n)`` after each write of ``n``
    bytes; every ``every`` bytes, the ones not yet asked for are (``start_writeback``). The
    last ones are left to the writer's ``fsync``."""

    def __init__(self, fd: int, every: int = KICK_EVERY):
        self.fd, self.every = fd, every
        self.written = 0  # bytes written so far
        self.asked = 0  # bytes whose writeback was asked for (a prefix of the file)

    def wrote(self, n: int) -> None:
        self.written += n
        if self.written - self.asked >= self.every:
            start_writeback(self.fd, self.asked, self.written - self.asked)
            self.asked = self.written
