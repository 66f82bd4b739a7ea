"""Trainer side of the device path: the last published snapshot kept where it costs least, and
the delta's chunks found by the device pass (``diff.diff_``) and coded on the host from the
compact change stream (``encode.encode_changes_chunks``): the same bytes as the reference.

    snap = DeviceSnapshot(keep="device")          # or "pinned": host memory, when the device is full
    snap.reset(live)                              # the first publish: a private copy
    blob = diff(*snap.views(live), chunker=snap.chunker, ...)     # nemo_dcr.delta.diff
    ...                                           # upload, commit
    snap.commit(live)                             # the snapshot becomes what was published

The diff does not touch the snapshot (``update=False``): a publish that fails before its commit
leaves it the base of the next delta. ``commit`` then writes only the changes (O(changes),
pre-images checked); tensors the chunker did not take (new, re-typed, reshaped, not on a device
the kernels run on) are copied whole.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from nemo_dcr.device import kernels
from nemo_dcr.device.apply import apply_
from nemo_dcr.device.diff import DeviceChanges, bits, diff_
from nemo_dcr.device.encode import encode_changes_chunks, tries_classes
from nemo_dcr.errors import DcrError

log = logging.getLogger("nemo_dcr.device")
KEEP = ("device", "pinned")


def runs_here(t: torch.Tensor) -> bool:
    """Whether the kernels can diff ``t`` where it is: a CUDA tensor with triton, or a CPU one
    under the Triton interpreter (tests)."""
    if not kernels.available() or not t.is_contiguous():
        return False
    return t.is_cuda or (kernels.interpreted() and t.device.type == "cpu")


def choose(device: str, tensors: Mapping[str, torch.Tensor]) -> bool:
    """``device``: "off" (the reference), "on" (the device path; an error where it cannot run),
    "auto" (the device path where some tensor can take it). Logs which path runs."""
    if device not in ("off", "on", "auto"):
        raise DcrError(f"device must be 'off', 'on' or 'auto', not {device!r}")
    if device == "off":
        return False
    ok = any(runs_here(t) for t in tensors.values())
    if not ok:
        why = "triton is not installed" if not kernels.available() else "no tensor is on a CUDA device"
        if device == "on":
            raise DcrError(f"device='on' but the device path cannot run: {why}")
        log.info("nemo-dcr publish: reference path (host snapshot): %s", why)
        return False
    log.info("nemo-dcr publish: device path (Triton kernels%s)", ", interpreted" if kernels.interpreted() else "")
    return True


class HostView(Mapping):
    """``tensors`` as the reference encoder reads them: a device tensor is copied to the host
    when it is looked up (one at a time), a host tensor is given as it is; the names in
    ``keep`` (those the device pass diffs) are given as they are, wherever they are."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], keep=()):
        self._t, self._keep = tensors, frozenset(keep)
        self.total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())

    def __getitem__(self, name):
        t = self._t[name]
        return t if t.device.type == "cpu" or name in self._keep else t.detach().cpu()

    def __contains__(self, name) -> bool:
        return name in self._t  # (Mapping's own looks the tensor up: a copy to the host)

    def __iter__(self):
        return iter(self._t)

    def __len__(self):
        return len(self._t)


class DeviceSnapshot:
    """The last published state, kept on the live tensors' device (``keep="device"``) or in
    pinned host memory (``keep="pinned"``: streamed to the device one tensor at a time for
    the diff, the changes written back on the host)."""

    def __init__(self, keep: str = "device"):
        if keep not in KEEP:
            raise DcrError(f"keep must be one of {KEEP}, not {keep!r}")
        self.keep = keep
        self.tensors: dict = {}
        self._pending: dict[str, DeviceChanges] = {}

    def _place(self, t: torch.Tensor, device) -> torch.Tensor:
        """A private contiguous copy of ``t`` where this snapshot keeps the tensors of ``device``."""
        t = t.detach()
        if self.keep == "pinned" or torch.device(device).type == "cpu":
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            return out.copy_(t)
        return t.to(device, copy=True, memory_format=torch.contiguous_format)

    def reset(self, live: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor] | None = None) -> None:
        """The snapshot becomes a private copy of ``live`` (the first publish, or a base rebuilt
        from the store), kept where ``like`` (default ``live``) has its tensors."""
        like = live if like is None else like
        self.tensors = {k: self._place(v, like[k].device if k in like else v.device) for k, v in live.items()}
        self._pending = {}

    def takes(self, name: str, t: torch.Tensor) -> bool:
        """Whether the device pass diffs ``t`` against the snapshot of ``name``."""
        s = self.tensors.get(name)
        return s is not None and s.dtype == t.dtype and s.shape == t.shape and s.is_contiguous() and runs_here(t)

    def job(self, live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a publish reads: the live tensors themselves (unchanged until it returns)."""
        return {k: v.detach() for k, v in live.items()}

    def target_digests(self, live) -> dict[str, str]:
        """None known ahead: ``diff`` hashes each (on the device, for a CUDA tensor)."""
        return {}

    def host_view(self, live: Mapping[str, torch.Tensor]) -> HostView:
        """The full state for the keyframe and the first state digest: one host copy at a time."""
        return HostView(live)

    def views(self, live: Mapping[str, torch.Tensor]) -> tuple[HostView, HostView]:
        """(base, target) for ``delta.diff`` with ``chunker``: the tensors the device pass takes
        as they are, the others (new, re-typed, reshaped: the reference sends them) on the host."""
        self._pending = {}
        taken = {k for k, v in live.items() if self.takes(k, v)}
        return HostView(self.tensors, taken), HostView(live, taken)

    def chunker(self, name, old, new, chunk_elems, encoding, level, keep_changes):
        """``delta.diff``'s chunker: None (the reference encodes it) unless ``takes``."""
        if not self.takes(name, new):
            return None
        old = self.tensors[name]
        snap = old if old.device == new.device else old.to(new.device, non_blocking=True)  # "pinned"
        ch = diff_(snap, new, chunk_elems=chunk_elems, use_classes=tries_classes(encoding, new.dtype), update=False)
        self._pending[name] = ch
        return encode_changes_chunks(ch, encoding, level, keep_changes)

    def commit(self, live: Mapping[str, torch.Tensor]) -> None:
        """The snapshot becomes ``live`` (unchanged since the diff): the changes the chunker
        found are written in place (pre-images checked), every other tensor is copied."""
        out = {}
        for name, t in live.items():
            ch = self._pending.get(name)
            snap = self.tensors.get(name)
            if ch is None or snap is None:
                out[name] = self._place(t, t.device)
                continue
            if snap.device == ch.pos.device:
                apply_(snap, ch.pos, ch.new, ch.old)
            else:  # pinned host snapshot: the changes go down, O(changes)
                b, pos = bits(snap), ch.pos.cpu()
                if not torch.equal(b[pos], ch.old.cpu()):
                    raise DcrError(f"{name}: the snapshot changed since the diff")
                b[pos] = ch.new.cpu()
            out[name] = snap
        self.tensors, self._pending = out, {}

