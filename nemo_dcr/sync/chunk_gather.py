"""``classes`` chunks on receivers sharded differently from the trainer: decoded with the help
of the receiver's group, before the first write (docs/design.md "Receivers sharded differently").

A ``classes`` chunk codes its changes against the *whole* base chunk (the trainer rank's region, in
chunks of the region's flat order): the positions per class of each base element's exponent, the
values as a difference from the base bits at the changed positions. A receiver rank holding only
part of the chunk (a vLLM TP worker holding its rows or columns of a tensor a trainer rank
published whole) cannot decode it alone, but the ranks of its group together hold every position:

1. every rank lists, for the version's entries with ``classes`` chunks, where its tensor sits in
   the canonical tensor (its ``ShardSpec``): one small all-gather;
2. from those layouts alone every rank derives the same list of chunks that some rank holds only
   part of (no rank decides alone, so every rank enters the same exchanges); a chunk the group
   together does not hold whole is refused here, before anything is written;
3. one exchange carries every rank's *classes* of its elements of those chunks (what the decoder
   reads from the base besides the changed positions: the clamped exponent class, packed in 1, 2,
   4 or 8 bits per element), from which each rank holding part of a chunk decodes its positions;
4. a second exchange carries the base bits at those positions (O(changes)); each rank then
   decodes the values and checks the chunk's pre- and post-image digests as a whole-chunk holder
   does, and ``apply`` writes only the positions it holds (``nemo_dcr.delta.apply.Decoded``).

Tensors on a device (a GPU engine's TP workers) are not staged through the host: each rank's bits
of a chunk are gathered and classed where they are, and what crosses to the host is what the
exchanges carry (the packed classes, 1-8 bits per element of a chunk held in part, and the base
bits at the changed positions), plus the changes themselves. A chunk a rank holds whole inside a
tensor it holds in part is located against its bits on the device (``chunk.locate_chunk``), as
``apply`` does for a whole tensor there; ``apply`` then writes the decoded changes on the device.

Every stage that can fail on one rank runs under ``Group.run``: a bad base on any rank is the same
typed error on every rank, and nothing was written anywhere. Without a group (one receiver) the
same code refuses, before the first write, what it cannot decode.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_dcr.codec import classes
from nemo_dcr.codec.chunk import CLASSES, decode_chunk, locate_chunk
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.codec.header import ChunkEntry, TensorEntry, TensorKind
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
    ``received``: bytes this rank received from the others (the classes of their parts of the
    chunks, their base bits at the changed positions; padding excluded)."""

    decoded: list[dict[tuple[str, int], Decoded]]
    received: int = 0


@dataclass(frozen=True)
class _Share:
    """One chunk to decode together: which of its positions (in chunk order) each rank holds."""

    part: int
    name: str
    chunk: ChunkEntry
    masks: dict[int, torch.Tensor]  # rank -> bool mask over the chunk's positions

    @property
    def key(self) -> tuple[int, str, int]:
        return self.part, self.name, self.chunk.start

    @property
    def bits(self) -> int:
        return classes.context_bits(self.chunk.cls)

    def nbytes(self, rank: int) -> int:
        """Bytes of ``rank``'s packed classes of the chunk."""
        m = self.masks.get(rank)
        per = 8 // self.bits
        return 0 if m is None else -(-int(m.sum()) // per)


def _pack(v: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values below ``2 ** bits`` (bits 1, 2, 4 or 8), ``8 // bits`` to a byte."""
    per = 8 // bits
    if per == 1:
        return v
    pad = torch.zeros(-(-v.numel() // per) * per, dtype=torch.uint8, device=v.device)
    pad[: v.numel()] = v
    pad = pad.reshape(-1, per)
    out = torch.zeros(pad.shape[0], dtype=torch.uint8, device=v.device)
    for j in range(per):
        out |= pad[:, j] << (j * bits)
    return out


def _unpack(b: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return b[:n]
    mask = (1 << bits) - 1
    return torch.stack([(b >> (j * bits)) & mask for j in range(per)], 1).reshape(-1)[:n]


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
            for m in masks.values():
                held |= m
            if not bool(held.all()):
                raise undecodable(e.name, c)
            out.append(_Share(key[0], e.name, c, masks))
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


def _positions(p: Plan, c: ChunkEntry, payload, ctx: torch.Tensor) -> torch.Tensor:
    """The changed positions of chunk ``c``, from the classes of its base elements alone."""
    dtype = p.entry.torch_dtype
    stand_in = classes.stand_in(ctx, c.cls, classes.MANTISSA[dtype], _bits_dtype(dtype))
    try:
        return decode_chunk(c, payload, dtype.itemsize, base=stand_in, dtype=dtype)[0]
    except DeltaFormatError:
        raise BaseMismatchError(f"{p.name}: chunk at element {c.start} does not match its base (its classes "
                                "gathered from the receiver group)") from None


def _last(ranks: list[int], me: int) -> list[int]:
    return [r for r in ranks if r != me] + ([me] if me in ranks else [])


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
    mine = [s for s in shares if me in s.masks]

    def own(s: _Share) -> tuple[torch.Tensor, torch.Tensor]:
        p = plans[(s.part, s.name)]
        return _own_bits(p, _chunk_positions(p.entry, s.chunk, p.held.device))

    received = 0
    idx_of: dict = {}  # share key -> the changed positions (chunk order)
    ctx_of: dict = {}  # share key -> the classes of the chunk's base elements
    if shares:
        def contexts():
            packed = [torch.empty(0, dtype=torch.uint8)]
            for s in mine:
                mant = classes.MANTISSA[plans[(s.part, s.name)].entry.torch_dtype]
                # classed where the bits are; only the packed classes cross to the host
                packed.append(_pack(classes.context(own(s)[0], s.chunk.cls, mant), s.bits).cpu())
            return torch.cat(packed)

        sizes = [sum(s.nbytes(r) for s in shares) for r in range(world)]
        bufs = group.all_gather_bytes(group.run(contexts, "read the classes to gather"), sizes)
        received += sum(n for r, n in enumerate(sizes) if r != me)

        def positions():
            # this rank's share of the base bits at the changed positions: every rank holding a
            # part of a chunk decodes the same positions from the same classes
            offs, sent = [0] * world, {}
            for s in shares:
                got = {}
                for r in sorted(s.masks):  # (every rank walks every buffer to its next chunk)
                    n = s.nbytes(r)
                    got[r] = _unpack(bufs[r][offs[r]: offs[r] + n], s.bits, int(s.masks[r].sum()))
                    offs[r] += n
                if me not in s.masks:
                    continue
                ctx = torch.empty(s.chunk.n, dtype=torch.uint8)
                for r in _last(sorted(s.masks), me):
                    ctx[s.masks[r]] = got[r]
                p = plans[(s.part, s.name)]
                idx = _positions(p, s.chunk, readers[s.part].payload(s.chunk), ctx)
                idx_of[s.key], ctx_of[s.key] = idx, ctx
                bits, mask = own(s)
                i = idx.to(mask.device)
                at = mask[i]  # the changed positions held here
                sent[s.key] = bits[mask.cumsum(0)[i[at]] - 1].cpu().numpy().tobytes()
            return sent

        olds = group.run(positions, "decode the positions of the classes chunks held in part", gather=True)
        received += sum(len(b) for r, d in enumerate(olds) if r != me for b in d.values())

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
                bits, mask = _own_bits(p, _chunk_positions(p.entry, c, p.held.device))
                payload = readers[i].payload(c)
                if not bool(mask.any()) or not c.k:
                    d = Decoded.nothing(bits_dtype)
                elif key not in by_key:  # (_shares: then this rank holds the whole chunk)
                    d = _decode(p, c, payload, bits, "held here")
                else:
                    s, idx = by_key[key], idx_of[key]
                    old = torch.empty(idx.numel(), dtype=bits_dtype)
                    for r in _last(sorted(s.masks), me):  # what this rank holds is what it checks
                        if olds[r][key]:
                            old[s.masks[r][idx]] = torch.frombuffer(bytearray(olds[r][key]), dtype=bits_dtype)
                    base = classes.stand_in(ctx_of[key], c.cls, classes.MANTISSA[p.entry.torch_dtype], bits_dtype)
                    base[idx] = old
                    d = _decode(p, c, payload, base, f"its bits gathered from ranks {sorted(s.masks)} of the "
                                "receiver group")
                out[i][(name, c.start)] = d
        return out

    decoded = group.run(decode_mine, "decode the classes chunks held in part")
    return Gathered(decoded, received)
