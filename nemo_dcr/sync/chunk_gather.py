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
4. a second exchange carries, per change, its position and the base bits there (O(changes)); one
   rank per chunk (``_checker``: its answering ranks in turn) then puts the chunk's changes
   together and checks its pre- and post-image digests as a whole-chunk holder does, the others
   decode only the changes they answered for (where shards overlap, every holder puts it
   together), and ``apply`` writes only the positions each holds
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
from nemo_dcr.codec.chunk import CLASSES, StreamsDoNotDecode, chunk_streams_many, decode_chunk, locate_chunk
from nemo_dcr.codec.classes import offsets
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.codec.header import ChunkEntry, TensorEntry, TensorKind
from nemo_dcr.delta.apply import Decoded, on_host, undecodable
from nemo_dcr.delta.plan import Action, Plan, plan_entry
from nemo_dcr.errors import BaseMismatchError, DcrError, DeltaFormatError
from nemo_dcr.state.digest import values_digest
from nemo_dcr.state.dtypes import INT_VIEW, int_view
from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.state.runs import Runs, answering, chunk_runs, expand, shard_rows
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
    width: int  # bytes per element (known to every rank from the header: ranks not holding it too)
    disjoint: bool  # no two ranks' shards of its tensor overlap: a rank answers for what it holds
    count_width: int = 4  # bytes per class count sent: what the longest run's count needs (_count_width)

    @property
    def key(self) -> tuple[int, str, int]:
        return self.part, self.name, self.chunk.start

    @property
    def classes(self) -> int:
        rows = self.chunk.cls
        return rows[-1][0] - rows[0][0] + 1 if rows else 1

    def count_bytes(self, rank: int) -> int:
        """Bytes of ``rank``'s class counts of the chunk (``count_width`` per class per run)."""
        return len(self.runs[rank]) * self.classes * self.count_width if rank in self.runs else 0


def _count_width(longest: int) -> int:
    """Bytes a class count of a run of at most ``longest`` elements is sent in: a TP engine's run
    is a row of its columns (hundreds to thousands of elements), and the counts are most of what a
    group exchanges (~3 per change at 1 %), so 1 or 2 bytes, not 4, where the runs allow."""
    return 1 if longest <= 0xFF else 2 if longest <= 0xFFFF else 4


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


def _shares(readers: Sequence[DeltaReader], layouts: list[dict]) -> list[_Share]:
    """The chunks some rank holds only part of, the same list on every rank (derived from every
    rank's layout alone). Raises when the group together lacks a position of one."""
    entries = {(i, e.name): e for i, r in enumerate(readers) for e in r.header.tensors}
    out = []
    # the ranks' shards of a tensor -> (them as specs, whether they overlap, the longest row): the
    # same for its entry in every part (an FSDP trainer's ranks each send one), and across a
    # model's tensors of one shape
    laid: dict = {}
    for key in sorted(set().union(*layouts)):
        lays = tuple((rank, lay[key]) for rank, lay in enumerate(layouts) if key in lay)
        try:
            got, keep = laid.get(lays), True
        except TypeError:  # (a layout of lists, not tuples: worked out each time)
            got, keep = None, False
        if got is None:
            holders = {rank: ShardSpec(*lay) for rank, lay in lays}
            ranks = sorted(holders)
            disjoint = not any(holders[a].overlaps(holders[b]) for i, a in enumerate(ranks) for b in ranks[i + 1:])
            row = max(shard_rows(h)[2] for h in holders.values())  # no run is longer than a holder's row
            got = (holders, ranks, disjoint, row)
            if keep:
                laid[lays] = got
        holders, ranks, disjoint, row = got
        e = entries[key]
        assert e.region is not None  # _has_classes
        if all(s.contains(e.region) for s in holders.values()):
            continue  # every holder has every chunk whole: each decodes its own
        for c in e.chunks:
            if c.enc != CLASSES or not c.k:
                continue
            held = {rank: h for rank in ranks if len(h := chunk_runs(e.region, c.start, c.n, holders[rank]))}
            if all(h.total == c.n for h in held.values()):
                continue  # nobody holds part of it
            runs = answering(held, c.n, disjoint)
            if sum(r.total for r in runs.values()) != c.n:
                raise undecodable(e.name, c)
            out.append(_Share(key[0], e.name, c, frozenset(held), runs, e.torch_dtype.itemsize, disjoint,
                              _count_width(min(c.n, row))))
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


def _range(s: _Share) -> tuple[int, int]:
    """The chunk's class range (its table's first and last class)."""
    rows = s.chunk.cls
    return (rows[0][0], rows[-1][0]) if rows else (0, 0)


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return int_view(torch.empty(0, dtype=dtype)).dtype


def _np_bits(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype of ``dtype``'s integer view (the exchanged base bits)."""
    got = _NP_BITS.get(dtype)
    if got is None:  # (once per dtype: making the default each call cost ~8 us a chunk)
        got = _NP_BITS[dtype] = torch.empty(0, dtype=_bits_dtype(dtype)).numpy().dtype
    return got


_NP_BITS: dict = {}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_VIEW = {w: torch.empty(0, dtype=INT_VIEW[w]).numpy().dtype for w in _UNSIGNED}  # the integer views, numpy's


def _call(p: Plan, s: _Share, runs: Runs) -> classes.RunCall:
    """This rank's bits of chunk ``s``'s runs ``runs`` as a call of the runs kernels."""
    base, starts = _run_bits(p, runs)
    lo, hi = _range(s)
    return classes.RunCall(base, starts, runs.length, lo, hi, classes.MANTISSA[p.entry.torch_dtype])


@dataclass(frozen=True)
class _Placed:
    """The changes of the chunks this rank holds part of (``shares``, in order), placed from every
    rank's class counts, one after another (int64 arrays; each chunk's in stream order): the chunk
    of each (``share``: its index in ``shares``), its class - lo, the rank answering for its
    position, that rank's run, the change's place among the run's elements of its class and its
    value difference; ``first``: where each chunk's changes start (and the total last)."""

    shares: list
    share: np.ndarray
    cls: np.ndarray
    owner: np.ndarray
    run: np.ndarray
    within: np.ndarray
    d: np.ndarray
    first: np.ndarray


def _order(s: _Share, cache: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of chunk ``s``, every answering rank's, in chunk order -> (each one's rank, its
    index among that rank's runs, its place among the ranks' runs laid end to end); alike for
    the chunks of one layout (kept in ``cache``)."""
    holders = sorted(s.runs)
    key = tuple((r, id(s.runs[r])) for r in holders)  # (the Runs live as long as the shares)
    got = cache.get(key)
    if got is None:
        starts = np.concatenate([s.runs[r].cstart for r in holders])
        owner = np.concatenate([np.full(len(s.runs[r]), r, dtype=np.int64) for r in holders])
        local = np.concatenate([np.arange(len(s.runs[r]), dtype=np.int64) for r in holders])
        o = np.argsort(starts, kind="stable")
        got = cache[key] = (owner[o], local[o], o)
    return got


def _place(plans: Mapping, readers: Sequence[DeltaReader], held: list[_Share], counts: list[np.ndarray]) -> _Placed:
    """Every change of the chunks ``held`` to the run holding it, from the runs' class counts
    (``counts[i]``: chunk i's, ``[runs, classes]``, each answering rank's runs in turn, ranks in
    order; every rank holding part of a chunk computes the same). A change past the last of its
    class: the streams do not fit the group's base. All the chunks' streams in one kernel call
    (``chunk_streams_many``), and every change placed in one (``classes.place_many``: per class of
    a chunk one walk over its runs, in chunk order)."""
    cache: dict = {}
    try:
        cls, rank, d, first = chunk_streams_many([r.buf for r in readers], [
            (s.part, s.chunk, plans[(s.part, s.name)].entry.torch_dtype) for s in held])
    except StreamsDoNotDecode as e:
        s = held[e.call]
        raise BaseMismatchError(f"{s.name}: chunk at element {s.chunk.start} does not match its base") from None
    owner_l, local_l, order_l, lo = [], [], [], []
    for s in held:
        owner, local, o = _order(s, cache)
        owner_l.append(owner)
        local_l.append(local)
        order_l.append(o)
        lo.append(_range(s)[0])
    k = np.diff(first)
    share = np.repeat(np.arange(len(held)), k)
    cls -= np.repeat(np.array(lo, dtype=np.int64), k)  # (from each chunk's lo)
    try:
        run, within = classes.place_many(counts, order_l, k, cls, rank)
    except classes.RankPastClass as e:
        s = held[e.call if e.call is not None else 0]
        raise BaseMismatchError(f"{s.name}: chunk at element {s.chunk.start} does not match its base (its class "
                                "counts gathered from the receiver group)") from None
    where = offsets(np.array([len(o) for o in order_l], dtype=np.int64))[share] + run  # among every chunk's runs
    return _Placed(held, share, cls, np.concatenate(owner_l)[where], np.concatenate(local_l)[where], within, d,
                   first)


def _select(calls: Mapping, pl: _Placed, me: int) -> tuple[tuple, np.ndarray]:
    """The changes this rank answers for, found in its bits -> (what it sends: how many of each
    chunk it answers for (int32, in ``pl.shares`` order where it answers for some runs), their
    positions in their chunks (int32: a chunk's positions fit) and base bits by element width
    (``{width: unsigned array}``); per change of ``pl``, its flat index in this rank's tensor where
    this rank answers for it, else -1). One kernel call for all the chunks; ``calls``: share key ->
    this rank's ``RunCall`` of it (as the counts were made from)."""
    answers = [i for i, s in enumerate(pl.shares) if me in s.runs]
    mine = np.flatnonzero(pl.owner == me)
    per = np.bincount(pl.share[mine], minlength=len(pl.shares))[answers]
    mine_calls = [calls[pl.shares[i].key] for i in answers]
    run = pl.run[mine]
    try:
        off, bits = classes.run_select_many(mine_calls, per, run, pl.cls[mine], pl.within[mine])
    except classes.RankPastClass as e:  # (cannot be, from this rank's own counts; said as what it would mean)
        s = pl.shares[answers[e.call]] if e.call is not None else pl.shares[0]
        raise BaseMismatchError(f"{s.name}: chunk at element {s.chunk.start} does not match its base "
                                "(its class counts)") from None
    runs = [pl.shares[i].runs[me] for i in answers]
    empty = np.empty(0, np.int64)
    cstart = np.concatenate([r.cstart for r in runs]) if runs else empty
    lstart = np.concatenate([r.lstart for r in runs]) if runs else empty
    at = offsets(np.array([len(r) for r in runs], dtype=np.int64))[np.repeat(np.arange(len(answers)), per)] + run
    local = np.full(pl.owner.size, -1, dtype=np.int64)
    local[mine] = lstart[at] + off
    widths = sorted({c.base.element_size() for c in mine_calls})
    if len(widths) == 1:  # (one dtype's width, the usual case: no mask per width)
        by_width = {widths[0]: bits.astype(_UNSIGNED[widths[0]])}
    else:
        width = np.repeat(np.array([c.base.element_size() for c in mine_calls], dtype=np.int64), per)
        by_width = {w: bits[width == w].astype(_UNSIGNED[w]) for w in widths}
    sent = (per.astype(np.int32), (cstart[at] + off).astype(np.int32), by_width)
    return sent, local


def _answer_bits(r: int, answered: list[_Share], per: np.ndarray, pos: np.ndarray, bits: dict) -> np.ndarray:
    """Rank ``r``'s answers' base bits (uint32), in its answers' order, checked against how many
    it answered for (``per``: of each chunk of ``answered``) and the positions it sent."""
    n_r = int(per.sum())
    if pos.size != n_r:
        raise BaseMismatchError(f"rank {r} of the receiver group sent {pos.size} positions, not {n_r}")
    one = {s.width for s in answered}
    if len(one) == 1 and set(bits) <= one:  # (one width, the usual case: the bits as they came)
        w = one.pop()
        b = bits.get(w, np.empty(0, _UNSIGNED[w]))
        if b.size != n_r:
            raise BaseMismatchError(f"rank {r} of the receiver group sent {b.size} base bits of width {w}, not {n_r}")
        return b.astype(np.uint32)
    widths = np.repeat(np.array([s.width for s in answered], dtype=np.int64), per)
    full = np.zeros(widths.size, dtype=np.uint32)
    for w, b in bits.items():
        m = widths == w
        if int(m.sum()) != b.size:
            raise BaseMismatchError(f"rank {r} of the receiver group sent {b.size} base bits of width {w}, "
                                    f"not {int(m.sum())}")
        full[m] = b
    return full


def _received(pl: _Placed, shares: list[_Share], found: list) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's answers put together for the chunks of ``pl`` -> per change of ``pl`` (stream
    order), its position in its chunk (-1 where no rank answered) and its base bits (uint32)."""
    n = int(pl.first[-1])
    at_all = np.full(n, -1, dtype=np.int64)
    old_all = np.zeros(n, dtype=np.uint32)
    index = {s.key: i for i, s in enumerate(pl.shares)}
    for r, (per, pos, bits) in enumerate(found):
        answered = [s for s in shares if r in s.runs]
        if len(per) != len(answered):
            raise BaseMismatchError(f"rank {r} of the receiver group answered for {len(per)} chunks, not "
                                    f"{len(answered)}")
        mine = np.array([index.get(s.key, -1) for s in answered], dtype=np.int64)
        full = _answer_bits(r, answered, per, pos, bits)
        idx = np.flatnonzero(pl.owner == r)
        expect = np.bincount(pl.share[idx], minlength=len(pl.shares))
        got = np.zeros(len(pl.shares), dtype=np.int64)
        got[mine[mine >= 0]] = per[mine >= 0]
        if (got != expect).any():
            i = int(np.argmax(got != expect))
            s = pl.shares[i]
            raise BaseMismatchError(f"{s.name}: chunk at element {s.chunk.start}: rank {r} placed {got[i]} of "
                                    f"its {expect[i]} changes")
        if (mine >= 0).all():  # (every chunk it answered for is one of these: no mask)
            at_all[idx], old_all[idx] = pos, full
        else:
            keep = np.repeat(mine >= 0, per)
            at_all[idx], old_all[idx] = pos[keep], full[keep]
    return at_all, old_all


def _width_groups(width: np.ndarray, share: np.ndarray) -> list[tuple[int, slice | np.ndarray]]:
    """The changes (``share``: each one's chunk; ``width``: each chunk's element width) by width
    -> (width, which changes): a slice of all of them where there is one width (a model of one
    dtype, the usual case: no mask, and views not gathers), else their indices."""
    widths = np.unique(width[share]).tolist()
    if len(widths) == 1:
        return [(widths[0], slice(None))]
    return [(w, np.flatnonzero(width[share] == w)) for w in widths]


def _checker(shares: list[_Share]) -> dict:
    """share key -> the rank that puts the chunk together and checks its pre- and post-image: its
    answering ranks in turn, chunk by chunk (the same on every rank), so that a group of n ranks
    checks each chunk once, each rank about 1/n of them, not every rank every chunk."""
    out = {}
    for j, s in enumerate(shares):
        ranks = sorted(s.runs)
        out[s.key] = ranks[j % len(ranks)]
    return out


def _decoded(plans: Mapping, pl: _Placed, shares: list[_Share], found: list, local: np.ndarray, me: int) -> dict:
    """Every chunk of ``pl`` -> its ``Decoded`` for this rank: ``_together`` for the chunks this
    rank checks (``_checker``) and those whose shards overlap (a rank may hold positions another
    answered for), ``_own`` for the rest: the changes this rank answered for alone, which their
    checker (under the same ``Group.run``, before anything is written) checks with the others'."""
    checker = _checker(shares)
    whole = np.array([not s.disjoint or checker[s.key] == me for s in pl.shares], dtype=bool)
    if whole.all():
        return _together(plans, pl, shares, found, local)
    out = _own(plans, pl, [s for s in shares if me in s.runs], found[me], local, me, ~whole)
    if whole.any():
        out.update(_together(plans, _subset(pl, whole), shares, found, local[whole[pl.share]]))
    return out


def _subset(pl: _Placed, keep: np.ndarray) -> _Placed:
    """``pl`` with only the chunks ``keep`` (a mask over ``pl.shares``) and their changes, as
    ``_together`` reads it: each change's chunk, answering rank and difference (the placing
    itself, ``cls``, ``run`` and ``within``, left empty: done with)."""
    sel = keep[pl.share]
    renum = np.cumsum(keep) - 1
    counts = np.diff(pl.first)[keep]
    done = np.empty(0, np.int64)
    return _Placed([s for s, k in zip(pl.shares, keep.tolist()) if k], renum[pl.share[sel]], done, pl.owner[sel],
                   done, done, pl.d[sel], offsets(counts))


def _own(plans: Mapping, pl: _Placed, answered: list[_Share], mine: tuple, local: np.ndarray, me: int,
         only: np.ndarray) -> dict:
    """The chunks ``only`` (a mask over ``pl.shares``: disjoint shards, checked by another rank) ->
    ``Decoded`` of the changes this rank answered for (``mine``: what it sent; ``local``: where
    each is in its tensor), their new bits from its own base bits; in the order they were
    placed (``apply`` writes them by ``local``: no order needed)."""
    per, pos, bits = mine
    idx = np.flatnonzero(pl.owner == me)  # (the order this rank's answers were made in)
    full = _answer_bits(me, answered, per, pos, bits)
    k = only[pl.share[idx]]
    j = idx[k]
    share, at, old32, d, loc = pl.share[j], pos[k].astype(np.int64), full[k], pl.d[j], local[j]
    width = np.array([s.width for s in pl.shares], dtype=np.int64)
    # each chunk's changes: pl.share is nondecreasing, so they are consecutive here, and so among
    # the changes of its width
    bounds = np.searchsorted(share, np.arange(len(pl.shares) + 1))
    by_width: dict = {}  # width -> (where each chunk's changes start among its changes, old bits, new bits)
    for w, sel in _width_groups(width, share):
        m = bounds if isinstance(sel, slice) else np.searchsorted(sel, bounds)
        u = old32[sel].astype(_UNSIGNED[w])
        by_width[w] = (m.tolist(), u.view(_VIEW[w]), classes.new_bits_host(u, d[sel]).view(_VIEW[w]))
    out = {}
    starts = bounds.tolist()
    for i, s in enumerate(pl.shares):
        if not only[i]:
            continue
        bits_dt = _np_bits(plans[(s.part, s.name)].entry.torch_dtype)
        a, b = starts[i], starts[i + 1]
        if a == b:
            empty = np.empty(0, bits_dt)
            out[s.key] = Decoded(torch.empty(0, dtype=torch.int64), torch.from_numpy(empty),
                                 torch.from_numpy(empty), torch.empty(0, dtype=torch.int64))
            continue
        at_w, ow, nw = by_width[s.width]
        lo, hi = at_w[i], at_w[i + 1]
        out[s.key] = Decoded(torch.from_numpy(at[a:b]), torch.from_numpy(ow[lo:hi].view(bits_dt)),
                             torch.from_numpy(nw[lo:hi].view(bits_dt)), torch.from_numpy(loc[a:b]))
    return out


def _together(plans: Mapping, pl: _Placed, shares: list[_Share], found: list, local: np.ndarray) -> dict:
    """Every chunk of ``pl`` decoded from its changes as the ranks answering for them placed them,
    in position order, checked against its pre- and post-image as a whole-chunk holder checks it
    -> share key -> ``Decoded`` (with ``local``, the changes this rank holds, where the group's
    shards do not overlap). The new bits in one pass per element width, every chunk's at once;
    per chunk only views of those arrays and its two digests (numpy: a torch call costs more)."""
    at_all, old_all = _received(pl, shares, found)
    # each chunk's changes in position order (one key: a stable sort of keys sorted by chunk
    # already is ~5x faster than lexsort; a position no rank answered, -1, sorts last and fails)
    o = np.argsort((pl.share << 32) | (at_all & 0xFFFFFFFF), kind="stable")
    at_all, old_all, share, local = at_all[o], old_all[o], pl.share[o], local[o]
    same = share[1:] == share[:-1]
    bad = np.zeros(len(pl.shares), dtype=bool)
    bad[share[at_all < 0]] = True
    bad[share[1:][same & (np.diff(at_all) <= 0)]] = True
    d_all = pl.d[o]
    width = np.array([s.width for s in pl.shares], dtype=np.int64)
    slot = np.zeros(share.size, dtype=np.int64)  # each change's place among the changes of its width
    by_width: dict = {}  # width -> (old bits, new bits, and of the changes held here: which, positions, local)
    for w, m in _width_groups(width, share):  # (every chunk here has changes: each width is one's)
        slot[m] = np.arange(share.size if isinstance(m, slice) else m.size)
        u = old_all[m].astype(_UNSIGNED[w])
        new, old = classes.new_bits_host(u, d_all[m]).view(_VIEW[w]), u.view(_VIEW[w])
        held = np.flatnonzero(local[m] >= 0)
        by_width[w] = (old, new, held, at_all[m][held], old[held], new[held], local[m][held])
    out = {}
    # per chunk, as Python ints: where its changes are among all (a chunk to share has some), among
    # its width's, and among the ones held here (each a numpy call per chunk before)
    first = pl.first.tolist()
    begin = slot[pl.first[:-1]]  # (a chunk to share has changes: pl.first[i] is its first)
    slots, end = begin.tolist(), begin + np.diff(pl.first)
    h_at: list = [None] * len(pl.shares)
    for w, (_, _, held, *_) in by_width.items():
        m = np.flatnonzero(width == w)
        h_at_w = zip(np.searchsorted(held, begin[m]).tolist(), np.searchsorted(held, end[m]).tolist())
        for i, h in zip(m.tolist(), h_at_w):
            h_at[i] = h
    bad_l = bad.tolist()
    for i, s in enumerate(pl.shares):
        p, c = plans[(s.part, s.name)], s.chunk
        j, k = slots[i], first[i + 1] - first[i]
        old, new, held, at_h, old_h, new_h, local_h = by_width[s.width]
        bits = _np_bits(p.entry.torch_dtype)
        if bad_l[i] or values_digest(old[j:j + k], c.values_algo) != c.pre:
            raise BaseMismatchError(f"{p.name}: chunk at element {c.start} does not match its base (its changes "
                                    f"placed by ranks {sorted(s.runs)} of the receiver group)")
        if values_digest(new[j:j + k], c.values_algo) != c.post:
            raise DeltaFormatError(f"{p.name}: chunk at element {c.start} decodes to values that do not "
                                   "match its post-image digest")
        if s.disjoint:
            h0, h1 = h_at[i]
            out[s.key] = Decoded(torch.from_numpy(at_h[h0:h1]), torch.from_numpy(old_h[h0:h1].view(bits)),
                                 torch.from_numpy(new_h[h0:h1].view(bits)), torch.from_numpy(local_h[h0:h1]))
        else:
            a, b = first[i], first[i + 1]
            out[s.key] = Decoded(torch.from_numpy(at_all[a:b]), torch.from_numpy(old[j:j + k].view(bits)),
                                 torch.from_numpy(new[j:j + k].view(bits)))
    return out


def decode_partial(blobs: Sequence[bytes | DeltaReader], tensors: Mapping, shards: Mapping, group: Group) -> Gathered:
    """Decode, before anything is written, every ``classes`` chunk of ``blobs`` (the parts of one
    version, the same on every rank) in entries this rank holds only part of. Collective: every
    rank of ``group`` calls it with the same parts. Each stage does a version's chunks together
    (one kernel call, a few numpy passes): an FSDP trainer's ranks publish thousands of small
    chunks, where a stage per chunk cost ~0.5 ms of Python a rank (docs/results.md, twenty-sixth
    turn)."""
    readers = [DeltaReader.open(b) for b in blobs]
    plans: dict = {}

    def layout():
        plans.update(_my_plans(readers, tensors, shards))
        return {k: (p.recv.global_shape, p.recv.offsets, p.recv.shape, p.recv.index_shape) for k, p in plans.items()}

    layouts = group.run(layout, "list the classes chunks held in part", gather=True)
    shares = group.run(lambda: _shares(readers, layouts), "find the classes chunks to decode together")
    me, world = group.rank, group.world_size

    received = 0
    placed: _Placed | None = None
    local = np.empty(0, np.int64)  # per change of placed, its flat index in this rank's tensor (-1: another rank's)
    found: list = []
    if shares:
        answers = [s for s in shares if me in s.runs]
        bytes_of = [[s.count_bytes(r) for s in shares] for r in range(world)]

        # this rank's bits of each chunk it answers for, as the kernels take them: made once, for
        # the counts and for the selection (nothing is written between the two)
        calls: dict = {}

        def counts():
            calls.update((s.key, _call(plans[(s.part, s.name)], s, s.runs[me])) for s in answers)
            n = classes.run_counts_many(list(calls.values()))
            widths = {s.count_width for s in answers}
            if len(widths) == 1:  # (the usual case: every chunk's runs alike)
                sent = n.astype(_UNSIGNED[widths.pop()])
            else:
                at = offsets(np.array([len(s.runs[me]) * s.classes for s in answers], dtype=np.int64))
                sent = np.concatenate([np.empty(0, np.uint8)] + [n[at[i]:at[i + 1]].astype(_UNSIGNED[s.count_width])
                                                                 .view(np.uint8) for i, s in enumerate(answers)])
            return torch.from_numpy(sent.view(np.uint8))

        sizes = [sum(b) for b in bytes_of]
        bufs = group.all_gather_bytes(group.run(counts, "count the classes of the chunks held in part"), sizes)
        received += sum(n for r, n in enumerate(sizes) if r != me)

        def locate():
            nonlocal placed, local
            at = [offsets(np.array(b, dtype=np.int64)) for b in bytes_of]  # each chunk's counts in each buffer
            held, got = [], []
            for i, s in enumerate(shares):
                if me in s.holders:
                    held.append(s)
                    got.append(np.concatenate([bufs[r][int(at[r][i]): int(at[r][i + 1])].numpy()
                                               .view(_UNSIGNED[s.count_width])
                                               for r in sorted(s.runs)]).reshape(-1, s.classes))
            if not held:
                return np.empty(0, np.int32), np.empty(0, np.int32), {}
            placed = _place(plans, readers, held, got)
            sent, local = _select(calls, placed, me)
            return sent

        found = group.run(locate, "place the changes of the classes chunks held in part", gather=True)
        received += sum(sum(a.nbytes for a in (v[0], v[1], *v[2].values())) for r, v in enumerate(found) if r != me)

    def decode_mine():
        out: list[dict] = [{} for _ in readers]
        together = _decoded(plans, placed, shares, found, local, me) if placed is not None else {}
        for (i, name), p in sorted(plans.items()):
            if p.action != Action.UNVERIFIED:
                continue  # holds the entry's whole region: apply decodes and checks it
            bits_dtype = _bits_dtype(p.entry.torch_dtype)
            assert p.recv is not None and p.entry.region is not None  # plan_entry, _has_classes
            for c in p.entry.chunks:
                if c.enc != CLASSES:
                    continue
                key = (i, name, c.start)
                if key in together:
                    out[i][(name, c.start)] = together[key]
                    continue
                mine = chunk_runs(p.entry.region, c.start, c.n, p.recv)
                if not len(mine) or not c.k:
                    out[i][(name, c.start)] = Decoded.nothing(bits_dtype)
                else:  # (_shares: this rank holds the whole chunk)
                    out[i][(name, c.start)] = _decode(p, c, readers[i].payload(c), _chunk_bits(p, mine), "held here")
        return out

    decoded = group.run(decode_mine, "decode the classes chunks held in part")
    return Gathered(decoded, received)
