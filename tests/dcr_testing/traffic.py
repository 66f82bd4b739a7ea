"""Counting the bytes that cross between host and device, on every thread.

``Traffic`` wraps ``torch.Tensor.to``/``cpu``/``cuda``/``copy_`` for the duration of a ``with``
block and counts the bytes of every result on another device type than its source. A
``TorchFunctionMode`` (what tests/gpu/run_gpu.py used before) is thread-local: the receivers apply
chunks on worker threads, whose copies it never saw, so a bound checked with it could not fail.
The methods are patched on the class instead, so every thread's copies are counted (one ``with``
block at a time in a process). ``meta`` counts as a device: a CPU-only test can check the counter
itself (tests/test_traffic.py)."""
from __future__ import annotations

import threading

import torch

_METHODS = ("to", "cpu", "cuda", "copy_")


class Traffic:
    """``with Traffic() as moved:`` ... ``moved.h2d``, ``moved.d2h``: bytes host->device and back."""

    _active = threading.Lock()  # one counter at a time: the methods are patched process-wide

    def __init__(self):
        self.h2d = self.d2h = 0
        self._lock = threading.Lock()
        self._saved: dict = {}

    def _count(self, src, dst) -> None:
        if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device.type != dst.device.type:
            n = dst.numel() * dst.element_size()
            with self._lock:
                if dst.device.type == "cpu":
                    self.d2h += n
                else:
                    self.h2d += n

    def _wrap(self, name: str, real):
        if name == "copy_":
            def copy_(dst, src, *a, **k):
                out = real(dst, src, *a, **k)
                self._count(src, dst)
                return out
            return copy_

        def move(t, *a, **k):
            out = real(t, *a, **k)
            self._count(t, out)
            return out
        return move

    def __enter__(self) -> Traffic:
        if not Traffic._active.acquire(blocking=False):
            raise RuntimeError("Traffic blocks do not nest: the tensor methods are patched process-wide")
        for name in _METHODS:
            real = torch.Tensor.__dict__.get(name, None)
            self._saved[name] = real  # None: inherited from torch._C.TensorBase
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            if real is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, real)
        self._saved.clear()
        Traffic._active.release()
