"""Apply: decode a delta and write it into the receiver's tensors in place (decode → apply → verify).

    report = apply(tensors, blob)             # in place, verified bit-exactly

Per entry, ``plan_entry`` (plan.py) decides what to do before anything is written; ``run_plan``
then runs each chunk through four steps: decode (the chunk's positions and values), locate (the
receiver's local indices), check (the pre-image of what is held) and write.

Tensors may live on a device (a GPU): a chunk is decoded on the host from its payload, and
only its changes cross (``_decode``); the writes, checks and digest updates are torch ops where
the tensor is, and the pre-image digests hash the O(changes) bits at the changes.

A ``classes`` chunk decodes only against the whole base chunk. A receiver holding part of an
entry's region decodes none of them itself: the caller hands in each one decoded already
(``Decoded``, decoded with the receiver group's help and checked against the chunk's pre-image:
``nemo_dcr.sync.chunk_gather``); without that, apply refuses before its first write.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, fields
from typing import NoReturn

import torch

from nemo_dcr.codec import ordered, planes
from nemo_dcr.codec.chunk import ADD, CLASSES, OVERWRITE, decode_chunk, dense_stream, light, locate_chunk
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.codec.header import ChunkEntry, TensorEntry, TensorKind
from nemo_dcr.codec.positions import DENSE
from nemo_dcr.delta.changes import OnChange, report_gone
from nemo_dcr.delta.overlap import Claims
from nemo_dcr.delta.plan import Action, Plan, plan_entry
from nemo_dcr.errors import BaseMismatchError, DcrError, DeltaFormatError, PartialApplyError, TargetMismatchError
from nemo_dcr.state.digest import (
    SUMMED,
    MovedSumDigest,
    Place,
    RunningDigest,
    algo_of,
    tensor_digest_like,
    values_digest,
)
from nemo_dcr.state.dtypes import itemsize
from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.state.index_map import IndexMap, ShardSpec
from nemo_dcr.state.runs import Runs, chunk_runs, copy_runs, gather_runs
from nemo_dcr.state.statedigest import WrittenDigest
from nemo_dcr.util.gc_pause import pausing
from nemo_dcr.util.parallel import default_workers, ordered_map, stream_workers
from nemo_dcr.util.progress import NullProgress, Progress


@dataclass
class ApplyReport:
    tensors_changed: int = 0
    tensors_skipped: int = 0  # already at the target
    tensors_added: list = field(default_factory=list)
    tensors_removed: list = field(default_factory=list)
    chunks_applied: int = 0
    chunks_already_applied: int = 0
    elements_changed: int = 0
    unverified: list = field(default_factory=list)  # entries only partly held: no digest check possible
    seconds: float = 0.0

    def add(self, other: ApplyReport) -> None:
        """Count ``other``'s tensors and chunks in (the reports of parts applied apart)."""
        for f in fields(self):
            if f.name != "seconds":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(frozen=True)
class Decoded:
    """A ``classes`` chunk decoded with what the receiver's group holds of the whole base chunk:
    ``idx`` the changed positions (relative to the chunk), ``old`` the base bits there (checked
    against the chunk's pre-image digest), ``new`` the new bits. Empty: the receiver holds none of
    the chunk's positions. ``local``, where the group placed the changes this receiver holds
    itself (its shards and the others' do not overlap): ``idx``, ``old`` and ``new`` are those
    changes only (the whole chunk was checked), ``local`` their flat indices in its tensor, and
    the index maps are not asked again."""

    idx: torch.Tensor
    old: torch.Tensor
    new: torch.Tensor
    local: torch.Tensor | None = None

    @classmethod
    def nothing(cls, bits_dtype: torch.dtype) -> Decoded:
        empty = torch.empty(0, dtype=bits_dtype)
        return cls(torch.empty(0, dtype=torch.int64), empty, empty)


DecodedChunks = Mapping[tuple[str, int], Decoded]  # (tensor name, chunk start) -> Decoded


@dataclass(frozen=True)
class _Target:
    """Where one plan's chunks are written, and how."""

    plan: Plan
    tensor: torch.Tensor
    fa: FlatAccess
    region_map: IndexMap
    recv_map: IndexMap
    dtype: torch.dtype
    w: int
    moved: MovedSumDigest | None = None  # the target digest, moved by each chunk's changes
    shift: int | None = None  # region-local + shift == local, where the region is one run held whole (_shift)
    written: WrittenDigest | None = None  # the state digest of what is written, summed as it is (a keyframe's)

    @property
    def xor_ok(self) -> bool:  # chunks coded against the base (xor, add) need a base
        return self.plan.action in (Action.APPLY, Action.RESUME, Action.UNVERIFIED)


def _target_of(plan: Plan, moved: MovedSumDigest | None = None, written: WrittenDigest | None = None) -> _Target:
    dtype = plan.entry.torch_dtype
    region = plan.sent
    if plan.action == Action.CREATE:
        try:
            tensor = torch.empty(region.shape, dtype=dtype)
        except RuntimeError as e:
            raise DcrError(f"{plan.name}: cannot allocate the new tensor {region.shape}: {e}") from None
        recv = region
    else:
        assert plan.recv is not None  # plan_entry places a held tensor without a shard spec as the whole tensor
        tensor, recv = plan.held, plan.recv
    region_map, recv_map = IndexMap(region), IndexMap(recv)
    return _Target(plan, tensor, FlatAccess(tensor), region_map, recv_map, dtype, itemsize(dtype), moved,
                   _shift(region_map, recv_map), written)


def _shift(region_map: IndexMap, recv_map: IndexMap) -> int | None:
    """The constant that takes a region-local flat index to the receiver's local one where the
    region is one run of the canonical tensor and lies whole inside the receiver's memory as one
    run: both whole, or a trainer rank's row shard of a tensor the receiver holds whole (or holds
    a row shard of that contains it). Its chunks then read and write the receiver's memory as a
    range, as a whole tensor's do; other layouts map each chunk's elements through the index
    maps (an index per element of the chunk: ~230 us more per 16K-element shard; docs/results.md,
    twenty-fourth turn). None where it is not so.

    Also 0 where the receiver holds exactly the region's elements, in any layout (a tensor-parallel
    trainer's column shard into a receiver holding the same columns): a box's elements run in
    increasing canonical order in its own flat order, so two boxes of the same elements number
    them alike. Mapped element by element, such a delta took ~30x a row shard's time."""
    ro = 0 if region_map.identity else region_map.run_offset
    rr = 0 if recv_map.identity else recv_map.run_offset
    if ro is None or rr is None:
        same = region_map.numel == recv_map.numel and recv_map.spec.contains(region_map.spec)
        return 0 if same else None
    shift = ro - rr
    return shift if 0 <= shift and shift + region_map.numel <= recv_map.numel else None


# ----------------------------------------------------------------------------- the four steps

def on_host(t: torch.Tensor) -> bool:
    """Whether the C kernels can read ``t``'s memory. Elsewhere (a GPU) a chunk is decoded on the
    host from its payload alone and only its changes go where ``t`` is (``_decode``)."""
    return t.device.type == "cpu"


def _decode(reader: DeltaReader, t: _Target, c: ChunkEntry):
    """Positions (in the tensor's region: the chunk's start added), values of chunk ``c``, the
    bits held at those positions where the decode read them already (``classes`` chunks; else
    None), all where the receiver's tensor is, and whether the new bits are written already. On
    a device only O(changes) crosses: positions and values of the other codings, and a
    ``classes`` chunk's decoded streams, which ``chunk.locate_chunk`` places against the base
    held there.

    A ``classes`` chunk of a tensor held whole, contiguous and on the host decodes *into* the
    tensor (``classes.decode``'s ``into``): its new bits are written as the scan passes them,
    before the caller's pre-image check, which writes the old bits back when it fails. A chunk
    that does not decode is left as it was."""
    dev = t.tensor.device
    if c.enc != CLASSES:
        idx, vals, _ = decode_chunk(c, reader.payload(c), t.w, with_old=True,
                                    checked=reader.payloads_checked, offset=c.start)
        return idx.to(dev), vals.to(dev), None, False
    # a classes chunk decodes against the receiver's bits of the *whole* chunk
    if not t.plan.checks_chunks:
        raise undecodable(t.plan.name, c)
    if t.shift is not None:
        base = t.fa.read(t.shift + c.start, t.shift + c.end)  # (a view of the tensor where it is contiguous)
    else:
        base = _held_chunk(t, c)
    try:
        if on_host(base):
            into = t.shift is not None and t.fa.contiguous
            return (*decode_chunk(c, reader.payload(c), t.w, base=base, dtype=t.dtype, with_old=True, into=into,
                                  checked=reader.payloads_checked, offset=c.start), into)
        idx, vals = locate_chunk(c, reader.payload(c), base, t.dtype)
        return idx + c.start, vals, base[idx], False
    except DeltaFormatError:
        # a checksum-valid chunk that does not decode against what is held: not this base (or
        # applied already); the pre-image check that follows reports it
        return torch.empty(0, dtype=torch.int64, device=dev), base[:0], base[:0], False


def _held_chunk(t: _Target, c: ChunkEntry) -> torch.Tensor:
    """The receiver's bits of chunk ``c`` of a region it holds but not as one run of its memory
    (a tensor-parallel trainer's column shard into a receiver holding the tensor whole): copied
    run by run (``state/runs.py``) from memory that is contiguous on the host, where mapping each
    of the chunk's elements through the index maps took ~0.9 ms a 64K-element chunk; elsewhere
    (a device, strided memory) mapped element by element."""
    runs = _held_runs(t, c)
    if runs is not None:
        return gather_runs(t.fa.read(0, t.fa.numel), runs)
    local, _ = t.recv_map.to_local(t.region_map.to_global(torch.arange(c.start, c.end, device=t.tensor.device)))
    return t.fa.gather(local)


def _held_runs(t: _Target, c: ChunkEntry) -> Runs | None:
    """The runs of chunk ``c`` in the receiver's memory, where that memory is contiguous on the
    host and holds all of the chunk (what a chunk whose pre-images are checked is); else None."""
    if not (t.fa.contiguous and t.tensor.is_cpu):
        return None
    runs = chunk_runs(t.region_map.spec, c.start, c.n, t.recv_map.spec)
    return runs if runs.total == c.n else None


def undecodable(name: str, c: ChunkEntry) -> DcrError:
    return DcrError(f"{name}: chunk at element {c.start} is coded against the whole base chunk, which this "
                    "receiver does not hold (nor, together, its group); publish with encoding 'portable' for "
                    "receivers sharded differently")


def _locate(t: _Target, pos: torch.Tensor, *vals: torch.Tensor):
    """Positions in the tensor's region, and values per position -> (canonical indices, the
    receiver's local indices, each of the values) of the changes it holds."""
    glob = t.region_map.to_global(pos)
    if t.shift is not None:  # every position held, at pos + shift (a receiver holding it whole: at glob)
        return glob, glob if t.recv_map.identity else pos + t.shift, *vals
    if t.recv_map.identity:  # a receiver holding the tensor whole holds every position, at its canonical index
        return glob, glob, *vals
    local, mask = t.recv_map.to_local(glob)
    if not bool(mask.all()):  # (to_local returns the held ones only)
        return glob[mask], local, *(v[mask] for v in vals)
    return glob, local, *vals


def _check(t: _Target, c: ChunkEntry, cur: torch.Tensor, in_journal: bool) -> bool:
    """True when the chunk is applied already; raises when what is held is not its base."""
    d = values_digest(cur, c.values_algo)
    if d == c.post or (d != c.pre and in_journal):
        return True  # (a classes chunk's post-image is not always recognisable)
    if d != c.pre:
        extra = (" (or it was applied already and changed the classes its positions are coded in: "
                 "resume with the journal of the first attempt)") if c.enc == CLASSES else ""
        raise BaseMismatchError(f"{t.plan.name}: chunk at element {c.start} does not match its base{extra}")
    return False


def new_bits(name: str, c: ChunkEntry, dtype: torch.dtype, cur: torch.Tensor | None, vals: torch.Tensor,
             xor_ok: bool = True) -> torch.Tensor:
    """The new bits of chunk ``c``'s changes from its decoded values and the bits held there
    (``cur``; torch ops, so on whatever device they are: the device path uses it too)."""
    if c.enc in (OVERWRITE, CLASSES):
        return vals
    if not xor_ok:
        raise DeltaFormatError(f"{name}: a {c.enc} chunk in a whole-tensor entry")
    assert cur is not None, f"{name}: a {c.enc} chunk needs the bits held"  # xor_ok: the callers gathered them
    if c.enc == ADD:
        if dtype.itemsize not in ordered.WIDTHS:
            raise DeltaFormatError(f"{name}: an add chunk for a {dtype.itemsize}-byte dtype")
        return ordered.decode(cur, vals, dtype.is_floating_point)
    return torch.bitwise_xor(cur, vals)


def _write(t: _Target, c: ChunkEntry, local: torch.Tensor, cur: torch.Tensor | None, vals: torch.Tensor):
    """Write the chunk's new bits; returns them."""
    new = new_bits(t.plan.name, c, t.dtype, cur, vals, t.xor_ok)
    t.fa.scatter(local, new)
    return new


def _apply_decoded(t: _Target, c: ChunkEntry, d: Decoded, on_change: OnChange | None):
    """Write the positions of a chunk decoded elsewhere (``Decoded``) that this receiver holds,
    each checked against the base bits the whole chunk was checked with. Decoded on the host (a
    chunk held in part: its positions placed from the group's class counts), the changes go where
    the tensor is: O(changes)."""
    dev = t.tensor.device
    if d.local is not None:  # placed here: the changes held, where
        glob, local, old, new = t.region_map.to_global(d.idx.to(dev) + c.start), d.local.to(dev), d.old.to(dev), \
            d.new.to(dev)
    else:  # (old and new apart, not stacked: the state digest's one-call path takes contiguous bits)
        glob, local, old, new = _locate(t, d.idx.to(dev) + c.start, d.old.to(dev), d.new.to(dev))
    cur = t.fa.gather(local)
    if torch.equal(cur, new):
        return "already", 0
    if not torch.equal(cur, old):
        raise BaseMismatchError(f"{t.plan.name}: chunk at element {c.start} does not match its base here "
                                "(it changed since the whole chunk was checked)")
    t.fa.scatter(local, new)
    if on_change is not None:
        on_change(t.plan.name, t.dtype, t.region_map.spec.global_shape, glob, cur, new)
    return "applied", int(local.numel())


def _apply_chunk(reader: DeltaReader, t: _Target, c: ChunkEntry, journal: set | None,
                 on_change: OnChange | None, decoded: DecodedChunks | None = None):
    key = (t.plan.name, c.start)
    in_journal = journal is not None and key in journal
    check = t.plan.checks_chunks
    if t.written is not None and not (c.pos == DENSE and on_change is None and t.fa.contiguous
                                      and t.shift is not None and not in_journal):
        t.written.give_up()  # summed as written only where a dense chunk is written into its range
    if in_journal and not check:  # pre-images, where checkable, are stronger
        return "already", 0
    d = decoded.get(key) if decoded is not None and not check else None
    if d is not None:
        out = _apply_decoded(t, c, d, on_change)
        if journal is not None:
            journal.add(key)
        return out
    if c.pos == DENSE and on_change is None and t.fa.contiguous:
        if t.shift is not None:
            out = _apply_range(reader, t, c, in_journal)
        elif c.enc == OVERWRITE and t.moved is None and not check and t.tensor.is_cpu:
            out = _apply_runs(reader, t, c)
        else:
            out = None
        if out is not None:
            if journal is not None and out[0] == "applied":
                journal.add(key)
            return out
    if c.enc == CLASSES and check and t.shift is None:
        out = _apply_staged(reader, t, c, in_journal, on_change)
        if out is not None:
            if journal is not None:
                journal.add(key)
            return out
    pos, vals, held, written = _decode(reader, t, c)
    glob, local, vals = _locate(t, pos, vals)
    need_cur = (t.xor_ok or on_change is not None) and t.plan.action != Action.CREATE
    if not need_cur:
        cur = None
    elif held is not None and held.numel() == local.numel():
        # the bits at local, as the decode read them from this tensor (a classes chunk decodes
        # against the whole chunk held, so every position is held) before it wrote any: no
        # second gather
        cur = held
    else:
        cur = t.fa.gather(local)
    if check:
        assert cur is not None  # checks_chunks implies xor_ok, so cur was gathered
        try:
            already = _check(t, c, cur, in_journal)
        except BaseMismatchError:
            if written:  # what the decode wrote goes: the tensor holds what it held
                t.fa.scatter(local, cur)
            raise
        if already:
            if written:
                t.fa.scatter(local, cur)
            return "already", 0
    new = vals if written else _write(t, c, local, cur, vals)
    if journal is not None:
        journal.add(key)
    if t.moved is not None:
        assert cur is not None  # an APPLY plan's chunks are checked against what is held: gathered
        t.moved.change(pos, cur, new, glob)
    if on_change is not None:
        on_change(t.plan.name, t.dtype, t.region_map.spec.global_shape, glob, cur, new)
    return "applied", int(local.numel())


# Below this many elements, plus STAGE_PER_CHANGE a change, a chunk gathered by runs is decoded
# into its gathered copy and written back whole: one copy of the chunk run by run costs less than
# mapping its changes through the index maps and scattering them (measured, BF16 column blocks into
# a whole tensor: 16K elements at 1 %, 3.4 against 11.3 us; 256K at 1 %, 18 against 21 us; 4M at
# 0.1 %, 330 against 37 us; docs/results.md, twenty-ninth turn).
STAGE_ELEMS = 1 << 17
STAGE_PER_CHANGE = 64


def _apply_staged(reader: DeltaReader, t: _Target, c: ChunkEntry, in_journal: bool, on_change: OnChange | None):
    """A ``classes`` chunk of a region the receiver holds whole but not as one run of its memory
    (a tensor-parallel trainer's column shard into a receiver holding the tensor whole), small
    or dense enough (``STAGE_ELEMS``): its base gathered run by run (``_held_runs``), decoded
    into that copy, checked, and the copy written back run by run. Nothing reaches the tensor
    before the pre-image check passes, and no change goes through the index maps unless someone
    is told of it (``on_change``: canonical indices). None where it does not apply (the caller
    takes the general path)."""
    runs = _held_runs(t, c) if c.n <= STAGE_ELEMS + STAGE_PER_CHANGE * c.k else None
    if runs is None:
        return None  # (held in part: the general path refuses it, or takes the group's decode)
    flat = t.fa.read(0, t.fa.numel)
    buf = gather_runs(flat, runs)
    try:
        pos, new, cur = decode_chunk(c, reader.payload(c), t.w, base=buf, dtype=t.dtype, with_old=True, into=True,
                                     checked=reader.payloads_checked, offset=c.start)
    except DeltaFormatError:  # not this base (or applied already): the pre-image check says which
        pos, new, cur = torch.empty(0, dtype=torch.int64), buf[:0], buf[:0]
    if _check(t, c, cur, in_journal):
        return "already", 0
    copy_runs(flat, buf, runs)  # (runs within the tensor: gather_runs read through them)
    if t.moved is not None:
        t.moved.change(pos, cur, new)
    if on_change is not None:
        on_change(t.plan.name, t.dtype, t.region_map.spec.global_shape, t.region_map.to_global(pos), cur, new)
    return "applied", int(pos.numel())


def _apply_range(reader: DeltaReader, t: _Target, c: ChunkEntry, in_journal: bool):
    """A ``dense`` chunk (every element of its range: a keyframe's, a tensor sent whole) into a
    region held whole and contiguous, with no one told of the changes: written into the range
    itself. The general path makes three int64 arrays of the chunk's length (positions, canonical,
    local) and scatters through them: 5x the chunk's BF16 bytes of scratch per worker, which the
    C library's arenas kept (a keyframe sync peaked at 2.3x the model for 2 MiB tensors)."""
    assert t.shift is not None  # (the caller's condition)
    view = t.fa.read(t.shift + c.start, t.shift + c.end)  # (a view: contiguous)
    raw = dense_stream(c, reader.payload(c), t.w, checked=reader.payloads_checked)  # decompressed: nothing below fails
    need_cur = t.xor_ok and t.plan.action != Action.CREATE
    if t.plan.checks_chunks and _check(t, c, view, in_journal):
        if t.written is not None:
            t.written.give_up()
        return "already", 0
    if c.enc == OVERWRITE and t.moved is None and view.device.type == "cpu":
        # the new bits are the values: joined straight into the range, no chunk-sized buffer
        planes.join(raw, c.k, t.w, out=view)
    else:
        vals = planes.join(raw, c.k, t.w).to(view.device)
        new = new_bits(t.plan.name, c, t.dtype, view if need_cur else None, vals, t.xor_ok)
        if t.moved is not None:
            t.moved.replace(c.start, view, new)
        view.copy_(new)
    if t.written is not None:  # what the range holds now (a light chunk's at the end: WrittenDigest.add)
        t.written.add(t.plan.name, t.dtype, t.region_map, view, c.start, later=light(c.n, True))
    return "applied", c.n


def _apply_runs(reader: DeltaReader, t: _Target, c: ChunkEntry):
    """A ``dense`` overwrite chunk (a keyframe's) into a receiver holding its region in part (a TP
    engine's columns of a tensor a trainer rank published whole), unchecked and with no one told:
    its values copied run by run (``state/runs.py``), where the general path mapped each of the
    chunk's elements through the index maps (a 64M BF16 keyframe into two ranks' columns spent
    ~3 s of each rank's CPU there; docs/results.md, twenty-fifth turn)."""
    runs = chunk_runs(t.region_map.spec, c.start, c.n, t.recv_map.spec)
    if not len(runs):
        return "applied", 0
    raw = dense_stream(c, reader.payload(c), t.w, checked=reader.payloads_checked)
    planes.join_runs(raw, c.k, t.w, t.fa.read(0, t.fa.numel), runs)
    return "applied", runs.total


def run_plan(reader: DeltaReader, plan: Plan, report: ApplyReport, workers: int | None = None, bar=None,
             journal: set | None = None, on_change: OnChange | None = None, verify: bool = False,
             decoded: DecodedChunks | None = None):
    """Apply one planned entry in place. Returns the tensor (a new one for ``create``).

    ``verify``: also check the target digest (``verify_plan``), hashing each range of the region
    as soon as the chunks before it are written, while the workers write the next ones.

    ``journal``: a set of ``(name, chunk start)`` already applied; those chunks are skipped and
    each chunk applied is added (re-delivery safety where pre-images cannot be checked).
    ``on_change`` (``delta/changes.py``) is called for every chunk written, and for every element
    of a tensor removed or replaced by one of another dtype or shape: incremental digests hang
    off it. ``decoded``: ``classes`` chunks of entries the receiver holds only part of, decoded
    already (see the module doc).
    """
    out: list = []
    run_plans(reader, [plan], report, workers, bar, journal, on_change, verify, decoded,
              done=lambda _, tensor: out.append(tensor))
    return out[0]


@dataclass
class _Run:
    """One planned entry on its way: where it writes (None: nothing to write), the tensor it
    ends with, its running target digest, and its chunks still out."""

    plan: Plan
    t: _Target | None
    tensor: torch.Tensor | None
    running: RunningDigest | MovedSumDigest | None = None
    left: int = 0


def _start(plan: Plan, report: ApplyReport, on_change: OnChange | None, verify: bool,
           written: WrittenDigest | None = None) -> _Run:
    """What ``run_plan`` does for an entry before its chunks (all of it, for one without any)."""
    if plan.action == Action.IGNORE:
        return _Run(plan, None, plan.tensor)
    if plan.action == Action.REMOVE:
        report_gone(plan.name, plan.held, plan.recv, on_change)
        return _Run(plan, None, plan.tensor)
    if plan.action == Action.SKIP or (plan.action != Action.CREATE and not plan.entry.chunks):
        report.tensors_skipped += 1
        if verify and not (plan.action == Action.SKIP and plan.entry.base_digest == plan.target):
            # (a ``skip`` of an entry whose target is its base: ``plan_entry`` found that digest
            # on the tensor already; hashing it again doubled an unchanged tensor's cost)
            verify_plan(plan, plan.held)
        return _Run(plan, None, plan.tensor)
    verifies = verify and _verifies(plan)
    base = plan.entry.base_digest
    moved = None
    if verifies and plan.action == Action.APPLY and base is not None and algo_of(plan.target) in SUMMED \
            and algo_of(base) == algo_of(plan.target):
        # the base's sum was checked (plan_entry), and a sum moves with the changes: the
        # target is checked in O(changes), not by reading the tensor again
        moved = MovedSumDigest(base, plan.entry.torch_dtype, plan.sent.shape, _place(plan))
    t = _target_of(plan, moved, written)
    if plan.replaces:
        report_gone(plan.name, plan.held, plan.recv, on_change)
    running: RunningDigest | MovedSumDigest | None = moved
    if verifies and moved is None:
        running = RunningDigest(_verified_view(plan, t.tensor), algo_of(plan.target), place=_place(plan))
    return _Run(plan, t, t.tensor, running, len(plan.entry.chunks))


def _finish(r: _Run, report: ApplyReport, bar) -> None:
    """What ``run_plan`` does for an entry once its chunks are written."""
    plan = r.plan
    if r.t is None:
        return
    if bar:
        bar.update(1)
    if plan.action == Action.CREATE:
        report.tensors_added.append(plan.name)
    else:
        report.tensors_changed += 1
    if plan.action == Action.UNVERIFIED or (plan.action == Action.OVERWRITE and not plan.covered):
        report.unverified.append(plan.name)
    if r.running is not None:
        verify_plan(plan, r.t.tensor, digest=r.running.hexdigest())


def run_plans(reader: DeltaReader, plans: Sequence[Plan], report: ApplyReport, workers: int | None = None,
              bar=None, journal: set | None = None, on_change: OnChange | None = None, verify: bool = False,
              decoded: DecodedChunks | None = None, done=None, reached: list | None = None,
              written: WrittenDigest | None = None) -> None:
    """``run_plan`` for each of ``plans``, their chunks in one stream over the workers: the
    workers go on to the next entry's chunks while the last ones of an entry are written (an
    entry of a chunk or three kept one of two workers idle half the time, when each entry was a
    map of its own). Entries start and finish in order: ``done(plan, tensor)`` is called for
    each as it finishes, after its target digest checked out; ``reached`` gets each plan as it
    starts (a plan that writes, reached: the receiver may have changed). ``written``: summed
    what each chunk writes, where it can be (``statedigest.WrittenDigest``)."""
    _run_segments([(reader, plans)], report, workers, bar, journal, on_change, verify, decoded, done, reached,
                  written)


class _Failed:
    """An item of ``_run_segments``' stream that raises ``error`` in its turn: the error of
    planning a later segment reaches the caller once every chunk before it is written."""

    def __init__(self, error: BaseException):
        self.error = error


def _run_segments(segments: Iterable, report: ApplyReport, workers: int | None, bar, journal: set | None,
                  on_change: OnChange | None, verify: bool, decoded: DecodedChunks | None, done,
                  reached: list | None, written: WrittenDigest | None = None) -> None:
    """``run_plans`` over ``(reader, plans)`` pairs, all their chunks in one stream over the
    workers. ``segments`` may block for the next pair (a delta still arriving): the workers
    write the chunks handed out already meanwhile, and no pair waits for the one before it to
    be written whole (one stream per pair made each segment of an arriving object a barrier at
    which a worker idled). An error ``segments`` raises reaches the caller as is, after the
    chunks of the pairs before it."""

    def items():
        try:
            for reader, plans in segments:
                for p in plans:
                    if reached is not None:
                        reached.append(p)
                    r = _start(p, report, on_change, verify, written)
                    if r.t is None or not p.entry.chunks:
                        yield reader, r, None
                    else:
                        for c in p.entry.chunks:
                            yield reader, r, c
        except Exception as e:  # noqa: BLE001 - raised in its turn, by ``one``
            yield _Failed(e)

    def one(item):
        if isinstance(item, _Failed):
            raise item.error
        reader, r, c = item
        return r, c, (None if c is None else _apply_chunk(reader, r.t, c, journal, on_change, decoded))

    # a window of 8 items per worker (ordered_map's default is 2): entries without a chunk of
    # their own go through it too (a tensor that did not change; from writers before 2026-12-07
    # also the end of each tensor whose last chunk filled a segment, written in the next one:
    # every other item of a 1 % delta). At 2 the window held one chunk per worker and none
    # queued, so between chunks each worker waited for the ordered results to move on (a 45M BF16
    # delta's local sync: 17.6 ms against 19.0, medians; docs/results.md, seventeenth turn)
    # workers None: ``stream_workers`` (one more than the cores, up to 8 cores): a worker that
    # waits to take the GIL back between a chunk's steps leaves its core to the extra one
    workers = workers or stream_workers()
    for r, c, res in ordered_map(one, items(), workers, window=8 * workers, light=_light):
        if c is not None:
            status, k = res
            if status != "applied" and isinstance(r.running, MovedSumDigest):
                # a chunk found applied already moved nothing here: the sum no longer follows,
                # and the target is hashed whole after all
                r.running = RunningDigest(_verified_view(r.plan, r.t.tensor), algo_of(r.plan.target),
                                          place=_place(r.plan))
            if r.running is not None:  # every chunk up to c is written, and later ones write past its end
                r.running.advance(c.start + c.n)
            if status == "applied":
                report.chunks_applied += 1
                report.elements_changed += k
            else:
                report.chunks_already_applied += 1
            r.left -= 1
        if r.left == 0:
            _finish(r, report, bar)
            if done is not None:
                done(r.plan, r.tensor)


def _light(item) -> bool:
    """``_run_segments``' items run on the calling thread: an entry's start or end without a chunk,
    a failure, a small chunk (``codec.chunk.light``)."""
    if isinstance(item, _Failed):
        return True
    c = item[2]
    return c is None or light(c.n, c.pos == DENSE)


def _verifies(plan: Plan) -> bool:
    return plan.covered and plan.action not in (Action.IGNORE, Action.REMOVE, Action.UNVERIFIED)


def _verified_view(plan: Plan, tensor: torch.Tensor) -> torch.Tensor:
    if plan.action == Action.CREATE:
        return tensor
    assert plan.recv is not None  # plan_entry: every held tensor has its shard spec
    return plan.recv.view_of(tensor, plan.sent)


def _place(plan: Plan) -> Place:
    """Where the entry's region sits in the state: what its (``"sdn"``) digests are keyed by."""
    return Place(plan.name, plan.sent)


def verify_plan(plan: Plan, tensor: torch.Tensor, digest: str | None = None) -> None:
    """Check the entry's target digest on ``tensor`` (``digest``: already computed on it)."""
    if not _verifies(plan):
        return
    d = digest or tensor_digest_like(_verified_view(plan, tensor), plan.target, _place(plan))
    if d != plan.target:
        raise TargetMismatchError(f"{plan.name}: result does not match the target digest "
                                  f"(got {d}, expected {plan.entry.target_digest})")


@pausing
def apply(tensors: MutableMapping[str, torch.Tensor], delta, *, shards: Mapping[str, ShardSpec] | None = None,
          verify: bool = True, resume: bool = False, workers: int | None = None,
          progress: bool | None = None, journal: set | None = None, on_change: OnChange | None = None,
          held_only: bool = False, decoded: DecodedChunks | None = None, claims: Claims | None = None,
          written: WrittenDigest | None = None) -> ApplyReport:
    """Apply ``delta`` (bytes, a path, or a DeltaReader) to ``tensors`` in place.

    Before anything is changed: the container and every chunk checksum are checked, every
    entry's base digest (where the receiver holds the entry's whole region), and that no two
    tensors written in place share memory (``AliasedWriteError``: ``delta/overlap.py``). While applying,
    each chunk's pre-image is checked; a chunk already applied is skipped, so re-delivery of
    an XOR delta is harmless. After applying, target digests are checked. ``held_only``: skip
    entries for tensors ``tensors`` does not have (instead of creating them or refusing). A failure after the
    first write raises ``PartialApplyError``; calling again with ``resume=True`` finishes.
    ``decoded``: the ``classes`` chunks of entries the receiver holds only part of, decoded
    already (``nemo_dcr.sync.chunk_gather``); any other such chunk is refused before the first write.
    ``claims``: the memory written in place (``delta/overlap.py``), shared where the objects of
    one version are applied one after another (default: this call's own).
    ``written``: the state digest of what the chunks write, summed as each is written
    (``statedigest.WrittenDigest``: a keyframe's, so that no pass over the model follows it).
    """
    t0 = time.perf_counter()
    reader = DeltaReader.open(delta)
    shards = shards or {}
    plans = _checked_plans(tensors, reader, shards, verify, resume, journal, decoded, held_only, workers,
                           claims if claims is not None else Claims())
    report = ApplyReport()
    reached: list[Plan] = []
    changed: list[str] = []  # tensors added to or removed from ``tensors`` (in-place writes: ``reached``)
    try:
        with (Progress(len(plans), "apply", unit="tensor") if progress else NullProgress(0, "")) as bar:
            run_plans(reader, plans, report, workers, bar, journal, on_change, verify, decoded,
                      done=_hand_over(tensors, report, changed), reached=reached, written=written)
    except DcrError as e:
        _raise_partial(e, changed, reached)
    report.seconds = time.perf_counter() - t0
    return report


def apply_stream(tensors: MutableMapping[str, torch.Tensor], segments: Iterable[DeltaReader], *,
                 shards: Mapping[str, ShardSpec] | None = None, workers: int | None = None,
                 journal: set | None = None, on_change: OnChange | None = None,
                 report: ApplyReport | None = None, claims: Claims | None = None,
                 written: WrittenDigest | None = None) -> ApplyReport:
    """Apply the segments of a version-3 object while it arrives (the readers
    ``codec.format.SegmentStream`` makes; ``segments`` may block for the next one): for each,
    what ``apply(segment, verify=False, resume=True)`` does, with the chunks of all of them in one
    stream over the workers, so that no segment waits for the one before it to be written whole.

    A segment's chunk checksums, plans and refusals are checked before its first write; an error
    found so (a ``DeltaFormatError`` for bytes damaged on the way) is raised as it is, once the
    segments before it are written. A failure while writing raises ``PartialApplyError`` as
    ``apply`` does. ``journal``: the chunks written, as ``apply`` keeps it (what a retry of the
    whole object skips). ``report``: filled in place (what was written, also when it raises).
    ``claims``: the memory the segments write in place (``delta/overlap.py``), shared where
    several objects of one version are applied at once (default: this call's own). ``written``:
    as ``apply``'s."""
    t0 = time.perf_counter()
    shards = shards or {}
    claims = claims if claims is not None else Claims()
    report = report if report is not None else ApplyReport()
    reached: list[Plan] = []
    changed: list[str] = []

    def planned():
        it = iter(segments)
        while True:
            try:  # the next segment read (it may fail to), then checked: both before its first write
                reader = next(it, None)
                if reader is None:
                    return
                plans = _checked_plans(tensors, reader, shards, False, True, journal, None, False, 1, claims)
            except DcrError as e:
                raise _Refused(e) from None
            yield reader, plans

    try:
        _run_segments(planned(), report, workers, None, journal, on_change, False, None,
                      _hand_over(tensors, report, changed), reached, written)
    except _Refused as r:
        raise r.error from None
    except DcrError as e:
        _raise_partial(e, changed, reached)
    report.seconds += time.perf_counter() - t0
    return report


class _Refused(Exception):
    """A segment of ``apply_stream`` refused before its first write (``error``): raised as is."""

    def __init__(self, error: DcrError):
        super().__init__(str(error))
        self.error = error


def _checked_plans(tensors, reader: DeltaReader, shards, verify: bool, resume: bool, journal: set | None,
                   decoded: DecodedChunks | None, held_only: bool, workers: int | None,
                   claims: Claims) -> list[Plan]:
    """The plans of a delta's entries, everything checked that can be before the first write;
    the memory of the tensors they write in place claimed in ``claims``."""
    reader.check_payloads()
    entries: Sequence[TensorEntry] = reader.header.tensors
    if held_only:  # one rank of a group: tensors it does not hold are other ranks' to apply
        entries = [e for e in entries if e.name in tensors]
    # the base digests of all entries, hashed on the worker threads; nothing is changed yet.
    # Fewer entries than workers: one after the other here, each digest spread over the workers
    # itself (on a worker thread the state-digest kernel's ranges run inline: one core hashed a
    # lone 64M tensor while the other idled)
    def plan(e: TensorEntry) -> Plan:
        return plan_entry(e, tensors.get(e.name), shards.get(e.name), verify=verify, resume=resume)

    def hashes_little(e: TensorEntry) -> bool:  # a plan that hashes nothing, or a small tensor: light
        return not verify or light(e.numel, dense=True)
    few = len(entries) < (workers or default_workers())
    plans = [plan(e) for e in entries] if few else list(ordered_map(plan, entries, workers, light=hashes_little))
    _refuse_undecodable(plans, journal, decoded)
    refuse_misfits(tensors, [p.entry for p in plans if p.action == Action.CREATE], shards)
    # a created tensor is built aside and handed over whole; every other write is in place
    claims.claim((p.name, p.held) for p in plans if p.action.writes and p.action != Action.CREATE)
    return plans


def _hand_over(tensors: MutableMapping[str, torch.Tensor], report: ApplyReport, changed: list):
    """``done`` for ``run_plans``: a created tensor to ``tensors`` once written, a removed one out."""
    def done(p: Plan, out):
        if p.action == Action.CREATE:
            tensors[p.name] = out
            changed.append(p.name)
        elif p.action == Action.REMOVE:
            del tensors[p.name]
            changed.append(p.name)
            report.tensors_removed.append(p.name)
    return done


def _raise_partial(e: DcrError, changed: list, reached: list) -> NoReturn:
    # a created tensor is built aside and only then handed to ``tensors``: reaching it
    # changes nothing (a receiver that refuses it, such as the rollout loader's, is unchanged)
    if changed or any(p.action.writes and p.action != Action.CREATE for p in reached):
        raise PartialApplyError(f"apply stopped after changing tensors in place: {e}. "
                                "Call apply again with resume=True to finish, or reload the base.") from e
    raise e


def creates(entry: TensorEntry, tensor: torch.Tensor | None, recv: ShardSpec | None) -> bool:
    """Whether applying ``entry`` makes a new tensor for the receiver (a new name, or another
    dtype or shape than the one held): ``plan_entry``'s ``create``."""
    if entry.kind != TensorKind.FULL or entry.region is None:
        return False
    if tensor is None or tensor.dtype != entry.torch_dtype:
        return True
    return tuple((recv or ShardSpec.full(tensor.shape)).global_shape) != tuple(entry.region.global_shape)


def refuse_misfits(tensors: Mapping[str, torch.Tensor], entries: Iterable[TensorEntry],
                   shards: Mapping[str, ShardSpec] | None = None) -> None:
    """Before the first write: where the receiver's mapping takes no new tensors (it offers
    ``refuse_new(entries)``, as the rollout loader's view of a model's own weights does), the
    entries that would make one are refused together, with what differs, while nothing is
    changed yet."""
    refuse = getattr(tensors, "refuse_new", None)
    if refuse is None:
        return
    shards = shards or {}
    new = [e for e in entries if creates(e, tensors.get(e.name), shards.get(e.name))]
    if new:
        refuse(new)


def _refuse_undecodable(plans: Sequence[Plan], journal: set | None, decoded: DecodedChunks | None) -> None:
    """Before the first write: a ``classes`` chunk of an entry the receiver holds only part of,
    that nobody decoded for it (and that it has not applied already)."""
    for p in plans:
        if not p.action.writes or p.checks_chunks:
            continue
        for c in p.entry.chunks:
            key = (p.name, c.start)
            if c.enc == CLASSES and not (decoded is not None and key in decoded) \
                    and not (journal is not None and key in journal):
                raise undecodable(p.name, c)


def remove_absent(tensors: MutableMapping[str, torch.Tensor], deltas: Iterable, *,
                  shards: Mapping[str, ShardSpec] | None = None,
                  on_change: OnChange | None = None) -> list:
    """After applying every part of a keyframe (a delta against nothing, which names every tensor
    of the target): drop the tensors ``tensors`` holds that no part names, so the receiver ends
    with exactly the target's tensor set. Returns the names removed."""
    named: list[str] = []
    for d in deltas:
        named += DeltaReader.open(d).header.names
    return remove_unnamed(tensors, named, shards=shards, on_change=on_change)


def remove_unnamed(tensors: MutableMapping[str, torch.Tensor], named: Iterable[str], *,
                   shards: Mapping[str, ShardSpec] | None = None,
                   on_change: OnChange | None = None) -> list:
    """``remove_absent`` given the names the keyframe's parts hold (a streaming receiver has them
    from the segments it read: ``SegmentStream.finish``)."""
    shards = shards or {}
    gone = sorted(set(tensors) - set(named))
    for name in gone:
        report_gone(name, tensors[name], shards.get(name), on_change)
        del tensors[name]
    return gone
