"""Exceptions raised by nemo-dcr. Every failure a user can cause is one of these."""


class DcrError(Exception):
    """Base class for all nemo-dcr errors."""


class DeltaFormatError(DcrError):
    """The delta is corrupted, truncated, foreign, or uses an unknown format version."""


class BaseMismatchError(DcrError):
    """The tensors a delta is applied to are not the base it was built from."""


class TargetMismatchError(DcrError):
    """After applying, the result does not match the target digest the sender recorded."""


class PartialApplyError(DcrError):
    """Applying failed after some tensors were already changed in place.

    Re-running the same apply with ``resume=True`` finishes it: chunks that were already
    applied are recognised by their post-image check and skipped.
    """


class MissingExtraError(DcrError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""
