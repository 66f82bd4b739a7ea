"""CRC-32 of the format's checksums (zlib's: ``zlib.crc32``'s values), by the C library where it
runs (``csrc/dcr_crc32.c``: carry-less multiplication, ~3.3x zlib's table code on 2 MiB here,
where zlib's was a tenth of a keyframe sync's CPU), else by zlib. Short buffers (headers, indexes)
go to zlib: there the call costs more than the checksum."""
from __future__ import annotations

import ctypes
import zlib

from nemo_dcr.codec import native

NATIVE_MIN = 4096  # bytes: shorter buffers go to zlib
#: bytes up to which the C CRC keeps the GIL (``native.held``: ~50 us here), so that a chunk's
#: CRC on a worker does not wait to take it back; longer ones give it up while they run
HELD_MAX = 128 << 10


def crc32(data, value: int = 0, use_native: bool | None = None) -> int:
    """``zlib.crc32(data, value)`` for any contiguous bytes-like ``data``."""
    lib = native.lib() if use_native is not False else None
    if lib is not None:
        a, address = native.buffer_address(data)
        if a.size >= NATIVE_MIN or use_native:
            if a.size <= HELD_MAX:
                lib = native.held() or lib
            out = ctypes.c_uint32()
            if lib.dcr_crc32(address, a.size, value, ctypes.byref(out)) == 0:
                return out.value
    return zlib.crc32(data, value)
