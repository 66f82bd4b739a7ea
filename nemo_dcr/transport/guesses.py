"""Reads of a version the relay has not seen committed: followers' guesses (sync/speculate.py).

A follower asks for the next version's first objects beside its HEAD read. Passed upstream as
they come, the reads of a version not yet published would cross the slow link once per child
and per sync. So the relay passes on the first read of such a key (it may be there: the version
may have been committed since the relay last read HEAD, and then it arrives a round trip
earlier) and remembers a miss for ``ttl`` seconds. A read of that key within them is answered
after a fresh HEAD read (shared with the HEAD reads the children send beside their guesses):
passed on if HEAD now names the version, 404 here if not. Misses then cost the upstream at most
one read per key per ``ttl``, however many children guess.
"""
from __future__ import annotations

import time
from collections import OrderedDict

__all__ = ["Misses"]


class Misses:
    """Keys the upstream did not have, each for ``ttl`` seconds (at most ``cap``, oldest dropped).
    Used on the relay's event loop only."""

    def __init__(self, ttl: float, cap: int = 4096, clock=time.monotonic):
        self.ttl, self.cap, self._clock = float(ttl), int(cap), clock
        self._at: OrderedDict[str, float] = OrderedDict()

    def missed(self, key: str) -> None:
        self._at[key] = self._clock()
        self._at.move_to_end(key)
        while len(self._at) > self.cap:
            self._at.popitem(last=False)

    def recent(self, key: str) -> bool:
        t = self._at.get(key)
        if t is None:
            return False
        if self._clock() - t > self.ttl:
            del self._at[key]
            return False
        return True

    def found(self, key: str) -> None:
        self._at.pop(key, None)
