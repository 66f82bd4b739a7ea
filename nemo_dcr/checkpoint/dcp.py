"""Publish a ``torch.distributed.checkpoint`` (DCP) directory: what FSDP2 trainers, torchtitan,
NeMo and Megatron save.

    publish_dcp("s3://bucket/run1", "ckpt/step-100")                       # one process
    publish_dcp(store, "ckpt/step-100", group=group)                       # every rank of a group
    nemo-dcr publish --store s3://bucket/run1 --dcp ckpt/step-100 [--ranks 4] [--prefix model.]

Everything comes from DCP's own metadata (``FileSystemReader.read_metadata()``): each tensor's
global shape and dtype, and the chunks it was saved as (``ChunkStorageMetadata`` offsets and
sizes, one per saving rank's shard; a replicated tensor once, ``dedup_save_plans`` having kept
one copy) with the file each is in (``__<rank>_<n>.distcp``: the saving rank). A publishing
group of ``W`` ranks splits the chunks by saving rank (of ``S`` saving ranks, each publisher
rank takes a contiguous ``S / W`` of them), so the shards are published as they were saved, in canonical coordinates,
and no process reads the whole model unless it is the only one. A rank's chunks of one tensor
must tile one rectangle (one delta entry per tensor and rank): true of every layout with one
chunk per saving rank, and of contiguous saving ranks merged into one publisher rank.

The bytes are read by ``torch.distributed.checkpoint.load`` itself (``no_dist``: each rank on
its own), into a rectangle this rank holds (``_Rect``, DCP's ``_Checkpointable`` protocol): DCP
plans reads of just the chunks that overlap it, with the checkpoint's own storage reader, so its
file format and transforms stay DCP's business. Non-tensor entries (``BytesStorageMetadata``:
step counters, RNG states, dataloader state) are not weights and are left out; ``prefix`` keeps
the entries under it (e.g. ``model.`` of a torchtitan checkpoint, whose optimizer state sits
beside the model) and strips it from the published names.
"""
from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nemo_dcr.codec.names import DEFAULT_LEVEL
from nemo_dcr.errors import DcrError
from nemo_dcr.state.index_map import ShardSpec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nemo_dcr.stores.base import Store

_FILE_RANK = re.compile(r"__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class Chunk:
    """One saved chunk of a tensor: where it sits, and which rank saved it (None: unknown)."""

    spec: ShardSpec
    saved_by: int | None


@dataclass(frozen=True)
class Entry:
    """A tensor of the checkpoint, as its metadata describes it."""

    key: str          # the DCP key (fully qualified name)
    name: str         # the published name (``key`` less ``prefix``)
    dtype: torch.dtype
    shape: tuple
    chunks: tuple


def read_layout(path: str, prefix: str | None = None) -> dict[str, Entry]:
    """The checkpoint's tensors (published name -> :class:`Entry`) from its metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise DcrError(f"{path} is not a torch.distributed.checkpoint directory (no .metadata file)")
    md = FileSystemReader(path).read_metadata()
    storage = md.storage_data or {}
    out: dict[str, Entry] = {}
    for key, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, TensorStorageMetadata):
            continue  # a pickled object (BytesStorageMetadata), not a weight
        if prefix and not key.startswith(prefix):
            continue
        shape = tuple(int(s) for s in tmd.size)
        chunks = []
        for i, c in enumerate(tmd.chunks):
            info = storage.get(MetadataIndex(key, c.offsets, i))
            m = _FILE_RANK.search(getattr(info, "relative_path", "") or "")
            chunks.append(Chunk(ShardSpec.of(shape, tuple(c.offsets), tuple(c.sizes)), int(m.group(1)) if m else None))
        name = key[len(prefix):] if prefix else key
        out[name] = Entry(key, name, tmd.properties.dtype, shape, tuple(chunks))
    if not out:
        raise DcrError(f"{path} holds no tensors{f' under {prefix!r}' if prefix else ''}")
    return out


def _box(name: str, specs: list[ShardSpec]) -> ShardSpec:
    """The rectangle that ``specs`` tile exactly, or DcrError."""
    from nemo_dcr.integrations.megatron import check_cover

    g = specs[0].global_shape
    lo = tuple(min(s.offsets[d] for s in specs) for d in range(len(g)))
    hi = tuple(max(s.offsets[d] + s.shape[d] for s in specs) for d in range(len(g)))
    box = ShardSpec.of(g, lo, tuple(h - lw for lw, h in zip(lo, hi)))
    inside = [{name: ShardSpec.of(box.shape, tuple(o - b for o, b in zip(s.offsets, lo)), s.shape)} for s in specs]
    try:
        check_cover(inside)  # no overlaps, no gaps: the chunks are the box
    except DcrError as e:
        raise DcrError(f"{name}: the chunks this rank takes ({[(s.offsets, s.shape) for s in specs]}) do not form "
                       f"one rectangle; publish with as many ranks as saved the checkpoint ({e})") from None
    return box


def assign(layout: Mapping[str, Entry], rank: int = 0, world: int = 1) -> dict[str, ShardSpec]:
    """The rectangle of each tensor publisher ``rank`` of ``world`` takes: the chunks saved by
    its contiguous share of the saving ranks (``S`` saving ranks: saver ``s`` goes to publisher
    ``s * world // S``; chunks of an unknown saver by their index), tiled into one."""
    savers = 1 + max((c.saved_by if c.saved_by is not None else i)
                     for e in layout.values() for i, c in enumerate(e.chunks))
    out = {}
    for name, e in layout.items():
        mine = [c.spec for i, c in enumerate(e.chunks)
                if (c.saved_by if c.saved_by is not None else i) * world // savers == rank and c.spec.numel]
        if mine:
            out[name] = mine[0] if len(mine) == 1 else _box(name, mine)
    return out


class _Rect(torch.Tensor):
    """A rectangle of a checkpoint tensor for ``dcp.load`` to fill, the way a DTensor is one:
    a tensor of the *global* shape (what DCP's load plan checks against the metadata) that holds
    only the rectangle (``data``), with DCP's ``_Checkpointable`` protocol: the rectangle's
    place (``__create_chunk_list__``: DCP reads the chunks that overlap it, and only the
    overlaps) and where to write (``__get_tensor_shard__``). No operation runs on it."""

    spec: ShardSpec
    data_: torch.Tensor

    @staticmethod
    def __new__(cls, spec: ShardSpec, dtype: torch.dtype):
        r = torch.Tensor._make_wrapper_subclass(cls, spec.global_shape, dtype=dtype, device=torch.device("cpu"))
        r.spec, r.data_ = spec, torch.empty(spec.shape, dtype=dtype)
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise DcrError(f"nemo-dcr: {func} on a checkpoint rectangle being loaded (only DCP's load reads it)")

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(self.spec.offsets), sizes=torch.Size(self.spec.shape))]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self.data_


def load_shards(path: str, rank: int = 0, world: int = 1, prefix: str | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """``(tensors, shards)``: publisher ``rank`` of ``world``'s part of the checkpoint (see
    :func:`assign`), read by DCP; ``shards`` names the tensors that are not whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    layout = read_layout(path, prefix)
    mine = assign(layout, rank, world)
    rects = {layout[n].key: _Rect(spec, layout[n].dtype) for n, spec in mine.items()}
    if rects:
        with warnings.catch_warnings():  # no_dist on purpose: each rank reads its own part
            warnings.filterwarnings("ignore", ".*assuming the intent is to load in a single process")
            dcp.load(rects, storage_reader=FileSystemReader(path), no_dist=True)
    tensors = {n: rects[layout[n].key].data_ for n in mine}
    return tensors, {n: s for n, s in mine.items() if not s.is_full}


def publish_dcp(store: Store | str, path: str, *, group: ProcessGroup | None = None, prefix: str | None = None,
                keyframe: bool = False, keyframe_every: int = 0, retain: int | None = None, encoding: str = "auto",
                level: int = DEFAULT_LEVEL, step: int | None = None, signer="env", dtype=None, trusted_keys=(),
                progress: bool | None = False, format_version: int | None = None, object_checksum: str | None = None):
    """Publish the DCP checkpoint at ``path`` as the next version (every rank of ``group`` calls
    it; None: this process alone). ``dtype``: publish floating-point tensors in it (a cast per
    element: the cast of a shard is the shard of the cast). ``signer``, ``trusted_keys``,
    ``progress``, ``format_version`` and ``object_checksum`` are the ``Publisher``'s (None: its
    defaults). -> ``PublishResult``."""
    import torch.distributed as dist

    from nemo_dcr.integrations.snapshot import parse_dtype
    from nemo_dcr.stores import open_store
    from nemo_dcr.sync.publisher import Publisher, format_choice

    fmt = format_choice(format_version, object_checksum)  # before the checkpoint is read
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    tensors, shards = load_shards(path, rank, world, prefix)
    dt = parse_dtype(dtype)
    if dt is not None:
        tensors = {n: (t.to(dt) if t.is_floating_point() else t) for n, t in tensors.items()}
    pub = Publisher(open_store(store) if isinstance(store, str) else store, keyframe_every=keyframe_every,
                    retain=retain, encoding=encoding, level=level, group=group, signer=signer,
                    trusted_keys=trusted_keys, progress=progress, **fmt)
    meta = {"dcp": os.path.basename(os.path.normpath(path))}
    return pub.publish(tensors, shards, keyframe=keyframe, step=step, meta=meta)


def _rank_main(rank: int, ranks: int, port: int, store: str, path: str, kw: dict, results) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
        r = publish_dcp(store, path, group=dist.group.WORLD, **kw)
        results.put((rank, None, {"version": r.version, "base_version": r.manifest.base_version,
                                  "kind": r.manifest.kind, "delta_bytes": r.delta_bytes,
                                  "keyframe_bytes": r.keyframe_bytes, "change_rate": r.change_rate}))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        results.put((rank, f"{type(e).__name__}: {e}", None))


def publish_dcp_ranks(store: str, path: str, ranks: int, timeout: float = 3600.0, **kw) -> dict:
    """:func:`publish_dcp` from ``ranks`` local processes (a gloo group on 127.0.0.1), each
    reading and publishing its share of the saving ranks' chunks. -> rank 0's summary
    (``version``, ``base_version``, ``kind``, ``delta_bytes``, ``keyframe_bytes``, ``change_rate``)."""
    import multiprocessing
    import socket

    from nemo_dcr.sync.publisher import format_choice

    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, not {ranks}")
    # a bad choice is refused here, once, not by each rank process after it started
    format_choice(kw.get("format_version"), kw.get("object_checksum"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, ranks, port, store, path, kw, results), daemon=True)
             for r in range(ranks)]
    for p in procs:
        p.start()
    got: dict = {}
    errors = {}
    try:
        for _ in range(ranks):
            rank, err, summary = results.get(timeout=timeout)
            got[rank] = summary
            if err is not None:
                errors[rank] = err
    finally:
        for p in procs:
            p.join(5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise DcrError("publishing the DCP checkpoint failed on " +
                       "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return got[0]


__all__ = ["Chunk", "Entry", "read_layout", "assign", "load_shards", "publish_dcp", "publish_dcp_ranks"]
