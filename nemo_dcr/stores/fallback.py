"""Read one store through a list of sources tried in order: a relay, its parent, ..., the store.

    >>> store = open_store(["http://relay-b:8470", "http://relay-a:8470", "s3://bucket/run1"])

A source that fails (refused, reset, timed out, an error status, a download cut short) is set
aside for ``retry_after`` seconds and the next one serves; a download broken off mid-object
resumes at the byte it reached from the next source (objects are immutable, and receivers check
every object's size and sha256 against the manifest anyway). After ``retry_after`` the first
sources are tried again first, so a restarted relay gets its children back. "Not found" is an
answer, not a failure: it is not retried elsewhere. Read-only: writes go to the store itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import NoReturn

from .base import NotFound, Store, StoreError
from .http import ReadOnlyStore, StoreUnavailable, wait_head

__all__ = ["FallbackStore"]


class FallbackStore(ReadOnlyStore):
    def __init__(self, sources: Sequence[Store], *, retry_after: float = 5.0):
        if not sources:
            raise StoreError("a fallback store needs at least one source")
        self.sources = list(sources)
        self.retry_after = float(retry_after)
        self.url = self.sources[0].url
        self._down_until = [0.0] * len(self.sources)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FallbackStore({[s.url for s in self.sources]!r})"

    # -- source selection ------------------------------------------------------------------

    def _order(self, exclude: set) -> list:
        """Indices to try: sources not set aside first, then the set-aside ones (better a
        source that failed a moment ago than none)."""
        now = time.monotonic()
        with self._lock:
            idx = [i for i in range(len(self.sources)) if i not in exclude]
            return [i for i in idx if self._down_until[i] <= now] + \
                   [i for i in idx if self._down_until[i] > now]

    def _mark(self, i: int, ok: bool) -> None:
        with self._lock:
            self._down_until[i] = 0.0 if ok else time.monotonic() + self.retry_after

    @property
    def active(self) -> str:
        """The URL of the source reads go to now."""
        return self.sources[self._order(set())[0]].url

    def _try(self, what: str, fn, exclude: set | None = None):
        """``(index, fn(source))`` from the first source that answers."""
        exclude = set() if exclude is None else exclude
        errors = []
        for i in self._order(exclude):
            try:
                out = fn(self.sources[i])
            except NotFound:
                self._mark(i, True)
                raise
            except StoreError as e:
                self._mark(i, False)
                exclude.add(i)
                errors.append(f"{self.sources[i].url}: {e}")
                continue
            self._mark(i, True)
            return i, out
        raise StoreUnavailable(f"{what}: no source could serve it: " + "; ".join(errors))

    # -- reads -----------------------------------------------------------------------------

    def get_stream(self, key: str, offset: int = 0) -> tuple[int, Iterator[bytes]]:
        tried: set = set()
        i, (size, first) = self._try(key, lambda s: s.get_stream(key, offset), tried)

        def chunks() -> Iterator[bytes]:
            nonlocal i
            pos, it = max(0, int(offset)), first
            try:
                while True:
                    try:
                        for b in it:
                            pos += len(b)
                            yield b
                        return
                    except NotFound:
                        raise
                    except StoreError as e:
                        self._mark(i, False)
                        tried.add(i)
                        it.close()
                        it = iter(())
                        try:
                            i, (n, it) = self._try(key, lambda s, at=pos: s.get_stream(key, at), tried)
                        except StoreUnavailable as e2:
                            raise StoreUnavailable(f"{key}: broke off at byte {pos} ({e}); {e2}") from None
                        if n != size:
                            raise StoreError(f"{key}: {self.sources[i].url} holds {n} bytes, "
                                             f"the source that broke off held {size}") from e
            finally:
                it.close()

        return size, chunks()

    def get_with_tag(self, key: str) -> tuple[bytes, str]:
        return self._try(key, lambda s: s.get_with_tag(key))[1]

    def get_if_changed(self, key: str, tag: str) -> tuple[bytes, str] | None:
        # a source that took over answers for the same object: the tag is the store's (a relay
        # passes its upstream's on), so an unchanged object is still recognised
        return self._try(key, lambda s: s.get_if_changed(key, tag))[1]

    def size(self, key: str) -> int:
        return self._try(key, lambda s: s.size(key))[1]

    def list(self, prefix: str = "") -> list[str]:
        return self._try(f"list({prefix!r})", lambda s: s.list(prefix))[1]

    def wait_head(self, newer_than: int | None, wait: float,
                  last: tuple[bytes, str] | None = None) -> tuple[bytes, str] | None:
        return self._try("HEAD", lambda s: wait_head(s, newer_than, wait, last))[1]

    def report(self, receiver: str, version: int | None) -> None:
        for s in self.sources:  # whichever serves the next HEAD read carries it
            s.report(receiver, version)

    def _read_only(self, op: str, key: str) -> NoReturn:
        raise StoreError(f"{op}({key!r}): {self!r} reads through relays and is read-only; "
                         "publish to the store itself")
