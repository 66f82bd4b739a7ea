"""Trainer side of the device path: diff the live shard against the published snapshot where
both live, update the snapshot in place, and hand the host only the compact change stream.

    ch = diff_(snapshot, live, chunk_elems=1 << 22)          # device work
    chunks = encode.encode_changes_chunks(ch, "auto", 3)    # host, O(changes)

``chunks`` are exactly what ``codec/chunk.encode_chunk`` makes of each chunk of (snapshot
before, live) (``device/encode.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from nemo_dcr.codec import classes
from nemo_dcr.codec.ordered import unsigned
from nemo_dcr.device import kernels
from nemo_dcr.errors import DcrError
from nemo_dcr.state.dtypes import INT_VIEW

BLOCK = 1024  # elements per program; chunks need not be a multiple (blocks stop at chunk ends)
GROUP = 16  # changes ranked together in the rank pass


@dataclass
class DeviceChanges:
    """The compact change stream of one shard, in position order. ``old``/``new``: integer views
    (pre-image and new bits). ``cls``/``rank`` (classes coding only): each change's base
    exponent class, clamped to its chunk's range, and its rank among the chunk's elements of
    that class. ``chunk_elems``: the chunking the classes and ranks refer to."""

    pos: torch.Tensor
    old: torch.Tensor
    new: torch.Tensor
    chunk_elems: int
    numel: int
    dtype: torch.dtype
    cls: torch.Tensor | None = None
    rank: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.pos.numel()

    def nbytes(self) -> int:
        """Bytes of the stream (what crosses to the host)."""
        ts = [self.pos, self.old, self.new] + [t for t in (self.cls, self.rank) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def cpu(self) -> DeviceChanges:
        cls = None if self.cls is None else self.cls.cpu()
        rank = None if self.rank is None else self.rank.cpu()
        return replace(self, pos=self.pos.cpu(), old=self.old.cpu(), new=self.new.cpu(), cls=cls, rank=rank)


def _need_kernels():
    if not kernels.available():
        raise DcrError('the device path needs triton: pip install "nemo-dcr[gpu]"')


def _check_pair(snapshot: torch.Tensor, live: torch.Tensor) -> None:
    if snapshot.dtype != live.dtype or snapshot.shape != live.shape or snapshot.device != live.device:
        raise DcrError(f"snapshot {snapshot.dtype}{list(snapshot.shape)} on {snapshot.device} does not match "
                       f"live {live.dtype}{list(live.shape)} on {live.device}")
    if not (snapshot.is_contiguous() and live.is_contiguous()):
        # a contiguous copy of the live shard is an O(model) copy: the caller decides, not us
        raise DcrError("the device diff needs contiguous tensors (snapshot and live)")
    if snapshot.data_ptr() == live.data_ptr() and snapshot.numel():
        raise DcrError("snapshot and live are the same memory")


def bits(t: torch.Tensor) -> torch.Tensor:
    """1-D integer view of a contiguous tensor (no copy)."""
    return t.reshape(-1).view(INT_VIEW[t.element_size()])


def diff_(snapshot: torch.Tensor, live: torch.Tensor, *, dtype: torch.dtype | None = None,
          chunk_elems: int | None = None, use_classes: bool | None = None, update: bool = True,
          block: int = BLOCK, group: int = GROUP, capacity: int | None = None) -> DeviceChanges:
    """Changes from ``snapshot`` to ``live`` (same dtype, shape, device; contiguous), and, with
    ``update``, ``snapshot`` made equal to ``live``. ``use_classes`` (default: where the dtype
    has a ``classes`` coding) adds each change's class and rank per ``chunk_elems`` chunk
    (default: the whole shard is one chunk). ``capacity``: slots first reserved for changes
    (default n/16); more are taken, by running the compact pass again, if needed."""
    _need_kernels()
    _check_pair(snapshot, live)
    dtype = dtype or live.dtype
    if dtype.itemsize != live.element_size():
        raise DcrError(f"dtype {dtype} does not fit {live.element_size()}-byte elements")
    if use_classes is None:
        use_classes = classes.applicable(dtype)
    if use_classes and not classes.applicable(dtype):
        raise DcrError(f"no classes coding for {dtype}")
    if block < 16 or block & (block - 1):
        raise DcrError("block must be a power of two >= 16")
    old, new = bits(snapshot), bits(live)
    n = new.numel()
    chunk = int(chunk_elems or max(n, 1))
    if chunk <= 0:
        raise DcrError("chunk_elems must be positive")
    nchunks = -(-n // chunk)
    bpc = -(-min(chunk, max(n, 1)) // block)
    nblocks = nchunks * bpc
    dev = new.device
    cap = max(int(capacity) if capacity is not None else n // 16, 1)
    while True:
        pos_r = torch.empty(cap, dtype=torch.int64, device=dev)
        old_r = torch.empty(cap, dtype=old.dtype, device=dev)
        new_r = torch.empty(cap, dtype=old.dtype, device=dev)
        ctr = torch.zeros(1, dtype=torch.int64, device=dev)
        boff = torch.zeros(nblocks, dtype=torch.int64, device=dev)
        bcnt = torch.zeros(nblocks, dtype=torch.int32, device=dev)
        if nblocks:
            kernels.diff_compact_kernel[(nblocks,)](old, new, n, chunk, bpc, pos_r, old_r, new_r, cap, ctr,
                                                    boff, bcnt, BLOCK=block)
        k = int(ctr.item())  # the one host sync of the compact pass: the stream's length
        if k <= cap:
            break
        cap = k
    # blocks reserved their slots in arrival order: put them back in position order, O(changes)
    excl = torch.cumsum(bcnt, 0, dtype=torch.int64) - bcnt
    bid = torch.repeat_interleave(torch.arange(nblocks, device=dev), bcnt.to(torch.int64), output_size=k)
    src = boff[bid] + (torch.arange(k, device=dev) - excl[bid])
    out = DeviceChanges(pos=pos_r[src], old=old_r[src], new=new_r[src], chunk_elems=chunk, numel=n, dtype=dtype)
    if use_classes and k:
        out.cls, out.rank = _ranks(old, out, pos_r, old_r, boff, bcnt, bid, src, nchunks, bpc, block, group)
    elif use_classes:
        out.cls = out.rank = torch.empty(0, dtype=torch.int64, device=dev)
    if update and k:
        kernels.scatter_kernel[(-(-k // block),)](old, out.pos, out.new, k, BLOCK=block)
    return out


def _class_range(exp: torch.Tensor, chunk_of: torch.Tensor, nchunks: int, nbins: int):
    """``classes.class_range`` of every chunk at once, on the device: (lo, hi) per chunk
    (0, 0 where a chunk has no change)."""
    ke = torch.bincount(chunk_of * nbins + exp, minlength=nchunks * nbins).view(nchunks, nbins)
    kc = ke.sum(1, keepdim=True)
    strong = ke >= torch.clamp(kc >> 8, min=4)
    use = torch.where(strong.any(1, keepdim=True), strong, ke > 0)
    ar = torch.arange(nbins, device=exp.device)
    lo = torch.where(use, ar, nbins).amin(1)
    hi = torch.where(use, ar, -1).amax(1)
    none = kc.squeeze(1) == 0
    return torch.where(none, 0, lo), torch.where(none, 0, hi)


def _ranks(old, out, pos_r, old_r, boff, bcnt, bid, src, nchunks, bpc, block, group):
    w = old.element_size()
    mant = classes.MANTISSA[out.dtype]
    nbins = 1 << (8 * w - 1 - mant)
    dev = old.device
    exp = classes._classes(unsigned(out.old), w, mant)
    lo, hi = _class_range(exp, out.pos // out.chunk_elems, nchunks, nbins)
    rb = 1 << max(int((hi - lo).max()), 1).bit_length()  # histogram bins: a power of two > hi - lo
    lohi = torch.stack([lo, hi], 1).reshape(-1).contiguous()
    hist = torch.empty(nchunks * bpc * rb, dtype=torch.int32, device=dev)
    within = torch.empty(pos_r.numel(), dtype=torch.int32, device=dev)
    kernels.class_rank_kernel[(nchunks * bpc,)](old, out.numel, out.chunk_elems, bpc, lohi, pos_r, old_r, boff,
                                                bcnt, hist, within, W=w, MANT=mant, RB=rb, BLOCK=block, G=group)
    # rank = elements of the class in the chunk's earlier blocks + those before it in its block
    h = hist.view(nchunks, bpc, rb).to(torch.int64)
    before = (torch.cumsum(h, 1) - h).view(-1, rb)
    chunk_of = bid // bpc
    cls = exp.clamp(lo[chunk_of], hi[chunk_of])
    rank = before[bid, cls - lo[chunk_of]] + within[src].to(torch.int64)
    return cls, rank

