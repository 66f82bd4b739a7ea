"""CRC-32 (codec/checksum.py): the C library's carry-less multiplication gives zlib.crc32's value
for every length (its folding, its 16-byte steps and its byte tail), offset and starting value."""
from __future__ import annotations

import random
import zlib

import pytest

from nemo_dcr.codec import checksum, native

needs_native = pytest.mark.skipif(native.lib() is None, reason=f"C kernels unavailable: {native.build_error}")


@needs_native
def test_native_crc32_is_zlibs():
    rng = random.Random(7)
    blob = bytes(rng.getrandbits(8) for _ in range((1 << 16) + 64))
    lengths = list(range(0, 260)) + [1000, 4095, 4096, 4097, 65521, 1 << 16]
    for n in lengths:
        for off in (0, 1, 13):
            data = memoryview(blob)[off:off + n]  # read-only, unaligned
            for value in (0, rng.getrandbits(32)):
                assert checksum.crc32(data, value, use_native=True) == zlib.crc32(data, value), (n, off, value)


@needs_native
def test_native_crc32_of_special_bytes_and_chained():
    for data in (b"\0" * 5000, b"\xff" * 5000, bytes(range(256)) * 20):
        assert checksum.crc32(data, use_native=True) == zlib.crc32(data)
        a, b = data[:1234], data[1234:]
        assert checksum.crc32(b, checksum.crc32(a, use_native=True), use_native=True) == zlib.crc32(data)


def test_without_the_library_it_is_zlib():
    data = bytes(range(256)) * 100
    assert checksum.crc32(data, 5, use_native=False) == zlib.crc32(data, 5)
    assert checksum.crc32(bytearray(data)) == zlib.crc32(data)
