"""A store in a local (or locally mounted POSIX) directory.

Layout: the object ``a/b/c`` is the file ``ROOT/a/b/c``. Names starting with '.' are the
store's own: temporary files (``.<name>.tmp-<random>``, next to their target) and the lock
directory ``ROOT/.locks/``; :meth:`LocalStore.list` never shows them, and keys may not use
them.

Atomicity and exclusion, also between several processes on one machine:

* ``put``/``put_file``: the data goes to a hidden temporary file in the target's directory,
  is fsync'ed, then ``os.replace``\\ d over the target and the directory is fsync'ed. Readers
  see the old or the new file, whole.
* ``put_if_absent``: temporary file + fsync, then ``os.link(temp, target)``, which fails with
  EEXIST if the target exists: exclusive, and the target's content is complete from the first
  instant it is visible.
* ``put_if_match``: read-compare-replace under an exclusive ``fcntl.flock`` on a lock file in
  ``ROOT/.locks/`` chosen by hashing the key (a fixed pool of lock files, so they do not pile
  up). Every mutating operation takes the same lock around its final rename/link/unlink, so a
  compare-and-set is linearizable with plain puts and deletes of the same key. The tag is the
  hex SHA-256 of the content. flock is reliable on local file systems; on network file
  systems (NFS, ...) it may not be, so do not share one directory between machines.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterator

from nemo_dcr.util.atomic import TEMP_RE, fsync_dir, install, open_temp, remove_quiet, write_temp
from nemo_dcr.util.writeback import Writeback

from .base import NotFound, PreconditionFailed, Store, StoreError, check_key, check_prefix
from .writer import ObjectWriter

__all__ = ["LocalStore"]

_LOCK_DIR = ".locks"
_N_LOCKS = 256
_COPY_BUF = 8 << 20
_STREAM_BUF = 1 << 20


def _tag_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalStore(Store):
    """A directory used as an object store. ``root`` is created if it does not exist."""

    def __init__(self, root: str | os.PathLike, *, create: bool = True):
        self.root = os.path.abspath(os.fspath(root))
        if create:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create store directory {self.root}: {e}") from e
        elif not os.path.isdir(self.root):
            raise StoreError(f"store directory does not exist: {self.root} (a mistyped path? a reader never "
                             "creates a store: the publisher's first version does)")
        self.url = "file://" + self.root

    # -- paths and locks -------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        n = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % _N_LOCKS
        lock_dir = os.path.join(self.root, _LOCK_DIR)
        path = os.path.join(lock_dir, f"{n:03d}.lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            os.makedirs(lock_dir, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # Each open() is its own open file description, so flock also excludes other
            # threads of this process, not only other processes.
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _ensure_dir(self, d: str) -> None:
        """``os.makedirs(d)``, tolerant of a concurrent delete() pruning the same directories
        (mkdir then sees EEXIST for a directory that is gone a moment later, or ENOENT for a
        parent): retried until the directory exists. A path component that is a file (an
        object) is a real collision and raises NotADirectoryError."""
        for _ in range(1000):
            try:
                os.makedirs(d, exist_ok=True)
                return
            except (FileExistsError, FileNotFoundError, NotADirectoryError):
                p = d
                while True:
                    try:  # one lstat: exists-then-isdir could see a directory pruned in between
                        mode = os.lstat(p).st_mode
                    except FileNotFoundError:
                        mode = None
                    if mode is not None and not stat.S_ISDIR(mode):
                        raise NotADirectoryError(
                            errno.ENOTDIR, "a parent of this path is a file", p
                        ) from None
                    parent = os.path.dirname(p)
                    if parent == p:
                        break
                    p = parent
        raise OSError(errno.EAGAIN, "directory kept disappearing while being created", d)

    def _write_temp(self, final: str, writer) -> str:
        """A filled, fsync'ed hidden temporary next to ``final`` (util/atomic.py); its directory
        is made again if a concurrent delete() pruned it. On failure nothing is left behind."""
        return write_temp(final, writer, make_dir=self._ensure_dir)

    def _temp_for(self, op: str, key: str, final: str, writer) -> str:
        """:meth:`_write_temp`, its I/O errors reported as ``op`` on ``key``."""
        try:
            return self._write_temp(final, writer)
        except OSError as e:
            raise self._io_error(op, key, e) from e

    def _io_error(self, op: str, key: str, e: OSError) -> StoreError:
        if isinstance(e, (NotADirectoryError, IsADirectoryError)) or e.errno in (
            errno.ENOTDIR, errno.EISDIR
        ):
            return StoreError(
                f"{op}({key!r}) in {self.url}: the key collides with another key used as a "
                f"directory (a local store cannot hold both 'a' and 'a/b'): {e}"
            )
        return StoreError(f"{op}({key!r}) in {self.url} failed: {e}")

    # -- reads -----------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(key, self.url) from None
        except OSError as e:
            raise self._io_error("get", key, e) from e

    def get_with_tag(self, key: str) -> tuple[bytes, str]:
        # The file is only ever replaced whole, so what we read is one version and the tag
        # computed from it is that version's tag.
        data = self.get(key)
        return data, _tag_of(data)

    def _open_object(self, op: str, key: str):
        try:
            return open(self._path(key), "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(key, self.url) from None
        except OSError as e:
            raise self._io_error(op, key, e) from e

    def get_to_file(self, key: str, path: str | os.PathLike) -> None:
        dest = os.path.abspath(os.fspath(path))
        fin = self._open_object("get_to_file", key)
        try:
            with fin:
                install(self._write_temp(dest, lambda f: shutil.copyfileobj(fin, f, _COPY_BUF)), dest)
        except OSError as e:
            raise StoreError(f"get_to_file({key!r}) -> {dest} failed: {e}") from e

    def get_stream(self, key: str, offset: int = 0) -> tuple[int, Iterator[bytes]]:
        f = self._open_object("get_stream", key)
        size = os.fstat(f.fileno()).st_size  # the file is only ever replaced whole, never grown

        def chunks() -> Iterator[bytes]:
            with f:
                try:
                    f.seek(max(0, int(offset)))
                    while True:
                        b = f.read(_STREAM_BUF)
                        if not b:
                            return
                        yield b
                except OSError as e:
                    raise self._io_error("get_stream", key, e) from e

        return size, chunks()

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(key, self.url) from None
        except OSError as e:
            raise self._io_error("size", key, e) from e
        if not os.path.isfile(path):
            raise NotFound(key, self.url)
        return st.st_size

    def _walk(self, prefix: str) -> Iterator[tuple[str, str, list[str]]]:
        """``(dirpath, its key prefix "a/b/", file names)`` of the directories that can hold keys
        starting with ``prefix``: only the deepest directory the prefix pins down is walked (S3
        semantics: "v1" matches "v1/x" and "v10/x"; the caller filters by string prefix), and
        the store's own hidden directories are skipped."""
        check_prefix(prefix)
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = os.path.join(self.root, *head.split("/")) if head else self.root
        if not os.path.isdir(start):
            return
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = os.path.relpath(dirpath, self.root)
            yield dirpath, "" if rel == "." else rel.replace(os.sep, "/") + "/", filenames

    def list(self, prefix: str = "") -> list[str]:
        return sorted(rel + name for _, rel, names in self._walk(prefix) for name in names
                      if not name.startswith(".") and (rel + name).startswith(prefix))

    # -- writes ----------------------------------------------------------------------------

    def _replace(self, op: str, key: str, tmp: str, final: str) -> None:
        try:
            install(tmp, final, lock=self._lock(key))
        except OSError as e:
            raise self._io_error(op, key, e) from e

    def put(self, key: str, data: bytes) -> None:
        data = self._check_data(key, data)
        final = self._path(key)
        tmp = self._temp_for("put", key, final, lambda f: f.write(data))
        self._replace("put", key, tmp, final)

    def open_writer(self, key: str) -> ObjectWriter:
        """Streams into a hidden temporary next to the object; ``commit`` fsyncs it and renames
        it into place (as :meth:`put` does with its bytes), ``abort`` removes it."""
        if self._put_overridden(LocalStore):
            return super().open_writer(key)
        return _LocalWriter(self, key)

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        final = self._path(key)
        src = os.fspath(path)
        try:
            fin = open(src, "rb")
        except OSError as e:
            raise StoreError(f"put_file({key!r}): cannot read {src}: {e}") from e
        with fin:
            tmp = self._temp_for("put_file", key, final, lambda f: shutil.copyfileobj(fin, f, _COPY_BUF))
        self._replace("put_file", key, tmp, final)

    def put_if_absent(self, key: str, data: bytes) -> None:
        data = self._check_data(key, data)
        final = self._path(key)
        tmp = self._temp_for("put_if_absent", key, final, lambda f: f.write(data))
        try:
            with self._lock(key):
                os.link(tmp, final)  # atomic, exclusive: EEXIST if the key exists
        except FileExistsError:
            if os.path.isdir(final):
                raise self._io_error(
                    "put_if_absent", key, IsADirectoryError(errno.EISDIR, "is a directory", final)
                ) from None
            raise PreconditionFailed(key, "the object already exists") from None
        except OSError as e:
            raise self._io_error("put_if_absent", key, e) from e
        finally:
            remove_quiet(tmp)
        fsync_dir(os.path.dirname(final))

    def put_if_match(self, key: str, data: bytes, tag: str) -> str:
        tag = self._check_tag(key, tag)
        data = self._check_data(key, data)
        final = self._path(key)
        tmp = self._temp_for("put_if_match", key, final, lambda f: f.write(data))
        try:
            with self._lock(key):
                try:
                    with open(final, "rb") as f:
                        current = _tag_of(f.read())
                except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                    raise PreconditionFailed(key, "the object does not exist (any more)") from None
                if current != tag:
                    raise PreconditionFailed(key, "the object changed since it was read")
                os.replace(tmp, final)
        except OSError as e:
            raise self._io_error("put_if_match", key, e) from e
        finally:
            remove_quiet(tmp)  # no-op after a successful replace
        fsync_dir(os.path.dirname(final))
        return _tag_of(data)

    def drop_unfinished(self, prefix: str, stale: Callable[[str], bool]) -> int:
        """Removes the hidden temporaries (``.<name>.tmp-<hex>``) under ``prefix`` of the keys
        ``stale`` names, then the directories that leaves empty."""
        dropped = 0
        for dirpath, rel, names in list(self._walk(prefix)):
            for name in names:
                m = TEMP_RE.match(name)
                if m and (rel + m.group("base")).startswith(prefix) and stale(rel + m.group("base")):
                    remove_quiet(os.path.join(dirpath, name))
                    dropped += 1
                    self._prune(dirpath)
        return dropped

    def _prune(self, d: str) -> None:
        """Remove ``d`` and its parents while they are empty, so that the key 'a' can be written
        after 'a/b' was deleted. A put racing with this re-creates the directory (_write_temp)."""
        while d != self.root:
            try:
                os.rmdir(d)
            except OSError:
                break
            d = os.path.dirname(d)

    def delete(self, key: str) -> None:
        final = self._path(key)
        try:
            with self._lock(key):
                os.unlink(final)
        except (FileNotFoundError, NotADirectoryError):
            return
        except IsADirectoryError:
            return  # only a "directory" of other keys: no object under this key
        except OSError as e:
            raise self._io_error("delete", key, e) from e
        parent = os.path.dirname(final)
        fsync_dir(parent)
        self._prune(parent)


class _LocalWriter(ObjectWriter):
    def __init__(self, store: LocalStore, key: str):
        super().__init__(key)
        self.store = store
        self.final = store._path(key)
        try:
            self.tmp, fd = open_temp(self.final, make_dir=store._ensure_dir)
        except OSError as e:
            raise store._io_error("open_writer", key, e) from e
        self.f = os.fdopen(fd, "wb", buffering=0)  # payloads come in large pieces: no second copy
        # the disk writes each few MB while the next are encoded: commit's fsync waits for the last
        self.writeback = Writeback(fd)

    def _write(self, mv: memoryview) -> None:
        try:
            while mv:
                n = self.f.write(mv)
                self.writeback.wrote(n)
                mv = mv[n:]
        except OSError as e:
            raise self.store._io_error("write", self.key, e) from e

    def _commit(self) -> None:
        try:
            os.fsync(self.f.fileno())
            self.f.close()
        except OSError as e:
            raise self.store._io_error("commit", self.key, e) from e
        self.store._replace("commit", self.key, self.tmp, self.final)

    def _abort(self) -> None:
        try:
            self.f.close()
        finally:
            remove_quiet(self.tmp)
