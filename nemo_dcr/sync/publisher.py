"""Trainer side, framework-free: publish a sequence of versions of a (possibly sharded) state.

    pub = Publisher("s3://bucket/run1", keyframe_every=50)
    pub.publish(local_tensors, shards)          # every rank of the trainer's group calls it

Each call diffs the rank's tensors against a private copy of the last *published* state (so
publishing every N steps sends the changes of N steps), uploads one part per rank,
gathers the parts' receipts over the trainer's own process group, and rank 0 commits the version
once every part is durable. A rank that fails or dies before its receipt is gathered leaves no
visible version. The private copy is made once; after each committed version it takes the
changes the diff found (O(changes), ``_Changes``), and a failed publish leaves it as it was.

Pipelined: each object is encoded straight into the store (``Store.open_writer``: S3 parts go
up while the encode runs) and made durable on a background thread while the next one (a
further delta part, the keyframe) is encoded; the commit still comes after every object of
every rank is durable.
``PublishResult.spans`` records each stage (encode, upload, commit) with its start and end.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nemo_dcr.codec import versions as format_versions
from nemo_dcr.codec.format import SEGMENTED
from nemo_dcr.codec.names import KEYFRAME_CHUNK
from nemo_dcr.codec.versions import FORMAT_VERSION
from nemo_dcr.delta import DEFAULT_CHUNK, DEFAULT_LEVEL, diff
from nemo_dcr.delta.changes import OnChange
from nemo_dcr.delta.stats import totals
from nemo_dcr.errors import CommitConflict, DcrError, ManifestError, PublishError, SignatureError, VersionNotFound
from nemo_dcr.state.digest import NAMED, sum_of_all
from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.state.index_map import IndexMap, ShardSpec
from nemo_dcr.state.statedigest import ChangeDigest, StateDigest, state_contrib
from nemo_dcr.sync.follower import Spans
from nemo_dcr.sync.group import Group
from nemo_dcr.sync.speculate import NEXT_META, hint
from nemo_dcr.sync.versions import (
    DEFINITION_2,
    FORMAT,
    HEAD_KEY,
    NEWEST_IN_HEAD,
    PARTS_BLAKE3,
    Head,
    Manifest,
    Part,
    commit,
    head_manifest,
    key_version,
    new_publish_id,
    read_head,
    version_dir,
)
from nemo_dcr.util.gc_pause import pausing
from nemo_dcr.util.memory import release_freed_memory
from nemo_dcr.util.parallel import standing
from nemo_dcr.util.progress import NullProgress, Progress

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nemo_dcr.device.capture import CaptureBase
    from nemo_dcr.device.trainer import DeviceSnapshot
    from nemo_dcr.stores.base import Store
    from nemo_dcr.stores.writer import ObjectWriter

# dense bytes per object of a rank's keyframe: big enough that a part's header and request
# are noise, small enough that encode, upload, download and apply of neighbouring parts overlap
DEFAULT_PART_BYTES = 32 << 20
# a delta's objects cover this many times as many dense bytes: a delta is ~0.2-3 % of them, so
# at part_bytes its objects were ~0.1-1 MB each (a 45M BF16 model four of ~170 KB), and every
# object costs a request and a part thread on each receiver and, through a relay, an upstream
# round trip (docs/results.md, "Format version 3, seventeenth turn"). 8x keeps a part that
# changed whole (a follower holds up to ``prefetch`` parts) at 256 MiB.
DELTA_PART_SCALE = 8
log = logging.getLogger("nemo_dcr.sync")

__all__ = ["Publisher", "PublishResult", "PublishError", "CommitConflict", "snapshot"]


@dataclass
class PublishResult:
    manifest: Manifest
    delta_bytes: int
    keyframe_bytes: int
    changed: int
    elements: int
    seconds: float
    spans: list = field(default_factory=list)  # Span per stage (this rank's), seconds from the start

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def change_rate(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict:
    """A private CPU copy: the caller's tensors may change as soon as we return."""
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def _empty_like(tensors: Mapping[str, torch.Tensor]) -> dict:
    """Contiguous CPU tensors for a snapshot filled later (``diff(copy_into=...)``): allocated,
    not yet touched. Not ``util.memory.host_empty_like``: that keeps the source's strides (the
    fill is by flat ranges) and asks for huge pages, which cost more for a buffer made once."""
    return {k: torch.empty(v.shape, dtype=v.dtype) for k, v in tensors.items()}


def object_checksum_for(name: str | None, format_version: int) -> str:
    """The parts' checksum ``Publisher(object_checksum=name, format_version=...)`` writes,
    checked before anything is written (``ValueError``)."""
    from nemo_dcr.stores.checksums import ALGOS
    if name is None:
        return "blake3" if format_version >= NEWEST_IN_HEAD else "sha256"
    if name not in ALGOS:
        raise ValueError(f"object_checksum {name!r}: one of {', '.join(ALGOS)}")
    if name == "blake3" and format_version < NEWEST_IN_HEAD:
        raise ValueError(f"object_checksum='blake3' needs format_version {NEWEST_IN_HEAD} (its manifests are "
                         f"format {PARTS_BLAKE3}); with format_version {format_version}, receivers of an "
                         f"earlier release follow the store: 'sha256'")
    if name != "blake3" and format_version >= DEFINITION_2:
        # (manifest format 5 is format 4's, BLAKE3 parts included: the formats stay one line)
        raise ValueError(f"format_version {format_version} names each part's blake3 (its manifests are format "
                         f"{DEFINITION_2}, after format {PARTS_BLAKE3}'s); object_checksum={name!r} goes with "
                         f"format_version {DEFINITION_2 - 1} or below (manifest format {NEWEST_IN_HEAD})")
    return name


def default_format(object_checksum: str | None) -> int:
    """The format version written when none is named: ``FORMAT_VERSION``, except with a
    part checksum other than BLAKE3. That choice keeps the store readable by receivers of the
    release before manifest format 4, so it gets the newest version whose manifests they
    read (manifest format 3: delta version 4), not a default they would refuse by its number."""
    if object_checksum is None or object_checksum == "blake3":
        return FORMAT_VERSION
    return min(FORMAT_VERSION, DEFINITION_2 - 1)


def resolve_format(format_version: int | None, object_checksum: str | None) -> tuple[int, str]:
    """The format version and part checksum a publisher writes for a choice by name (None:
    the default, ``default_format``): ``DcrError`` for a version this build does not write,
    ``ValueError`` for a checksum it does not go with, both before anything is written."""
    fv = default_format(object_checksum) if format_version is None else format_versions.version(format_version).number
    return fv, object_checksum_for(object_checksum, fv)


def format_choice(format_version: int | None, object_checksum: str | None) -> dict:
    """``Publisher`` keyword arguments for a format version and part checksum chosen by name
    (``resolve_format``), every error a ``DcrError``. The CLI and the checkpoint publishers take
    the choice this way."""
    try:
        fv, checksum = resolve_format(format_version, object_checksum)
    except ValueError as e:
        raise DcrError(str(e)) from None
    return {"format_version": fv, "object_checksum": checksum}


class Publisher:
    def __init__(self, store: Store | str, *, keyframe_every: int = 0, encoding: str = "auto",
                 level: int = DEFAULT_LEVEL, chunk_elems: int = DEFAULT_CHUNK, workers: int | None = None,
                 retain: int | None = None,
                 group: ProcessGroup | None = None, signer="env", device: str = "off", keep: str = "device",
                 part_bytes: int = DEFAULT_PART_BYTES, delta_part_bytes: int | None = None, max_uploads: int = 4,
                 format_version: int | None = None,
                 object_checksum: str | None = None,
                 trusted_keys=(), allow_unverified_chain: bool = False, progress: bool | None = False):
        """``keyframe_every``: also publish the full state every K versions (0: only the first).
        ``retain``: after each commit, delete versions older than both the newest keyframe and
        the newest ``retain`` versions (None: delete nothing). ``signer``: a
        :class:`~nemo_dcr.sync.signing.Signer` that signs every manifest and HEAD; ``"env"``
        (default): from ``$NEMO_DCR_SIGNING_KEY(_FILE)`` if set; None: unsigned. ``device``:
        "auto" or "on" diffs CUDA tensors on the device against a snapshot kept there
        (``keep="device"``) or in pinned host memory (``keep="pinned"``), and only the compact
        change stream comes to the host (``nemo_dcr/device``; same bytes); "off" (default): the
        host snapshot and the reference encoder. The first publish logs which path runs. Or a
        ``device/capture.DeviceCapture``'s ``base``: each publish is given a job captured on the
        device earlier (the Lightning callback's background publishes).
        ``part_bytes``: a rank's keyframe is split into objects of whole tensors, about this
        many dense bytes each, so that part j+1 encodes while part j uploads and a receiver
        applies part j while part j+1 downloads (0: one object per rank). ``delta_part_bytes``:
        the same for its deltas (None: ``DELTA_PART_SCALE`` (8) times ``part_bytes``, 256 MiB by
        default: a delta's bytes are a small share of the dense bytes it covers, and each object
        costs every receiver a request).
        ``max_uploads``: encoded parts uploading at once (their bytes are held until uploaded).
        ``format_version``: of every delta and keyframe part (``codec/versions.py``; None: the
        default, ``default_format``: 5, state digests under their definition 2 and manifest
        format 5; 4, 3, 2 or 1 while receivers older than format version 5, 4, 3 or 2 still
        follow the store), and of the manifests and HEAD (format 3 from delta version 3: HEAD
        carries the newest manifest).
        ``object_checksum``: the hash each part's receipt names, ``"blake3"`` (manifest format 4
        and 5, ~2.5x faster for the publisher, relays and followers alike) or ``"sha256"``
        (manifest format 3, delta versions 3 and 4; while receivers of an earlier release still
        follow the store: they refuse format 4 by its number; with no ``format_version`` it
        writes version 4). None: ``"blake3"`` from ``format_version`` 3, ``"sha256"`` below it.

        Signed chains: a store whose versions are signed takes only versions signed by a key
        that verifies its chain. Before anything is written, HEAD (and, on a restore, every
        manifest) is checked against the signer's own public key, ``trusted_keys`` (public
        keys: a key rotation's old key) and ``$NEMO_DCR_TRUSTED_KEYS(_FILE)``; an unsigned
        publisher refuses a signed chain. A HEAD that does not verify (a forgery, a replay, an
        unsigned version) is not built on: the publisher continues from its own last version
        if it holds one, else only ``keyframe=True`` publishes (replacing that HEAD). Every
        verifying receiver would refuse what an unsigned or foreign-signed publisher adds, so
        ``allow_unverified_chain=True`` (tests and fault campaigns playing a forger) is the only
        way to do it.

        ``progress``: a bar on stderr over the bytes each publish encodes (None: when stderr is
        a terminal, as the command line does; False, the default: never, as in a trainer)."""
        from nemo_dcr.stores import open_store
        from nemo_dcr.sync.signing import chain_verifier, resolve_signer
        self.store = open_store(store) if isinstance(store, str) else store
        self.signer = resolve_signer(signer)
        self.allow_unverified_chain = bool(allow_unverified_chain)
        self.progress = progress
        self._verifier = chain_verifier(self.signer, trusted_keys)  # None: an unsigned publisher
        self.keyframe_every = keyframe_every
        self.encoding, self.level, self.chunk_elems, self.workers = encoding, level, chunk_elems, workers
        self.retain = retain
        self.part_bytes, self.max_uploads = int(part_bytes), max(1, int(max_uploads))
        self.delta_part_bytes = DELTA_PART_SCALE * self.part_bytes if delta_part_bytes is None \
            else int(delta_part_bytes)
        self.format_version, self.object_checksum = resolve_format(format_version, object_checksum)
        #: the state digest definition of the manifests (and summed tensor digests) written
        self.definition = format_versions.version(self.format_version).definition
        self.group = Group(group)
        self._base: dict | None = None        # the last published snapshot (this rank's tensors)
        self._shards: dict | None = None
        self._head: Head | None = None
        self._manifest: Manifest | None = None  # _head's manifest, as committed or restored here
        self._digest: StateDigest | None = None  # this rank's partial digest of _base (of ``definition``)
        # rank 0: the publish id the last manifest committed here reserved for the version after
        # it (sync/speculate.py: followers read there beside HEAD); used by that version's first
        # attempt alone, so no key is ever written by two publishes
        self._next_id: str | None = None
        # name -> tensor digest of _base[name], as the diff that published it wrote it: _base is
        # private and unchanged since, so the next diff need not hash it again
        self._tensor_digests: dict = {}
        self.device, self.keep = device, keep
        # the device path's snapshot (its tensors are _base), once chosen
        self._dev: DeviceSnapshot | CaptureBase | None = None
        self._dev_chosen = False

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
        first publish). Read-only: it is the base of the next delta, and each publish updates
        these tensors in place (by the changes) where it can."""
        if self._base is None:
            return None
        assert self._shards is not None  # set together with _base
        return self._base, self._shards

    # ------------------------------------------------------------------ publish
    @pausing
    def publish(self, tensors: Mapping[str, torch.Tensor], shards: Mapping[str, ShardSpec] | None = None, *,
                keyframe: bool = False, step: int | None = None, meta: dict | None = None) -> PublishResult:
        """Publish the next version. ``tensors`` are read during this call only (the caller may
        change them once it returns). ``keyframe=True`` also stores the full state; if the last
        published state cannot then be rebuilt from the store (a restarted trainer whose base is
        lost or corrupt), the version is a keyframe alone, without a delta part.

        Every step that can fail on one rank goes through ``Group.run``: a failure anywhere is
        raised alike on every rank (``PublishError`` naming the ranks and their errors for the
        upload, ``CommitConflict`` for a lost race), and nothing is committed."""
        t0 = time.perf_counter()
        spans = Spans(t0)
        g = self.group
        if meta is not None and NEXT_META in meta:
            raise ValueError(f"meta key {NEXT_META!r} is the publisher's own (sync/speculate.py)")
        head, tag, publish_id, version = g.run(lambda: self._reserved(*self._read_head(keyframe)) if g.rank == 0
                                               else None, "read the store's HEAD", src=0)
        kf = keyframe or head is None or (self.keyframe_every > 0 and version % self.keyframe_every == 0)
        local: dict[str, Any] = {}  # what upload() leaves behind: snapshot, shards, digests

        dev = self._device_path(tensors)
        # the host path diffs the caller's tensors in place against its snapshot and brings the
        # snapshot to them after the commit, by the changes (O(changes)), where it can: same
        # tensors (names, dtypes, shapes, shards) on the CPU, continuing from its own last version
        # (during the diff already where the format lets it: _Changes; undone if the publish fails)
        keep = _Changes(self._base, self._shards or {}, early=self.format_version >= SEGMENTED) \
            if not dev and self._base is not None and self._continues(tensors, shards, head) else None
        source = self._keyframe_source(tensors) if kf and head is None and not dev and keep is None else None

        def upload():
            # the device path keeps its own snapshot and diffs the live tensors against it
            local["snap"] = dev.job(tensors) if dev else {k: v.detach() for k, v in tensors.items()} if keep \
                else _empty_like(source) if source is not None else snapshot(tensors)
            local["shards"] = dict(shards or {})
            if head is not None and not _same_head(self._head, head):
                try:  # fresh publisher, or the store moved on; every rank fails alike (Group.run)
                    g.run(lambda: self._restore(head, local["snap"], local["shards"]),
                          f"rebuild version {head.version} from the store")
                except Exception as e:
                    if not keyframe:
                        raise PublishError(f"cannot rebuild version {head.version}, the base of this delta, from the "
                                           f"store ({e}); publish(keyframe=True) publishes the full state without "
                                           "it") from e
                    # a keyframe was asked for and the published state cannot be rebuilt (and
                    # verified) on every rank: publish the keyframe alone, no delta part
                    self._base = self._shards = self._head = self._manifest = self._digest = None
                    self._tensor_digests = {}
            receipt, local["digest"], local["tensor_digests"] = self._upload(
                local["snap"], local["shards"], head, version, publish_id, kf, spans, keep, source)
            return receipt

        try:
            receipts = g.run(upload, f"publishing version {version}", error=PublishError, gather=True,
                             note="no version committed")
            t = time.perf_counter()
            manifest, new_head = g.run(
                lambda: self._commit(receipts, head, tag, version, publish_id, step, meta) if g.rank == 0 else None,
                f"committing version {version}", src=0)
        except BaseException:
            if keep is not None:
                self._undo(keep)
            raise
        if dev:  # the snapshot becomes what was published: O(changes) where the device pass ran
            dev.commit(local["snap"]) if self._base is dev.tensors else dev.reset(local["snap"])
            local["snap"] = dev.tensors
        elif keep is not None:  # likewise on the host: committed, so the changes go into the snapshot
            assert self._base is not None  # keep is made only for a publisher with a snapshot
            keep.commit(local["snap"])
            local["snap"] = self._base
        spans.add("commit", f"version {version}", t)
        if kf:  # a keyframe's dense chunks, freed, stay in the worker threads' arenas
            release_freed_memory()
        self._base, self._shards, self._digest, self._head = local["snap"], local["shards"], local["digest"], new_head
        self._manifest = manifest
        self._tensor_digests = local["tensor_digests"]
        if self.retain is not None:
            from nemo_dcr.sync.retention import prune
            retain = self.retain
            g.run(lambda: prune(self.store, new_head, keep=retain) if g.rank == 0 else None,
                  f"retention after version {version}", src=0)
        return PublishResult(manifest, manifest.delta_bytes(), manifest.keyframe_bytes(), manifest.changed,
                             manifest.elements, time.perf_counter() - t0, spans)

    @staticmethod
    def _keyframe_source(tensors: Mapping[str, torch.Tensor]) -> dict | None:
        """For a keyframe alone (nothing to restore, no delta part), the caller's tensors, which
        its encode reads, copying each chunk into a fresh snapshot while the chunk is in cache,
        rather than a pass over the model into fresh memory before the encode (44 of ~210 ms for
        64M BF16); None (a copy first) where a tensor is not in host memory."""
        if not all(v.device.type == "cpu" for v in tensors.values()):
            return None
        return {k: v.detach() for k, v in tensors.items()}

    def _undo(self, keep: _Changes) -> None:
        """A failed publish: the snapshot goes back to the last published state, or, should
        that fail too, is forgotten (the next publish rebuilds it from the store)."""
        try:
            keep.undo()
        except Exception:
            log.exception("could not take a failed version's changes out of the snapshot; the next publish "
                          "rebuilds the last published state from the store")
            self._base = self._shards = self._head = self._manifest = self._digest = None
            self._tensor_digests = {}

    def _reserved(self, head: Head | None, tag, publish_id: str, version: int):
        """``_read_head``'s answer, under the publish id the last manifest reserved for this
        version where this publisher continues its own chain (else a guess would be wrong)."""
        nxt, self._next_id = self._next_id, None
        if nxt is not None and head is not None and _same_head(self._head, head) and version == head.version + 1:
            publish_id = nxt
        return head, tag, publish_id, version

    def _read_head(self, keyframe: bool):
        """Rank 0 (which signs): HEAD, its tag, a fresh publish id and the version to publish. A
        chain signed for another run is refused here, before the first upload.

        A damaged HEAD (its checksum or format broken in the store) stops every publish with its
        ``ManifestError``, except a keyframe: that replaces HEAD (compare-and-set on the damaged
        bytes) with a keyframe numbered above every version in the store and this publisher's
        own, so that no receiver (nor a verifier that refuses older versions) sees it as a step
        back."""
        try:
            head, tag = read_head(self.store)
        except ManifestError as e:
            if not keyframe:
                raise ManifestError(f"{e}; publish(keyframe=True) replaces it with a new keyframe") from None
            _, tag = self.store.get_with_tag(HEAD_KEY)
            listed = [key_version(k)[0] for k in self.store.list("versions/")]
            top = max([v for v in listed if v is not None] + [self.version if self.version is not None else -1])
            log.warning("nemo-dcr: HEAD is damaged (%s); publishing keyframe version %d in its place", e, top + 1)
            return None, tag, new_publish_id(), top + 1
        if self.signer is not None:
            self.signer.check_continues(head)
        version = 0 if head is None else head.version + 1
        why = None if head is None or self.allow_unverified_chain or _same_head(self._head, head) \
            else self._unverifiable(head)
        if why is None:
            return head, tag, new_publish_id(), version
        if self.signer is None:
            raise SignatureError(f"{why}; a version without this run's signature would stop every receiver that "
                                 "verifies them: publish with the signing key (--signing-key and --namespace, or "
                                 "$NEMO_DCR_SIGNING_KEY_FILE and $NEMO_DCR_NAMESPACE), or to another store")
        assert self._verifier is not None and head is not None  # made with the signer; why is None without HEAD
        if self._head is not None:  # this publisher's own last version is verified: the next one follows it
            log.warning("nemo-dcr: the store's HEAD is not one this publisher can verify (%s); version %d follows "
                        "this publisher's own version %d instead", why, max(version, self._head.version + 1),
                        self._head.version)
            return self._head, tag, new_publish_id(), max(version, self._head.version + 1)
        ours = self._verifies_below(head)
        if not keyframe or not ours:
            raise SignatureError(f"{why}; this publisher does not build on a chain it cannot verify: " + (
                "publish(keyframe=True) (--keyframe) replaces that HEAD with a keyframe" if ours else
                "if the key that signed it is an old key of this run, trust it (trusted_keys / --trusted-key: a "
                "key rotation); else this is the wrong store or the wrong key"))
        listed = [key_version(k)[0] for k in self.store.list("versions/")]
        top = max([v for v in listed if v is not None] + [head.version])
        log.warning("nemo-dcr: the store's HEAD is not one this publisher can verify (%s); publishing keyframe "
                    "version %d in its place", why, top + 1)
        return None, tag, new_publish_id(), top + 1

    def _verifies_below(self, head: Head, tries: int = 8) -> bool:
        """Whether this run's versions are under an unverifiable HEAD (a manifest there verifies:
        the one HEAD's manifest names as its base, else one of the ``tries`` newest others in the
        store): HEAD was put over this run's chain, so a keyframe may replace it. Not so for a
        publisher with the wrong key, which must not replace a good chain."""
        from nemo_dcr.sync.versions import is_manifest_key, read_manifest
        assert self._verifier is not None  # a signing publisher
        below: list = []
        try:
            m = read_manifest(self.store, head.manifest, head.manifest_sha256)
            if m.base_manifest is not None:
                below.append((m.base_manifest, m.base_sha256))
        except DcrError:
            pass
        try:
            keys = [k for k in self.store.list("versions/") if is_manifest_key(k) and k != head.manifest]
        except DcrError:
            keys = []
        below += [(k, None) for k in sorted(keys, key=lambda k: key_version(k)[0] or 0, reverse=True)[:tries]]
        for key, sha in below:
            try:
                self._verifier.check_manifest(read_manifest(self.store, key, sha))
                return True
            except DcrError:
                continue
        return False

    def _unverifiable(self, head: Head) -> str | None:
        """Why this publisher must not extend the chain at ``head`` (None: it may). Unsigned
        publisher: the store holds signed versions. Signing publisher: HEAD fails its
        verifier, or is unsigned over signed versions (an unsigned chain is extended: signing
        starts there, docs/user-guide.md)."""
        from nemo_dcr.sync.signing import holds_signed_versions
        if self.signer is None:
            return holds_signed_versions(self.store, head)
        assert self._verifier is not None  # made with the signer
        if head.signature is None:
            return holds_signed_versions(self.store, head)
        try:
            self._verifier.check_head(head)
        except SignatureError as e:
            return str(e)
        return None

    def _continues(self, tensors: Mapping[str, torch.Tensor], shards, head: Head | None) -> bool:
        """Whether this version's delta is against this publisher's own snapshot, of the same
        CPU tensors (names, dtypes, shapes, shards): then the snapshot follows by the changes."""
        base = self._base
        if base is None or head is None or not _same_head(self._head, head) or dict(shards or {}) != self._shards:
            return False
        return set(tensors) == set(base) and all(
            t.device.type == "cpu" and t.dtype == base[k].dtype and t.shape == base[k].shape
            for k, t in tensors.items())

    def _upload(self, snap, shards, head, version, publish_id, kf, spans: Spans,
                keep: _Changes | None = None, source=None) -> tuple[dict, StateDigest, dict]:
        """Upload this rank's objects -> (receipt, this rank's partial digest of ``snap``, the
        tensor digests of ``snap`` the deltas hold). Each object uploads on a background thread
        while the next one is encoded; every upload has returned (or raised here) before this
        does. ``keep``: also given every change the deltas carry. ``source``: the caller's
        tensors, which a keyframe alone reads, copying them into ``snap`` (empty until then) as
        it encodes them."""
        rank = self.group.rank
        d = version_dir(version, publish_id)
        out: dict[str, Any] = {"parts": [], "keyframe_parts": []}
        meta = {"version": version, "publish_id": publish_id, "rank": rank}
        dev = self._dev
        # the full-state steps (keyframe, first digest) read host copies, one tensor at a time
        host = dev.host_view(snap) if dev else source if source is not None else snap
        uploads = _Uploads(self, spans)
        groups = split_parts(self._base or {}, snap, self.delta_part_bytes)
        # the next version's delta parts, for the hint its manifest carries (_next_names): the
        # same tensors split alike, whatever this version is
        out["next"] = [_part_name("part", rank, j)
                       for j in range(len(split_parts(snap, snap, self.delta_part_bytes)))]
        digests: dict = {}
        dense = sum(t.numel() * t.element_size() for t in snap.values())
        bar = Progress(dense * ((head is not None and self._base is not None) + kf), f"publish v{version}",
                       enabled=self.progress) if self.progress is not False else NullProgress(0, "")
        # format 4, 5: the tensor digests the parts' headers name are this rank's terms of the state
        # digest (``"sdn"``, ``"sdb"``), so it is their sum: O(tensors), with no sum of its own over
        # the changes (a delta) or over the model (the first version)
        summed = format_versions.version(self.format_version).tensor_digest in NAMED
        try:
            if head is not None and self._base is not None:
                # (added, removed, reshaped and re-typed tensors included)
                change = None if summed else ChangeDigest(definition=self.definition)
                on_change = change if keep is None else keep.also(change)
                base, target = dev.views(snap) if dev else (self._base, snap)
                for j, names in enumerate(groups):
                    uploads.encode(out["parts"], f"{d}/{_part_name('part', rank, j)}", f"delta part {j}", j,
                                   lambda w, names=names, j=j: diff(
                                       _only(base, names), _only(target, names), shards=shards,
                                       base_shards=self._shards, encoding=self.encoding, level=self.level,
                                       chunk_elems=self.chunk_elems, workers=self.workers, meta={**meta, "part": j},
                                       on_change=on_change, progress=bar, base_digests=self._tensor_digests,
                                       chunker=dev.chunker if dev else None, format_version=self.format_version,
                                       target_digests=dev.target_digests(snap) if dev else None, out=w,
                                       write_base=keep.wants if keep is not None and keep.early else None),
                                   digests)
                assert self._digest is not None  # set together with _base
                new_digest = None if change is None else self._digest + change.total
            else:
                new_digest = None  # the first version's O(model) digest: after the encode, beside its uploads
            if kf:
                # beside a delta, the tensors' (format 3 to 5) digests are known from it: the delta
                # summed them from the changes, and the keyframe's chunks are not summed again
                known = dict(digests) if head is not None and self._base is not None else None
                for j, names in enumerate(split_parts({}, snap, self.part_bytes)):
                    uploads.encode(out["keyframe_parts"], f"{d}/{_part_name('key', rank, j)}", f"keyframe part {j}",
                                   j, lambda w, names=names, j=j: diff(
                                       {}, _only(host, names), shards=shards, encoding="overwrite", level=self.level,
                                       chunk_elems=min(self.chunk_elems, KEYFRAME_CHUNK), workers=self.workers,
                                       meta={**meta, "part": j},
                                       progress=bar, format_version=self.format_version, out=w,
                                       target_digests=known, copy_into=None if source is None else snap), digests)
            if new_digest is None and summed:
                new_digest = _summed_state(snap, digests, self.definition)
            if new_digest is None:
                # the last objects are still being made durable (fsync, CompleteMultipartUpload)
                # on their threads: this pass over the model runs meanwhile
                t = time.perf_counter()
                new_digest = state_contrib(host, shards, definition=self.definition)
                spans.add("digest", f"version {version}", t)
        except BaseException:
            uploads.join(quiet=True)  # no upload left running past a failed publish
            bar.close()
            raise
        uploads.join()  # raises the first upload's error, after every upload ended
        bar.close()
        for k in ("parts", "keyframe_parts"):  # uploads finish in any order; the manifest lists parts in order
            out[k] = [p for _, p in sorted(out[k], key=lambda x: x[0])]
        out["digest"] = new_digest.hex()
        if head is not None and self._base is not None:
            assert self._digest is not None
            out["base"] = self._digest.hex()  # (the base manifest's digest may be of another definition: _commit)
        return out, new_digest, digests

    def _finish(self, w: ObjectWriter, header: dict) -> dict:
        """Make an encoded object durable in the store; its receipt, from the writer's count and
        hash of the bytes written and the header's counts (nothing is read back)."""
        w.commit()
        elements, changed, dense = totals(header)
        return Part.of(w.algo, w.checksum, rank=self.group.rank, key=w.key, size=w.size,
                       changed=changed, elements=elements, dense_bytes=dense).__dict__

    def _manifest_format(self) -> int:
        """Format-3 deltas go with format-3 manifests: HEAD carries the manifest, so a follower
        has the part list with HEAD (a reader of format 2 refuses both); format 4 when the parts'
        checksums are BLAKE3 (a reader of format 3 refuses it by its number); format 5 with
        format-5 deltas: its state digests are of definition 2 (a reader of format 4 refuses it)."""
        if self.format_version < NEWEST_IN_HEAD:
            return FORMAT
        if self.definition == 2:
            return DEFINITION_2
        return PARTS_BLAKE3 if self.object_checksum == "blake3" else NEWEST_IN_HEAD

    def _commit(self, results, head, tag, version, publish_id, step, meta=None) -> tuple[Manifest, Head]:
        """Rank 0: the manifest from every rank's receipt, then HEAD by compare-and-set."""
        try:
            total = StateDigest.zero(self.definition)
            for r in results:
                total = total + StateDigest.from_hex(r["digest"], self.definition)
            base = self._base_manifest(head, keyframe=all(r["keyframe_parts"] for r in results))
            base_digest = base.target_digest if base else None
            if base is not None and base.definition != self.definition:
                # the first version of format 5 after format 4 (or back): its base_digest is the
                # base state's under this manifest's definition, which every rank summed (_restore);
                # a keyframe with no delta into it (no rank holds the base: a publisher that could
                # not rebuild it) names none, as no digest of another definition is written
                if all("base" in r for r in results):
                    b = StateDigest.zero(self.definition)
                    for r in results:
                        b = b + StateDigest.from_hex(r["base"], self.definition)
                    base_digest = b.hex()
                elif not any(r["parts"] for r in results):
                    base_digest = None
                else:
                    raise PublishError(f"version {version}'s base, version {base.version}, has state digests of "
                                       f"definition {base.definition}, and not every rank holds it to sum it again")
            nxt = new_publish_id()
            m = Manifest(
                version=version, publish_id=publish_id, target_digest=total.hex(),
                base_version=head.version if base and head else None,
                base_manifest=head.manifest if base and head else None,
                base_digest=base_digest, base_sha256=base.sha256 if base else None,
                parts=[Part(**p) for r in results for p in r["parts"]] if base else [],
                keyframe_parts=[Part(**p) for r in results for p in r["keyframe_parts"]],
                encoding={"encoding": self.encoding, "level": self.level, "chunk_elems": self.chunk_elems},
                world_size=self.group.world_size, step=step,
                meta={**(meta or {}), NEXT_META: hint(nxt, _next_names(results))},
                format=self._manifest_format())
            new_head = commit(self.store, m, head, tag, signer=self.signer)
            self._next_id = nxt
            if self._verifier is not None:  # remembered: an older HEAD replayed later is refused
                self._verifier.check_head(new_head)
            return m, new_head
        except (CommitConflict, PublishError):
            raise
        except Exception as e:
            raise PublishError(f"commit failed: {type(e).__name__}: {e}") from e

    def _base_manifest(self, head: Head | None, keyframe: bool) -> Manifest | None:
        """The manifest of the version this one follows (None for the first). The one this
        publisher committed or restored is used as it is, so a damaged or lost copy in the store
        does not stop the publisher that wrote it. Otherwise it is read from the store; when it
        is unreadable there, a keyframe is committed without a base (its delta parts are left
        out: nothing can be checked against the base) and anything else fails with a
        ``PublishError`` that says so."""
        if head is None:
            return None
        known = self._manifest
        if known is not None and known.key == head.manifest and known.sha256 == head.manifest_sha256:
            return known
        try:
            return head_manifest(self.store, head)
        except (ManifestError, VersionNotFound) as e:
            if not keyframe:
                raise PublishError(f"the manifest of version {head.version}, the base of this one, is unreadable "
                                   f"({e}); publish(keyframe=True) commits a keyframe without it") from None
            log.warning("nemo-dcr: the base manifest of version %d is unreadable (%s); committing a keyframe "
                        "without a base link", head.version + 1, e)
            return None

    def _device_path(self, tensors):
        """The device path's snapshot, when it runs (chosen, and logged, at the first publish).
        ``device`` may also be one given whole: ``device/capture.DeviceCapture.base`` (the
        callback's jobs captured on the device)."""
        if not isinstance(self.device, str):
            self._dev = self.device
        elif not self._dev_chosen and self.device != "off":
            from nemo_dcr.device.trainer import DeviceSnapshot, choose
            self._dev_chosen = True
            if choose(self.device, tensors):
                self._dev = DeviceSnapshot(self.keep)
        return self._dev

    def _restore(self, head: Head, like: dict, shards: dict) -> None:
        """Rebuild this rank's part of the published state at ``head`` from the store."""
        from nemo_dcr.sync.follower import Follower
        # Seed only what the keyframe cannot create: a tensor held in a group (where each rank
        # applies the tensors it holds) or a shard. A single rank starts empty, so the published
        # state is rebuilt with exactly its own tensor set, dtypes and shapes, not the new
        # snapshot's (tensors added, removed, reshaped or re-typed since then).
        tensors = {k: torch.zeros_like(v, device="cpu") for k, v in like.items()
                   if self.group.active or (k in shards and not shards[k].is_full)}
        # a signed chain is rebuilt through the publisher's own verifier: nothing forged becomes its base
        verifier = self._verifier if head.signature is not None and self._verifier is not None \
            and not self.allow_unverified_chain else "env"
        f = Follower(self.store, tensors, shards, group=self.group.group, workers=self.workers, verifier=verifier)
        f.sync(head.version, head=head)
        m = f.manifest
        assert m is not None and m.version == head.version  # sync(version) holds it verified, or raised
        # alone, this rank's digest is the whole state's, which the sync checked against the
        # manifest: not summed again (an O(model) pass); in a group each rank sums its own part
        # (under this publisher's definition: a store of format 4 published on in format 5 is summed once)
        self._digest = StateDigest.from_hex(m.target_digest, m.definition) \
            if not self.group.active and m.definition == self.definition \
            else state_contrib(tensors, shards, definition=self.definition)
        if self._dev is not None:  # the rebuilt base goes where the device path keeps it
            self._dev.reset(tensors, like)
            tensors = self._dev.tensors
        self._base, self._shards, self._head, self._manifest = tensors, shards, head, f.manifest
        self._tensor_digests = {}  # rebuilt, not published from here: hashed by the next diff


class _Changes:
    """The changes of one version's diff (its ``on_change`` calls, from the worker threads),
    written into the publisher's snapshot so that it becomes the published state in O(changes)
    instead of a copy of the model.

    Where the diff reads each base chunk only before it reports the chunk's changes (format 3:
    the base's tensor digests are summed before the chunks, ``delta/diff.py``; ``early``), each
    chunk's changes go into the snapshot at once: the diff writes them (its ``write_base``:
    ``wants``) as its encoder reads them, before it reports them. Their old bits are kept, and
    ``undo`` (a failed publish) writes them back. Otherwise the new bits are kept and
    written at ``commit``. Either way a failed publish leaves the snapshot the base of the next
    delta. Past ``MAX_SHARE`` of the snapshot's elements (a version that changed most of them:
    the changes would take more memory than the copy) what was written is undone, the changes
    are dropped as they come, and ``commit`` copies the snapshot whole from the published
    tensors instead."""

    MAX_SHARE = 1 / 8  # an index (int32 where it fits) and the bits per change: 6-10 bytes against 2 of a BF16 copy

    def __init__(self, base: Mapping[str, torch.Tensor], shards: Mapping[str, ShardSpec], early: bool):
        """``base``: the snapshot, the diff's base, sharded as ``shards``; ``early``: the diff
        reads no base chunk after reporting its changes, so they go into ``base`` at once: the
        diff is given ``write_base=self.wants`` and writes them (a segmented delta's)."""
        self.limit = int(sum(t.numel() for t in base.values()) * self.MAX_SHARE)
        self.kept: list = []   # (name, local index, bits): the old bits when early, else the new
        self.count = 0
        self.whole = False  # copy the snapshot whole at the commit
        self._base = base
        self._shards = shards
        self.early = early
        self._lock = threading.Lock()

    def wants(self) -> bool:
        """The diff's ``write_base``: write a chunk's changes into the snapshot? (Not once it is
        to be copied whole.) An answer read while another chunk's report turns that on is made
        good by that chunk's own report (``__call__``)."""
        return not self.whole

    def also(self, then: OnChange | None) -> OnChange:
        """An ``on_change`` that keeps the changes and tells ``then`` of them (if not None)."""
        def both(name, dtype, global_shape, global_idx, old, new):
            if then is not None:
                then(name, dtype, global_shape, global_idx, old, new)
            self(name, global_idx, old, new)
        return both

    def _local(self, name: str, global_idx: torch.Tensor) -> torch.Tensor:
        spec = self._shards.get(name)
        # (the diff's changes of the snapshot's own shard: every index is held)
        return global_idx if spec is None else IndexMap(spec).held_to_local(global_idx)

    def __call__(self, name: str, global_idx: torch.Tensor, old: torch.Tensor | None,
                 new: torch.Tensor | None) -> None:
        with self._lock:
            self.count += int(global_idx.numel())
            if self.whole or new is None or old is None or self.count > self.limit:
                # (None: a removed, added or re-typed tensor; a publisher that continues has none)
                if not self.whole:
                    self._undo()
                    self.whole = True
                if self.early and new is not None and old is not None:
                    # the diff wrote this chunk if it asked before the switch, else its old
                    # bits are there already: either way they are written back
                    FlatAccess(self._base[name]).scatter(self._local(name, global_idx), old)
                return
            local = self._local(name, global_idx)
            # kept in int32 where the tensor allows (10 -> 6 bytes per change held), and the
            # diff's gathered copies of the bits (not views)
            self.kept.append((name, local.to(torch.int32) if self._base[name].numel() < 1 << 31 else local,
                              old if self.early else new))

    def _undo(self) -> None:
        if self.early:
            for name, local, old in self.kept:
                FlatAccess(self._base[name]).scatter(local.long(), old)
        self.kept = []

    def undo(self) -> None:
        """The publish failed: the snapshot is the last published state again."""
        with self._lock:
            self._undo()

    def commit(self, published: Mapping[str, torch.Tensor]) -> None:
        """The version is committed: bring the snapshot to it (``published``: its tensors)."""
        with self._lock:
            if self.whole:
                for name, t in self._base.items():
                    t.copy_(published[name])
            elif not self.early:
                for name, local, new in self.kept:
                    FlatAccess(self._base[name]).scatter(local.long(), new)
            self.kept = []


def _summed_state(snap: Mapping[str, torch.Tensor], digests: Mapping[str, str], definition: int) -> StateDigest:
    """This rank's part of the state digest of ``snap`` from its tensors' ``"sdn"`` (``"sdb"``)
    digests (the parts' headers name one for every tensor the rank publishes): their sum, by the
    digest's definition (docs/format.md, "Digests")."""
    return sum_of_all((digests[name] for name in snap), definition)


def target_digests(header: dict) -> dict:
    """name -> target tensor digest of every tensor a delta (its header, as ``diff`` returned
    it) leaves in place."""
    return {e["name"]: e["target_digest"] for e in header["tensors"] if e["kind"] != "removed"}


class _Uploads:
    """This rank's objects: each encoded straight into its store object (``open_writer``: a
    local temporary, an S3 multipart upload, streaming while the encode runs), then made durable
    on a standing thread (``util/parallel.standing``: none started per publish) while the next
    one encodes; at most ``Publisher.max_uploads`` objects written or finishing at once (a store
    that cannot stream holds their bytes in memory)."""

    def __init__(self, pub: Publisher, spans: Spans):
        self.pub, self.spans = pub, spans
        self.tasks: list[Future] = []
        self.errors: list[BaseException] = []
        self.room = threading.BoundedSemaphore(pub.max_uploads)

    def encode(self, into: list, key: str, what: str, order: int, encode, digests: dict) -> None:
        """``encode(writer) -> header`` into the object ``key``, then its upload finished on a
        thread (its receipt into ``into``); the target digests the header names into ``digests``."""
        from nemo_dcr.stores.writer import open_writer
        self.room.acquire()
        if self.errors:  # an upload failed: encode no more
            self.room.release()
            raise self.errors[0]
        t = time.perf_counter()
        try:
            w = open_writer(self.pub.store, key, self.pub.object_checksum)
        except BaseException:
            self.room.release()
            raise
        try:
            header = encode(w)
        except BaseException:
            w.abort()
            self.room.release()
            raise
        self.spans.add("encode", what, t)
        digests.update(target_digests(header))  # the next version's base digests, known now

        def run():
            try:
                into.append((order, self.pub._finish(w, header)))
                self.spans.add("upload", key, t)  # streamed from the encode's start to durable
            except BaseException as e:  # raised by join() on the publishing thread
                w.abort()
                self.errors.append(e)
            finally:
                self.room.release()

        self.tasks.append(standing(run))

    def join(self, quiet: bool = False) -> None:
        wait(self.tasks)
        if self.errors and not quiet:
            raise self.errors[0]


def split_parts(base: Mapping, target: Mapping, part_bytes: int) -> list[list[str]]:
    """The tensor names of ``base`` and ``target`` (sorted, as a delta lists them) in groups of
    whole tensors of about ``part_bytes`` dense bytes of the target each (a removed tensor
    counts nothing; one larger tensor is a group of its own). ``part_bytes`` <= 0: one group."""
    names = sorted(set(base.keys()) | set(target.keys()))
    if part_bytes <= 0:
        return [names]
    groups: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for n in names:
        t = target.get(n) if n in target else None
        b = t.numel() * t.element_size() if t is not None else 0
        if cur and size + b > part_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    return groups + [cur] if cur or not groups else groups


def _only(tensors: Mapping, names: list) -> dict:
    return {n: tensors[n] for n in names if n in tensors}


def _part_name(kind: str, rank: int, j: int) -> str:
    """``part-00003.dcr`` for a rank's first part (the name of a one-part rank), then
    ``part-00003.1.dcr``, ``part-00003.2.dcr``..."""
    return f"{kind}-{rank:05d}.dcr" if j == 0 else f"{kind}-{rank:05d}.{j}.dcr"


def _next_names(results: list) -> list[str]:
    """The names of the next version's delta parts, as far as they are known now: each rank's
    tensors as they are, split as its next delta will split them (``_upload``), rank by rank
    as the manifest lists them."""
    return [name for r in results for name in r["next"]]


def _same_head(a: Head | None, b: Head) -> bool:
    return a is not None and a.version == b.version and a.manifest == b.manifest \
        and a.manifest_sha256 == b.manifest_sha256
