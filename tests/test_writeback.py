"""Writeback asked for while a file is written (util/writeback.py): which ranges are asked for,
that the kernel accepts the request on a real file, and that the files written that way -- a
local store's objects, a streamed download, a safetensors file -- hold exactly their bytes."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from nemo_dcr.checkpoint.safetensors_io import write_file
from nemo_dcr.stores.http import write_stream_to_file
from nemo_dcr.stores.local import LocalStore
from nemo_dcr.util import writeback
from nemo_dcr.util.writeback import Writeback, start_writeback

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")


@pytest.fixture
def asked(monkeypatch):
    """Every writeback asked for, as (fd, offset, length); each still asked of the kernel."""
    out = []

    def record(fd, offset, length):
        out.append((fd, offset, length))
        return real(fd, offset, length)

    real = writeback.start_writeback
    monkeypatch.setattr(writeback, "start_writeback", record)
    return out


def _check_prefix(asked, every, total):
    """The ranges asked for are the file's first bytes, in order, none shorter than ``every``,
    and what is left unasked (for the fsync) is shorter than ``every``."""
    pos = 0
    for _, offset, length in asked:
        assert offset == pos and length >= every
        pos += length
    assert 0 <= total - pos < every


def test_ranges_asked_cover_the_file_every_few_bytes(asked, tmp_path):
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, 5000, 200)] + [20000, 1, 3]
    with open(tmp_path / "f", "wb", buffering=0) as f:
        wb = Writeback(f.fileno(), every=4096)
        for n in sizes:
            f.write(b"x" * n)
            wb.wrote(n)
    assert len(asked) > 50
    _check_prefix(asked, 4096, sum(sizes))
    assert all(fd == asked[0][0] for fd, _, _ in asked)


def test_nothing_asked_below_the_threshold(asked, tmp_path):
    with open(tmp_path / "f", "wb", buffering=0) as f:
        wb = Writeback(f.fileno(), every=1 << 20)
        for _ in range(10):
            f.write(b"y" * 1000)
            wb.wrote(1000)
    assert asked == []


@linux
def test_the_kernel_takes_the_request(tmp_path):
    # a wrong binding (argument types, a missing symbol) would return False or raise here
    with open(tmp_path / "f", "wb", buffering=0) as f:
        f.write(os.urandom(1 << 20))
        assert start_writeback(f.fileno(), 0, 1 << 20) is True
        assert start_writeback(f.fileno(), 0, 0) is False  # nothing to ask for


def test_a_bad_descriptor_is_refused_quietly(tmp_path):
    r, w = os.pipe()  # a pipe has no writeback: the call fails, nothing raises
    try:
        assert start_writeback(w, 0, 4096) is False
    finally:
        os.close(r)
        os.close(w)


def _pieces(total: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out, n = [], 0
    while n < total:
        k = min(int(rng.integers(1, 1 << 20)), total - n)
        out.append(rng.integers(0, 256, k, dtype=np.uint8).tobytes())
        n += k
    return out


def test_local_store_object_streamed_with_writeback(asked, tmp_path):
    pieces = _pieces(4 * writeback.KICK_EVERY + 12345, 1)  # pieces <= 1 MiB: asked at <= 9, 18, 27 MiB
    store = LocalStore(tmp_path / "store")
    with store.open_writer("v/obj") as w:
        for p in pieces:
            w.write(p)
    assert store.get("v/obj") == b"".join(pieces)
    _check_prefix(asked, writeback.KICK_EVERY, sum(map(len, pieces)))
    assert len(asked) >= 3


def test_streamed_download_with_writeback(asked, tmp_path):
    pieces = _pieces(4 * writeback.KICK_EVERY + 7, 2)
    total = sum(map(len, pieces))
    write_stream_to_file(total, iter(pieces), tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"".join(pieces)
    _check_prefix(asked, writeback.KICK_EVERY, total)
    assert len(asked) >= 3


def test_safetensors_file_written_with_writeback(asked, tmp_path):
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(1 << 20, generator=g).to(torch.bfloat16) for i in range(10)}
    tensors["tiny"] = torch.tensor([-0.0, float("nan")], dtype=torch.float32)
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    raw = (tmp_path / "ref.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    write_file(str(tmp_path / "out.safetensors"), raw[8:8 + n].decode(), lambda name: tensors[name])
    assert (tmp_path / "out.safetensors").read_bytes() == raw  # byte for byte, writeback or not
    assert load_file(str(tmp_path / "out.safetensors")).keys() == tensors.keys()
    _check_prefix(asked, writeback.KICK_EVERY, len(raw))
    assert len(asked) >= 2
