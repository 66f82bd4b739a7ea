"""The relay's object cache on disk: only objects whose size and sha256 matched their manifest,
bounded in bytes (least recently used go first) and pruned of versions the upstream no longer
lists. It starts empty: what a previous run left is removed, not trusted."""
from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["ObjectCache", "Entry"]


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
        for d in (self._objects, self._tmp):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d, exist_ok=True)
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

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

    def evict_older_than(self, version: int) -> int:
        old = [k for k, e in self._entries.items() if e.version < version]
        for k in old:
            self.discard(k)
        return len(old)
