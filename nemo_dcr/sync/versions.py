"""Versions: manifests, the head pointer and the joint commit.

Store layout (keys relative to the store's root):

    HEAD                                          {"version", "manifest", "keyframe": {...}}
    versions/<v:012d>/<publish id>/part-<r>.dcr   one delta per publishing rank (base v-1 -> v)
    versions/<v:012d>/<publish id>/key-<r>.dcr    keyframe parts (full state), on keyframe versions
    versions/<v:012d>/<publish id>/manifest.json  the version's manifest

Objects go first, the manifest next, and the version becomes visible only when HEAD moves to it
by an atomic compare-and-set (``put_if_match`` / ``put_if_absent``). Every publish writes under a
fresh publish id, so a publisher that loses a race for a version never touches the winner's
objects; its own are orphans that retention removes.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field

from nemo_dcr.errors import DcrError, DeltaFormatError

HEAD_KEY = "HEAD"
FORMAT = 1


class CommitConflict(DcrError):
    """Another publisher committed this version first (or the head moved underneath us)."""


class VersionNotFound(DcrError):
    """The store has no such version, or retention has removed what reaching it needs."""


def new_publish_id() -> str:
    return f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}"


def version_dir(version: int, publish_id: str) -> str:
    return f"versions/{version:012d}/{publish_id}"


@dataclass
class Part:
    """Receipt of one uploaded object."""

    rank: int
    key: str
    size: int
    sha256: str
    changed: int = 0
    elements: int = 0
    dense_bytes: int = 0


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
    created: float = field(default_factory=time.time)
    format: int = FORMAT

    @property
    def key(self) -> str:
        return f"{version_dir(self.version, self.publish_id)}/manifest.json"

    @property
    def is_keyframe(self) -> bool:
        return bool(self.keyframe_parts)

    def delta_bytes(self) -> int:
        return sum(p.size for p in self.parts)

    def keyframe_bytes(self) -> int:
        return sum(p.size for p in self.keyframe_parts)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, key: str = "<manifest>") -> "Manifest":
        try:
            d = json.loads(data)
            if d.get("format") != FORMAT:
                raise DeltaFormatError(f"{key}: manifest format {d.get('format')!r} is not supported")
            d["parts"] = [Part(**p) for p in d["parts"]]
            d["keyframe_parts"] = [Part(**p) for p in d["keyframe_parts"]]
            m = cls(**d)
            if not isinstance(m.version, int) or m.version < 0 or not isinstance(m.publish_id, str):
                raise ValueError("version/publish_id")
            if m.parts and (m.base_version is None or m.base_manifest is None or m.base_digest is None):
                raise ValueError("delta parts without a base")
            if not m.parts and not m.keyframe_parts:
                raise ValueError("no parts")
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise DeltaFormatError(f"{key}: not a valid nemo-dcr manifest ({e})") from None
        if m.key != key and key != "<manifest>":
            raise DeltaFormatError(f"{key}: manifest names itself {m.key}")
        return m


@dataclass
class Head:
    version: int
    manifest: str
    keyframe_version: int
    keyframe_manifest: str

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Head":
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError) as e:
            raise DeltaFormatError(f"HEAD is not a valid nemo-dcr head pointer ({e})") from None


def read_head(store):
    """-> (Head or None, tag or None)."""
    from nemo_dcr.stores import NotFound
    try:
        data, tag = store.get_with_tag(HEAD_KEY)
    except NotFound:
        return None, None
    return Head.from_bytes(data), tag


def read_manifest(store, key: str) -> Manifest:
    from nemo_dcr.stores import NotFound
    try:
        return Manifest.from_bytes(store.get(key), key)
    except NotFound:
        raise VersionNotFound(f"manifest {key} is not in the store (removed by retention?)") from None


def commit(store, manifest: Manifest, expected_head: Head | None, tag) -> Head:
    """Write the manifest, then move HEAD from ``expected_head`` to it atomically."""
    from nemo_dcr.stores import PreconditionFailed
    try:
        store.put_if_absent(manifest.key, manifest.to_bytes())
    except PreconditionFailed:
        raise CommitConflict(f"{manifest.key} already exists: publish ids must be unique") from None
    if manifest.is_keyframe:
        kv, kk = manifest.version, manifest.key
    else:
        kv, kk = expected_head.keyframe_version, expected_head.keyframe_manifest
    head = Head(manifest.version, manifest.key, kv, kk)
    try:
        if expected_head is None:
            store.put_if_absent(HEAD_KEY, head.to_bytes())
        else:
            store.put_if_match(HEAD_KEY, head.to_bytes(), tag)
    except PreconditionFailed:
        raise CommitConflict(f"version {manifest.version} was committed by another publisher first; "
                             f"this publish ({manifest.publish_id}) is discarded") from None
    return head


def chain(store, target: Manifest, current: int | None) -> list:
    """Steps that take a receiver at ``current`` (None: nothing) to ``target``.

    Returns a list of ("delta" | "keyframe", Manifest), oldest first. Deltas are preferred; a
    keyframe is used when the receiver has nothing, or the deltas back to it were removed.
    """
    if current is not None and current > target.version:
        raise VersionNotFound(f"receiver is at version {current}, newer than the requested {target.version}")
    steps, newest_keyframe = [], None
    m = target
    while True:
        if current is not None and m.version == current:
            return list(reversed(steps))
        if m.is_keyframe and current is None:
            steps.append(("keyframe", m))
            return list(reversed(steps))
        if m.is_keyframe and newest_keyframe is None:
            newest_keyframe = len(steps)
        if m.parts and m.base_version is not None and (current is None or m.base_version >= current):
            try:
                prev = read_manifest(store, m.base_manifest)
            except VersionNotFound:
                prev = None
            if prev is not None:
                steps.append(("delta", m))
                m = prev
                continue
        if m.is_keyframe:
            steps.append(("keyframe", m))
            return list(reversed(steps))
        if newest_keyframe is not None:
            kf = steps[newest_keyframe][1]
            return [("keyframe", kf)] + list(reversed(steps[:newest_keyframe]))
        raise VersionNotFound(
            f"cannot reach version {target.version} from "
            f"{'an empty receiver' if current is None else f'version {current}'}: "
            f"the deltas or keyframe needed are no longer in the store")
