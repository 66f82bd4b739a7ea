"""Trainer side, framework-free: publish a sequence of versions of a (possibly sharded) state.

    pub = Publisher("s3://bucket/run1", keyframe_every=50)
    pub.publish(local_tensors, shards)          # every rank of the trainer's group calls it

Each call snapshots (copies) the rank's tensors, diffs them against the last *published*
snapshot (so publishing every N steps sends the changes of N steps), uploads one part per rank,
gathers the parts' receipts over the trainer's own process group, and rank 0 commits the version
once every part is durable. A rank that fails or dies before its receipt is gathered leaves no
visible version.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from nemo_dcr.delta import DEFAULT_CHUNK, DEFAULT_LEVEL, diff
from nemo_dcr.delta.stats import inspect
from nemo_dcr.errors import CommitConflict, PublishError
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.state.statedigest import ChangeDigest, StateDigest, state_contrib
from nemo_dcr.sync.group import Group
from nemo_dcr.sync.versions import Head, Manifest, Part, commit, new_publish_id, read_head, read_manifest, version_dir

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nemo_dcr.stores.base import Store

__all__ = ["Publisher", "PublishResult", "PublishError", "CommitConflict", "snapshot"]


@dataclass
class PublishResult:
    manifest: Manifest
    delta_bytes: int
    keyframe_bytes: int
    changed: int
    elements: int
    seconds: float

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def change_rate(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict:
    """A private CPU copy: the caller's tensors may change as soon as we return."""
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


class Publisher:
    def __init__(self, store: Store | str, *, keyframe_every: int = 0, encoding: str = "auto", level: int = DEFAULT_LEVEL,
                 chunk_elems: int = DEFAULT_CHUNK, workers: int | None = None, retain: int | None = None,
                 group: ProcessGroup | None = None):
        """``keyframe_every``: also publish the full state every K versions (0: only the first).
        ``retain``: after each commit, delete versions older than both the newest keyframe and
        the newest ``retain`` versions (None: delete nothing)."""
        from nemo_dcr.stores import open_store
        self.store = open_store(store) if isinstance(store, str) else store
        self.keyframe_every = keyframe_every
        self.encoding, self.level, self.chunk_elems, self.workers = encoding, level, chunk_elems, workers
        self.retain = retain
        self.group = Group(group)
        self._base: dict | None = None        # the last published snapshot (this rank's tensors)
        self._shards: dict | None = None
        self._head: Head | None = None
        self._digest: StateDigest | None = None  # this rank's partial digest of _base

    @property
    def version(self) -> int | None:
        return self._head.version if self._head else None

    @property
    def head(self) -> Head | None:
        """HEAD as this publisher last committed (or restored) it."""
        return self._head

    @property
    def published(self) -> tuple[dict, dict] | None:
        """``(tensors, shards)``: this rank's copy of the last published state (None before the
        first publish). Read-only: it is the base of the next delta."""
        return None if self._base is None else (self._base, self._shards)

    # ------------------------------------------------------------------ publish
    def publish(self, tensors: Mapping[str, torch.Tensor], shards: Mapping[str, ShardSpec] | None = None, *,
                keyframe: bool = False, step: int | None = None, meta: dict | None = None) -> PublishResult:
        """Publish the next version. ``keyframe=True`` also stores the full state; if the last
        published state cannot then be rebuilt from the store (a restarted trainer whose base is
        lost or corrupt), the version is a keyframe alone, without a delta part.

        Every step that can fail on one rank goes through ``Group.run``: a failure anywhere is
        raised alike on every rank (``PublishError`` naming the ranks and their errors for the
        upload, ``CommitConflict`` for a lost race), and nothing is committed."""
        t0 = time.perf_counter()
        g = self.group
        head, tag, publish_id = g.run(lambda: (*read_head(self.store), new_publish_id()) if g.rank == 0 else None,
                                      "read the store's HEAD", src=0)
        version = 0 if head is None else head.version + 1
        kf = keyframe or head is None or (self.keyframe_every > 0 and version % self.keyframe_every == 0)
        local = {}

        def upload():
            local["snap"], local["shards"] = snapshot(tensors), dict(shards or {})
            if head is not None and not _same_head(self._head, head):
                try:  # fresh publisher, or the store moved on; every rank fails alike (Group.run)
                    g.run(lambda: self._restore(head, local["snap"], local["shards"]),
                          f"rebuild version {head.version} from the store")
                except Exception:
                    if not keyframe:
                        raise
                    # a keyframe was asked for and the published state cannot be rebuilt (and
                    # verified) on every rank: publish the keyframe alone, no delta part
                    self._base = self._shards = self._head = self._digest = None
            receipt, local["digest"] = self._upload(local["snap"], local["shards"], head, version, publish_id, kf)
            return receipt

        receipts = g.run(upload, f"publishing version {version}", error=PublishError, gather=True,
                         note="no version committed")
        manifest, new_head = g.run(
            lambda: self._commit(receipts, head, tag, version, publish_id, step, meta) if g.rank == 0 else None,
            f"committing version {version}", src=0)
        self._base, self._shards, self._digest, self._head = local["snap"], local["shards"], local["digest"], new_head
        if self.retain is not None:
            from nemo_dcr.sync.retention import prune
            g.run(lambda: prune(self.store, new_head, keep=self.retain) if g.rank == 0 else None,
                  f"retention after version {version}", src=0)
        return PublishResult(manifest, manifest.delta_bytes(), manifest.keyframe_bytes(), manifest.changed,
                             manifest.elements, time.perf_counter() - t0)

    def _upload(self, snap, shards, head, version, publish_id, kf) -> tuple[dict, StateDigest]:
        """Upload this rank's objects -> (receipt, this rank's partial digest of ``snap``)."""
        rank = self.group.rank
        d = version_dir(version, publish_id)
        out = {"parts": [], "keyframe_parts": []}
        meta = {"version": version, "publish_id": publish_id, "rank": rank}
        if head is not None and self._base is not None:
            change = ChangeDigest()  # added, removed, reshaped and re-typed tensors included
            blob = diff(self._base, snap, shards=shards, base_shards=self._shards, encoding=self.encoding,
                        level=self.level, chunk_elems=self.chunk_elems, workers=self.workers, meta=meta,
                        on_change=change, progress=False)
            out["parts"].append(self._put(f"{d}/part-{rank:05d}.dcr", blob))
            new_digest = self._digest + change.total
        else:
            new_digest = state_contrib(snap, shards)
        if kf:
            blob = diff({}, snap, shards=shards, encoding="overwrite", level=self.level,
                        chunk_elems=self.chunk_elems, workers=self.workers, meta=meta, progress=False)
            out["keyframe_parts"].append(self._put(f"{d}/key-{rank:05d}.dcr", blob))
        out["digest"] = new_digest.hex()
        return out, new_digest

    def _put(self, key: str, blob: bytes) -> dict:
        s = inspect(blob, check=False)  # just encoded here: no need to re-read every payload
        self.store.put(key, blob)
        return Part(rank=self.group.rank, key=key, size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
                    changed=s["changed"], elements=s["elements"], dense_bytes=s["dense_bytes"]).__dict__

    def _commit(self, results, head, tag, version, publish_id, step, meta=None) -> tuple[Manifest, Head]:
        """Rank 0: the manifest from every rank's receipt, then HEAD by compare-and-set."""
        try:
            total = StateDigest.zero()
            for r in results:
                total = total + StateDigest.from_hex(r["digest"])
            base = read_manifest(self.store, head.manifest, head.manifest_sha256) if head is not None else None
            m = Manifest(
                version=version, publish_id=publish_id, target_digest=total.hex(),
                base_version=head.version if head else None, base_manifest=head.manifest if head else None,
                base_digest=base.target_digest if base else None, base_sha256=base.sha256 if base else None,
                parts=[Part(**p) for r in results for p in r["parts"]],
                keyframe_parts=[Part(**p) for r in results for p in r["keyframe_parts"]],
                encoding={"encoding": self.encoding, "level": self.level, "chunk_elems": self.chunk_elems},
                world_size=self.group.world_size, step=step, meta=meta or {})
            return m, commit(self.store, m, head, tag)
        except CommitConflict:
            raise
        except Exception as e:
            raise PublishError(f"commit failed: {type(e).__name__}: {e}") from e

    def _restore(self, head: Head, like: dict, shards: dict) -> None:
        """Rebuild this rank's part of the published state at ``head`` from the store."""
        from nemo_dcr.sync.follower import Follower
        # Seed only what the keyframe cannot create: a tensor held in a group (where each rank
        # applies the tensors it holds) or a shard. A single rank starts empty, so the published
        # state is rebuilt with exactly its own tensor set, dtypes and shapes, not the new
        # snapshot's (tensors added, removed, reshaped or re-typed since then).
        tensors = {k: torch.zeros_like(v) for k, v in like.items()
                   if self.group.active or (k in shards and not shards[k].is_full)}
        f = Follower(self.store, tensors, shards, group=self.group.group, workers=self.workers)
        f.sync(head.version, head=head)
        self._base, self._shards, self._head = tensors, shards, head
        self._digest = state_contrib(tensors, shards)


def _same_head(a: Head | None, b: Head) -> bool:
    return a is not None and a.version == b.version and a.manifest == b.manifest \
        and a.manifest_sha256 == b.manifest_sha256
