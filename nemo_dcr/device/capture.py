"""The trainer's device path for a publish that runs in the background (the Lightning callback):
the snapshot, diff and compaction happen on the device at the optimizer step, only the compact
change stream comes to the host, and the upload runs later from that alone.

    cap = DeviceCapture(keep="device", chunk_elems=..., encoding="auto")
    job = cap.capture(live, full=False)        # training thread: O(changes) to the host
    pub = Publisher(store, device=cap.base)    # the publisher reads the job, not the device
    pub.publish(job, shards)                   # background thread, any time later

``Publisher(device="on")`` (``trainer.DeviceSnapshot``) diffs the live tensors during the
publish, so they must not change until it returns: right for a synchronous publish, not for one
that uploads while training goes on. Here the diff runs at capture time against the *kept*
snapshot, the state of the previous capture (= the last published version once the queue has
drained; a failed publish stops the callback, so the chain never skips one), and updates it in
place (``diff_(update=True)``: O(changes) writes). What the job carries:

* per tensor diffed on the device: its change stream (positions, old and new bits, classes and
  ranks) on the host, and its target digest, hashed on the device (``device/blake3.py``: 16
  bytes); the publisher codes the delta from the stream (``encode.encode_changes_chunks``, the
  same bytes as the reference) and takes the digest as given (``diff(target_digests=)``);
* host copies of the tensors the device pass cannot take (new, re-typed, reshaped,
  non-contiguous, not on a device the kernels run on), and of the previous bits of tensors
  removed or re-typed (the state digest subtracts them);
* with ``full=True`` (the first capture, a keyframe version), host copies of every tensor: a
  keyframe uploads the full state, O(model) to the host by definition.

Memory: ``keep="device"`` holds one copy of the published tensors in device memory (the
model's size in its publish dtype, per rank); ``keep="pinned"`` holds it in pinned host memory
instead and streams each tensor to the device for its diff (O(model) host-to-device bytes per
publish, no device memory beyond one tensor at a time); the changes are written back on the host.
No other copy of the model is kept on the host (the host path keeps two).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from nemo_dcr.codec.names import DEFAULT_CHUNK
from nemo_dcr.device.diff import DeviceChanges, bits, diff_
from nemo_dcr.device.encode import encode_changes_chunks, tries_classes
from nemo_dcr.device.trainer import KEEP, runs_here
from nemo_dcr.errors import DcrError
from nemo_dcr.state.digest import tensor_digest
from nemo_dcr.state.dtypes import INT_VIEW


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


@dataclass
class Captured(Mapping):
    """One publish's state, taken at its step, none of it on the device. As a mapping: name ->
    a host tensor (sent whole, or ``full``) or a meta tensor (dtype and shape of a tensor whose
    change stream is in ``streams``)."""

    streams: dict[str, DeviceChanges] = field(default_factory=dict)  # on the host
    digests: dict[str, str] = field(default_factory=dict)  # target digests of the streamed tensors
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    shapes: dict[str, torch.Tensor] = field(default_factory=dict)  # meta tensors of every name
    gone: dict[str, torch.Tensor] = field(default_factory=dict)  # previous bits: removed / re-typed
    full: bool = False
    d2h_bytes: int = 0  # what crossed to the host for this capture
    index: int = -1     # the capture's number (integrations/device_snapshot.py counts them)

    def __getitem__(self, name):
        return self.host[name] if name in self.host else self.shapes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shapes.values())


class DeviceCapture:
    """The kept snapshot (device or pinned memory) and the capture against it."""

    def __init__(self, keep: str = "device", chunk_elems: int = DEFAULT_CHUNK, encoding: str = "auto", level: int = 3):
        if keep not in KEEP:
            raise DcrError(f"keep must be one of {KEEP}, not {keep!r}")
        self.keep, self.chunk_elems, self.encoding = keep, int(chunk_elems), encoding
        self.kept: dict[str, torch.Tensor] = {}
        self._digests: dict[str, str] = {}
        # the streamed tensors' target digests, hashed on the device: what format version 2 writes
        # (BLAKE3); format 3's are sums the publisher's diff updates from the changes alone
        self.hash_targets = True
        self.base = CaptureBase(self, level)

    def kept_bytes(self) -> int:
        """Memory the kept snapshot takes (device memory, or pinned host memory)."""
        return sum(t.numel() * t.element_size() for t in self.kept.values())

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if self.keep == "pinned" or t.device.type == "cpu":
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available()).copy_(t)
        return t.to(t.device, copy=True, memory_format=torch.contiguous_format)

    def _takes(self, name: str, t: torch.Tensor) -> bool:
        s = self.kept.get(name)
        return s is not None and s.dtype == t.dtype and s.shape == t.shape and runs_here(t)

    def capture(self, live: Mapping[str, torch.Tensor], full: bool = False) -> Captured:
        """The state of ``live`` now, as a publish job; the kept snapshot becomes ``live``."""
        out = Captured(full=full)
        for name in [k for k in self.kept if k not in live]:
            out.gone[name] = _host(self.kept.pop(name))
            out.d2h_bytes += out.gone[name].numel() * out.gone[name].element_size()
        for name, t in live.items():
            t = t.detach()
            out.shapes[name] = _meta(t)
            if not self._takes(name, t):
                if name in self.kept:
                    out.gone[name] = _host(self.kept[name])
                    out.d2h_bytes += out.gone[name].numel() * out.gone[name].element_size()
                out.host[name] = _host(t)
                out.d2h_bytes += t.numel() * t.element_size()
                self.kept[name] = self._place(t)
                continue
            s = self.kept[name]
            snap = s if s.device == t.device else s.to(t.device, non_blocking=True)  # "pinned": streamed down
            ch = diff_(snap, t, chunk_elems=self.chunk_elems, use_classes=tries_classes(self.encoding, t.dtype),
                       update=snap is s)
            host = ch.cpu()
            if snap is not s and host.k:  # pinned: the changes written back on the host, O(changes)
                bits(s)[host.pos] = host.new
            out.streams[name] = host
            out.d2h_bytes += ch.nbytes()
            if self.hash_targets:
                out.digests[name] = tensor_digest(t)  # on the device for a CUDA tensor: 16 bytes cross
            if full:
                out.host[name] = _host(t)
                out.d2h_bytes += t.numel() * t.element_size()
        self._digests = {**{k: v for k, v in self._digests.items() if k in out.streams}, **out.digests}
        return out

    def unchanged(self) -> Captured:
        """A job for the kept state again (an empty version): every kept tensor, no change."""
        out = Captured()
        empty = torch.empty(0, dtype=torch.int64)
        for name, s in self.kept.items():
            out.shapes[name] = _meta(s)
            if self.hash_targets:
                if name not in self._digests:
                    self._digests[name] = tensor_digest(s)
                out.digests[name] = self._digests[name]
            iv = INT_VIEW[s.element_size()]
            cls = empty if tries_classes(self.encoding, s.dtype) else None
            out.streams[name] = DeviceChanges(pos=empty, old=torch.empty(0, dtype=iv), new=torch.empty(0, dtype=iv),
                                              chunk_elems=self.chunk_elems, numel=s.numel(), dtype=s.dtype,
                                              cls=cls, rank=cls)
        return out


class _FullState(Mapping):
    def __init__(self, job: Captured):
        self._job = job
        self.total_bytes = job.total_bytes

    def __getitem__(self, name):
        if name not in self._job.host:
            raise DcrError(f"{name}: this version needs the full state (a keyframe, or the first version) but its "
                           "capture holds only the changes; capture it with full=True")
        return self._job.host[name]

    def __iter__(self):
        return iter(self._job)

    def __len__(self):
        return len(self._job)


class CaptureBase:
    """What ``Publisher(device=...)`` keeps as the last published state when its jobs are
    ``Captured``: names, dtypes and shapes (meta tensors; the bits are the capture's kept
    snapshot), or the host tensors a rebuild from the store made. The publisher's seams: ``views``
    and ``chunker`` for the delta, ``target_digests``, ``host_view`` for the keyframe and the
    first state digest, ``commit``/``reset`` after a commit or a rebuild."""

    def __init__(self, capture: DeviceCapture, level: int):
        self._cap = capture
        self.tensors: dict[str, torch.Tensor] = {}
        self._job: Captured | None = None
        self._rebuilt = False  # the base was rebuilt from the store since the last commit

    def job(self, tensors) -> Captured:
        """What a publish reads: the job itself (nothing of it is on the device)."""
        return self._job_of(tensors)

    @staticmethod
    def _job_of(snap) -> Captured:
        if not isinstance(snap, Captured):
            raise DcrError("a publisher that takes device captures was given plain tensors")
        return snap

    def views(self, snap) -> tuple[Mapping, Mapping]:
        job = self._job = self._job_of(snap)
        if self._rebuilt and job.streams:
            raise DcrError("the store moved on since this trainer's last version (its base was rebuilt from the "
                           "store), so the changes captured on the device are not against it; publish a keyframe")
        return {**self.tensors, **job.gone}, job

    def chunker(self, name, old, new, chunk_elems, encoding, level, keep_changes):
        job = self._job
        ch = None if job is None else job.streams.get(name)
        if ch is None:
            return None
        if ch.chunk_elems != chunk_elems or (tries_classes(encoding, ch.dtype) and ch.cls is None):
            raise DcrError(f"{name}: captured with chunk_elems {ch.chunk_elems} for encoding "
                           f"{self._cap.encoding!r}; published with {chunk_elems}, {encoding!r}")
        return encode_changes_chunks(ch, encoding, level, keep_changes)

    def target_digests(self, snap) -> dict[str, str]:
        return dict(self._job_of(snap).digests)

    def host_view(self, snap) -> Mapping:
        """The full state, for a keyframe or the first state digest: the job's host copies (a
        tensor it holds only the changes of is an error when read)."""
        return _FullState(self._job_of(snap))

    def reset(self, live, like=None) -> None:
        """After a rebuild from the store (``like`` given: host tensors, the base of the next
        delta) or after the first commit (the published state: its shapes)."""
        if like is not None:
            self.tensors, self._rebuilt = dict(live), True
        else:
            self.tensors, self._rebuilt = {k: _meta(v) for k, v in live.items()}, False
        self._job = None

    def commit(self, live) -> None:
        self.reset(live)
