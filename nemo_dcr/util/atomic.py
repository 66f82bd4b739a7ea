"""Writing files so that a reader, or the next run after a crash, sees the old or the new
content whole, never a mix. One implementation for every writer in the package (checkpoint
outputs, local store objects, S3 downloads, the native kernel's build cache).

* One file: the data goes to a hidden temporary file next to the target
  (``.<name>.tmp-<32 hex>``), created exclusively with the umask's mode, fsync'ed, then
  ``os.replace``\\ d over the target, then the directory is fsync'ed.
* A set of files in one directory (a sharded checkpoint): :class:`FileSet`. Every new file is
  written as a temporary, then a journal naming the renames and deletions is committed (itself
  by temp + rename), then the renames and deletions run, then the journal goes. A kill before
  the journal leaves the old files (and temporaries the next :class:`FileSet` on the directory
  removes); a kill after it is rolled forward by :func:`recover`. Writers hold an exclusive
  ``flock`` on the directory, so one never removes another's live temporaries.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator

JOURNAL = ".nemo-dcr-journal.json"
TEMP_RE = re.compile(r"^\.(?P<base>.+)\.tmp-[0-9a-f]{32}$")


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in ``path`` durable (best effort: some file systems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def temp_name(final: str) -> str:
    """A fresh hidden temporary name next to ``final`` (same directory: the rename stays atomic)."""
    d, base = os.path.split(final)
    return os.path.join(d, f".{base}.tmp-{uuid.uuid4().hex}")


def open_temp(final: str, *, make_dir: Callable[[str], None] | None = None) -> tuple[str, int]:
    """``(path, fd)`` of a new, empty temporary next to ``final``, open for writing. ``make_dir``
    (re)creates the directory first, and again if it vanished under us (a local store prunes
    empty directories concurrently)."""
    d = os.path.dirname(final)
    for attempt in range(1000):
        if make_dir is not None:
            make_dir(d)
        tmp = temp_name(final)
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides the mode
        except FileNotFoundError:
            if make_dir is None or attempt == 999:
                raise
    raise AssertionError("unreachable")  # the last attempt raises


def write_temp(final: str, fill: Callable, *, make_dir: Callable[[str], None] | None = None) -> str:
    """Create a temporary next to ``final`` (``open_temp``), fill it with ``fill(f)``, fsync it,
    return its path. On failure nothing is left behind."""
    tmp, fd = open_temp(final, make_dir=make_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        remove_quiet(tmp)
        raise
    return tmp


def keep_mode(tmp: str, final: str) -> None:
    """Give ``tmp`` the permission bits of the file it will replace (an in-place rewrite keeps 0644)."""
    try:
        mode = os.stat(final).st_mode & 0o7777
    except OSError:
        return
    os.chmod(tmp, mode)


def install(tmp: str, final: str, *, lock=None) -> None:
    """Rename ``tmp`` over ``final`` (under ``lock`` when given) and make it durable; on failure
    remove ``tmp`` and raise."""
    try:
        with lock if lock is not None else contextlib.nullcontext():
            os.replace(tmp, final)
    except BaseException:
        remove_quiet(tmp)
        raise
    fsync_dir(os.path.dirname(final))


def write_atomic(final: str, data: bytes) -> None:
    install(write_temp(final, lambda f: f.write(data)), final)


@contextlib.contextmanager
def replacing(final: str, *, same_mode: bool = False) -> Iterator[str]:
    """Yield a temporary path next to ``final`` for the caller to fill (by path: a compiler, a
    downloader); on success fsync it and rename it over ``final``; on any error remove it."""
    tmp = temp_name(final)
    try:
        yield tmp
        fsync_file(tmp)
        if same_mode:
            keep_mode(tmp, final)
    except BaseException:
        remove_quiet(tmp)
        raise
    install(tmp, final)


@contextlib.contextmanager
def dir_lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on the directory itself: writers of one directory take turns."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_temps(dirpath: str, base: str | None = None) -> list[str]:
    """Remove temporaries left in ``dirpath`` by killed writers (all of them, or those for the
    target name ``base``). Only call this holding :func:`dir_lock` on ``dirpath``."""
    gone: list[str] = []
    try:
        names = os.listdir(dirpath)
    except OSError:
        return gone
    for n in names:
        m = TEMP_RE.match(n)
        if m is None or (base is not None and m.group("base") != base):
            continue
        p = os.path.join(dirpath, n)
        if os.path.isfile(p) and not os.path.islink(p):
            remove_quiet(p)
            gone.append(n)
    if gone:
        fsync_dir(dirpath)
    return gone


@contextlib.contextmanager
def output_file(out: str) -> Iterator[str]:
    """:func:`replacing` for a user-named output file: its directory is created if missing
    (umask mode), writers of that directory take turns, temporaries that killed runs left for
    the same name are removed first, and a replaced file keeps its mode."""
    parent, base = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with dir_lock(parent):
        remove_temps(parent, base)
        with replacing(os.path.join(parent, base), same_mode=True) as tmp:
            yield tmp
            fault("written")


def _plain(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _journal_ops(dirpath: str) -> tuple[list, list] | None:
    path = os.path.join(dirpath, JOURNAL)
    try:
        with open(path, "rb") as f:
            j = json.loads(f.read())
        ren, dele = j["replace"], j["delete"]
        ok = (all(isinstance(p, list) and len(p) == 2 and TEMP_RE.match(str(p[0])) and _plain(p[0]) and _plain(p[1])
                  for p in ren) and all(_plain(n) for n in dele))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        from nemo_dcr.errors import DcrError
        raise DcrError(f"{path}: unreadable journal of an interrupted write; inspect the directory, "
                       f"then remove it")
    return ren, dele


def _roll_forward(dirpath: str, ren: list, dele: list) -> None:
    for tmp, final in ren:
        t = os.path.join(dirpath, tmp)
        if os.path.lexists(t):  # else: renamed before the kill
            os.replace(t, os.path.join(dirpath, final))
            fault("mid-swap")
    for n in dele:
        try:
            os.unlink(os.path.join(dirpath, n))
        except FileNotFoundError:
            pass
    fsync_dir(dirpath)
    os.unlink(os.path.join(dirpath, JOURNAL))
    fsync_dir(dirpath)


def recover(dirpath: str, *, locked: bool = False) -> bool:
    """Finish a file-set replacement that a kill interrupted after its commit point. Returns
    whether there was one."""
    if not os.path.lexists(os.path.join(dirpath, JOURNAL)):
        return False
    with contextlib.nullcontext() if locked else dir_lock(dirpath):
        ops = _journal_ops(dirpath)  # again, under the lock: another process may have finished it
        if ops is None:
            return False
        _roll_forward(dirpath, *ops)
    return True


class FileSet:
    """Replace some files of one directory as a unit, leaving every other file alone.

        with FileSet(dirpath, delete=["old-shard.safetensors"]) as fs:
            write_into(fs.temp("model.safetensors"))
        # committed here; on an exception nothing changed

    Files named in ``delete`` and not written are removed at the commit. Temporaries of killed
    writers are removed, and an interrupted commit is finished, when the set opens."""

    def __init__(self, dirpath: str, *, delete=(), same_mode: bool = True):
        self.dir = dirpath
        self.delete = list(delete)
        self.same_mode = same_mode
        self._temps: dict[str, str] = {}
        self._lock: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> FileSet:
        lock = self._lock = dir_lock(self.dir)
        lock.__enter__()
        try:
            recover(self.dir, locked=True)
            remove_temps(self.dir)
        except BaseException:
            lock.__exit__(None, None, None)
            raise
        return self

    def temp(self, name: str) -> str:
        """The temporary path to write ``name``'s new content to (created empty, umask mode)."""
        if not _plain(name) or name in self._temps:
            raise ValueError(f"bad or repeated file name {name!r}")
        tmp = write_temp(os.path.join(self.dir, name), lambda f: None)
        self._temps[name] = tmp
        return tmp

    def _commit(self) -> None:
        fault("written")
        ren = []
        for name, tmp in self._temps.items():
            final = os.path.join(self.dir, name)
            fsync_file(tmp)
            if self.same_mode:
                keep_mode(tmp, final)
            ren.append([os.path.basename(tmp), name])
        dele = [n for n in self.delete if n not in self._temps and os.path.lexists(os.path.join(self.dir, n))]
        fsync_dir(self.dir)
        journal = json.dumps({"replace": ren, "delete": dele}).encode()
        install(write_temp(os.path.join(self.dir, JOURNAL), lambda f: f.write(journal)),
                os.path.join(self.dir, JOURNAL))  # the commit point
        fault("committed")
        _roll_forward(self.dir, ren, dele)

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self._commit()
            else:
                for tmp in self._temps.values():
                    remove_quiet(tmp)
        finally:
            if self._lock is None:  # __exit__ without __enter__: a caller bug, not something to commit
                raise RuntimeError("FileSet used without entering it")
            self._lock.__exit__(None, None, None)
        return False


def fault(point: str) -> None:
    """Fault injection for the crash tests: ``NEMO_DCR_KILL_AT=<point>`` SIGKILLs this process
    when it reaches ``point``. Costs one environment lookup."""
    if os.environ.get("NEMO_DCR_KILL_AT") == point:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)

