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

Which way: the deltas from the receiver's version if its version is on the store's chain *with
the receiver's digest* (a store wiped and republished, or rewritten with another history, is
recognised and the receiver re-keyed from a keyframe); otherwise, or when an object of that path
is missing or corrupt, the next keyframe (newest first) with the deltas after it. The path taken
and every path given up are in the ``SyncResult`` and the log.

In a group every step that can fail on one rank goes through ``Group.run``: every rank raises
the same typed error, and takes the same fallback.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, MutableMapping

import torch

from nemo_dcr.delta import apply, remove_absent
from nemo_dcr.errors import (BaseMismatchError, CorruptObjectError, DcrError, GroupError, PartialApplyError,
                             TargetMismatchError, VersionNotFound)
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.state.statedigest import ChangeDigest, StateDigest, allreduce_digest, state_contrib
from nemo_dcr.sync.group import Group
from nemo_dcr.sync.versions import Head, Manifest, manifest_at, no_plan, plans, read_head, read_manifest

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nemo_dcr.stores.base import Store

__all__ = ["Follower", "SyncResult", "CorruptObjectError"]

log = logging.getLogger("nemo_dcr.sync")


@dataclass
class SyncResult:
    version: int | None
    from_version: int | None
    steps: list = field(default_factory=list)  # (kind, version) applied
    bytes: int = 0
    changed: int = 0
    seconds: float = 0.0
    repaired: bool = False
    path: str = ""                              # the path taken, e.g. "keyframe 4 + deltas 5..6"
    fallbacks: list = field(default_factory=list)  # paths given up on the way, with the reason
    rekeyed: bool = False                       # the store's history was not the one followed

    @property
    def updated(self) -> bool:
        return bool(self.steps)


class _Unavailable(DcrError):
    """A step's objects could not be fetched (missing or corrupt on some rank): try another path."""

    def __init__(self, kind: str, manifest: Manifest, error: Exception):
        self.kind, self.manifest, self.error = kind, manifest, error
        super().__init__(str(error))


def describe(steps: list) -> str:
    """``keyframe 4 + deltas 5..6``, ``delta 3``, ``deltas 2..4``."""
    out, deltas = [], [m.version for k, m in steps if k == "delta"]
    out += [f"keyframe {m.version}" for k, m in steps if k == "keyframe"]
    if deltas:
        out.append(f"delta {deltas[0]}" if len(deltas) == 1 else f"deltas {deltas[0]}..{deltas[-1]}")
    return " + ".join(out) or "nothing"


class Follower:
    def __init__(self, store: Store | str, tensors: MutableMapping[str, torch.Tensor],
                 shards: Mapping[str, ShardSpec] | None = None, *, version: int | None = None,
                 group: ProcessGroup | None = None,
                 retries: int = 3, backoff: float = 0.1, workers: int | None = None, verify_initial: bool = True,
                 max_fallbacks: int = 8):
        """``version``: the version ``tensors`` already hold (checked against its digest unless
        ``verify_initial=False``); None means "nothing yet": the first sync starts from a keyframe.
        ``shards``: the receiver's ShardSpec per tensor name (a name missing from it is a whole
        tensor). The mapping is used as given and consulted at every step, so a view that
        resolves names lazily (the rollout loader's) stays live. ``max_fallbacks``: paths given
        up on missing or corrupt objects before a sync fails."""
        from nemo_dcr.stores import open_store
        self.store = open_store(store) if isinstance(store, str) else store
        self.tensors = tensors
        self.shards = shards if shards is not None else {}
        self.group = Group(group)
        self.retries, self.backoff, self.workers = retries, backoff, workers
        self.max_fallbacks = max_fallbacks
        self._version: int | None = None
        self._held: Manifest | None = None        # the manifest of the verified state
        self._digest: StateDigest | None = None  # global digest of the verified state
        self._pending: dict | None = None        # a version whose apply was interrupted
        if version is not None:
            m = self.group.run(lambda: manifest_at(self.store, version), f"read the manifest of version {version}")
            d = self._full_digest()
            if verify_initial and d.hex() != m.target_digest:
                raise BaseMismatchError(f"the receiver's tensors are not version {version} "
                                        f"(digest {d.hex()}, expected {m.target_digest})")
            self._version, self._held, self._digest = version, m, StateDigest.from_hex(m.target_digest)

    @property
    def version(self) -> int | None:
        """The verified version the tensors hold (None: none yet, or unknown after a failure)."""
        return self._version

    @property
    def manifest(self) -> Manifest | None:
        """The manifest of the verified version held (its ``key`` and ``sha256`` identify it)."""
        return self._held if self._version is not None else None

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
            v = self._version
            self._forget()
            raise BaseMismatchError(f"the receiver's tensors no longer match version {v} "
                                    f"(digest {d.hex()}); the next sync rebuilds them from a keyframe")

    def read_head(self) -> Head | None:
        """The store's HEAD, read by rank 0 and the same on every rank (a damaged HEAD raises
        ManifestError on every rank)."""
        g = self.group
        return g.run(lambda: read_head(self.store)[0] if g.rank == 0 else None, "read the store's HEAD", src=0)

    def latest(self) -> int | None:
        head = self.read_head()
        return head.version if head else None

    def is_current(self, head: Head, version: int | None = None) -> bool:
        """Whether the tensors hold what ``sync(version, head=head)`` would bring, known from
        HEAD alone: the very manifest HEAD names (its key and digest), not just its number."""
        if self._pending is not None or self._version is None or self._held is None:
            return False
        if version is not None and version != head.version:
            return False  # (sync finds out, walking the chain)
        return head.manifest == self._held.key and head.manifest_sha256 in (None, self._held.sha256)

    # ------------------------------------------------------------------ sync
    def sync(self, version: int | None = None, *, head: Head | None = None) -> SyncResult:
        """Bring the tensors to ``version`` (default: the newest committed one)."""
        t0 = time.perf_counter()
        g = self.group
        if head is None:
            head = self.read_head()
        if head is None:
            raise VersionNotFound("the store has no committed version yet")
        res = SyncResult(self._version, self._version)
        if self._pending is not None:
            res.repaired = True
            self._finish_pending(res)
        if self.is_current(head, version):
            return self._done(res, t0)
        tv = head.version if version is None else version
        target = g.run(lambda: read_manifest(self.store, head.manifest, head.manifest_sha256) if tv == head.version
                       else manifest_at(self.store, tv, head), f"read the manifest of version {tv}")
        if self._version is not None and target.version == self._version:
            if target.target_digest == self._digest.hex():
                self._held = target  # the same state under another manifest (a republished store)
                return self._done(res, t0)
        bad: set = set()
        while True:
            steps = g.run(lambda: self._plan(target, bad), f"plan the sync to version {tv}")
            if steps is None:
                last = res.fallbacks[-1] if res.fallbacks else None
                raise _no_path(target, self._version, last)
            res.path = describe(steps)
            if self._version is not None and steps and steps[0][0] == "keyframe" and not res.fallbacks:
                # the receiver's version, with its digest, is not on the chain to the target: the
                # store was wiped and republished or rewritten (or retention removed the deltas)
                res.rekeyed = True
                log.warning("nemo-dcr: version %d (manifest %s) with this receiver's digest is not on the chain to "
                            "version %d in %s; re-keying from a keyframe", self._version,
                            self._held.key if self._held else "?", target.version,
                            getattr(self.store, "url", self.store))
            log.info("nemo-dcr: version %s -> %d: %s", self._version, target.version, res.path)
            try:
                for kind, m in steps:
                    self._step(kind, m, res)
            except _Unavailable as u:
                if len(res.fallbacks) >= self.max_fallbacks:
                    raise u.error from None
                bad.add((u.manifest.key, u.kind))
                res.fallbacks.append(_Fallback(f"{u.kind} {u.manifest.version}", u.error))
                log.info("nemo-dcr: cannot use the %s of version %d (%s); trying another path",
                         u.kind, u.manifest.version, u.error)
                continue
            return self._done(res, t0)

    def _plan(self, target: Manifest, bad: set):
        digest = self._digest.hex() if self._version is not None and self._digest is not None else None
        for p in plans(self.store, target, self._version, digest):
            if not any((m.key, kind) in bad for kind, m in p):
                return p
        return None

    def _done(self, res: SyncResult, t0: float) -> SyncResult:
        res.version, res.seconds = self._version, time.perf_counter() - t0
        return res

    def _forget(self) -> None:
        self._version = self._held = self._digest = None

    # ------------------------------------------------------------------ steps
    def _step(self, kind: str, m: Manifest, res: SyncResult, resume: bool = False) -> None:
        g = self.group
        parts = m.parts if kind == "delta" else m.keyframe_parts
        try:  # every object verified before the first write
            blobs = g.run(lambda: [self._fetch(p) for p in parts], f"download the {kind} of version {m.version}")
        except (CorruptObjectError, VersionNotFound, GroupError) as e:
            raise _Unavailable(kind, m, e) from e
        res.bytes += sum(len(b) for b in blobs)
        if kind == "delta" and not resume and (self._digest is None or self._digest.hex() != m.base_digest):
            raise BaseMismatchError(f"version {m.version} was built on a state whose digest is {m.base_digest}, "
                                    f"the receiver's is {self._digest.hex() if self._digest else 'unknown'}")
        if self._pending is None or self._pending["version"] != m.version:
            # one journal per part: its keys are (tensor, chunk start within the sending rank's
            # region), and every rank's part of a sharded tensor has a chunk starting at 0
            self._pending = {"version": m.version, "kind": kind, "manifest": m, "journal": {},
                             "change": ChangeDigest()}
        pend = self._pending
        on_change = pend["change"] if kind == "delta" else None  # a keyframe's digest is recomputed whole

        def apply_parts():
            for p, blob in zip(parts, blobs):
                # in a group each rank holds only some tensors (a replicated one is held, and
                # counted in the state digest, by exactly one rank): the rest are other ranks' to
                # apply. A tensor no rank holds still fails the group's digest check.
                r = apply(self.tensors, blob, shards=self.shards, verify=False, resume=True,
                          workers=self.workers, journal=pend["journal"].setdefault(p.key, set()),
                          on_change=on_change, progress=False, held_only=g.active)
                res.changed += r.elements_changed
            if kind == "keyframe":  # the keyframe names every tensor of the version: drop the rest
                remove_absent(self.tensors, blobs, shards=self.shards)

        self._version = None  # from here until verified, the state is "in between"
        g.run(apply_parts, f"apply version {m.version}")
        self._verify(m, kind, full=resume)
        res.steps.append((kind, m.version))

    def _verify(self, m: Manifest, kind: str, full: bool = False) -> None:
        """O(changes) for a delta applied in one go; a full recomputation for keyframes and for
        a version finished after an interruption (anything may have happened in between)."""
        pend = self._pending
        if kind == "delta" and not full:
            change = pend["change"].total
            if self.group.active:
                change = allreduce_digest(change, self.group.group)
            d = StateDigest.from_hex(m.base_digest) + change
        else:
            d = self._full_digest()
        if d.hex() != m.target_digest and kind == "delta":
            d = self._full_digest()  # incremental accounting can be off after an interruption
        if d.hex() != m.target_digest:
            raise TargetMismatchError(f"after applying version {m.version} the receiver's digest is {d.hex()}, "
                                      f"expected {m.target_digest}; the next sync re-bootstraps")
        self._version, self._held, self._digest, self._pending = m.version, m, d, None

    def _finish_pending(self, res: SyncResult) -> None:
        pend = self._pending
        try:
            self._step(pend["kind"], pend["manifest"], res, resume=True)
        except (BaseMismatchError, TargetMismatchError, PartialApplyError, _Unavailable):
            # the interrupted state cannot be completed: start over from the newest keyframe
            self._pending = None
            self._forget()

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


class _Fallback(str):
    """A path given up: ``"<kind> <version>: <why>"`` (``.error`` keeps the exception)."""

    def __new__(cls, what: str, error: Exception):
        s = super().__new__(cls, f"{what}: {type(error).__name__}: {error}")
        s.error = error
        return s


def _no_path(target: Manifest, current: int | None, last) -> Exception:
    if last is not None:
        return last.error  # every path needed an object that cannot be had: say which
    return no_plan(target, current)
