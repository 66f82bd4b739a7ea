"""The relay's object cache on disk: only objects whose size and checksum matched their manifest,
bounded in bytes (least recently used go first) and pruned of versions the upstream no longer
lists. It starts empty: what a previous run left is removed, not trusted.

The cache directory is the relay's own: it writes a marker file (:data:`MARKER`) into it and
holds a lock on that file while it runs. At start-up it removes only ``objects/`` and ``tmp/`` of
a directory that carries its marker; a directory without the marker must be new or empty (a
user's ``--cache-dir $HOME`` is refused, never cleared), and a second relay on the same directory
is refused while the first holds the lock."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from nemo_dcr.stores.base import StoreError

__all__ = ["ObjectCache", "Entry", "MARKER"]

MARKER = ".nemo-dcr-relay-cache"
_OWN = ("objects", "tmp", MARKER)  # all the relay ever puts in its directory


@dataclass
class Entry:
    path: str
    size: int
    version: int


class ObjectCache:
    def __init__(self, root: str, max_bytes: int):
        self.root = os.path.abspath(root)
        self.max_bytes = int(max_bytes)
        self._objects = os.path.join(self.root, "objects")
        self._tmp = os.path.join(self.root, "tmp")
        self._lock_fd: int | None = _claim(self.root)
        try:
            for d in (self._objects, self._tmp):
                if os.path.islink(d):
                    raise StoreError(f"relay cache directory {self.root}: {d} is a symbolic link; the relay "
                                     "removes only directories it made")
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d, exist_ok=True)
        except BaseException:
            self.close()
            raise
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def close(self) -> None:
        """Release the directory (its lock); the files stay for the next run to clear."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __len__(self) -> int:
        return len(self._entries)

    def temp_path(self) -> str:
        """A fresh file name for a download in flight."""
        return os.path.join(self._tmp, uuid.uuid4().hex)

    def lookup(self, key: str) -> Entry | None:
        e = self._entries.get(key)
        if e is not None:
            self._entries.move_to_end(key)
        return e

    def admit(self, key: str, tmp: str, size: int, version: int) -> bool:
        """Move the verified download ``tmp`` into the cache; False (``tmp`` left to the
        caller) if it could never fit."""
        if size > self.max_bytes:
            return False
        path = os.path.join(self._objects, hashlib.sha256(key.encode()).hexdigest())
        self.discard(key)
        os.replace(tmp, path)
        self._entries[key] = Entry(path, size, version)
        self.bytes += size
        while self.bytes > self.max_bytes and self._entries:
            self.discard(next(iter(self._entries)))
        return key in self._entries

    def discard(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is None:
            return
        self.bytes -= e.size
        self.evicted += 1
        try:
            os.unlink(e.path)  # a reader that has it open keeps reading (POSIX)
        except OSError:
            pass

    def discard_prefix(self, prefix: str) -> int:
        """Drop every object whose key starts with ``prefix`` (a version's directory)."""
        gone = [k for k in self._entries if k.startswith(prefix)]
        for k in gone:
            self.discard(k)
        return len(gone)

    def evict_older_than(self, version: int) -> int:
        old = [k for k, e in self._entries.items() if e.version < version]
        for k in old:
            self.discard(k)
        return len(old)


def _claim(root: str) -> int:
    """Make ``root`` the relay's cache directory, or refuse: it must carry the relay's marker, or
    be new or empty. Returns the descriptor of the marker, locked (one relay per directory)."""
    marker = os.path.join(root, MARKER)
    try:
        os.makedirs(root, exist_ok=True)
        if not os.path.isfile(marker):
            foreign = sorted(n for n in os.listdir(root) if n != MARKER)
            if foreign:
                shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
                raise StoreError(f"relay cache directory {root} is not empty and was not made by a relay "
                                 f"(it holds {shown}; no {MARKER} file): nothing was removed. Give a new or "
                                 "empty directory, which the relay then owns")
        try:
            w = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(w, "wb") as f:
                f.write(b"nemo-dcr relay cache: objects/ and tmp/ here are removed when a relay starts\n")
        # locked through a read-only descriptor: a file held open for writing would keep the
        # file system from being remounted read-only
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise StoreError(f"relay cache directory {root}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StoreError(f"relay cache directory {root} is in use by another relay (it holds the lock on "
                         f"{MARKER}); give each relay its own directory") from None
    return fd
