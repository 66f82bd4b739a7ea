"""The callback's device path (issue 24): when the weights live on a GPU, the publish snapshot is
a capture on the device (``nemo_dcr/device/capture.py``), not a host copy of the model.

    dev = CallbackDevice("auto", keep="device", chunk_elems=..., encoding=..., keyframe_every=...)
    if dev.wants(module, snapshot_fn, format_version):            # weights on CUDA, triton there
        job, shards = dev.take(module, dtype)                     # the training thread's stall
        publisher.publish(job, shards)                            # Publisher(device=dev.base), later

Per publish the training thread runs one fused diff pass per tensor on the device (the live
tensors against the kept snapshot of the previous publish, which it updates in place) and moves
the compact change stream and a 16-byte digest per tensor to the host: O(changes) bytes, where
the host path copied the whole model (``snapshot.module_snapshot``). Megatron models and plain
modules alike: their live tensors (``module_tensors``; Megatron's ``megatron_snapshot(copy=False)``
views, or device-side copies where a block is not a view; a DTensor (FSDP2) module's local blocks,
``dtensor.local_shards``) are captured where they are, with the shards the host path would
publish. A custom ``snapshot_fn`` keeps the host path (what it returns is the caller's).

A capture holds the whole state only where the version needs it: the first one (nothing kept
yet) and keyframe versions (``keyframe_every``). Which version a capture becomes is known from
the first committed one (``committed``): versions follow one per job, and a failed publish stops
the callback. Until that first commit, captures are whole.
"""
from __future__ import annotations

import logging
import threading

from nemo_dcr.codec.names import DEFAULT_CHUNK
from nemo_dcr.codec.versions import FORMAT_VERSION, version
from nemo_dcr.device import kernels
from nemo_dcr.device.capture import Captured, DeviceCapture
from nemo_dcr.errors import DcrError

from .dtensor import is_dtensor, local_shards
from .snapshot import _megatron, is_megatron, module_tensors, parse_dtype

log = logging.getLogger("nemo_dcr.callbacks")
DEVICE_MODES = ("auto", "on", "off")


def live_tensors(module, dtype=None):
    """(tensors, shards) of ``module`` without a host copy: its own tensors, or for a Megatron
    model its local shards as views (device copies where a block is not one); floating-point
    tensors cast to ``dtype`` on their device when one is given. A module with DTensor parameters
    (FSDP2): this rank's blocks of them (views of the local tensors) and their shards, each block
    from one rank, as ``snapshot.module_snapshot`` takes them."""
    if is_megatron(module):
        m = _megatron()
        if hasattr(m, "force_param_sync"):  # a collective: every rank snapshots at the same step
            m.force_param_sync(module)
        try:
            tensors, shards = m.megatron_snapshot(module, copy=False)
        except DcrError:  # a block that is not a view of a parameter (tiled experts): copies where they are
            tensors, shards = m.megatron_snapshot(module, copy=True, device=None)
    else:
        tensors, shards = module_tensors(module), {}
        if any(is_dtensor(t) for t in tensors.values()):
            tensors, shards = local_shards(tensors, main_only=True)
    dt = parse_dtype(dtype)
    if dt is not None:
        tensors = {k: (v.to(dt) if v.is_floating_point() and v.dtype != dt else v) for k, v in tensors.items()}
    return dict(tensors), dict(shards or {})


class CallbackDevice:
    """The callback's choice of path, its capture and what it knows of the version numbers."""

    def __init__(self, device: str = "auto", keep: str = "device", chunk_elems: int = DEFAULT_CHUNK,
                 encoding: str = "auto", level: int = 3, keyframe_every: int = 0):
        if device not in DEVICE_MODES:
            raise ValueError(f"device must be one of {DEVICE_MODES}, not {device!r}")
        self.device = device
        self.capture = DeviceCapture(keep, chunk_elems, encoding, level)
        self.keyframe_every = int(keyframe_every)
        self.active: bool | None = None  # decided at the first publish
        self.shards: dict = {}
        self._taken = 0                  # captures made (the next one's index)
        self._first: int | None = None   # the version of capture 0, once committed
        self._first_known = threading.Event()
        self._lock = threading.Lock()

    @property
    def base(self):
        """What the publisher is given as ``device``."""
        return self.capture.base

    def wants(self, module, snapshot_fn=None, format_version: int = FORMAT_VERSION) -> bool:
        """Whether this publish takes the device path (decided once, at the first publish, and
        logged): ``device`` is not "off", no ``snapshot_fn``, a format version whose chunk digests
        are BLAKE3's (2 to 4: the device coder makes those), triton installed, and the weights on
        a CUDA device (or, with "on" under TRITON_INTERPRET=1, on the CPU: how the tests run it).
        The capture hashes each tensor on the device only for a version whose tensor digests are
        BLAKE3 (2); version 3's and 4's are summed from the changes by the publisher's diff."""
        if self.active is None:
            why = None
            if self.device == "off":
                why = "device='off'"
            elif snapshot_fn is not None:
                why = "a custom snapshot_fn"
            elif version(format_version).values_digest != "blake3":
                why = f"format version {format_version}"
            elif not kernels.available():
                why = 'triton is not installed (pip install "nemo-dcr[gpu]")'
            elif not any(p.is_cuda for p in module_tensors(module).values()) and not (
                    self.device == "on" and kernels.interpreted()):  # (the tests: CPU tensors, interpreted)
                why = "the weights are not on a CUDA device"
            if why is not None and self.device == "on":
                raise DcrError(f"device='on' but the callback's device path cannot run: {why}")
            self.active = why is None
            self.capture.hash_targets = version(format_version).tensor_digest == "blake3"
            if self.active:
                log.info("nemo-dcr callback: device path (snapshot kept in %s memory; per publish only the "
                         "changes come to the host)", "device" if self.capture.keep == "device" else "pinned host")
            else:
                log.info("nemo-dcr callback: host snapshot per publish (%s)", why)
        return self.active

    def _full(self) -> bool:
        """Whether capture number ``_taken`` needs the whole state (nothing kept, or a keyframe)."""
        if not self.capture.kept:
            return True
        if self._taken > 0:
            # the first capture's version is known once it committed (the publish worker may still
            # be at it): waited for once, so that keyframes fall where the publisher puts them; a
            # first publish that failed leaves it unknown, and the capture whole, to be safe
            self._first_known.wait(timeout=600)
        with self._lock:
            first = self._first
        if first is None:
            return True
        return self.keyframe_every > 0 and (first + self._taken) % self.keyframe_every == 0

    def take(self, module, dtype=None) -> tuple[Captured, dict]:
        """The training thread's part of a publish: the job, and the shards."""
        tensors, self.shards = live_tensors(module, dtype)
        job = self.capture.capture(tensors, full=self._full())
        job.index, self._taken = self._taken, self._taken + 1
        kept = self.capture.kept_bytes()
        if job.index == 0:
            log.info("nemo-dcr callback: the last published version takes %.1f MB of %s memory", kept / 1e6,
                     "device" if self.capture.keep == "device" else "pinned host")
        return job, self.shards

    def unchanged(self) -> tuple[Captured, dict]:
        """A job publishing the last captured state again (an empty version)."""
        job = self.capture.unchanged()
        job.index, self._taken = self._taken, self._taken + 1
        return job, self.shards

    def failed(self) -> None:
        """A publish failed (from the publish worker): the first version may never be known."""
        self._first_known.set()

    def committed(self, job, version: int) -> None:
        """Capture ``job.index`` was published as ``version`` (from the publish worker)."""
        index = getattr(job, "index", None)
        if isinstance(job, Captured) and index is not None:
            with self._lock:
                self._first = version - index
            self._first_known.set()
