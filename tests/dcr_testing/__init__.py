"""Helpers the tests import (fixtures live in tests/conftest.py, nothing here is a fixture).

* this module: bit-exact comparisons and receiver states
  (``from dcr_testing import assert_bits_equal, assert_state, bits, zeros_like``), a store whose
  uploads fail (``FailingStore``)
* ``dcr_testing.shards``: shard layouts (``grid``, ``cut``)
* ``dcr_testing.procs``: groups of worker processes with a deadline (``launch``, ``free_port``)
* ``dcr_testing.s3``: the moto S3 server on 127.0.0.1 and ``S3Store``s on it
* ``dcr_testing.cli``: ``nemo-dcr`` in-process (``run_cli``) and the console script's path
* ``dcr_testing.mp_workers``, ``dcr_testing.mp_megatron``: what the multi-process tests' ranks run
"""
import signal
from contextlib import contextmanager

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparison."""
    from nemo_dcr.state.dtypes import int_view
    return int_view(t)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert torch.equal(bits(a), bits(b)), f"{what}: bits differ"


def zeros_like(state):
    """A receiver's starting tensors: same names, dtypes and shapes, all zero."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


def assert_state(recv, state):
    """Same names, and every tensor bit-identical."""
    assert sorted(recv) == sorted(state)
    for k in state:
        assert_bits_equal(recv[k], state[k], k)


class FailingStore:
    """A LocalStore at ``root`` whose puts of delta objects start failing after ``ok`` of them
    (the callbacks' tests: a publish that fails in the background)."""

    def __init__(self, root, ok):
        from nemo_dcr.stores import LocalStore
        self.inner, self.ok = LocalStore(root), ok

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data):
        if key.endswith(".dcr"):
            if self.ok <= 0:
                raise OSError(f"injected upload failure for {key}")
            self.ok -= 1
        return self.inner.put(key, data)


@contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (SIGALRM; main thread only)."""
    def boom(*_):
        raise AssertionError(f"did not finish within {seconds}s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def record_held_calls(monkeypatch) -> list:
    """The names of the C library's functions called through ``native.held()`` (its GIL-keeping
    handle) from now on, in order; the calls themselves go to the real library."""
    from nemo_dcr.codec import native
    called: list = []
    real = native.held()

    class Recording:
        def __getattr__(self, name):
            called.append(name)
            return getattr(real, name)
    monkeypatch.setattr(native, "held", lambda: Recording())
    return called
