"""``classes`` chunks on receivers sharded differently from the trainer: decoded with the help
of the receiver's group, before the first write (docs/design.md "Receivers sharded differently").

A ``classes`` chunk codes its changes against the *whole* base chunk (the trainer rank's region, in
chunks of the region's flat order): each change as its base element's exponent class and its rank
among the chunk's elements of that class in index order, the value as a difference from the base
bits there. A receiver rank holding only part of the chunk (a vLLM TP worker holding its rows or
columns of a tensor a trainer rank published whole) cannot place the changes alone, but the ranks
of its group together hold every position:

1. every rank lists, for the version's entries with ``classes`` chunks, where its tensor sits in
   the canonical tensor (its ``ShardSpec``): one small all-gather;
2. from those layouts alone every rank derives the same list of chunks that some rank holds only
   part of (no rank decides alone, so every rank enters the same exchanges), and which rank
   answers for each position (the lowest holding it), as runs of consecutive positions; a chunk
   the group together does not hold whole is refused here, before anything is written;
3. one exchange carries, per run, how many of its base elements fall in each class: from those
   counts every rank finds, for each change, the run and so the rank holding it, and that rank
   where in the run it is;
4. a second exchange carries, per change, its position and the base bits there (O(changes)); each
   rank then decodes the values and checks the chunk's pre- and post-image digests as a
   whole-chunk holder does, and ``apply`` writes only the positions it holds
   (``nemo_dcr.delta.apply.Decoded``).

What crosses between ranks, and to the host from a device, is the class counts (a few bytes per
class per run: a row of a column-split tensor is one run) and O(changes); no rank's bits of a
chunk leave it. Tensors on a device (a GPU engine's TP workers) are not staged through the host:
the counts and the located changes are computed where the weights are; a chunk a rank holds whole
inside a tensor it holds in part is located against its bits there (``chunk.locate_chunk``), as
``apply`` does for a whole tensor; ``apply`` then writes the decoded changes on the device.

Every stage that can fail on one rank runs under ``Group.run``: a bad base on any rank is the same
typed error on every rank, and nothing was written anywhere. Without a group (one receiver) the
same code refuses, before the first write, what it cannot decode.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_dcr.codec import classes
from nemo_dcr.codec.chunk import CLASSES, chunk_streams, decode_chunk, locate_chunk
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.codec.header import ChunkEntry, TensorEntry, TensorKind
from nemo_dcr.codec.ordered import to_bits, unsigned
from nemo_dcr.delta.apply import Decoded, on_host, undecodable
from nemo_dcr.delta.plan import Action, Plan, plan_entry
from nemo_dcr.errors import BaseMismatchError, DcrError, DeltaFormatError
from nemo_dcr.state.digest import values_digest
from nemo_dcr.state.dtypes import int_view
from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.state.index_map import IndexMap, ShardSpec
from nemo_dcr.sync.group import Group

__all__ = ["Gathered", "decode_partial"]


@dataclass(frozen=True)
class Gathered:
    """What ``decode_partial`` found: per part, the chunks decoded for ``apply(decoded=...)``;
    ``received``: bytes this rank received from the others (their runs' class counts, the
    positions and base bits of the changes they hold; padding excluded)."""

    decoded: list[dict[tuple[str, int], Decoded]]
    received: int = 0


@dataclass(frozen=True)
class _Share:
    """One chunk to decode together: which of its positions (in chunk order) each rank holds, and
    the runs of positions each rank answers for (those no lower rank holds)."""

    part: int
    name: str
    chunk: ChunkEntry
    masks: dict[int, torch.Tensor]  # rank -> bool mask over the chunk's positions
    runs: dict[int, tuple[torch.Tensor, torch.Tensor]]  # rank -> (starts, ends) of its runs, increasing

    @property
    def key(self) -> tuple[int, str, int]:
        return self.part, self.name, self.chunk.start

    @property
    def classes(self) -> int:
        rows = self.chunk.cls
        return rows[-1][0] - rows[0][0] + 1 if rows else 1

    def count_bytes(self, rank: int) -> int:
        """Bytes of ``rank``'s class counts of the chunk (int32 per class per run)."""
        return len(self.runs[rank][0]) * self.classes * 4 if rank in self.runs else 0


def _runs(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bool mask -> (starts, ends) of its runs of True."""
    z = torch.zeros(1, dtype=torch.int8)
    d = torch.diff(m.to(torch.int8), prepend=z, append=z)
    return (d == 1).nonzero().flatten(), (d == -1).nonzero().flatten()


def _has_classes(e: TensorEntry) -> bool:
    return e.kind == TensorKind.DELTA and e.region is not None and any(c.enc == CLASSES for c in e.chunks)


def _chunk_positions(e: TensorEntry, c: ChunkEntry, device=None) -> torch.Tensor:
    """The chunk's canonical positions, computed on ``device`` (where a receiver's tensor is: its
    indices are not built on the host and copied over)."""
    assert e.region is not None  # _has_classes
    return IndexMap(e.region).to_global(torch.arange(c.start, c.start + c.n, dtype=torch.int64, device=device))


def _my_plans(readers: Sequence[DeltaReader], tensors: Mapping, shards: Mapping) -> dict:
    """(part, name) -> the apply plan of each entry with ``classes`` chunks that this rank holds
    some of. An entry that does not fit the receiver is left to ``apply`` to report."""
    plans = {}
    for i, r in enumerate(readers):
        for e in r.header.tensors:
            if not _has_classes(e) or e.name not in tensors:
                continue
            try:
                p = plan_entry(e, tensors[e.name], shards.get(e.name), verify=False, resume=True)
            except DcrError:
                continue
            if p.action != Action.IGNORE:
                plans[(i, e.name)] = p
    return plans


def _shares(readers: Sequence[DeltaReader], layouts: list[dict]) -> list[_Share]:
    """The chunks some rank holds only part of, the same list on every rank (derived from every
    rank's layout alone). Raises when the group together lacks a position of one."""
    entries = {(i, e.name): e for i, r in enumerate(readers) for e in r.header.tensors}
    out = []
    for key in sorted(set().union(*layouts)):
        holders = {rank: ShardSpec(*lay[key]) for rank, lay in enumerate(layouts) if key in lay}
        e = entries[key]
        assert e.region is not None  # _has_classes
        if all(s.contains(e.region) for s in holders.values()):
            continue  # every holder has every chunk whole: each decodes its own
        maps = {rank: IndexMap(s) for rank, s in holders.items()}
        for c in e.chunks:
            if c.enc != CLASSES or not c.k:
                continue
            glob = _chunk_positions(e, c)
            masks = {rank: m.to_local(glob)[1] for rank, m in maps.items()}
            masks = {rank: m for rank, m in masks.items() if bool(m.any())}
            if all(bool(m.all()) for m in masks.values()):
                continue  # nobody holds part of it
            held = torch.zeros(c.n, dtype=torch.bool)
            runs = {}
            for rank in sorted(masks):  # a position held by several ranks is answered for by the lowest
                own = masks[rank] & ~held
                held |= masks[rank]
                if bool(own.any()):
                    runs[rank] = _runs(own)
            if not bool(held.all()):
                raise undecodable(e.name, c)
            out.append(_Share(key[0], e.name, c, masks, runs))
    return out


def _own_bits(p: Plan, glob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's bits at the chunk positions it holds, in chunk order; the mask of those), where
    the tensor and ``glob`` are."""
    assert p.recv is not None  # plan_entry gives every held tensor its shard spec
    local, mask = IndexMap(p.recv).to_local(glob)
    return FlatAccess(p.held).gather(local), mask


def _decode(p: Plan, c: ChunkEntry, payload, base: torch.Tensor, where: str) -> Decoded:
    """Decode chunk ``c`` against ``base`` (its true bits at the changed positions, its classes
    elsewhere) and check it as a whole-chunk holder does; where ``base`` is (a device: the streams
    decoded on the host, placed against ``base`` there, as ``apply`` does)."""
    dtype = p.entry.torch_dtype
    try:
        if on_host(base):
            idx, new = decode_chunk(c, payload, dtype.itemsize, base=base, dtype=dtype)
        else:
            idx, new = locate_chunk(c, payload, base, dtype)
    except DeltaFormatError:  # checksum-valid, so: not coded against these bits
        idx, new = None, None
    if idx is None or values_digest(base[idx], c.values_algo) != c.pre:
        raise BaseMismatchError(f"{p.name}: chunk at element {c.start} does not match its base ({where})")
    if values_digest(new, c.values_algo) != c.post:
        raise DeltaFormatError(f"{p.name}: chunk at element {c.start} decodes to values that do not match its "
                               "post-image digest")
    return Decoded(idx, base[idx], new)


def _answered(p: Plan, s: _Share, me: int):
    """The positions of chunk ``s`` this rank answers for, where its tensor is: (their places in
    the chunk, their bits, their classes - lo, the index of this rank's run each is in)."""
    dev = p.held.device
    starts, ends = (t.to(dev) for t in s.runs[me])
    lengths = ends - starts
    run_of = torch.repeat_interleave(torch.arange(starts.numel(), device=dev), lengths)
    pos = starts[run_of] + torch.arange(run_of.numel(), device=dev) - (torch.cumsum(lengths, 0) - lengths)[run_of]
    bits, _ = _own_bits(p, _chunk_positions(p.entry, s.chunk, dev)[pos])
    ctx = classes.context(bits, s.chunk.cls, classes.MANTISSA[p.entry.torch_dtype]).to(torch.int64)
    return pos, bits, ctx, run_of


@dataclass(frozen=True)
class _Placed:
    """A chunk's changes placed from every rank's class counts: per change (in stream order), the
    class - lo, the rank answering for its position, that rank's run and the change's place among
    the run's elements of its class; and the value differences."""

    cls: torch.Tensor
    owner: torch.Tensor
    run: torch.Tensor
    within: torch.Tensor
    d: torch.Tensor


def _place(p: Plan, s: _Share, payload, counts: dict[int, torch.Tensor]) -> _Placed:
    """Every change of chunk ``s`` to the run holding it, from the runs' class counts (every rank
    holding part of the chunk computes the same). A change past the last of its class: the streams
    do not fit the group's base."""
    dtype = p.entry.torch_dtype
    lo = s.chunk.cls[0][0] if s.chunk.cls else 0
    try:
        cls, rank, d = chunk_streams(s.chunk, payload, dtype.itemsize, dtype)
    except DeltaFormatError:
        raise BaseMismatchError(f"{p.name}: chunk at element {s.chunk.start} does not match its base") from None
    cls = cls - lo
    holders = sorted(s.runs)
    starts = torch.cat([s.runs[r][0] for r in holders])
    owner = torch.cat([torch.full((len(s.runs[r][0]),), r, dtype=torch.int64) for r in holders])
    local = torch.cat([torch.arange(len(s.runs[r][0])) for r in holders])
    n = torch.cat([counts[r] for r in holders])  # [runs, classes]
    o = torch.argsort(starts)
    owner, local, n = owner[o], local[o], n[o]
    upto = torch.cumsum(n, 0)  # of each class, in the runs up to and including each
    bad = (cls < 0) | (cls >= s.classes)
    if not bool(bad.any()):
        bad = rank >= upto[-1][cls]
    if bool(bad.any()):
        raise BaseMismatchError(f"{p.name}: chunk at element {s.chunk.start} does not match its base (its class "
                                "counts gathered from the receiver group)")
    run = torch.empty_like(rank)
    for c in torch.unique(cls).tolist():
        at = cls == c
        run[at] = torch.searchsorted(upto[:, c].contiguous(), rank[at], right=True)
    within = rank - (upto - n)[run, cls]
    return _Placed(cls, owner[run], local[run], within, d)


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return int_view(torch.empty(0, dtype=dtype)).dtype


def decode_partial(blobs: Sequence[bytes | DeltaReader], tensors: Mapping, shards: Mapping, group: Group) -> Gathered:
    """Decode, before anything is written, every ``classes`` chunk of ``blobs`` (the parts of one
    version, the same on every rank) in entries this rank holds only part of. Collective: every
    rank of ``group`` calls it with the same parts."""
    readers = [DeltaReader.open(b) for b in blobs]
    plans: dict = {}

    def layout():
        plans.update(_my_plans(readers, tensors, shards))
        return {k: (p.recv.global_shape, p.recv.offsets, p.recv.shape, p.recv.index_shape) for k, p in plans.items()}

    layouts = group.run(layout, "list the classes chunks held in part", gather=True)
    shares = group.run(lambda: _shares(readers, layouts), "find the classes chunks to decode together")
    me, world = group.rank, group.world_size

    received = 0
    placed: dict = {}  # share key -> _Placed
    found: list[dict] = [{} for _ in range(world)]  # rank -> share key -> (its changes' positions, base bits)
    if shares:
        def counts():
            mine = [torch.empty(0, dtype=torch.uint8)]
            for s in shares:
                if me in s.runs:
                    _, _, ctx, run_of = _answered(plans[(s.part, s.name)], s, me)
                    n = torch.bincount(run_of * s.classes + ctx, minlength=len(s.runs[me][0]) * s.classes)
                    mine.append(n.to(torch.int32).cpu().view(torch.uint8))
            return torch.cat(mine)

        sizes = [sum(s.count_bytes(r) for s in shares) for r in range(world)]
        bufs = group.all_gather_bytes(group.run(counts, "count the classes of the chunks held in part"), sizes)
        received += sum(n for r, n in enumerate(sizes) if r != me)

        def locate():
            offs, sent = [0] * world, {}
            for s in shares:
                got = {}
                for r in sorted(s.runs):  # (every rank walks every buffer to its next chunk)
                    n = s.count_bytes(r)
                    raw = bufs[r][offs[r]: offs[r] + n].clone()  # (aligned for the int32 view)
                    got[r] = raw.view(torch.int32).to(torch.int64).reshape(-1, s.classes)
                    offs[r] += n
                if me not in s.masks:
                    continue
                p = plans[(s.part, s.name)]
                pl = placed[s.key] = _place(p, s, readers[s.part].payload(s.chunk), got)
                if me not in s.runs:
                    continue
                mine = (pl.owner == me).nonzero().flatten()
                # gathered and classed again, not kept from counts(): kept for every chunk of a
                # version it would be ~3 int64 per element held, several times the weights
                pos, bits, ctx, run_of = _answered(p, s, me)
                dev = pos.device
                # this rank's elements grouped by (run, class), in index order within each group
                group_of = run_of * s.classes + ctx
                order = torch.argsort(group_of, stable=True)
                size = torch.bincount(group_of, minlength=len(s.runs[me][0]) * s.classes)
                first = torch.cumsum(size, 0) - size
                at = (pl.run[mine] * s.classes + pl.cls[mine]).to(dev)
                el = order[first[at] + pl.within[mine].to(dev)]
                # (which changes they are, every rank knows: pl.owner; a position in a chunk fits int32)
                sent[s.key] = (pos[el].to(torch.int32).cpu(), bits[el].cpu())
            return sent

        found = group.run(locate, "place the changes of the classes chunks held in part", gather=True)
        received += sum(sum(t.numel() * t.element_size() for t in v) for r, d in enumerate(found) if r != me
                        for v in d.values())

    def together(p: Plan, s: _Share) -> Decoded:
        """Chunk ``s`` from the changes every rank placed: checked as a whole-chunk holder does."""
        c, pl = s.chunk, placed[s.key]
        if pl.d.numel() != c.k:
            raise DeltaFormatError(f"{p.name}: chunk at element {c.start} holds {pl.d.numel()} changes, "
                                   f"its entry {c.k}")
        bits_dtype = _bits_dtype(p.entry.torch_dtype)
        idx = torch.full((c.k,), -1, dtype=torch.int64)
        old = torch.empty(c.k, dtype=bits_dtype)
        for r in sorted(s.runs):
            if s.key in found[r]:
                where, b = found[r][s.key]
                i = (pl.owner == r).nonzero().flatten()
                if i.numel() != where.numel():
                    raise BaseMismatchError(f"{p.name}: chunk at element {c.start}: rank {r} placed {where.numel()} of "
                                            f"its {i.numel()} changes")
                idx[i], old[i] = where.to(torch.int64), b
        o = torch.argsort(idx)
        idx, old, d = idx[o], old[o], pl.d[o]
        where = f"its changes placed by ranks {sorted(s.runs)} of the receiver group"
        if bool((idx < 0).any()) or bool((idx[1:] <= idx[:-1]).any()) or values_digest(old, c.values_algo) != c.pre:
            raise BaseMismatchError(f"{p.name}: chunk at element {c.start} does not match its base ({where})")
        new = to_bits(classes.new_values(unsigned(old), d, old.element_size()), old.element_size()).view(bits_dtype)
        if values_digest(new, c.values_algo) != c.post:
            raise DeltaFormatError(f"{p.name}: chunk at element {c.start} decodes to values that do not match its "
                                   "post-image digest")
        return Decoded(idx, old, new)

    def decode_mine():
        out: list[dict] = [{} for _ in readers]
        by_key = {s.key: s for s in shares}
        for (i, name), p in sorted(plans.items()):
            if p.action != Action.UNVERIFIED:
                continue  # holds the entry's whole region: apply decodes and checks it
            bits_dtype = _bits_dtype(p.entry.torch_dtype)
            for c in p.entry.chunks:
                if c.enc != CLASSES:
                    continue
                key = (i, name, c.start)
                if key in by_key and me in by_key[key].masks:
                    out[i][(name, c.start)] = together(p, by_key[key])
                    continue
                bits, mask = _own_bits(p, _chunk_positions(p.entry, c, p.held.device))
                if not bool(mask.any()) or not c.k:
                    out[i][(name, c.start)] = Decoded.nothing(bits_dtype)
                else:  # (_shares: this rank holds the whole chunk)
                    out[i][(name, c.start)] = _decode(p, c, readers[i].payload(c), bits, "held here")
        return out

    decoded = group.run(decode_mine, "decode the classes chunks held in part")
    return Gathered(decoded, received)
