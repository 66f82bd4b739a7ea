"""Rollout side, framework-free: keep a set of receiver tensors bit-exact with the newest
committed version.

    f = Follower("s3://bucket/run1", model_tensors, shards)   # version=None: bootstrap from a keyframe
    f.sync()                                                  # -> SyncResult, or raises

For each version on the way: every object is fetched and checked against the manifest's
sha256 *before* anything is applied (failed downloads are retried; an object that stays corrupt
is an error naming it); the receiver's digest is checked against the version's base digest;
parts are applied in place with per-chunk pre-image checks; the state digest is updated from
the changed elements alone and checked against the version's target digest.

On a failure the receiver is at the old version (nothing was written yet) or the follower knows
it is mid-way: the next ``sync`` resumes that version (chunks already applied are recognised),
and if the state still does not verify it re-bootstraps from the newest keyframe. ``version``
only ever names a state that has been verified.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping

import torch

from nemo_dcr.delta import apply, remove_absent
from nemo_dcr.sync.group import Group
from nemo_dcr.errors import BaseMismatchError, DcrError, PartialApplyError, TargetMismatchError
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.state.statedigest import DigestChange, StateDigest, allreduce_digest, state_contrib
from nemo_dcr.sync.versions import Head, Manifest, VersionNotFound, chain, read_head, read_manifest


class CorruptObjectError(DcrError):
    """An object's bytes do not match the checksum in its manifest, after every retry."""


@dataclass
class SyncResult:
    version: int | None
    from_version: int | None
    steps: list = field(default_factory=list)  # (kind, version) applied
    bytes: int = 0
    changed: int = 0
    seconds: float = 0.0
    repaired: bool = False

    @property
    def updated(self) -> bool:
        return bool(self.steps)


class Follower:
    def __init__(self, store, tensors: MutableMapping[str, torch.Tensor],
                 shards: Mapping[str, ShardSpec] | None = None, *, version: int | None = None, group=None,
                 retries: int = 3, backoff: float = 0.1, workers: int | None = None, verify_initial: bool = True):
        """``version``: the version ``tensors`` already hold (checked against its digest unless
        ``verify_initial=False``); None means "nothing yet": the first sync starts from a keyframe."""
        from nemo_dcr.stores import open_store
        self.store = open_store(store) if isinstance(store, str) else store
        self.tensors = tensors
        self.shards = dict(shards or {})
        self.group = Group(group)
        self.retries, self.backoff, self.workers = retries, backoff, workers
        self._version: int | None = None
        self._digest: StateDigest | None = None  # global digest of the verified state
        self._pending: dict | None = None        # a version whose apply was interrupted
        if version is not None:
            m = self._manifest_of(version)
            d = self._full_digest()
            if verify_initial and d.hex() != m.target_digest:
                raise BaseMismatchError(f"the receiver's tensors are not version {version} "
                                        f"(digest {d.hex()}, expected {m.target_digest})")
            self._version, self._digest = version, StateDigest.from_hex(m.target_digest)

    @property
    def version(self) -> int | None:
        """The verified version the tensors hold (None: none yet, or unknown after a failure)."""
        return self._version

    def check(self) -> None:
        """Recompute the digest of the whole state (O(model)) and compare it with the version the
        follower believes it holds. Per-version checks are O(changes): they catch a wrong base
        where the delta touches it and any error in what was applied, but not a scribble on
        elements no delta touched; this does. On a mismatch the follower forgets its version, so
        the next sync rebuilds from a keyframe."""
        if self._version is None:
            return
        d = self._full_digest()
        if d != self._digest:
            v, self._version, self._digest = self._version, None, None
            raise BaseMismatchError(f"the receiver's tensors no longer match version {v} "
                                    f"(digest {d.hex()}); the next sync rebuilds them from a keyframe")

    def latest(self) -> int | None:
        head, _ = read_head(self.store)
        return head.version if head else None

    # ------------------------------------------------------------------ sync
    def sync(self, version: int | None = None, *, head: Head | None = None) -> SyncResult:
        """Bring the tensors to ``version`` (default: the newest committed one)."""
        t0 = time.perf_counter()
        g = self.group
        if head is None:
            head = g.broadcast(read_head(self.store)[0] if g.rank == 0 else None)
        if head is None:
            raise VersionNotFound("the store has no committed version yet")
        res = SyncResult(self._version, self._version)
        if self._pending is not None:
            res.repaired = True
            self._finish_pending(res)
        target_v = head.version if version is None else version
        if self._version == target_v:
            res.version, res.seconds = self._version, time.perf_counter() - t0
            return res

        def plan():
            target = read_manifest(self.store, head.manifest) if target_v == head.version else \
                self._manifest_of(target_v, head)
            return chain(self.store, target, self._version)

        for kind, m in self._together(plan, f"plan the sync to version {target_v}"):
            self._step(kind, m, res)
        res.version, res.seconds = self._version, time.perf_counter() - t0
        return res

    # ------------------------------------------------------------------ steps
    def _step(self, kind: str, m: Manifest, res: SyncResult, resume: bool = False) -> None:
        parts = m.parts if kind == "delta" else m.keyframe_parts
        blobs = self._together(lambda: [self._fetch(p) for p in parts],  # all verified before the first write
                               f"download version {m.version}")
        res.bytes += sum(len(b) for b in blobs)
        if kind == "delta" and not resume and (self._digest is None or self._digest.hex() != m.base_digest):
            raise BaseMismatchError(f"version {m.version} was built on a state whose digest is {m.base_digest}, "
                                    f"the receiver's is {self._digest.hex() if self._digest else 'unknown'}")
        if self._pending is None or self._pending["version"] != m.version:
            # one journal per part: its keys are (tensor, chunk start within the sending rank's
            # region), and every rank's part of a sharded tensor has a chunk starting at 0
            self._pending = {"version": m.version, "kind": kind, "manifest": m, "journal": {},
                             "change": StateDigest.zero()}
        pend = self._pending
        change = DigestChange() if kind == "delta" else None  # a keyframe's digest is recomputed whole

        self._version = None  # from here until verified, the state is "in between"
        err = None
        try:
            for p, blob in zip(parts, blobs):
                # in a group each rank holds only some tensors (a replicated one is held, and
                # counted in the state digest, by exactly one rank): the rest are other ranks' to
                # apply. A tensor no rank holds still fails the group's digest check.
                r = apply(self.tensors, blob, shards=self.shards, verify=False, resume=True,
                          workers=self.workers, journal=pend["journal"].setdefault(p.key, set()),
                          on_change=change, progress=False, held_only=self.group.active)
                res.changed += r.elements_changed
            if kind == "keyframe":  # the keyframe names every tensor of the version: drop the rest
                remove_absent(self.tensors, blobs, shards=self.shards)
        except Exception as e:
            err = e
        if change is not None:
            pend["change"] = pend["change"] + change.total
        if not self.group.all_ok(err is None):
            raise err if err is not None else DcrError(f"another rank failed to apply version {m.version}")
        self._verify(m, kind, full=resume)
        res.steps.append((kind, m.version))

    def _together(self, fn, what: str):
        """``fn()`` on every rank of the group; if it raises on one, it raises on all (the others
        with a DcrError), so no rank goes on to a collective that a failed rank never joins
        (a hang until the group's timeout, or collectives paired wrongly)."""
        err = out = None
        try:
            out = fn()
        except Exception as e:
            err = e
        if not self.group.all_ok(err is None):
            if err is not None:
                raise err
            raise DcrError(f"another rank of the group failed to {what}")
        return out

    def _verify(self, m: Manifest, kind: str, full: bool = False) -> None:
        """O(changes) for a delta applied in one go; a full recomputation for keyframes and for
        a version finished after an interruption (anything may have happened in between)."""
        pend = self._pending
        if kind == "delta" and not full:
            change = allreduce_digest(pend["change"], self.group.group) if self.group.active else pend["change"]
            d = StateDigest.from_hex(m.base_digest) + change
        else:
            d = self._full_digest()
        if d.hex() != m.target_digest and kind == "delta":
            d = self._full_digest()  # incremental accounting can be off after an interruption
        if d.hex() != m.target_digest:
            raise TargetMismatchError(f"after applying version {m.version} the receiver's digest is {d.hex()}, "
                                      f"expected {m.target_digest}; the next sync re-bootstraps")
        self._version, self._digest, self._pending = m.version, d, None

    def _finish_pending(self, res: SyncResult) -> None:
        pend = self._pending
        try:
            self._step(pend["kind"], pend["manifest"], res, resume=True)
        except (BaseMismatchError, TargetMismatchError, PartialApplyError):
            # the interrupted state cannot be completed: start over from the newest keyframe
            self._pending, self._version, self._digest = None, None, None

    # ------------------------------------------------------------------ helpers
    def _fetch(self, part) -> bytes:
        from nemo_dcr.stores import NotFound, StoreError
        last = None
        for attempt in range(self.retries + 1):
            try:
                data = self.store.get(part.key)
            except NotFound:
                raise VersionNotFound(f"object {part.key} is missing from the store") from None
            except StoreError as e:
                last = f"download failed: {e}"
            else:
                if len(data) == part.size and hashlib.sha256(data).hexdigest() == part.sha256:
                    return data
                last = f"{len(data)} bytes with sha256 {hashlib.sha256(data).hexdigest()[:16]}..., " \
                       f"manifest says {part.size} bytes, {part.sha256[:16]}..."
            if attempt < self.retries:
                time.sleep(self.backoff * (2 ** attempt))
        raise CorruptObjectError(f"object {part.key} is corrupt or unreadable after {self.retries + 1} attempts: {last}")

    def _full_digest(self) -> StateDigest:
        d = state_contrib(self.tensors, self.shards)
        return allreduce_digest(d, self.group.group) if self.group.active else d

    def _manifest_of(self, version: int, head: Head | None = None) -> Manifest:
        if head is None:
            head, _ = read_head(self.store)
        if head is None or version > head.version:
            raise VersionNotFound(f"version {version} is not committed")
        m = read_manifest(self.store, head.manifest)
        while m.version > version:
            if m.base_manifest is None:
                break
            m = read_manifest(self.store, m.base_manifest)
        if m.version != version:
            raise VersionNotFound(f"version {version} is no longer in the store")
        return m
