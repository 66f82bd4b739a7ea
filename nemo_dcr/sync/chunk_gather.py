"""``classes`` chunks on receivers sharded differently from the trainer: the whole base chunk,
gathered over the receiver's group, before the first write (docs/design.md "Receivers sharded
differently").

A ``classes`` chunk codes its changes against the bits of the *whole* base chunk (the trainer
rank's region, in chunks of the region's flat order). A receiver rank holding only part of the
chunk (a vLLM TP worker holding its rows or columns of a tensor a trainer rank published whole)
cannot decode it alone, but the ranks of its group together hold every position of it. So:

1. every rank lists, for the version's entries with ``classes`` chunks, where its tensor sits
   in the canonical tensor (its ``ShardSpec``): one small all-gather;
2. from those layouts alone every rank derives the same list of chunks that some rank holds
   only part of (no rank decides alone, so every rank enters the same exchange); a chunk the
   group together does not hold whole is refused here, before anything is written;
3. one exchange carries, from every rank, its bits of every such chunk in canonical order;
4. each rank holding part of a chunk assembles the whole base chunk, decodes it and checks the
   chunk's pre- and post-image digests as a whole-chunk holder does; ``apply`` then writes
   only the positions it holds (``nemo_dcr.delta.apply.Decoded``).

Every stage that can fail on one rank runs under ``Group.run``: a bad base on any rank is the
same typed error on every rank, and nothing was written anywhere. Without a group (one receiver)
the same code refuses before the first write what it cannot decode.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_dcr.codec.chunk import CLASSES, decode_chunk
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.codec.header import ChunkEntry, TensorEntry, TensorKind
from nemo_dcr.delta.apply import Decoded, undecodable
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
    ``received``: bytes of other ranks' base bits this rank received (padding excluded)."""

    decoded: list[dict[tuple[str, int], Decoded]]
    received: int = 0


@dataclass(frozen=True)
class _Share:
    """One chunk to gather: which positions of it (in chunk order) each holding rank sends."""

    part: int
    name: str
    chunk: ChunkEntry
    width: int
    masks: dict[int, torch.Tensor]  # rank -> bool mask over the chunk's positions

    def nbytes(self, rank: int) -> int:
        m = self.masks.get(rank)
        return 0 if m is None else int(m.sum()) * self.width


def _has_classes(e: TensorEntry) -> bool:
    return e.kind == TensorKind.DELTA and e.region is not None and any(c.enc == CLASSES for c in e.chunks)


def _chunk_positions(e: TensorEntry, c: ChunkEntry) -> torch.Tensor:
    assert e.region is not None  # _has_classes
    return IndexMap(e.region).to_global(torch.arange(c.start, c.start + c.n, dtype=torch.int64))


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
        width = e.torch_dtype.itemsize
        for c in e.chunks:
            if c.enc != CLASSES:
                continue
            glob = _chunk_positions(e, c)
            masks = {rank: m.to_local(glob)[1] for rank, m in maps.items()}
            counts = [int(m.sum()) for m in masks.values()]
            if all(k in (0, c.n) for k in counts):
                continue  # nobody holds part of it
            held = torch.zeros(c.n, dtype=torch.bool)
            for m in masks.values():
                held |= m
            if not bool(held.all()):
                raise undecodable(e.name, c)
            out.append(_Share(key[0], e.name, c, width, masks))
    return out


def _own_bits(p: Plan, glob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's bits at the chunk positions it holds, in chunk order; the mask of those)."""
    assert p.recv is not None  # plan_entry gives every held tensor its shard spec
    local, mask = IndexMap(p.recv).to_local(glob)
    return FlatAccess(p.held).gather(local), mask


def _decode(p: Plan, c: ChunkEntry, payload, base: torch.Tensor, where: str) -> Decoded:
    """Decode chunk ``c`` against the whole ``base`` and check it as a whole-chunk holder does."""
    dtype = p.entry.torch_dtype
    try:
        idx, new = decode_chunk(c, payload, dtype.itemsize, base=base, dtype=dtype)
    except DeltaFormatError:  # checksum-valid, so: not coded against these bits
        idx, new = None, None
    if idx is None or values_digest(base[idx]) != c.pre:
        raise BaseMismatchError(f"{p.name}: chunk at element {c.start} does not match its base ({where})")
    if values_digest(new) != c.post:
        raise DeltaFormatError(f"{p.name}: chunk at element {c.start} decodes to values that do not match its "
                               "post-image digest")
    return Decoded(idx, base[idx], new)


def decode_partial(blobs: Sequence[bytes], tensors: Mapping, shards: Mapping, group: Group) -> Gathered:
    """Decode, before anything is written, every ``classes`` chunk of ``blobs`` (the parts of one
    version, the same on every rank) in entries this rank holds only part of. Collective: every
    rank of ``group`` calls it with the same parts."""
    readers = [DeltaReader.open(b) for b in blobs]
    plans: dict = {}

    def layout():
        plans.update(_my_plans(readers, tensors, shards))
        return {k: (p.recv.global_shape, p.recv.offsets, p.recv.shape) for k, p in plans.items()}

    layouts = group.run(layout, "list the classes chunks held in part", gather=True)
    shares = group.run(lambda: _shares(readers, layouts), "find the classes chunks to gather")

    me = group.rank
    by_key = {(s.part, s.name, s.chunk.start): s for s in shares}
    received = 0
    theirs: dict = {}  # (part, name, chunk start) -> {rank: bits}
    if shares:
        def mine():
            bits = [torch.empty(0, dtype=torch.uint8)]
            for s in shares:
                if me in s.masks:
                    p = plans[(s.part, s.name)]
                    bits.append(_own_bits(p, _chunk_positions(p.entry, s.chunk))[0].reshape(-1).view(torch.uint8))
            return torch.cat(bits)

        sizes = [sum(s.nbytes(r) for s in shares) for r in range(group.world_size)]
        bufs = group.all_gather_bytes(group.run(mine, "read the base bits to gather"), sizes)
        received = sum(n for r, n in enumerate(sizes) if r != me)
        offs = [0] * group.world_size
        for s in shares:
            got = theirs.setdefault((s.part, s.name, s.chunk.start), {})
            for r in sorted(s.masks):
                n = s.nbytes(r)
                got[r] = bufs[r][offs[r]: offs[r] + n]
                offs[r] += n

    def decode_mine():
        out: list[dict] = [{} for _ in readers]
        for (i, name), p in sorted(plans.items()):
            if p.action != Action.UNVERIFIED:
                continue  # holds the entry's whole region: apply decodes and checks it
            bits_dtype = int_view(torch.empty(0, dtype=p.entry.torch_dtype)).dtype
            for c in p.entry.chunks:
                if c.enc != CLASSES:
                    continue
                own, mask = _own_bits(p, _chunk_positions(p.entry, c))
                if not bool(mask.any()):
                    d = Decoded.nothing(bits_dtype)
                elif bool(mask.all()):
                    d = _decode(p, c, readers[i].payload(c), own, "held here")
                else:
                    parts, share = theirs[(i, name, c.start)], by_key[(i, name, c.start)]
                    base = torch.empty(c.n, dtype=bits_dtype)
                    for r, b in sorted(parts.items()):
                        base[share.masks[r]] = b.clone().view(bits_dtype)
                    base[mask] = own  # what this rank holds is what it checks
                    d = _decode(p, c, readers[i].payload(c), base,
                                f"its bits gathered from ranks {sorted(parts)} of the receiver group")
                out[i][(name, c.start)] = d
        return out

    decoded = group.run(decode_mine, "decode the classes chunks held in part")
    return Gathered(decoded, received)
