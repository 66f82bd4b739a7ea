"""Versions: manifests, the head pointer and the joint commit.

Store layout (keys relative to the store's root):

    HEAD                                          {"version", "manifest", "keyframe": {...}}
    versions/<v:012d>/<publish id>/part-<r>[.<j>].dcr   delta parts per publishing rank (base v-1 -> v)
    versions/<v:012d>/<publish id>/key-<r>[.<j>].dcr    keyframe parts (full state), on keyframe versions
    (a rank's objects split by whole tensors, ``Publisher(part_bytes=, delta_part_bytes=)``; j from 1 after the first)
    versions/<v:012d>/<publish id>/manifest.json  the version's manifest

Objects go first, the manifest next, and the version becomes visible only when HEAD moves to it
by an atomic compare-and-set (``put_if_match`` / ``put_if_absent``). Every publish writes under a
fresh publish id, so a publisher that loses a race for a version never touches the winner's
objects; its own are orphans that retention removes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from nemo_dcr.errors import CommitConflict, ManifestError, SignatureError, VersionNotFound
from nemo_dcr.stores.checksums import ALGOS as _CHECKSUMS

if TYPE_CHECKING:
    from nemo_dcr.stores.base import Store

__all__ = ["HEAD_KEY", "FORMAT", "NEWEST_IN_HEAD", "PARTS_BLAKE3", "DEFINITION_2", "CommitConflict", "VersionNotFound",
           "ManifestError", "Part", "Manifest", "Head",
           "new_publish_id", "version_dir", "read_head", "read_manifest", "walk", "manifest_at", "commit", "plans",
           "no_plan", "locate", "Found", "canonical_sha256", "is_manifest_key", "is_store_key", "head_manifest"]

log = logging.getLogger("nemo_dcr.sync")

HEAD_KEY = "HEAD"
FORMAT = 2          # written; 2 = with checksums (see docs/design.md, "Integrity of manifests and HEAD")
NEWEST_IN_HEAD = 3  # written with format-3 deltas: HEAD carries its manifest (one round trip to the parts)
PARTS_BLAKE3 = 4    # format 3, each part's checksum BLAKE3 where it was SHA-256 (stores/checksums.py)
#: format 4, its state digests (``target_digest``, ``base_digest``) of the state digest's definition 2
#: (written with format-5 deltas; a reader of format 4 refuses it by its number rather than
#: report every version's digest as a wrong state)
DEFINITION_2 = 5
_READABLE = (1, 2, 3, 4, 5)  # 1: stores written before checksums, read unverified


def _canonical(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def canonical_sha256(d: dict) -> str:
    """sha256 of ``d``'s canonical JSON (sorted keys, no spaces, ASCII; NaN refused)."""
    return hashlib.sha256(_canonical(d)).hexdigest()


# What a manifest or HEAD may name, checked when it is parsed: a key from the store's own layout,
# never one a crafted object could point outside it or at another version's objects with.
_PUBLISH_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_MANIFEST_KEY = re.compile(r"versions/(\d{12,})/([A-Za-z0-9][A-Za-z0-9_-]{0,127})/manifest\.json")
_PART_NAME = re.compile(r"(part|key)-\d{5,}(\.\d+)?\.dcr")  # rank, then the part index past the first
_HEX256 = re.compile(r"[0-9a-f]{64}")


def _uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


_OBJECT_KEY = re.compile(r"versions/\d{12,20}/[A-Za-z0-9][A-Za-z0-9_-]{0,127}/"
                         r"(manifest\.json|(part|key)-\d{5,9}(\.\d{1,9})?\.dcr)")


def is_store_key(key) -> bool:
    """Whether ``key`` is one of the store's own layout (what readers ever ask for): HEAD, a
    version's manifest or one of its parts. A relay forwards nothing else upstream."""
    return isinstance(key, str) and (key == HEAD_KEY or _OBJECT_KEY.fullmatch(key) is not None)


def is_manifest_key(key, version: int | None = None) -> bool:
    """Whether ``key`` is a manifest's key in the store layout (of ``version``, when given)."""
    m = _MANIFEST_KEY.fullmatch(key) if isinstance(key, str) else None
    return m is not None and (version is None or int(m.group(1)) == version)


def _check_manifest_key(key, version, what: str) -> None:
    if not is_manifest_key(key, version):
        raise ValueError(f"{what} {key!r} is not the key of version {version!r}'s manifest")


def _sealed(d: dict, fmt: int, what: str) -> dict:
    """Check and strip the checksum of a parsed object (format 2), or make sure a format-1
    object has none (a one-byte edit of the format number must not switch the check off)."""
    checksum = d.pop("checksum", None)
    if fmt == 1:
        if checksum is not None:
            raise ValueError("a format-1 object carries a checksum")
        return d
    if not isinstance(checksum, str):
        raise ValueError("no checksum")
    if hashlib.sha256(_canonical(d)).hexdigest() != checksum:
        raise ManifestError(f"{what}: checksum mismatch: the object was altered or damaged in the store")
    return d


def _shallow(obj) -> dict:
    """``obj``'s fields by name, the values themselves: every caller serialises the result
    (canonical JSON, ``to_bytes``) and changes no nested value. ``dataclasses.asdict`` deep-copied
    each part and dict on the way: ``Manifest.sha256`` took 50.8 us with it, 14.6 without, and a
    delta sync makes three (docs/results.md, "a manifest's identity without a deep copy")."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _fields(obj, signed: bool) -> dict:
    d = _shallow(obj)
    if not signed or d["signature"] is None:
        del d["signature"]
    for k in ("parts", "keyframe_parts"):
        if k in d:
            d[k] = [p.stored() for p in getattr(obj, k)]
    return d


def new_publish_id() -> str:
    return f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}"


def version_dir(version: int, publish_id: str) -> str:
    return f"versions/{version:012d}/{publish_id}"


@dataclass
class Part:
    """Receipt of one uploaded object: its size and checksum, ``sha256`` (manifest formats 1-3)
    or ``blake3`` (format 4); exactly one is set, and only the one set is stored."""

    rank: int
    key: str
    size: int
    sha256: str | None = None
    changed: int = 0
    elements: int = 0
    dense_bytes: int = 0
    blake3: str | None = None

    @classmethod
    def of(cls, algo: str, checksum: str, **fields) -> Part:
        """A part whose checksum ``checksum`` is ``algo``'s (``stores/checksums.py``)."""
        if algo not in _CHECKSUMS:
            raise ValueError(f"unknown object checksum {algo!r}")
        fields[algo] = checksum
        return cls(**fields)

    @property
    def algo(self) -> str:
        """The algorithm of the part's checksum: ``"blake3"`` or ``"sha256"``."""
        return "blake3" if self.blake3 is not None else "sha256"

    @property
    def checksum(self) -> str:
        """The part's checksum (hex), as the manifest records it."""
        c = self.blake3 if self.blake3 is not None else self.sha256
        assert c is not None  # check() refuses a part with neither
        return c

    def check(self, directory: str, fmt: int) -> None:
        """A parsed part must lie in its version's own directory, with sane numbers and the
        checksum its manifest's format names (``fmt``)."""
        if not (isinstance(self.key, str) and self.key.startswith(directory + "/")
                and _PART_NAME.fullmatch(self.key[len(directory) + 1:])):
            raise ValueError(f"part key {self.key!r} is not an object of {directory}")
        if not all(_uint(x) for x in (self.rank, self.size, self.changed, self.elements, self.dense_bytes)):
            raise ValueError(f"part {self.key}: rank and sizes must be non-negative integers")
        # one checksum, of the format's algorithm: a part that named both, or the other one,
        # would let an edit choose which a reader checks
        want, other = ("blake3", "sha256") if fmt >= PARTS_BLAKE3 else ("sha256", "blake3")
        if getattr(self, other) is not None:
            raise ValueError(f"part {self.key}: a format-{fmt} manifest names each part's {want}, not its {other}")
        c = getattr(self, want)
        if not isinstance(c, str) or not _HEX256.fullmatch(c):
            raise ValueError(f"part {self.key}: {want} must be 64 lowercase hex digits")

    def stored(self) -> dict:
        """The part as its manifest stores it: the checksum it has, not the other's ``null``
        (a format 1-3 part's bytes are those it always had)."""
        d = _shallow(self)
        for algo in _CHECKSUMS:
            if d[algo] is None:
                del d[algo]
        return d


@dataclass
class Manifest:
    version: int
    publish_id: str
    target_digest: str                    # StateDigest hex of the whole state at this version
    base_version: int | None = None       # None: no delta parts (the first version)
    base_manifest: str | None = None      # key of the base version's manifest
    base_digest: str | None = None
    parts: list = field(default_factory=list)           # delta parts (base -> this version)
    keyframe_parts: list = field(default_factory=list)  # full state, on keyframe versions
    encoding: dict = field(default_factory=dict)
    world_size: int = 1
    step: int | None = None
    meta: dict = field(default_factory=dict)      # free-form (the CLI keeps the file layout here)
    # to the millisecond: every digit then counts (HEAD carries the manifest from format 3, and
    # one edited digit of a 17-digit float can parse to the same number, passing HEAD's checksum)
    created: float = field(default_factory=lambda: round(time.time(), 3))
    format: int = FORMAT
    base_sha256: str | None = None        # the base manifest's sha256 (format 2): links are checked
    signature: dict | None = None         # the publisher's signature (nemo_dcr.sync.signing); None: unsigned

    @property
    def key(self) -> str:
        return f"{version_dir(self.version, self.publish_id)}/manifest.json"

    def fields(self, signed: bool = True) -> dict:
        """The stored fields (without the checksum); ``signed=False``: without the signature
        too, the body a signature covers. An unsigned object has no ``signature`` field, so its
        bytes and identity are those of a store written before signing existed."""
        return _fields(self, signed)

    @property
    def sha256(self) -> str:
        """The manifest's identity: sha256 of its canonical body, signature included (stored in
        it as ``checksum``, and recorded by HEAD and by the next version's ``base_sha256``)."""
        return canonical_sha256(self.fields())

    @property
    def definition(self) -> int:
        """The definition (``statedigest.DEFINITIONS``) of the state digests it holds."""
        return 2 if self.format >= DEFINITION_2 else 1

    @property
    def is_keyframe(self) -> bool:
        return bool(self.keyframe_parts)

    @property
    def kind(self) -> str:
        """``delta``, ``keyframe`` (the full state alone) or ``delta+keyframe``."""
        if not self.parts:
            return "keyframe"
        return "delta+keyframe" if self.keyframe_parts else "delta"

    @property
    def elements(self) -> int:
        """Elements of the whole state (from the delta parts, or the keyframe's)."""
        return sum(p.elements for p in self.parts) or sum(p.elements for p in self.keyframe_parts)

    @property
    def changed(self) -> int:
        """Elements the delta changed (0 for a version without a delta)."""
        return sum(p.changed for p in self.parts)

    @property
    def dense_bytes(self) -> int:
        """Bytes of the whole state, uncompressed."""
        return sum(p.dense_bytes for p in self.parts) or sum(p.dense_bytes for p in self.keyframe_parts)

    @property
    def change_rate(self) -> float | None:
        return self.changed / self.elements if self.parts and self.elements else None

    def delta_bytes(self) -> int:
        return sum(p.size for p in self.parts)

    def keyframe_bytes(self) -> int:
        return sum(p.size for p in self.keyframe_parts)

    def to_bytes(self) -> bytes:
        d = self.fields()
        if self.format != 1:
            d["checksum"] = canonical_sha256(d)
        return json.dumps(d, sort_keys=True, indent=1).encode()

    def check_links(self) -> None:
        """Every key the manifest names is one of the store's own layout: its parts in its own
        version's directory, its base link a manifest key of ``base_version`` (older than this
        one). A crafted manifest cannot make a reader touch anything else (ValueError)."""
        d = version_dir(self.version, self.publish_id)
        for p in (*self.parts, *self.keyframe_parts):
            p.check(d, self.format)
        if self.base_version is not None or self.base_manifest is not None:
            if not isinstance(self.base_version, int) or not _uint(self.base_version) \
                    or self.base_version >= self.version:
                raise ValueError(f"base version {self.base_version!r} of version {self.version}")
            _check_manifest_key(self.base_manifest, self.base_version, "base manifest")
        if self.signature is not None and not isinstance(self.signature, dict):
            raise ValueError("signature must be an object")

    @classmethod
    def from_bytes(cls, data: bytes, key: str = "<manifest>", sha256: str | None = None) -> Manifest:
        """Parse and check a manifest; ``sha256``: the identity its referrer recorded for it."""
        try:
            d = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise ManifestError(f"{key}: not a valid nemo-dcr manifest ({e})") from None
        return cls.from_stored(d, key, sha256)

    def stored(self) -> dict:
        """The stored object as a dict (its fields and checksum): what HEAD carries from format 3."""
        return json.loads(self.to_bytes())

    @classmethod
    def from_stored(cls, d, key: str = "<manifest>", sha256: str | None = None) -> Manifest:
        """:meth:`from_bytes` of an object already parsed from JSON (a copy is checked)."""
        try:
            if not isinstance(d, dict):
                raise ValueError("not an object")
            d = dict(d)
            if d.get("format") not in _READABLE:
                raise ManifestError(f"{key}: manifest format {d.get('format')!r} is not supported")
            d = _sealed(d, d["format"], key)
            d["parts"] = [Part(**p) for p in d["parts"]]
            d["keyframe_parts"] = [Part(**p) for p in d["keyframe_parts"]]
            m = cls(**d)
            if not _uint(m.version) or not isinstance(m.publish_id, str) or not _PUBLISH_ID.fullmatch(m.publish_id):
                raise ValueError("version/publish_id")
            if m.parts and (m.base_version is None or m.base_manifest is None or m.base_digest is None):
                raise ValueError("delta parts without a base")
            if not m.parts and not m.keyframe_parts:
                raise ValueError("no parts")
            m.check_links()
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise ManifestError(f"{key}: not a valid nemo-dcr manifest ({e})") from None
        if m.key != key and key != "<manifest>":
            raise ManifestError(f"{key}: manifest names itself {m.key}")
        if sha256 is not None and m.sha256 != sha256:
            raise ManifestError(f"{key}: not the manifest its referrer recorded (sha256 {m.sha256[:16]}..., "
                                f"expected {sha256[:16]}...): altered, or replaced by another publish")
        return m


@dataclass
class Head:
    version: int
    manifest: str
    keyframe_version: int
    keyframe_manifest: str
    manifest_sha256: str | None = None    # the manifest's identity (None only in format-1 stores)
    keyframe_sha256: str | None = None
    format: int = FORMAT
    signature: dict | None = None         # the publisher's signature (nemo_dcr.sync.signing); None: unsigned
    # format 3: the stored manifest HEAD names (Manifest.stored()), so a follower has it with HEAD
    newest: dict | None = None

    def fields(self, signed: bool = True) -> dict:
        """As :meth:`Manifest.fields`: no ``signature`` field when unsigned (or ``signed=False``);
        no ``newest`` before format 3."""
        d = _fields(self, signed)
        if self.newest is None:
            del d["newest"]
        return d

    @property
    def newest_manifest(self) -> Manifest | None:
        """The manifest HEAD names, carried in HEAD (format 3; None before), checked against
        HEAD's record of it when HEAD was parsed."""
        if self.newest is None:
            return None
        return Manifest.from_stored(self.newest, self.manifest, self.manifest_sha256)

    def to_bytes(self) -> bytes:
        d = self.fields()
        if self.format != 1:
            d["checksum"] = canonical_sha256(d)
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Head:
        try:
            d = json.loads(data)
            if not isinstance(d, dict):
                raise ValueError("not an object")
            fmt = d.setdefault("format", 1)  # format-1 HEADs carry no format field
            if fmt not in _READABLE:
                raise ManifestError(f"HEAD format {fmt!r} is not supported")
            d = _sealed(d, fmt, "HEAD")
            h = cls(**d)
            if fmt == 1 and (h.manifest_sha256 is not None or h.keyframe_sha256 is not None):
                raise ValueError("a format-1 HEAD names manifest digests")
            if fmt != 1 and not (isinstance(h.manifest_sha256, str) and isinstance(h.keyframe_sha256, str)):
                raise ValueError("no manifest digests")
            if not _uint(h.version) or not _uint(h.keyframe_version) or h.keyframe_version > h.version:
                raise ValueError("version/keyframe_version")
            _check_manifest_key(h.manifest, h.version, "manifest")
            _check_manifest_key(h.keyframe_manifest, h.keyframe_version, "keyframe manifest")
            if h.signature is not None and not isinstance(h.signature, dict):
                raise ValueError("signature must be an object")
            if (fmt >= NEWEST_IN_HEAD) != isinstance(h.newest, dict):
                raise ValueError("the manifest it names (format 3 carries it; earlier formats do not)")
        except (ValueError, TypeError, RecursionError) as e:
            raise ManifestError(f"HEAD is not a valid nemo-dcr head pointer ({e})") from None
        if h.newest is not None:
            h.newest_manifest  # noqa: B018 - checked now: a damaged one is HEAD's damage (ManifestError)
        return h


def read_head(store: Store) -> tuple[Head | None, str | None]:
    """-> (Head or None, tag or None)."""
    from nemo_dcr.stores import NotFound
    try:
        data, tag = store.get_with_tag(HEAD_KEY)
    except NotFound:
        return None, None
    return Head.from_bytes(data), tag


def read_manifest(store: Store, key: str, sha256: str | None = None) -> Manifest:
    """The manifest at ``key``, checked (and, with ``sha256``, checked to be the one recorded)."""
    from nemo_dcr.stores import NotFound
    try:
        data = store.get(key)
    except NotFound:
        raise VersionNotFound(f"manifest {key} is not in the store (removed by retention?)") from None
    return Manifest.from_bytes(data, key, sha256)


def _base_of(store: Store, m: Manifest, known: Manifest | None = None) -> Manifest:
    if m.base_manifest is None:
        raise ManifestError(f"{m.key}: version {m.version} has no base manifest")
    if known is not None and m.base_manifest == known.key and m.base_sha256 is not None \
            and m.base_sha256 == known.sha256:
        return known
    return read_manifest(store, m.base_manifest, m.base_sha256)


def head_manifest(store: Store, head: Head) -> Manifest:
    """The manifest ``head`` names: carried in HEAD from format 3 (checked with HEAD, and through
    a verifying store signature included: no round trip), read from the store before."""
    m = head.newest_manifest
    return m if m is not None else read_manifest(store, head.manifest, head.manifest_sha256)


def walk(store: Store, start: Head | Manifest, *, missing_ok: bool = True) -> Iterator[Manifest]:
    """The manifests of the chain from ``start`` (HEAD or a manifest) back through base links,
    newest first, each checked against the digest its referrer recorded. Stops at a version
    without a base, or (``missing_ok``) at one retention removed; a damaged manifest raises."""
    try:
        m = head_manifest(store, start) if isinstance(start, Head) else start
    except VersionNotFound:
        if missing_ok:
            return
        raise
    while True:
        yield m
        if m.base_manifest is None:
            return
        try:
            m = _base_of(store, m)
        except VersionNotFound:
            if missing_ok:
                return
            raise


def manifest_at(store: Store, version: int, head: Head | None = None) -> Manifest:
    """The manifest of ``version`` on HEAD's chain."""
    if head is None:
        head, _ = read_head(store)
    if head is None or version > head.version:
        raise VersionNotFound(f"version {version} is not committed")
    for m in walk(store, head):
        if m.version <= version:
            if m.version == version:
                return m
            break
    raise VersionNotFound(f"version {version} is no longer in the store")


@dataclass
class Found:
    """What :func:`locate` found: the manifest of the newest version on HEAD's chain with the
    digest sought (None: none within reach), how many manifests it read, and why the search
    ended before the chain's first version, when it did (None: it found the version, or read the
    whole chain)."""

    manifest: Manifest | None
    read: int = 0
    ended: str | None = None


def locate(store: Store, digest: str | Callable[[int], str], head: Head | None = None, *,
           worth_fetching: bool = False) -> Found:
    """The newest version on HEAD's chain whose state digest is ``digest``, read from HEAD down
    only as far as needed: a receiver at a recent version costs a manifest read or two, however
    long the history. A manifest that cannot be read (damaged, removed, or -- through a verifying
    store -- not signed by a trusted key, e.g. by a rotated-out key) ends the search there
    instead of failing it: nothing below it can be reached by deltas through it anyway.
    ``worth_fetching``: also end it where the deltas from further down to the newest keyframe
    cost more bytes than that keyframe (a receiver there is better served by the keyframe, so
    finding its version is not worth the reads). ``digest``: the state digest's text, or a
    function of the definition (``Manifest.definition``) giving the text under it, asked at each
    manifest (it keeps what it sums: ``checkpoint.sync``'s): a chain whose publisher moved to
    format 5 holds both."""
    def under(m: Manifest) -> str:
        return digest if isinstance(digest, str) else digest(m.definition)

    if head is None:
        head, _ = read_head(store)
    if head is None:
        return Found(None, 0, "the store has no committed version")
    found = Found(None)
    budget: int | None = None  # the newest keyframe's bytes, once walked
    spent = 0                  # bytes of the deltas walked at and below it
    try:
        found.read += 1
        m = head_manifest(store, head)
        while True:
            if m.target_digest == under(m):
                found.manifest = m
                return found
            if m.base_manifest is None:
                return found  # a version with no base: the chain's first
            # a keyframe without a delta part does not end the walk: a receiver below it is still
            # at a version of the chain (a pull going back to it, or past it, starts there)
            if budget is None and m.is_keyframe:
                budget = m.keyframe_bytes()
            if budget is not None:
                spent += m.delta_bytes()
                if worth_fetching and spent > budget:
                    found.ended = (f"the deltas into version {m.version} and up to keyframe {head.keyframe_version} "
                                   f"({spent:,} B) cost more than that keyframe ({budget:,} B)")
                    return found
            found.read += 1
            m = _base_of(store, m)
    except (VersionNotFound, ManifestError, SignatureError) as e:
        found.ended = f"{type(e).__name__}: {e}"
        log.info("nemo-dcr: looking for the state %s, the walk down the chain ended: %s",
                 digest if isinstance(digest, str) else "of the tensors given", found.ended)
        return found


def key_version(key: str) -> tuple[int | None, str | None]:
    """``versions/<v>/<publish id>/...`` -> (v, publish id); (None, None) for any other key."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[0] == "versions" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    return None, None


def commit(store: Store, manifest: Manifest, expected_head: Head | None, tag, signer=None) -> Head:
    """Write the manifest, then move HEAD from ``expected_head`` to it atomically. With a
    ``signer`` (nemo_dcr.sync.signing.Signer) the manifest (in place) and HEAD are signed.
    ``expected_head`` None with a ``tag``: HEAD is there but unreadable (damaged); a keyframe
    replaces it if it is still those bytes."""
    from nemo_dcr.stores import PreconditionFailed
    if signer is not None:
        signer.check_continues(expected_head)
        signer.sign(manifest)
    try:
        store.put_if_absent(manifest.key, manifest.to_bytes())
    except PreconditionFailed:
        raise CommitConflict(f"{manifest.key} already exists: publish ids must be unique") from None
    ks: str | None
    if manifest.is_keyframe:
        kv, kk, ks = manifest.version, manifest.key, manifest.sha256
    else:
        if expected_head is None:
            raise CommitConflict(f"{manifest.key}: a delta follows a HEAD, and the store has none")
        kv, kk, ks = expected_head.keyframe_version, expected_head.keyframe_manifest, expected_head.keyframe_sha256
        if ks is None:  # the keyframe was committed to a format-1 store: record its identity now
            ks = read_manifest(store, kk).sha256
    head = Head(manifest.version, manifest.key, kv, kk, manifest.sha256, ks, format=manifest.format,
                newest=manifest.stored() if manifest.format >= NEWEST_IN_HEAD else None)
    if signer is not None:
        signer.sign(head)
    try:
        if expected_head is None and tag is None:
            store.put_if_absent(HEAD_KEY, head.to_bytes())
        else:
            store.put_if_match(HEAD_KEY, head.to_bytes(), tag)
    except PreconditionFailed:
        raise CommitConflict(f"version {manifest.version} was committed by another publisher first; "
                             f"this publish ({manifest.publish_id}) is discarded") from None
    return head


def plans(store: Store, target: Manifest, current: int | None = None,
          digest: str | Callable[[int], str] | None = None, known: Manifest | None = None,
          refused: list | None = None) -> Iterator[list]:
    """Ways to take a receiver holding version ``current`` (state digest ``digest``, when
    known, or a function of the definition giving its text under it as ``locate``'s; None:
    nothing) to ``target``, best first. Each is a list of ("delta" | "keyframe",
    Manifest) steps, oldest first: the deltas from the receiver's own version, then each
    keyframe on the chain (newest first) with the deltas after it. The receiver's version
    counts only if its manifest on this chain has the receiver's digest: a store wiped and
    republished (same numbers, another history) is recognised and the receiver re-keyed from a
    keyframe. Manifests are read lazily: a caller that takes the first plan reads no further
    back than it needs, and ``known`` (the receiver's manifest, already checked) is not read
    again where the chain names it by key and sha256 (one round trip less per sync). A broken
    link (removed or damaged manifest, or one a verifying store refused: its ``SignatureError``
    is appended to ``refused``) ends the walk there."""
    walked: list = []
    waiting: list = []          # keyframes newer than the receiver's version, offered after its deltas
    searching = current is not None

    def from_keyframe(j):
        return [("keyframe", walked[j])] + [("delta", walked[i]) for i in range(j - 1, -1, -1)]

    m = target
    while True:
        walked.append(m)
        j = len(walked) - 1
        if searching and current is not None and m.version <= current:  # searching implies a current
            searching = False
            if m.version == current and (digest is None or m.target_digest == (
                    digest if isinstance(digest, str) else digest(m.definition))):
                yield [("delta", walked[i]) for i in range(j - 1, -1, -1)]
            for k in waiting:
                yield from_keyframe(k)
            waiting = []
        if m.is_keyframe:
            if searching:
                waiting.append(j)
            else:
                yield from_keyframe(j)
        if not m.parts:
            break  # no delta into this version: nothing older can lead past it
        try:
            m = _base_of(store, m, known)
        except VersionNotFound:
            break  # retention removed what is older
        except (ManifestError, SignatureError) as e:
            # damaged, or (through a verifying store) not signed by a trusted key: nothing older
            # can be used, but a keyframe already walked (signed itself) still can
            log.warning("nemo-dcr: the chain below version %d is broken (%s)", m.version, e)
            if refused is not None and isinstance(e, SignatureError):
                refused.append(e)
            break
    for k in waiting:
        yield from_keyframe(k)


def no_plan(target: Manifest, current: int | None) -> VersionNotFound:
    """The error when :func:`plans` has nothing (left) to offer."""
    return VersionNotFound(
        f"cannot reach version {target.version} from "
        f"{'an empty receiver' if current is None else f'version {current}'}: "
        f"the deltas or keyframe needed are no longer in the store")
