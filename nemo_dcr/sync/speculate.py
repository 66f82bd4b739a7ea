"""The next version's first objects, asked for beside the HEAD read (issue 25: round trips).

A follower that reads HEAD to learn the newest version asks for that version's parts only once
HEAD has answered: two round trips before the first byte of a part, where a link with 40 ms of
latency makes them most of a small delta's reload. Object keys carry a publish id that no reader
can guess (two publishes of one version never share a key), so the publisher says ahead of time
where its next version will be: each manifest's ``meta[NEXT_META]`` names the publish id it
reserved for the version after it and that version's first objects (``hint``). A follower holding
that version sends GETs for them while it reads HEAD (``Speculation``); when HEAD then names that
very version, under that id, those parts are already arriving: one round trip instead of two.

Nothing is taken on trust: a part read so is checked like any other (its size and sha256 from
the manifest HEAD carries, each chunk against its pre-image), and it is only used for the key the
manifest names. A guess that missed (a version further on, another publisher or a retry under a
fresh id, an object not written yet) cost its GETs and nothing else: the follower reads as before.

Through a relay the guesses go on to the upstream, but a relay answers a guess the upstream
did not have moments ago itself, unless HEAD now names its version (``transport/guesses.py``):
misses cost the slow link at most one read per key per poll interval, however many children
guess. Not done: in a group (every rank reads what it applies), for a sync to a given version or
with HEAD given (``sync(head=...)``), with ``Follower(speculate=False)``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait

from nemo_dcr.sync.versions import Manifest, is_store_key, version_dir
from nemo_dcr.util.parallel import standing

__all__ = ["NEXT_META", "MAX_NAMES", "hint", "predicted", "Speculation"]

NEXT_META = "nemo_dcr.next"  # the manifest's meta key of the hint (reserved: a user's meta may not use it)
MAX_NAMES = 16  # objects named in a hint: the ones a follower's first downloads take


def hint(publish_id: str, names: list[str]) -> dict:
    """The hint a manifest carries: the next version's publish id and its first object names."""
    return {"publish_id": publish_id, "parts": list(names)[:MAX_NAMES]}


def predicted(m: Manifest | None, limit: int, window: float | None = None) -> list[str]:
    """The keys the version after ``m`` is expected to have, from the hint ``m`` carries: at most
    ``limit``, and of those only as many as the downloads' pacing would start at once
    (``sync/pace.py``: the next while the ones before it have at most ``window`` bytes to come),
    taking ``m``'s own delta parts' sizes as the likeliest (a version without one, whose next
    delta's sizes nothing tells: the first object alone, which the pacing starts at once in any
    case). [] without a hint (an older publisher) or with one that is not well formed (it
    is only a guess: never an error)."""
    h = m.meta.get(NEXT_META) if m is not None and isinstance(m.meta, dict) else None
    if m is None or not isinstance(h, dict) or limit <= 0:
        return []
    pid, names = h.get("publish_id"), h.get("parts")
    if not isinstance(pid, str) or not isinstance(names, list):
        return []
    d = version_dir(m.version + 1, pid)
    # delta parts in the store's own layout only (its one definition: sync/versions.py)
    keys = [k for k in (f"{d}/{n}" for n in names[:min(limit, MAX_NAMES)]
                        if isinstance(n, str) and n.startswith("part-")) if is_store_key(k)]
    if window is None:
        return keys
    if not m.parts:
        return keys[:1]
    n, ahead = 1, 0
    for p in m.parts[:len(keys) - 1]:
        ahead += p.size
        if ahead > window:
            break
        n += 1
    return keys[:n]


class Speculation:
    """GETs of ``keys`` under way, on the process's standing threads. ``take(key)``: that
    object's open stream ``(size, chunks)`` once its answer came, or None (not asked for, or
    missing, or failed: the caller reads it as usual). ``close``: the streams not taken are
    closed once their answers came. ``taken``: how many were."""

    def __init__(self, open_stream: Callable[[str], tuple[int, Iterator[bytes]]], keys: list[str]):
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {k: standing(open_stream, k) for k in keys}
        self.taken = 0

    def asked(self, key: str) -> bool:
        """Whether ``key`` was asked for and not yet taken."""
        with self._lock:
            return key in self._pending

    def take(self, key: str) -> tuple[int, Iterator[bytes]] | None:
        with self._lock:
            f = self._pending.pop(key, None)
        if f is None:
            return None
        try:
            opened = f.result()
        except Exception:  # noqa: BLE001 - missing (not written yet) or failed: read as usual
            return None
        with self._lock:
            self.taken += 1
        return opened

    def close(self) -> None:
        """Wait for the answers of the reads not taken and close their streams: a sync leaves no
        read behind (a miss is answered as soon as HEAD is, both one round trip)."""
        with self._lock:
            left, self._pending = list(self._pending.values()), {}
        wait(left)
        for f in left:
            if not f.cancelled() and f.exception() is None:
                close = getattr(f.result()[1], "close", None)
                if close is not None:
                    close()
