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

import numpy as np
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
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.state.runs import RunMaps, Runs, answering, expand
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
    """One chunk to decode together: the ranks holding some of its positions, and the runs of
    positions each rank answers for (those no lower rank holds)."""

    part: int
    name: str
    chunk: ChunkEntry
    holders: frozenset  # ranks holding some of the chunk's positions
    runs: dict[int, Runs]  # rank -> the runs it answers for

    @property
    def key(self) -> tuple[int, str, int]:
        return self.part, self.name, self.chunk.start

    @property
    def classes(self) -> int:
        rows = self.chunk.cls
        return rows[-1][0] - rows[0][0] + 1 if rows else 1

    def count_bytes(self, rank: int) -> int:
        """Bytes of ``rank``'s class counts of the chunk (int32 per class per run)."""
        return len(self.runs[rank]) * self.classes * 4 if rank in self.runs else 0


def _has_classes(e: TensorEntry) -> bool:
    return e.kind == TensorKind.DELTA and e.region is not None and any(c.enc == CLASSES for c in e.chunks)


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


def _shares(readers: Sequence[DeltaReader], layouts: list[dict], maps: RunMaps) -> list[_Share]:
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
        ranks = sorted(holders)
        disjoint = not any(holders[a].overlaps(holders[b]) for i, a in enumerate(ranks) for b in ranks[i + 1:])
        for c in e.chunks:
            if c.enc != CLASSES or not c.k:
                continue
            held = {rank: h for rank in ranks if len(h := maps.held(e.region, c.start, c.n, holders[rank]))}
            if all(h.total == c.n for h in held.values()):
                continue  # nobody holds part of it
            runs = answering(held, c.n, disjoint)
            if sum(r.total for r in runs.values()) != c.n:
                raise undecodable(e.name, c)
            out.append(_Share(key[0], e.name, c, frozenset(held), runs))
    return out


def _run_bits(p: Plan, runs: Runs) -> tuple[torch.Tensor, np.ndarray]:
    """This rank's bits of ``runs``, where its tensor is, as (a 1-D integer view, each run's start
    in it): the tensor's own flat bits when it is contiguous (nothing copied), else the runs
    gathered."""
    fa = FlatAccess(p.held)
    if fa.contiguous:
        return fa.read(0, fa.numel), runs.lstart
    at = torch.from_numpy(expand(runs.lstart, runs.length)).to(p.held.device)
    return fa.gather(at), np.cumsum(runs.length) - runs.length


def _chunk_bits(p: Plan, runs: Runs) -> torch.Tensor:
    """This rank's bits of a chunk it holds whole (``runs`` cover it), in chunk order: a view where
    the chunk is one run of a contiguous tensor."""
    fa = FlatAccess(p.held)
    if len(runs) == 1 and fa.contiguous:
        lo = int(runs.lstart[0])
        return fa.read(lo, lo + int(runs.length[0]))
    return fa.gather(torch.from_numpy(expand(runs.lstart, runs.length)).to(p.held.device))


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


@dataclass(frozen=True)
class _Placed:
    """A chunk's changes placed from every rank's class counts: per change (in stream order), the
    class - lo, the rank answering for its position, that rank's run and the change's place among
    the run's elements of its class (int64 arrays); and the value differences."""

    cls: np.ndarray
    owner: np.ndarray
    run: np.ndarray
    within: np.ndarray
    d: torch.Tensor


def _place(p: Plan, s: _Share, payload, counts: dict[int, np.ndarray]) -> _Placed:
    """Every change of chunk ``s`` to the run holding it, from the runs' class counts (every rank
    holding part of the chunk computes the same). A change past the last of its class: the streams
    do not fit the group's base. (numpy: a few dozen runs and classes, a few hundred changes a
    chunk, where torch's per-call cost was most of a chunk's time.)"""
    dtype = p.entry.torch_dtype
    lo = s.chunk.cls[0][0] if s.chunk.cls else 0
    try:
        cls_t, rank_t, d = chunk_streams(s.chunk, payload, dtype.itemsize, dtype)
    except DeltaFormatError:
        raise BaseMismatchError(f"{p.name}: chunk at element {s.chunk.start} does not match its base") from None
    cls, rank = cls_t.numpy() - lo, rank_t.numpy()
    holders = sorted(s.runs)
    starts = np.concatenate([s.runs[r].cstart for r in holders])
    owner = np.concatenate([np.full(len(s.runs[r]), r, dtype=np.int64) for r in holders])
    local = np.concatenate([np.arange(len(s.runs[r]), dtype=np.int64) for r in holders])
    n = np.concatenate([counts[r] for r in holders])  # [runs, classes]
    o = np.argsort(starts, kind="stable")
    owner, local, n = owner[o], local[o], n[o]
    upto = np.cumsum(n, 0)  # of each class, in the runs up to and including each
    bad = (cls < 0) | (cls >= s.classes)
    if not bad.any():
        bad = rank >= upto[-1][cls]
    if bad.any():
        raise BaseMismatchError(f"{p.name}: chunk at element {s.chunk.start} does not match its base (its class "
                                "counts gathered from the receiver group)")
    # each change's run: the first whose count of its class, summed, passes its rank; one search
    # over the classes' columns laid end to end (class c's column offset by c * big keeps it sorted)
    runs, big = len(n), int(upto[-1].max()) + 1
    run = np.searchsorted((np.arange(s.classes)[:, None] * big + upto.T).ravel(), cls * big + rank,
                          side="right") - cls * runs
    within = rank - (upto - n)[run, cls]
    return _Placed(cls, owner[run], local[run], within, d)


def _range(s: _Share) -> tuple[int, int]:
    """The chunk's class range (its table's first and last class)."""
    rows = s.chunk.cls
    return (rows[0][0], rows[-1][0]) if rows else (0, 0)


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return int_view(torch.empty(0, dtype=dtype)).dtype


def _np_bits(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype of ``dtype``'s integer view (the exchanged base bits)."""
    return _NP_BITS.setdefault(dtype, torch.empty(0, dtype=_bits_dtype(dtype)).numpy().dtype)


_NP_BITS: dict = {}


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
    maps = RunMaps()
    shares = group.run(lambda: _shares(readers, layouts, maps), "find the classes chunks to decode together")
    me, world = group.rank, group.world_size

    received = 0
    placed: dict = {}  # share key -> _Placed
    found: list[dict] = [{} for _ in range(world)]  # rank -> share key -> (its changes' positions, base bits)
    if shares:
        def counts():
            mine = [torch.empty(0, dtype=torch.uint8)]
            for s in shares:
                if me in s.runs:
                    p, runs = plans[(s.part, s.name)], s.runs[me]
                    base, starts = _run_bits(p, runs)
                    lo, hi = _range(s)
                    n = classes.run_counts(base, starts, runs.length, lo, hi, classes.MANTISSA[p.entry.torch_dtype])
                    mine.append(torch.from_numpy(n.reshape(-1).view(np.uint8)))
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
                    raw = bufs[r][offs[r]: offs[r] + n].numpy()
                    got[r] = raw.view(np.uint32).astype(np.int64).reshape(-1, s.classes)
                    offs[r] += n
                if me not in s.holders:
                    continue
                p = plans[(s.part, s.name)]
                pl = placed[s.key] = _place(p, s, readers[s.part].payload(s.chunk), got)
                if me not in s.runs:
                    continue
                mine = np.flatnonzero(pl.owner == me)
                runs, run = s.runs[me], pl.run[mine]
                # the bits read again, not kept from counts(): kept for every chunk of a version they
                # would be a copy of the weights held in part
                base, starts = _run_bits(p, runs)
                lo, hi = _range(s)
                try:
                    off = classes.run_select(base, starts, runs.length, lo, hi, classes.MANTISSA[p.entry.torch_dtype],
                                             run, pl.cls[mine], pl.within[mine])
                except classes.RankPastClass:  # (cannot be, from this rank's own counts; said as what it would mean)
                    raise BaseMismatchError(f"{p.name}: chunk at element {s.chunk.start} does not match its base "
                                            "(its class counts)") from None
                local = torch.from_numpy(runs.lstart[run] + off).to(p.held.device)
                # (which changes they are, every rank knows: pl.owner; a position in a chunk fits int32.
                # numpy, not tensors: all_gather_object pickles them, and a tensor pickles ~20x slower)
                bits = FlatAccess(p.held).gather(local).cpu().numpy()
                sent[s.key] = ((runs.cstart[run] + off).astype(np.int32), bits)
            return sent

        found = group.run(locate, "place the changes of the classes chunks held in part", gather=True)
        received += sum(sum(a.nbytes for a in v) for r, d in enumerate(found) if r != me for v in d.values())

    def together(p: Plan, s: _Share) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chunk ``s``'s changes as every rank placed them, in position order, checked against its
        pre-image as a whole-chunk holder checks them -> (positions, base bits, differences)."""
        c, pl = s.chunk, placed[s.key]
        if pl.d.numel() != c.k:
            raise DeltaFormatError(f"{p.name}: chunk at element {c.start} holds {pl.d.numel()} changes, "
                                   f"its entry {c.k}")
        at_all = np.full(c.k, -1, dtype=np.int64)  # each change's position, in stream order
        old_all = np.zeros(c.k, dtype=_np_bits(p.entry.torch_dtype))
        for r in sorted(s.runs):
            if s.key in found[r]:
                at, b = found[r][s.key]
                i = np.flatnonzero(pl.owner == r)
                if i.size != at.size or b.dtype != old_all.dtype:
                    raise BaseMismatchError(f"{p.name}: chunk at element {c.start}: rank {r} placed {at.size} of "
                                            f"its {i.size} changes")
                at_all[i], old_all[i] = at, b
        o = np.argsort(at_all, kind="stable")
        at_all = at_all[o]
        idx, old, d = torch.from_numpy(at_all), torch.from_numpy(old_all[o]), pl.d[torch.from_numpy(o)]
        if (at_all < 0).any() or (np.diff(at_all) <= 0).any() or values_digest(old, c.values_algo) != c.pre:
            raise BaseMismatchError(f"{p.name}: chunk at element {c.start} does not match its base (its changes "
                                    f"placed by ranks {sorted(s.runs)} of the receiver group)")
        return idx, old, d

    def new_bits(pending: list) -> list[Decoded]:
        """The new bits of the chunks decoded together, ``(plan, chunk, positions, base bits,
        differences)`` each: one pass per element width for all of them (a dozen torch calls a
        version, not a chunk), each chunk checked against its post-image."""
        out: list[Decoded | None] = [None] * len(pending)
        by_width: dict = {}
        for j, item in enumerate(pending):
            by_width.setdefault(item[3].element_size(), []).append(j)
        for w, js in by_width.items():
            old, d = torch.cat([pending[j][3] for j in js]), torch.cat([pending[j][4] for j in js])
            new = to_bits(classes.new_values(unsigned(old), d, w), w)
            for j, part in zip(js, torch.split(new, [pending[j][3].numel() for j in js])):
                p, c, idx, base, _ = pending[j]
                part = part.view(base.dtype)
                if values_digest(part, c.values_algo) != c.post:
                    raise DeltaFormatError(f"{p.name}: chunk at element {c.start} decodes to values that do not "
                                           "match its post-image digest")
                out[j] = Decoded(idx, base, part)
        return out  # type: ignore[return-value]

    def decode_mine():
        out: list[dict] = [{} for _ in readers]
        by_key = {s.key: s for s in shares}
        pending, where = [], []
        for (i, name), p in sorted(plans.items()):
            if p.action != Action.UNVERIFIED:
                continue  # holds the entry's whole region: apply decodes and checks it
            bits_dtype = _bits_dtype(p.entry.torch_dtype)
            assert p.recv is not None and p.entry.region is not None  # plan_entry, _has_classes
            for c in p.entry.chunks:
                if c.enc != CLASSES:
                    continue
                key = (i, name, c.start)
                if key in by_key and me in by_key[key].holders:
                    pending.append((p, c, *together(p, by_key[key])))
                    where.append((i, name, c.start))
                    continue
                mine = maps.held(p.entry.region, c.start, c.n, p.recv)
                if not len(mine) or not c.k:
                    out[i][(name, c.start)] = Decoded.nothing(bits_dtype)
                else:  # (_shares: this rank holds the whole chunk)
                    out[i][(name, c.start)] = _decode(p, c, readers[i].payload(c), _chunk_bits(p, mine), "held here")
        for (i, name, start), dec in zip(where, new_bits(pending)):
            out[i][(name, start)] = dec
        return out

    decoded = group.run(decode_mine, "decode the classes chunks held in part")
    return Gathered(decoded, received)
