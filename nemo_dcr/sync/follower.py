"""Rollout side, framework-free: keep a set of receiver tensors bit-exact with the newest
committed version.

    f = Follower("s3://bucket/run1", model_tensors, shards)   # version=None: bootstrap from a keyframe
    f.sync()                                                  # -> SyncResult, or raises

For each version on the way: every object is fetched and checked against the manifest's
size and checksum (SHA-256, or BLAKE3 in format-4 manifests) *before* anything of that version
is applied (failed downloads are retried; an object that stays corrupt is an error naming it);
the receiver's digest is checked against the version's base digest; parts are applied in place
with per-chunk pre-image checks; the state digest is updated from the changed elements alone and
checked against the version's target digest.

Pipelined: background threads (the process's standing ones, reused from sync to sync) stream
the objects of the whole path (``store.get_stream``,
checksum computed as the bytes arrive), up to ``prefetch`` objects at once ahead of the apply, so
their requests' round trips overlap, and version k+1 downloads while version k is applied and
verified. ``stream=True`` (a single receiver, not a
group) also applies each part of a version as soon as that part checked out, while the next part
downloads: the first write then comes before the later parts of the version were checked (see
docs/design.md "Streaming pipeline" for what is checked before it). Without it, each object's
header is parsed on its download thread once the object checked out, beside the other
downloads and the apply of the step before, not after all of them. ``SyncResult.spans`` records
each stage (fetch, verify, parse, apply, digest) with its start and end.

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

import logging
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nemo_dcr.codec.format import DeltaReader, SegmentStream
from nemo_dcr.delta import ApplyReport, apply, apply_stream, remove_absent, remove_unnamed
from nemo_dcr.delta.apply import refuse_misfits
from nemo_dcr.delta.overlap import Claims
from nemo_dcr.errors import (
    BaseMismatchError,
    CorruptObjectError,
    DcrError,
    DeltaFormatError,
    GroupError,
    PartialApplyError,
    TargetMismatchError,
    VersionNotFound,
)
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.state.statedigest import ChangeDigest, StateDigest, WrittenDigest, allreduce_digest, state_contrib
from nemo_dcr.stores import checksums
from nemo_dcr.stores.http import read_head_since, wait_head
from nemo_dcr.sync.chunk_gather import decode_partial
from nemo_dcr.sync.group import Group
from nemo_dcr.sync.pace import LinkEstimate, Pacer
from nemo_dcr.sync.speculate import Speculation, predicted
from nemo_dcr.sync.versions import Head, Manifest, head_manifest, manifest_at, no_plan, plans
from nemo_dcr.util.gc_pause import pausing
from nemo_dcr.util.memory import PrefaultedBuffer, release_freed_memory
from nemo_dcr.util.parallel import standing
from nemo_dcr.util.progress import NullProgress, Progress

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
    gathered: int = 0                           # bytes of base bits received from the group (chunk_gather)
    speculated: int = 0                         # objects asked for beside the HEAD read and read so (sync/speculate.py)
    # Span per stage, seconds from the start of the sync (sync() passes its own; lambda: Spans is defined below)
    spans: Spans = field(default_factory=lambda: Spans())

    @property
    def updated(self) -> bool:
        return bool(self.steps)


@dataclass
class Span:
    """One stage of a sync or publish: ``stage`` (fetch, verify, parse, gather, apply, digest;
    encode, upload, commit), what it worked on, and its start and end in seconds from the start of the call."""
    stage: str
    what: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


_TALLY = threading.Lock()


class Spans(list):
    """Spans recorded against one origin (``perf_counter`` at the start of the call); appended
    from several threads (list.append is atomic)."""

    def __init__(self, t0: float | None = None):
        super().__init__()
        self.t0 = time.perf_counter() if t0 is None else t0

    def add(self, stage: str, what: str, start: float, end: float | None = None) -> None:
        end = time.perf_counter() if end is None else end
        self.append(Span(stage, what, start - self.t0, end - self.t0))


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
                 max_fallbacks: int = 8, prefetch: int = 4, stream: bool = False, verifier="env",
                 name: str | None = None, metrics=None, metrics_port: int | None = None,
                 manifest: Manifest | None = None, on_write=None, progress: bool | None = False,
                 speculate: bool = True):
        """``version``: the version ``tensors`` already hold (checked against its digest unless
        ``verify_initial=False``); None means "nothing yet": the first sync starts from a keyframe.
        ``manifest``: instead of ``version``, that version's manifest where the caller has it
        (as :func:`~nemo_dcr.sync.versions.locate` found it), so it is not looked for again.
        ``shards``: the receiver's ShardSpec per tensor name (a name missing from it is a whole
        tensor). The mapping is used as given and consulted at every step, so a view that
        resolves names lazily (the rollout loader's) stays live. ``max_fallbacks``: paths given
        up on missing or corrupt objects before a sync fails. ``prefetch``: objects downloaded
        ahead of the apply, at most that many at once, each started when the ones under way have
        about one bandwidth-delay product left (``sync/pace.py``; their bytes are held in memory;
        0: no background download).
        ``stream``: apply each part of a version once it checked out, before the version's
        later parts arrived, and a part of format 3 segment by segment while it still arrives
        (each chunk checked against its pre-image, the part's sha256 at its end; ignored in a
        group, where every rank applies only after every part checked out on every rank). ``verifier``: a
        :class:`~nemo_dcr.sync.signing.Verifier`; HEAD and every manifest are then read through it
        and refused unless signed by a trusted key (``"env"``, the default: from
        ``$NEMO_DCR_TRUSTED_KEYS(_FILE)`` if set; None: unsigned stores are read as they are).
        ``name``: how the follower reports itself to the relays it reads through (with the
        version it holds, on each HEAD read; default ``<host>-<pid>``). ``metrics``: a
        :class:`~nemo_dcr.metrics.FollowerMetrics` to record into; ``metrics_port``: serve them
        (made if not given) at ``http://127.0.0.1:<port>/metrics`` and ``/healthz``
        (``self.metrics_server``; 0: a free port). ``on_write(name, global_idx, new_bits)``:
        called for every chunk written into ``tensors`` (deltas and keyframes, from the apply's
        worker threads; ``global_idx`` canonical flat positions, ``new_bits`` their new bits as
        the dtype's integer view), for receivers that keep a second copy of some tensor in
        another layout (the vLLM receiver's pieces of a tensor held in several strided boxes).
        ``progress``: a bar on stderr over the bytes a sync downloads (None: when stderr is a
        terminal, as ``nemo-dcr pull``; False, the default: never). ``speculate``: a sync that
        reads HEAD also asks, at the same time, for the first objects the version after the one
        held is expected to have (where its manifest says they will be: ``sync/speculate.py``),
        so a follower one version behind has its parts one round trip after it asked, not two;
        not in a group. ``SyncResult.speculated`` counts the objects read so."""
        from nemo_dcr.stores import open_reader
        from nemo_dcr.stores.http import check_receiver_name
        from nemo_dcr.sync.signing import verifying
        # a reader: a local path that does not exist is an error (mistyped), not a new empty store
        self.store = verifying(open_reader(store) if isinstance(store, (str, list, tuple, os.PathLike)) else store,
                               verifier)
        self.name = check_receiver_name(name if name is not None else _default_name())
        self.metrics, self.metrics_server = metrics, None
        if metrics_port is not None:
            from nemo_dcr.metrics import FollowerMetrics, serve
            self.metrics = self.metrics if self.metrics is not None else FollowerMetrics()
            self.metrics_server = serve(self.metrics, metrics_port)
        self.tensors = tensors
        self.on_write = on_write
        self.shards = shards if shards is not None else {}
        self.group = Group(group)
        self.retries, self.backoff, self.workers = retries, backoff, workers
        self.max_fallbacks = max_fallbacks
        self.prefetch, self.stream = max(0, int(prefetch)), bool(stream)
        self.speculate = bool(speculate)
        self._speculation: Speculation | None = None  # during a sync: the reads sent beside HEAD's
        # the link to the store as this follower's downloads found it (sync/pace.py): paces them
        self.link = LinkEstimate()
        self.progress = progress
        self._bar: Progress = NullProgress(0, "")
        self._version: int | None = None
        self._held: Manifest | None = None        # the manifest of the verified state
        # global digest of the verified state: under its manifest's definition (docs/format.md,
        # "State digest"), or under the next version's where that is another (_digest_under)
        self._digest: StateDigest | None = None
        self._pending: dict | None = None        # a version whose apply was interrupted
        # rank 0: HEAD as last read ((bytes, tag), Head), so that the next read is conditional
        self._head_read: tuple[tuple[bytes, str], Head] | None = None
        if manifest is not None and version not in (None, manifest.version):
            raise ValueError(f"version {version} and the manifest of version {manifest.version} given")
        if manifest is None and version is not None:
            v = version
            manifest = self.group.run(lambda: manifest_at(self.store, v), f"read the manifest of version {v}")
        if manifest is not None:
            m, version = manifest, manifest.version
            d = self._full_digest(m.definition) if verify_initial else None  # O(model): only when asked for
            if d is not None and d.hex() != m.target_digest:
                raise BaseMismatchError(f"the receiver's tensors are not version {version} "
                                        f"(digest {d.hex()}, expected {m.target_digest})")
            self._version, self._held, self._digest = version, m, StateDigest.from_hex(m.target_digest, m.definition)
        self._reported()

    def _reported(self) -> None:
        """Tell the relays (and the metrics) the version held now."""
        report = getattr(self.store, "report", None)  # a duck-typed store may have none
        if report is not None:
            report(self.name, self._version)
        if self.metrics is not None:
            self.metrics.held(self._version)

    def _seen(self, head: Head | None) -> Head | None:
        if head is not None and self.metrics is not None:
            self.metrics.seen_head(head.version)
        return head

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
        if self._version is None or self._digest is None:
            return
        d = self._full_digest(self._digest.definition)
        if d != self._digest:
            v = self._version
            self._forget()
            raise BaseMismatchError(f"the receiver's tensors no longer match version {v} "
                                    f"(digest {d.hex()}); the next sync rebuilds them from a keyframe")

    def read_head(self) -> Head | None:
        """The store's HEAD, read by rank 0 and the same on every rank (a damaged HEAD raises
        ManifestError on every rank)."""
        g = self.group
        return self._seen(g.run(lambda: self._head_from(read_head_since(self.store, self._last_head()))
                                if g.rank == 0 else None, "read the store's HEAD", src=0))

    def _last_head(self) -> tuple[bytes, str] | None:
        return self._head_read[0] if self._head_read is not None else None

    def _head_from(self, pair: tuple[bytes, str] | None) -> Head | None:
        """HEAD from a read's ``(bytes, tag)``, kept for the next (conditional) read; the very
        pair kept is an unchanged HEAD, not parsed again."""
        if pair is None:
            self._head_read = None
            return None
        if self._head_read is not None and pair is self._head_read[0]:
            return self._head_read[1]
        head = Head.from_bytes(pair[0])
        self._head_read = (pair, head)
        return head

    def latest(self) -> int | None:
        head = self.read_head()
        return head.version if head else None

    def wait(self, newer_than: int | None = None, timeout: float = 30.0, *,
             poll_interval: float = 0.5) -> Head | None:
        """Block until the store's HEAD names a version newer than ``newer_than`` (default: the
        version held; None held: any version) and return that HEAD, or None after ``timeout``
        seconds. A relay (``HttpStore``, or a fallback list of them) is long-polled, so the
        answer comes as soon as the relay learns of the version; any other store is read every
        ``poll_interval`` seconds. In a group rank 0 waits and every rank gets its answer.
        Pass the HEAD on: ``f.sync(head=f.wait())``."""
        g = self.group
        newer = self._version if newer_than is None else newer_than

        def wait_rank0():
            deadline = time.monotonic() + max(0.0, float(timeout))
            while True:
                t0 = time.monotonic()
                head = self._head_from(wait_head(self.store, newer, max(0.0, min(deadline - t0, 60.0)),
                                                 self._last_head()))
                if head is not None and (newer is None or head.version > newer):
                    return head
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                # every round takes poll_interval at least: whether the store long-polls is known
                # only from how long it took (a signed store, or a list of relays that fails over
                # to the store itself, offers wait_head but answers at once), as the relay's own
                # HEAD watcher does
                time.sleep(min(max(0.0, poll_interval - (time.monotonic() - t0)), left))

        return self._seen(g.run(lambda: wait_rank0() if g.rank == 0 else None, "wait for a new version", src=0))

    def is_current(self, head: Head, version: int | None = None) -> bool:
        """Whether the tensors hold what ``sync(version, head=head)`` would bring, known from
        HEAD alone: the very manifest HEAD names (its key and digest), not just its number."""
        if self._pending is not None or self._version is None or self._held is None:
            return False
        if version is not None and version != head.version:
            return False  # (sync finds out, walking the chain)
        return head.manifest == self._held.key and head.manifest_sha256 in (None, self._held.sha256)

    # ------------------------------------------------------------------ sync
    @pausing
    def sync(self, version: int | None = None, *, head: Head | None = None) -> SyncResult:
        """Bring the tensors to ``version`` (default: the newest committed one)."""
        try:
            try:
                res = self._sync(version, self._seen(head))
            finally:
                spec, self._speculation = self._speculation, None
                if spec is not None:
                    spec.close()
            if spec is not None:
                res.speculated = spec.taken
        except BaseException as e:
            if self.metrics is not None:
                self.metrics.failed(e, self._version)
            self._reported()
            raise
        if self.metrics is not None:
            self.metrics.synced(res)
        self._reported()
        return res

    def _sync(self, version: int | None, head: Head | None) -> SyncResult:
        t0 = time.perf_counter()
        g = self.group
        if head is None:
            if version is None:
                self._speculation = self._speculate()
            t = time.monotonic()
            head = self.read_head()
            self.link.round_trip(time.monotonic() - t)  # a small request: the link's round trip, or more
        if head is None:
            raise VersionNotFound("the store has no committed version yet")
        res = SyncResult(self._version, self._version, spans=Spans(t0))
        if self._pending is not None:
            res.repaired = True
            self._finish_pending(res)
        if self.is_current(head, version):
            return self._done(res, t0)
        tv = head.version if version is None else version
        target = g.run(lambda: head_manifest(self.store, head) if tv == head.version
                       else manifest_at(self.store, tv, head),
                       f"read the manifest of version {tv}")
        if self._version is not None and target.version == self._version:
            assert self._digest is not None  # set together with _version (_verify)
            if target.target_digest == self._known_digest(target.definition):
                self._held = target  # the same state under another manifest (a republished store)
                return self._done(res, t0)
        bad: set = set()
        while True:
            steps = g.run(lambda: self._plan(target, bad), f"plan the sync to version {tv}")
            if steps is None:
                last = res.fallbacks[-1] if res.fallbacks else None
                raise _no_path(target, self._version, last)
            res.path = describe(steps)
            if self._version is not None and target.version < self._version <= head.version:
                # going back (an older version asked for; the store still has the newer ones):
                # deltas lead forward only, so an older version is rebuilt from a keyframe
                log.info("nemo-dcr: going back from version %d to version %d: from a keyframe (deltas lead "
                         "forward only)", self._version, target.version)
            elif self._version is not None and steps and steps[0][0] == "keyframe" and not res.fallbacks:
                # the receiver's version, with its digest, is not on the chain to the target: the
                # store was wiped and republished or rewritten (or retention removed the deltas)
                res.rekeyed = True
                log.warning("nemo-dcr: the version this receiver holds (%d, manifest %s) is not on the chain to "
                            "version %d in %s (the store was republished or rewritten, or retention removed the "
                            "deltas from it); rebuilding from a keyframe", self._version,
                            self._held.key if self._held else "?", target.version,
                            getattr(self.store, "url", self.store))
            log.info("nemo-dcr: version %s -> %d: %s", self._version, target.version, res.path)
            if self.progress is not False and g.rank == 0:
                self._bar.close()
                self._bar = Progress(sum(p.size for kind, m in steps for p in _parts(kind, m)),
                                     f"pull v{target.version}", enabled=self.progress)
            feed = _Feed(self, steps, res.spans)
            try:
                for kind, m in steps:
                    self._step(kind, m, res, feed=feed)
            except _Unavailable as u:
                if len(res.fallbacks) >= self.max_fallbacks:
                    raise u.error from None
                bad.add((u.manifest.key, u.kind))
                res.fallbacks.append(_Fallback(f"{u.kind} {u.manifest.version}", u.error))
                log.info("nemo-dcr: cannot use the %s of version %d (%s); trying another path",
                         u.kind, u.manifest.version, u.error)
                continue
            finally:
                feed.close()
                self._bar.close()
            return self._done(res, t0)

    def _speculate(self) -> Speculation | None:
        """The reads of the next version's first objects, sent now (beside the HEAD read), where
        the version held names them and they are worth guessing (``sync/speculate.py``)."""
        if not self.speculate or self.group.active or self._pending is not None or self._version is None:
            return None
        keys = predicted(self._held, max(1, self.prefetch), Pacer(self.link).window())
        if not keys:
            return None
        store = self.store
        return Speculation(lambda k: _open_stream(store, k), keys)

    def _plan(self, target: Manifest, bad: set):
        digest = self._known_digest if self._version is not None and self._digest is not None else None
        known = self._held if self._version is not None else None
        refused: list = []
        for p in plans(self.store, target, self._version, digest, known, refused):
            if not any((m.key, kind) in bad for kind, m in p):
                return p
        if refused:  # no way there, and the way back was signed by no trusted key: that says why
            raise refused[0]
        return None

    def _done(self, res: SyncResult, t0: float) -> SyncResult:
        if any(kind == "keyframe" for kind, _ in res.steps):
            release_freed_memory()
        res.version, res.seconds = self._version, time.perf_counter() - t0
        return res

    def _forget(self) -> None:
        self._version = self._held = self._digest = None

    # ------------------------------------------------------------------ steps
    def _step(self, kind: str, m: Manifest, res: SyncResult, resume: bool = False, feed: _Feed | None = None) -> None:
        parts = _parts(kind, m)
        own = feed is None
        if feed is None:  # a step on its own (finishing an interrupted version)
            feed = _Feed(self, [(kind, m)], res.spans)
        try:
            self._apply_step(kind, m, parts, res, resume, feed)
        finally:
            if own:
                feed.close()

    def _take(self, feed: _Feed, kind: str, m: Manifest, parts) -> list:
        try:
            return self.group.run(lambda: [feed.take(p) for p in parts], f"download the {kind} of version {m.version}")
        except (CorruptObjectError, VersionNotFound, GroupError) as e:
            raise _Unavailable(kind, m, e) from e

    def _apply_step(self, kind: str, m: Manifest, parts, res: SyncResult, resume: bool, feed: _Feed) -> None:
        g = self.group
        stream = self.stream and not g.active
        # default: every object of the version verified before its first write
        blobs = [] if stream else self._take(feed, kind, m, parts)
        if kind == "delta" and not resume:
            summed = self._digest is not None and not self._known_digest(m.definition)
            held = self._digest_under(m.definition)
            if held is None or held.hex() != m.base_digest:
                if summed:  # (summed from the tensors now: they are not the version held, as it was published)
                    self._forget()
                raise BaseMismatchError(f"version {m.version} was built on a state whose digest is {m.base_digest}, "
                                        f"the receiver's is {held.hex() if held else 'unknown'}"
                                        + ("; the next sync rebuilds from a keyframe" if summed else ""))
        before = self._pending
        if self._pending is None or self._pending["version"] != m.version or self._pending["kind"] != kind:
            # one journal per part: its keys are (tensor, chunk start within the sending rank's
            # region), and every rank's part of a sharded tensor has a chunk starting at 0
            # ``claims``: the memory its parts write in place, shared by all of them (two names
            # over one memory, both written, are refused: ``delta/overlap.py``)
            # ``written``: a keyframe's state digest, summed as its chunks are written (_verify)
            self._pending = {"version": m.version, "kind": kind, "manifest": m, "journal": {},
                             "change": ChangeDigest(definition=m.definition), "claims": Claims(),
                             "written": WrittenDigest(definition=m.definition) if kind == "keyframe" else None}
        pend = self._pending
        on_change = self._on_change(pend["change"] if kind == "delta" else None)  # a keyframe's digest: whole
        decoded = pend.setdefault("decoded", {})  # part key -> classes chunks decoded over the group
        opened: dict = {}  # id(blob) -> its DeltaReader: the header parsed once, for gather and apply

        def reader(blob) -> DeltaReader:
            r = opened.get(id(blob))
            if r is None:  # (parsed on its download thread, or here: its error raised here, in order)
                r = opened[id(blob)] = feed.parsed(blob) or DeltaReader.open(blob)
            return r

        def gather(ps, bs):
            # classes chunks of tensors held here only in part: decoded with the whole base chunk
            # gathered over the group, and checked, before the first write (kept for a resume:
            # once some rank wrote, the group no longer holds the base)
            if kind != "delta" or all(p.key in decoded for p in ps):
                return
            if not g.active and all(s.is_full for s in self.shards.values()):
                return  # alone, holding every tensor whole: no chunk is held in part (and planning each
                # entry to find that out was ~5 % of a delta sync of many small tensors)
            t = time.perf_counter()
            got = decode_partial([reader(b) for b in bs], self.tensors, self.shards, g)
            decoded.update({p.key: d for p, d in zip(ps, got.decoded)})
            res.gathered += got.received
            res.spans.add("gather", f"version {m.version}", t)

        def apply_part(p, blob):
            # in a group each rank holds only some tensors (a replicated one is held, and
            # counted in the state digest, by exactly one rank): the rest are other ranks' to
            # apply. A tensor no rank holds still fails the group's digest check.
            t = time.perf_counter()
            r = apply(self.tensors, reader(blob), shards=self.shards, verify=False, resume=True,
                      workers=self.workers, journal=pend["journal"].setdefault(p.key, set()),
                      on_change=on_change, progress=False, held_only=g.active, decoded=decoded.get(p.key),
                      claims=pend["claims"], written=pend["written"])
            res.spans.add("apply", p.key, t)
            res.changed += r.elements_changed

        def apply_parts():
            for p, blob in zip(parts, blobs):
                apply_part(p, blob)
            if kind == "keyframe":  # the keyframe names every tensor of the version: drop the rest
                remove_absent(self.tensors, [reader(b) for b in blobs], shards=self.shards)

        if not stream:
            try:
                # a receiver that takes no new tensors (a model's own weights) refuses a version
                # that does not fit it, all parts at once, before any of them is written
                g.run(lambda: self._refuse_misfits([reader(b) for b in blobs]),
                      f"check version {m.version} fits the receiver")
                gather(parts, blobs)  # collective: every rank, before any writes
            except DcrError:
                self._pending = before  # nothing was written: the receiver is still at its version
                raise
        self._version = None  # from here until verified, the state is "in between"
        if stream:
            # each part applied once it checked out, while the next one downloads; a later part
            # that cannot be had leaves the version pending (journal) and the path is given up.
            # A part of format 3 is applied segment by segment while it still arrives (each
            # chunk checked against its pre-image; the object's sha256 once it is all there)
            # Each part's bytes are let go once it is applied: what is kept is its tensor names
            # (a keyframe's), so a keyframe sync holds the model and the parts in flight, not the
            # model twice
            named: list[str] = []
            # the parts downloading at once are applied at once, as their segments come: on a
            # first sync the parts of a version share the link and arrive together, and taken
            # one at a time the later ones, all there, were applied one after the other after it
            # (issue 25). Each part is its own tensors (its own journal); the workers take the
            # chunks of all of them. Taken, checked and finished in the plan's order as before.
            streaming = _Streaming(self, feed, pend, on_change, res, parts, together=kind == "delta")
            try:
                for p in parts:
                    streamed = streaming.result(p)
                    blob = self._take(feed, kind, m, [p])[0]
                    res.bytes += len(blob)
                    if streamed is not None:
                        # its segments were read and checked as they came: the rest of what opening
                        # the object checks (closing segment, trailer), without parsing it again
                        named += streamed.finish()
                    else:
                        r = opened[id(blob)] = DeltaReader.open(blob)
                        gather([p], [blob])
                        apply_part(p, blob)
                        del opened[id(blob)]
                        named += r.header.names
                        del r
                    del blob
            finally:
                streaming.close()  # no part is written past this step's end
            if kind == "keyframe":
                remove_unnamed(self.tensors, named, shards=self.shards)
        else:
            g.run(apply_parts, f"apply version {m.version}")
            res.bytes += sum(len(b) for b in blobs)
        t = time.perf_counter()
        try:
            self._verify(m, kind, full=resume)
        finally:
            res.spans.add("digest", f"version {m.version}", t)
        res.steps.append((kind, m.version))

    def _on_change(self, digest):
        """What apply reports each written chunk to: the state digest's change (deltas), and the
        caller's ``on_write``."""
        hook = self.on_write
        if hook is None:
            return digest

        def report(name, dtype, global_shape, glob, old, new):
            if digest is not None:
                digest(name, dtype, global_shape, glob, old, new)
            hook(name, glob, new)
        return report

    def _apply_arriving(self, p, arriving: _Arriving, pend: dict, on_change,
                        res: SyncResult) -> SegmentStream | None:
        """Apply a part of format 3 segment by segment as its bytes arrive -> its stream when it
        was all applied so (``finish()`` it once the object checked out), or None: a part of
        format 1 or 2, nothing applied; or bytes that do not read as a delta, the segments before
        them applied: the part is applied once it is all there and checked. The segments' chunks
        go to the workers as one stream (``apply_stream``): a worker goes on to the next
        segment's chunks while the last ones of a segment are written. A download that fails
        leaves what was applied in the journal: ``_take`` raises its error."""
        stream = SegmentStream(arriving.buf, p.key)
        journal = pend["journal"].setdefault(p.key, set())
        first: list[float] = []  # when the first segment was there: the apply span's start

        def segments():
            filled = 0
            while True:
                # woken when the next segment can be there, not at each read of the download
                filled, ended = arriving.wait(stream.wanted(filled) - 1)
                for r in stream.ready(filled):
                    if not first:
                        first.append(time.perf_counter())
                    yield r
                if stream.streamable is False or ended:
                    return

        rep = ApplyReport()
        try:
            apply_stream(self.tensors, segments(), shards=self.shards, workers=self.workers, journal=journal,
                         on_change=on_change, report=rep, claims=pend["claims"], written=pend["written"])
        except DeltaFormatError as e:
            # bytes damaged on the way (a segment's index or a chunk fails its checksum,
            # found before that segment wrote anything) are the download's to retry or
            # report, with the object's sha256: the part is then taken whole, and what was
            # applied already is skipped by its journal
            log.info("nemo-dcr: %s no longer streamed (%s); applied once it is all there and checked", p.key, e)
            return None
        finally:
            with _TALLY:  # parts streamed at once (_Streaming) add up here
                res.changed += rep.elements_changed
            if first:
                res.spans.add("apply", p.key, first[0])
        return None if stream.streamable is False else stream

    def _refuse_misfits(self, readers: list) -> None:
        """Before any write: a version that does not fit a receiver taking no new tensors
        (``delta.apply.refuse_misfits``), all its parts at once. In a group, each rank its own."""
        held = self.group.active
        refuse_misfits(self.tensors, [e for r in readers for e in r.header.tensors
                                      if not held or e.name in self.tensors], self.shards)

    def _verify(self, m: Manifest, kind: str, full: bool = False) -> None:
        """O(changes) for a delta applied in one go; a full recomputation for keyframes and for
        a version finished after an interruption (anything may have happened in between)."""
        pend = self._pending
        if kind == "delta" and not full:
            assert pend is not None and m.base_digest is not None  # _apply_step set it; a delta has a base
            change = pend["change"].total
            if self.group.active:
                change = allreduce_digest(change, self.group.group)
            d = StateDigest.from_hex(m.base_digest, m.definition) + change
        elif kind == "keyframe" and not full:
            d = self._written_digest(pend["written"] if pend is not None else None, m.definition)
            if d.hex() != m.target_digest:
                # (what was written is not all the receiver holds, or not the target)
                d = self._full_digest(m.definition)
        else:
            d = self._full_digest(m.definition)
        if d.hex() != m.target_digest and kind == "delta":
            d = self._full_digest(m.definition)  # incremental accounting can be off after an interruption
        if d.hex() != m.target_digest:
            raise TargetMismatchError(f"after applying version {m.version} the receiver's digest is {d.hex()}, "
                                      f"expected {m.target_digest}; the next sync re-bootstraps")
        self._version, self._held, self._digest, self._pending = m.version, m, d, None

    def _finish_pending(self, res: SyncResult) -> None:
        pend = self._pending
        assert pend is not None  # sync() calls this only for a pending version
        try:
            self._step(pend["kind"], pend["manifest"], res, resume=True)
        except (BaseMismatchError, TargetMismatchError, PartialApplyError, _Unavailable):
            # the interrupted state cannot be completed: start over from the newest keyframe
            self._pending = None
            self._forget()

    # ------------------------------------------------------------------ helpers
    def _fetch(self, part, spans: Spans | None = None, arriving: _Arriving | None = None) -> bytearray | memoryview:
        """The object's bytes, streamed and hashed as they arrive into one buffer of the
        manifest's size (``arriving``'s, which reports how far it is filled), checked against the
        manifest's size and checksum (retried: an object is immutable, so a retry writes the same
        bytes again; never more than ``part.size`` bytes held)."""
        from nemo_dcr.stores import NotFound, StoreError
        spans = spans if spans is not None else Spans()
        arriving = arriving if arriving is not None else _Arriving(part.size)
        buf = arriving.buf
        last = None
        for attempt in range(self.retries + 1):
            t = time.perf_counter()
            try:
                spec = self._speculation
                opened = spec.take(part.key) if spec is not None and attempt == 0 else None
                size, chunks = opened if opened is not None else _open_stream(self.store, part.key)
                try:
                    h, n = checksums.new(part.algo), 0
                    if size == part.size:
                        for b in chunks:
                            if n + len(b) > part.size:
                                n += len(b)
                                break
                            buf[n:n + len(b)] = b
                            h.update(b)
                            n += len(b)
                            arriving.wrote(n)
                            self._bar.update(len(b))
                    else:
                        n = size
                finally:
                    close = getattr(chunks, "close", None)
                    if close is not None:
                        close()
            except NotFound:
                raise VersionNotFound(f"object {part.key} is missing from the store") from None
            except StoreError as e:
                last = f"download failed: {e}"
                spans.add("fetch", part.key, t)
            else:
                spans.add("fetch", part.key, t)
                t = time.perf_counter()
                digest = h.hexdigest() if n == part.size else None
                spans.add("verify", part.key, t)
                if digest == part.checksum:
                    return buf
                last = f"{n}{'+' if n > part.size else ''} bytes" + \
                       (f" with {part.algo} {digest[:16]}..." if digest else "") + \
                       f", manifest says {part.size} bytes, {part.checksum[:16]}..."
            if attempt < self.retries:
                time.sleep(self.backoff * (2 ** attempt))
        raise CorruptObjectError(f"object {part.key} is corrupt or unreadable after {self.retries + 1} attempts: "
                                 f"{last}")

    def _full_digest(self, definition: int) -> StateDigest:
        d = state_contrib(self.tensors, self.shards, definition=definition)
        return allreduce_digest(d, self.group.group) if self.group.active else d

    def _known_digest(self, definition: int) -> str:
        """The verified state's digest text under ``definition``, where it is known without a pass
        over the model (else ``""``, which no manifest's digest equals)."""
        if self._digest is not None and self._digest.definition == definition:
            return self._digest.hex()
        held = self._held if self._version is not None else None
        return held.target_digest if held is not None and held.definition == definition else ""

    def _digest_under(self, definition: int) -> StateDigest | None:
        """The verified state's digest under ``definition`` (None: no verified state). Under
        another definition than the one known, summed whole once, on every rank: a version
        whose publisher moved to format 5 (definition 2) follows one of format 4, and its
        ``base_digest`` is the base state's under definition 2."""
        if self._version is None or self._digest is None:
            return None
        known = self._known_digest(definition)
        if known:
            return StateDigest.from_hex(known, definition)
        self._digest = self._full_digest(definition)
        return self._digest

    def _written_digest(self, written: WrittenDigest | None, definition: int) -> StateDigest:
        """A keyframe's state digest from what its chunks wrote, summed as they were written, where
        that was every element this receiver holds (each rank of a group decides alone, and every
        rank makes the one all-reduce): no pass over the model after the last chunk. Else summed
        whole."""
        held = sum(t.numel() for t in self.tensors.values())
        if written is not None and written.complete and written.elements == held:
            d = written.total
        else:
            d = state_contrib(self.tensors, self.shards, definition=definition)
        return allreduce_digest(d, self.group.group) if self.group.active else d


def _default_name() -> str:
    """``<host>-<pid>``, in the characters a receiver's name may have."""
    host = re.sub(r"[^A-Za-z0-9._:@/+-]", "-", socket.gethostname()).strip("-._:@/+")[:100] or "receiver"
    return f"{host}-{os.getpid()}"


def _open_stream(store, key: str):
    """``store.get_stream`` where the store has one; a duck-typed store (a wrapper offering
    ``get`` alone) is read whole."""
    if getattr(type(store), "get_stream", None) is None:
        data = store.get(key)
        return len(data), iter([data])
    return store.get_stream(key)


def _parts(kind: str, m: Manifest) -> list:
    return m.parts if kind == "delta" else m.keyframe_parts


class _Streaming:
    """The parts of a step applied while they download (``Follower._apply_arriving``). A delta's
    parts: as many at once as the feed downloads at once, each on a standing thread
    (``util/parallel.standing``), their chunks going to the same workers. A keyframe's: one
    after the other, on the caller's thread (each part's dense chunks in flight are its bytes
    again; applied at memory speed, they keep up with their download anyway). ``result(part)``,
    in the plan's order: that part's stream once all of it was applied so, or None (apply it
    once it is taken). ``close`` stops what has not started and waits for what has."""

    def __init__(self, follower: Follower, feed: _Feed, pend: dict, on_change, res: SyncResult, parts: list,
                 together: bool):
        self._f, self._feed, self._pend, self._on_change, self._res = follower, feed, pend, on_change, res
        self._parts = parts
        self._out: dict[int, Future] = {}
        self._loops: list[Future] = []
        if feed.ahead > 1 and together:
            # ``ahead`` loops take the parts in the plan's order, as a pool of that many threads did
            self._out = {id(p): Future() for p in parts}
            self._todo = deque(parts)
            self._lock = threading.Lock()
            self._loops = [standing(self._loop) for _ in range(min(feed.ahead, len(parts)))]

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._todo:
                    return
                p = self._todo.popleft()
            out = self._out[id(p)]
            if not out.set_running_or_notify_cancel():
                continue  # close() cancelled it before it started
            try:
                out.set_result(self._one(p))
            except BaseException as e:  # noqa: BLE001 - raised by result() on the caller's thread
                out.set_exception(e)

    def _one(self, p):
        arriving = self._feed.arriving(p)
        if arriving is None:
            return None
        return self._f._apply_arriving(p, arriving, self._pend, self._on_change, self._res)

    def result(self, p):
        if not self._loops:  # one at a time (without background downloads, None: taken whole)
            return self._one(p)
        return self._out[id(p)].result()

    def close(self) -> None:
        if not self._loops:
            return
        for f in self._out.values():
            f.cancel()
        self._feed.stop_waiting(self._parts)  # a part waiting for its download to start gives up
        wait(self._loops)


class _Feed:
    """The objects of a path's steps, downloaded in the background and handed over in the plan's
    order. Up to ``Follower.prefetch`` objects are downloading or downloaded, not yet taken, at
    once, on that many threads, paced by the link's bandwidth-delay product (``sync/pace.py``):
    the next download starts when the running ones have about one BDP left, so a request's
    round trip overlaps the other downloads instead of adding to them, and on a bandwidth-bound
    link the objects come one after the other at the link's rate, the first one first (prefetch
    0: each object downloaded when it is taken). A download that fails stops further downloads;
    its error is raised by ``take`` of that object."""

    def __init__(self, follower: Follower, steps: list, spans: Spans):
        self._follower = follower
        self._fetch = lambda p, arriving=None: follower._fetch(p, spans, arriving)
        self._parts = [p for kind, m in steps for p in _parts(kind, m)]
        self._index = {id(p): i for i, p in enumerate(self._parts)}
        self._given_up: set = set()  # objects whose arriving() no longer waits (stop_waiting)
        self._ahead = min(follower.prefetch, len(self._parts))
        follower.link.age()
        self.pacer = Pacer(follower.link)
        self._done: dict[int, tuple[bytes | bytearray | memoryview | None, Exception | None]] = {}
        self._arriving: dict[int, _Arriving] = {}  # downloads under way (or done, not yet taken)
        self._next = 0    # the next object to start downloading
        self._taken = 0   # the next object the consumer takes
        self._failed: Exception | None = None
        self._stop = False
        self._cond = threading.Condition()
        # a step that opens its objects whole (not streamed: a group, or ``stream=False``) parses
        # every header before its first write, one after another: 8 parts of 512 entries took
        # ~90 ms after the last download, a fifth of a delta sync. Parsed on the download thread
        # as each object checks out, that overlaps the other downloads and the step before
        self._parse = not (follower.stream and not follower.group.active)
        self._spans = spans
        self._readers: dict[int, tuple] = {}  # id(object) -> (the object, its DeltaReader)
        # on standing threads: a sync that started its own waited ~1 ms per thread on a busy
        # machine before the first download, and again before the first part was applied
        self._tasks = [standing(self._run) for _ in range(self._ahead)]

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._failed) and self._next < len(self._parts) \
                        and (self._next - self._taken >= self._ahead or not self.pacer.ready()):
                    # as many ahead as allowed: wait for the consumer; or the running downloads
                    # have more than a BDP left: wait for their bytes
                    self._cond.wait()
                if self._stop or self._failed or self._next >= len(self._parts):
                    return
                i = self._next
                self._next += 1
                arriving = self._arriving[i] = _Arriving(self._parts[i].size,
                                                         lambda n, i=i: self._received(i, n))
                spec = self._follower._speculation
                # a read sent beside HEAD has its bytes coming already: no round trip to measure
                self.pacer.started(i, self._parts[i].size,
                                   early=spec is not None and spec.asked(self._parts[i].key))
                self._cond.notify_all()
            item: tuple[bytes | bytearray | memoryview | None, Exception | None]
            try:
                item = (self._fetch(self._parts[i], arriving), None)
            except Exception as e:  # handed to the consumer, raised there
                item = (None, e)
            arriving.end()
            with self._cond:
                self.pacer.ended(i)  # (its bytes are in: the next download need not wait for its parse)
                if item[1] is not None:
                    self._done[i] = item
                    if self._failed is None:
                        self._failed = item[1]
                self._cond.notify_all()
            if item[1] is not None:
                continue
            reader = self._parsed_ahead(self._parts[i], item[0])
            with self._cond:
                self._done[i] = item
                if reader is not None:
                    self._readers[id(item[0])] = (item[0], reader)  # (the object held: its id not reused)
                self._cond.notify_all()

    def _received(self, i: int, n: int) -> None:
        with self._cond:
            self.pacer.received(i, n)
            self._cond.notify_all()  # a download waiting for the running ones' bytes looks again

    def _parsed_ahead(self, part, data) -> DeltaReader | None:
        """``data``'s header parsed, where its step opens it whole; None where it does not, or
        where it does not parse: the step opens it again and raises the error where it would."""
        if not self._parse or self._stop:
            return None
        t = time.perf_counter()
        try:
            r = DeltaReader.open(data)
        except Exception:  # (anything: this thread must hand the object over; the step's own parse raises it)
            return None
        self._spans.add("parse", part.key, t)
        return r

    def parsed(self, data) -> DeltaReader | None:
        """The reader of an object taken (``take``) whose header its download thread parsed
        already, once; None otherwise."""
        with self._cond:
            got = self._readers.pop(id(data), None)
        return got[1] if got is not None and got[0] is data else None

    def take(self, part) -> bytes | bytearray | memoryview:
        if not self._tasks:
            return self._fetch(part)
        with self._cond:
            i = self._taken
            if i >= len(self._parts) or self._parts[i] is not part:
                # the consumer follows the plan's order: anything else is a bug here
                raise RuntimeError(f"fetch order broken: expected {self._parts[min(i, len(self._parts) - 1)].key}, "
                                   f"got {part.key}")
            while i not in self._done:
                if self._failed is not None and i >= self._next:
                    raise self._failed  # never started: an earlier download failed
                self._cond.wait()
            data, err = self._done.pop(i)
            self._arriving.pop(i, None)
            self._taken += 1
            self._cond.notify_all()
        if err is not None:
            raise err
        assert data is not None
        return data

    @property
    def ahead(self) -> int:
        """Objects downloading at once (0: each downloaded when it is taken)."""
        return len(self._tasks)

    def arriving(self, part) -> _Arriving | None:
        """An object not yet taken while it downloads (its bytes so far), once its download
        started: None without background downloads, when its download could not start
        (``take`` says why), or once ``stop_waiting`` was called for it."""
        if not self._tasks:
            return None
        with self._cond:
            i = self._index.get(id(part))
            if i is None or i < self._taken:
                raise RuntimeError(f"fetch order broken at {part.key}")
            while i not in self._arriving and i not in self._done:
                if i in self._given_up or (self._failed is not None and i >= self._next):
                    return None
                self._cond.wait()
            return self._arriving.get(i)

    def stop_waiting(self, parts) -> None:
        """Who waits in ``arriving`` for one of ``parts`` whose download has not started returns
        None (a step that ends early; the path's later steps still stream)."""
        with self._cond:
            self._given_up.update(self._index[id(p)] for p in parts)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._done.clear()
            self._cond.notify_all()
        wait(self._tasks)  # a download under way finishes (bounded by the store's timeouts)
        self._done.clear()
        self._readers.clear()


#: downloads at least this large land in a mapping of their own, given back to the system when
#: the object is let go (a heap buffer of that size is kept by the C library's arenas, per fetch
#: thread: a keyframe sync peaked at 1.9x the model, 1.5x with each part let go once applied)
MAPPED_MIN = 1 << 20


class _Arriving:
    """An object downloading into ``buf`` (its size, as the manifest says): how far it is
    filled, and whether the download ended (checked or not: ``_Feed.take`` says). A large
    one's pages are faulted in ahead of the download by a helper thread (``PrefaultedBuffer``)."""

    def __init__(self, size: int, on_wrote=None):
        self.filled = 0
        self._mapped = PrefaultedBuffer(size, written=lambda: self.filled) if size >= MAPPED_MIN else None
        self.buf: bytearray | memoryview = self._mapped.view if self._mapped is not None else bytearray(size)
        self.ended = False
        self._cond = threading.Condition()
        self._on_wrote = on_wrote  # told the bytes of each attempt so far (the feed's pacing)

    def wrote(self, n: int) -> None:
        with self._cond:
            self.filled = max(self.filled, n)
            self._cond.notify_all()
        if self._on_wrote is not None:
            self._on_wrote(n)

    def end(self) -> None:
        with self._cond:
            self.ended = True
            self._cond.notify_all()
        if self._mapped is not None:  # nothing more is written
            self._mapped.stop()

    def wait(self, beyond: int) -> tuple[int, bool]:
        """-> (bytes there, ended) once more than ``beyond`` bytes are there or it ended."""
        with self._cond:
            while self.filled <= beyond and not self.ended:
                self._cond.wait()
            return self.filled, self.ended


class _Fallback(str):
    """A path given up: ``"<kind> <version>: <why>"`` (``.error`` keeps the exception)."""

    error: Exception

    def __new__(cls, what: str, error: Exception):
        s = super().__new__(cls, f"{what}: {type(error).__name__}: {error}")
        s.error = error
        return s


def _no_path(target: Manifest, current: int | None, last) -> Exception:
    if last is not None:
        return last.error  # every path needed an object that cannot be had: say which
    return no_plan(target, current)
