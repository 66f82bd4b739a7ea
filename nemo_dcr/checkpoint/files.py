"""Diff and apply on safetensors checkpoints (files or sharded directories).

    diff_checkpoints("base/", "target/", "step.dcr")
    apply_checkpoint("base/", "step.dcr", "out/")

``apply_checkpoint`` verifies every base tensor and every result tensor against the digests in
the delta, rebuilds the target's files byte for byte, and moves them into place only when all
of it succeeded.
"""
from __future__ import annotations

import math
import os
from contextlib import closing
from dataclasses import dataclass

from nemo_dcr.checkpoint.safetensors_io import (
    Checkpoint,
    check_layout,
    has_layout,
    input_kind,
    layout_for,
    refuse_overlap,
    write_checkpoint,
    write_order,
)
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.codec.header import TensorKind
from nemo_dcr.codec.versions import FORMAT_VERSION
from nemo_dcr.delta import DEFAULT_CHUNK, DEFAULT_LEVEL, Action, ApplyReport, diff, plan_entry, run_plan
from nemo_dcr.errors import BaseMismatchError, DcrError
from nemo_dcr.state.digest import Place, tensor_digest_like
from nemo_dcr.util.atomic import output_file
from nemo_dcr.util.gc_pause import pausing
from nemo_dcr.util.parallel import default_workers, ordered_ahead
from nemo_dcr.util.progress import NullProgress, Progress


@pausing
def diff_checkpoints(base: str, target: str, out: str, *, encoding: str = "auto", level: int = DEFAULT_LEVEL,
                     chunk_elems: int = DEFAULT_CHUNK, workers: int | None = None,
                     progress: bool | None = None, format_version: int = FORMAT_VERSION) -> dict:
    """Write the delta BASE -> TARGET to ``out`` atomically. Returns the delta header.
    ``format_version``: as ``diff``'s (1: for receivers older than format version 2)."""
    b, t = Checkpoint(base), Checkpoint(target)
    out = os.path.realpath(out)  # a symlink named as the output is written through
    if os.path.isdir(out):
        raise DcrError(f"{out} is a directory; the delta is a single file")
    refuse_overlap(out, [out], [base, target, *b.files.values(), *t.files.values()])
    with output_file(out) as tmp:
        with open(tmp, "wb") as f:
            header = diff(b, t, encoding=encoding, level=level, chunk_elems=chunk_elems, workers=workers,
                          meta={"layout": t.layout()}, out=f, progress=progress, format_version=format_version)
            f.flush()
            os.fsync(f.fileno())
    return header


@dataclass
class FileApplyResult:
    out: str
    files: int
    report: ApplyReport
    already: bool = False  # an in-place apply found the checkpoint at the target already (nothing written)


@pausing
def apply_checkpoint(base: str, delta: str, out: str, *, workers: int | None = None,
                     progress: bool | None = None) -> FileApplyResult:
    if input_kind(delta, "delta") != "file":  # a FIFO would block the reader forever
        raise DcrError(f"{delta}: is a directory; the delta must be a regular file")
    reader = DeltaReader.open(delta)
    reader.check_payloads()
    h = reader.header
    ckpt = Checkpoint(base)  # (finishes a swap a killed run committed: an in-place retry may be done already)
    entries = {e.name: e for e in h.tensors}
    layout = h.meta.get("layout")
    if layout is None:
        layout = layout_for(_TargetShapes(entries))
    layout = check_layout(layout, [n for n, e in entries.items() if not e.removed], f"{delta}: layout")
    in_place = os.path.exists(out) and os.path.samefile(out, base)
    try:
        return _apply_files(reader, entries, layout, ckpt, delta, out, in_place, workers, progress)
    except BaseMismatchError:
        # nothing was written (the base is checked before the swap): a retry of an in-place
        # apply that a kill interrupted after its commit point finds the target in place
        if in_place and at_target(ckpt, entries, layout):
            return FileApplyResult(out, 0, ApplyReport(), already=True)
        raise


def at_target(ckpt: Checkpoint, entries: dict, layout: dict) -> bool:
    """Whether ``ckpt`` holds the delta's target: its tensors (by the target digests) and its
    files byte for byte. O(model): only asked when the base does not match."""
    names = {n for n, e in entries.items() if not e.removed}
    if set(ckpt) != names:
        return False
    for n in names:
        e, t = entries[n], ckpt[n]
        if t.dtype != e.torch_dtype or tuple(t.shape) != tuple(e.shape) \
                or tensor_digest_like(t, e.target_digest, Place(n)) != e.target_digest:
            return False
    return has_layout(ckpt, layout)


def _apply_files(reader, entries, layout, ckpt, delta, out, in_place, workers, progress) -> FileApplyResult:
    foreign = sorted(set(ckpt) - set(entries))
    if foreign:
        raise BaseMismatchError(f"base has {len(foreign)} tensor(s) the delta does not know "
                                f"(e.g. {foreign[0]!r}): not the base this delta was built from")
    missing = sorted(n for n, e in entries.items() if e.kind != TensorKind.FULL and n not in ckpt)
    if missing:
        raise BaseMismatchError(f"base lacks tensor {missing[0]!r} that the delta was built on")
    protect = [delta] if in_place else [delta, ckpt.path, *ckpt.files.values()]  # checked before any write
    report = ApplyReport()
    bar = Progress(ckpt.total_bytes, "apply") if progress or progress is None else NullProgress(0, "")

    def prepare(name):
        """Tensor ``name`` read, its base checked, the delta applied, the target checked."""
        e = entries.get(name)
        if e is None or e.removed:
            raise DcrError(f"delta layout names {name!r} but carries no data for it")
        tensor = ckpt[name] if e.kind == TensorKind.DELTA else None  # a fresh, writable copy
        plan = plan_entry(e, tensor, None)  # checks the base digest
        if plan.action == Action.SKIP and e.chunks:
            # at the target, not the base: refused (``apply_checkpoint`` then asks whether the
            # whole checkpoint is the target already: an in-place apply killed after its commit)
            raise BaseMismatchError(f"{name}: base tensor holds the delta's target, not the base it was built from")
        part = ApplyReport()  # (its own: the jobs run at once)
        # verify: the target digest follows the changes (a sum digest: O(changes), not a second pass)
        return name, run_plan(reader, plan, part, workers, verify=True), part

    def produce(name):
        got, tensor, part = next(prepared)
        assert got == name, f"the checkpoint's writer asked for {name!r}, {got!r} was prepared"
        report.add(part)
        bar.update(tensor.numel() * tensor.element_size())
        return tensor

    for name, e in entries.items():  # removed tensors: the base must still be the right one
        if e.removed and e.base_digest and tensor_digest_like(ckpt[name], e.base_digest, Place(name)) \
                != e.base_digest:
            raise BaseMismatchError(f"{name}: base tensor is not the one this delta was built from")
    # each tensor is prepared on a thread of its own while the ones before it are written, a few
    # at once: one at a time, a checkpoint of one-chunk tensors kept one worker busy
    prepared = ordered_ahead(prepare, write_order(layout), lambda n: _nbytes(entries.get(n)),
                             AHEAD_BYTES, _jobs(workers))
    with bar, closing(prepared):
        files = write_checkpoint(out, layout, produce, protect=protect)
    return FileApplyResult(out, files, report)


#: how many bytes of tensors may be prepared ahead of the writer (one at any size), and how many
#: tensors at once: twice the workers, so that one-chunk tensors keep them all busy (on 2 cores, 2,
#: 4 and 8 at once applied 64 tensors of 2M BF16 in the same time; one at a time took twice that)
AHEAD_BYTES = 256 << 20
AHEAD_JOBS = 2 * default_workers()


def _jobs(workers: int | None) -> int:
    """Tensors prepared at once for ``workers`` (one asked for: one, each job then runs inline)."""
    if workers == 1:
        return 1
    return AHEAD_JOBS if workers is None else 2 * workers


def _nbytes(e) -> int:
    if e is None or e.removed:
        return 0
    return math.prod(e.shape) * e.torch_dtype.itemsize


class _TargetShapes(dict):
    """Stand-in tensors (meta device) with the target's dtype and shape, for ``layout_for``."""

    def __init__(self, entries):
        import torch
        super().__init__({n: torch.empty(e.shape, dtype=e.torch_dtype, device="meta")
                          for n, e in entries.items() if not e.removed})
