"""The storage interface every backend implements, its errors and key rules.

A store holds immutable-looking *objects* under '/'-separated relative *keys*. Every write is
atomic: a reader sees either the old object or the new one, whole, never a mix or a prefix.
Two conditional writes give the primitives needed to coordinate several writers without a
lock server:

* :meth:`Store.put_if_absent` -- exclusive create; exactly one of several racing writers wins.
* :meth:`Store.get_with_tag` / :meth:`Store.put_if_match` -- compare-and-set on an opaque tag
  (the ETag on S3, a content hash locally).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from nemo_dcr.errors import NotFound, PreconditionFailed, StoreError  # re-exported: defined with every other error

if TYPE_CHECKING:
    from .writer import ObjectWriter

__all__ = ["Store", "StoreError", "NotFound", "PreconditionFailed", "check_key", "check_prefix"]


def check_key(key: str) -> str:
    """Validate an object key and return it; raise StoreError if it is not acceptable.

    Keys are relative, '/'-separated, with no empty part (so no leading, trailing or doubled
    '/'), no '.' or '..' part, and no part starting with '.' (those names are reserved for a
    store's own temporary and lock files). NUL and backslash are refused too.
    """
    if not isinstance(key, str):
        raise StoreError(f"invalid key {key!r}: must be a str, not {type(key).__name__}")
    if not key:
        raise StoreError("invalid key '': must not be empty")
    if "\x00" in key or "\\" in key:
        raise StoreError(f"invalid key {key!r}: NUL and backslash are not allowed")
    if key.startswith("/"):
        raise StoreError(f"invalid key {key!r}: must be relative (no leading '/')")
    for part in key.split("/"):
        if not part:
            raise StoreError(f"invalid key {key!r}: empty path component")
        if part in (".", ".."):
            raise StoreError(f"invalid key {key!r}: '.' and '..' components are not allowed")
        if part.startswith("."):
            raise StoreError(
                f"invalid key {key!r}: components starting with '.' are reserved for the store"
            )
    return key


def check_prefix(prefix: str) -> str:
    """Validate a listing prefix: '' or a key, optionally ending in '/', or the beginning of
    a key (``"ckpt/v1"`` matches ``"ckpt/v10/a"`` too, as S3 prefixes do)."""
    if not isinstance(prefix, str):
        raise StoreError(f"invalid prefix {prefix!r}: must be a str")
    if prefix == "":
        return prefix
    check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


class Store(abc.ABC):
    """Abstract object store. Subclasses: :class:`LocalStore`, :class:`S3Store`.

    Every method raises :class:`StoreError` (or a subclass) on failure, never a backend
    exception.
    """

    #: ``file:///abs/root`` or ``s3://bucket/prefix``
    url: str

    # -- reads -----------------------------------------------------------------------------

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; :class:`NotFound` if it does not exist."""

    @abc.abstractmethod
    def get_to_file(self, key: str, path: str | os.PathLike) -> None:
        """Stream the object into the file ``path``. Atomic: written to a hidden temporary
        file next to ``path`` and renamed into place, so on any failure ``path`` is untouched
        and no partial file is left behind."""

    def get_stream(self, key: str, offset: int = 0) -> tuple[int, Iterator[bytes]]:
        """``(size, chunks)``: the whole object's size in bytes and an iterator over its bytes
        from ``offset`` on, read as they arrive (a relay passes them on before the object is
        complete; a reader that lost its source resumes at an offset from another one).
        :class:`NotFound` if the object does not exist. Close the iterator (``chunks.close()``)
        when stopping early. This default reads the whole object first; backends that can
        stream override it."""
        data = self.get(key)
        offset = max(0, int(offset))
        return len(data), iter([data[offset:]] if offset < len(data) else [])

    @abc.abstractmethod
    def get_with_tag(self, key: str) -> tuple[bytes, str]:
        """``(bytes, tag)``, a consistent pair: the tag is that of exactly these bytes."""

    def get_if_changed(self, key: str, tag: str) -> tuple[bytes, str] | None:
        """``(bytes, tag)`` as :meth:`get_with_tag`, or None while the object's tag is still
        ``tag``: a conditional read, so that polling an unchanged object (HEAD, which carries the
        newest manifest from format 3: up to ~16 KB) costs a response's headers on S3
        (``If-None-Match``: 304) and through a relay, not its bytes. This default reads the
        object and compares (a local directory has no link to save)."""
        data, now = self.get_with_tag(key)
        return None if now == tag else (data, now)

    def exists(self, key: str) -> bool:
        """Whether the object exists (this default asks for its size)."""
        try:
            self.size(key)
            return True
        except NotFound:
            return False

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes; :class:`NotFound` if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All keys starting with ``prefix`` (recursively), sorted."""

    # -- writes ----------------------------------------------------------------------------

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Create or overwrite the object, atomically."""

    @abc.abstractmethod
    def put_file(self, key: str, path: str | os.PathLike) -> None:
        """Create or overwrite the object from the file ``path``, streaming (multipart and
        parallel where the backend supports it); atomic like :meth:`put`."""

    def open_writer(self, key: str) -> ObjectWriter:
        """A writer of the object ``key`` as a stream of bytes (``stores/writer.py``): nothing is
        visible until its ``commit``, then the whole object, as after :meth:`put`. This default
        holds the bytes and calls :meth:`put` at commit; stores that can stream override it
        (and fall back to this default in a subclass that overrides ``put``, so that a wrapped
        ``put`` stays the one write path)."""
        from .writer import BufferedWriter
        check_key(key)
        return BufferedWriter(self, key)

    def drop_unfinished(self, prefix: str, stale: Callable[[str], bool]) -> int:
        """Drop the unfinished writes under ``prefix`` whose key ``stale(key)`` says no writer can
        still finish: what a writer killed mid-object (``open_writer``) leaves behind, invisible
        to :meth:`list` (a local store's hidden temporaries, S3's incomplete multipart uploads).
        Returns how many were dropped; this default has none to drop."""
        return 0

    def _put_overridden(self, own: type) -> bool:
        """Whether a subclass of ``own`` (the class defining the streaming writer) replaced ``put``."""
        return type(self).put is not own.put  # type: ignore[attr-defined]

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create the object only if ``key`` does not exist; :class:`PreconditionFailed`
        otherwise. Of several concurrent callers exactly one succeeds."""

    @abc.abstractmethod
    def put_if_match(self, key: str, data: bytes, tag: str) -> str:
        """Compare-and-set: replace the object only if its current tag is ``tag``; return
        the new tag. :class:`PreconditionFailed` if the tag differs or the object is gone.
        ``tag=None`` is refused: use :meth:`put_if_absent` to create."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object. Deleting a missing object is not an error."""

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _check_tag(key: str, tag) -> str:
        if tag is None:
            raise StoreError(
                f"put_if_match({key!r}) needs the tag from get_with_tag; "
                "to create an object that must not exist yet use put_if_absent"
            )
        if not isinstance(tag, str) or not tag:
            raise StoreError(f"put_if_match({key!r}): invalid tag {tag!r}")
        return tag

    @staticmethod
    def _check_data(key: str, data) -> bytes:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return bytes(data) if not isinstance(data, bytes) else data
        raise StoreError(f"put({key!r}): data must be bytes-like, not {type(data).__name__}")

    def report(self, receiver: str, version: int | None) -> None:
        """Tell the relays this store reads through (if any) that ``receiver`` holds ``version``
        (sent with its HEAD reads, shown by their ``/metrics``, ``.stats`` and ``nemo-dcr
        status``). A store that is not a relay has no one to tell."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
