"""Exceptions raised by nemo-dcr: every class in one place. Every failure a user can cause is a
``DcrError``; the modules that used to define some of these re-export them under their old names.
"""
from __future__ import annotations

from typing import NamedTuple


class DcrError(Exception):
    """Base class for all nemo-dcr errors."""


# ----------------------------------------------------------------------------- deltas

class DeltaFormatError(DcrError):
    """The delta is corrupted, truncated, foreign, or uses an unknown format version."""


class BaseMismatchError(DcrError):
    """The tensors a delta is applied to are not the base it was built from."""


class TargetMismatchError(DcrError):
    """After applying, the result does not match the target digest the sender recorded."""


class AliasedWriteError(DcrError):
    """A delta writes two of the receiver's tensors that share memory (tied weights under two
    names). Refused before the first write of ``apply`` (nothing was changed); in
    ``apply_stream``, before the refused segment's first write, as its other refusals."""


class PartialApplyError(DcrError):
    """Applying failed after some tensors were already changed in place.

    Re-running the same apply with ``resume=True`` finishes it: chunks that were already
    applied are recognised by their post-image check and skipped.
    """


# ----------------------------------------------------------------------------- checkpoints

class CheckpointError(DcrError):
    """A checkpoint file is missing, unreadable or not valid safetensors."""


# ----------------------------------------------------------------------------- stores

class StoreError(DcrError):
    """A storage operation failed (bad key, I/O error, remote error after retries, ...)."""

    #: set by the S3 store when its client retried the request: a conditional write that failed
    #: after a retry may have been the first attempt's own write, so its outcome is ambiguous.
    retried: bool = False


class NotFound(StoreError):
    """The object does not exist. ``.key`` is the key that was asked for."""

    def __init__(self, key: str, where: str = ""):
        self.key = key
        super().__init__(f"object not found: {key!r}" + (f" in {where}" if where else ""))


class PreconditionFailed(StoreError):
    """A conditional write lost: the key already exists (put_if_absent) or its tag changed
    (put_if_match). Nothing was written. ``.key`` is the key."""

    def __init__(self, key: str, reason: str = ""):
        self.key = key
        super().__init__(f"precondition failed for {key!r}" + (f": {reason}" if reason else ""))


# ----------------------------------------------------------------------------- versions

class ManifestError(DcrError):
    """A manifest or HEAD object is not valid: unparsable, of an unknown format, or altered
    (its checksum, or the digest its referrer recorded for it, does not match)."""


class CommitConflict(DcrError):
    """Another publisher committed this version first (or the head moved underneath us)."""


class VersionNotFound(DcrError):
    """The store has no such version, or retention has removed what reaching it needs."""


class SignatureError(DcrError):
    """A manifest or HEAD is not signed by a trusted key for this namespace: signed by a key the
    reader does not trust, wrongly signed (altered after signing), or signed for another namespace
    (run). Raised before any part of that version is fetched."""


class UnsignedError(SignatureError):
    """A reader configured with trusted keys met an unsigned manifest or HEAD."""


class ReplayError(SignatureError):
    """HEAD names an older version than one this reader already verified, or another manifest for
    the same version: a rolled-back or replayed store."""


class CorruptObjectError(DcrError):
    """An object's bytes do not match the checksum in its manifest, after every retry."""


# ----------------------------------------------------------------------------- groups

class RankFailure(NamedTuple):
    """What one rank raised: the exception's class (module and qualified name) and message."""

    module: str
    qualname: str
    message: str

    @property
    def type_name(self) -> str:
        return self.qualname


class GroupError(DcrError):
    """A step failed on ranks of a process group whose failures were of different kinds (or of a
    kind that is not a ``DcrError``). Raised alike on every rank; see ``rank_failures``.

    Every error raised by ``nemo_dcr.sync.group.Group.run`` (of this class or of the one class all
    failed ranks raised) carries ``rank_failures``: ``{rank: RankFailure}``.
    """

    rank_failures: dict = {}


class PublishError(DcrError):
    """A rank could not publish its part; no version was committed."""


class DeltaPublishError(DcrError):
    """A background publish failed; the message names the step and the cause."""


# ----------------------------------------------------------------------------- optional dependencies

class MissingExtraError(DcrError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""
