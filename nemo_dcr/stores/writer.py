"""Objects written as a stream: the publisher encodes a delta straight into its object.

    w = open_writer(store, key)          # checksum="blake3": the receipt's hash (stores/checksums.py)
    try:
        diff(base, target, out=w)        # any writer of bytes: w.write(b)
    except BaseException:
        w.abort()                        # nothing appears, nothing is left behind
        raise
    w.commit()                           # the object appears whole, atomically
    w.size, w.checksum                   # of exactly the bytes written

Until :meth:`ObjectWriter.commit` returns, no reader sees anything under ``key``; then it sees
the whole object, as after ``store.put``. The writer hashes the bytes as they pass, so the
publisher's receipt (size, checksum) costs no second pass over the object. Backends that can
stream write the bytes as they come (a local store into a hidden temporary next to the object,
S3 as the parts of a multipart upload, uploading while the rest is still being encoded); every
other store gets :class:`BufferedWriter`, which holds the bytes and ``put``\\ s them at commit,
so a store that wraps ``put`` (a fault injector, an auditing proxy) still sees every write.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from . import checksums
from .base import StoreError

if TYPE_CHECKING:
    from .base import Store

__all__ = ["ObjectWriter", "BufferedWriter", "open_writer"]


class ObjectWriter(abc.ABC):
    """One object being written. ``write`` as often as needed, then ``commit`` once (or
    ``abort``). As a context manager: aborted on an exception, committed otherwise."""

    def __init__(self, key: str):
        self.key = key
        self.size = 0
        self.algo = "sha256"
        self._sum = checksums.new(self.algo)
        self._state = "open"  # open -> committed | aborted

    def hash_with(self, algo: str) -> None:
        """Hash the bytes with ``algo`` (``stores/checksums.py``) rather than SHA-256; before
        the first write (``StoreError`` after it: the hash would miss what was written)."""
        if self.size or self._state != "open":
            raise StoreError(f"{self.key!r}: the checksum is chosen before the first write")
        self.algo, self._sum = algo, checksums.new(algo)

    @property
    def checksum(self) -> str:
        """Hex checksum (``algo``) of the bytes written so far (of the whole object once
        committed)."""
        return self._sum.hexdigest()

    def write(self, data) -> int:
        if self._state != "open":
            raise StoreError(f"write to {self.key!r}: the object was already {self._state}")
        mv = memoryview(data).cast("B")
        if mv.nbytes:
            self._sum.update(mv)  # both hashes drop the GIL on large buffers: workers keep encoding
            self._write(mv)
            self.size += mv.nbytes
        return mv.nbytes

    def flush(self) -> None:
        """Wait until what a streaming backend already sent of the bytes written has arrived
        (S3: the parts in flight); raises a failed part's error. Nothing becomes visible."""
        if self._state != "open":
            raise StoreError(f"flush of {self.key!r}: the object was already {self._state}")
        self._flush()

    def commit(self) -> None:
        """Make the object visible, whole; on failure nothing is visible and the writer is
        aborted (``StoreError``)."""
        if self._state != "open":
            raise StoreError(f"commit of {self.key!r}: the object was already {self._state}")
        try:
            self._commit()
        except BaseException:
            self.abort()
            raise
        self._state = "committed"

    def abort(self) -> None:
        """Drop what was written (quietly: this runs on error paths)."""
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            self._abort()
        except Exception:
            pass

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            self.commit()

    @abc.abstractmethod
    def _write(self, mv: memoryview) -> None:
        ...

    @abc.abstractmethod
    def _commit(self) -> None:
        ...

    def _flush(self) -> None:  # noqa: B027 - a writer that sends nothing early has nothing to wait for
        pass

    def _abort(self) -> None:  # noqa: B027 - a writer that holds nothing outside memory needs nothing
        pass


class BufferedWriter(ObjectWriter):
    """Holds the bytes and ``store.put``\\ s them at commit: the writer of any store that cannot
    stream, and of one whose ``put`` is its only write path."""

    def __init__(self, store, key: str):
        super().__init__(key)
        self.store = store
        self._pieces: list[bytes] = []

    def _write(self, mv: memoryview) -> None:
        self._pieces.append(mv.tobytes() if not isinstance(mv.obj, bytes) or mv.nbytes != len(mv.obj)
                            else mv.obj)

    def _commit(self) -> None:
        data = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
        self._pieces = []
        self.store.put(self.key, data)

    def _abort(self) -> None:
        self._pieces = []


def open_writer(store: Store, key: str, checksum: str = "sha256") -> ObjectWriter:
    """A writer for ``key`` in ``store``: the store's own (``Store.open_writer``) where its class
    has one, else a :class:`BufferedWriter` (a duck-typed store offering ``put`` alone); its
    receipt hashed with ``checksum``."""
    fn = getattr(type(store), "open_writer", None)
    w = fn(store, key) if fn is not None else BufferedWriter(store, key)
    if checksum != w.algo:
        w.hash_with(checksum)
    return w
