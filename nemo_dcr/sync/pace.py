"""Downloads paced by the bandwidth-delay product (issue 25).

A receiver downloads a version's objects in order over one link. Started all at once they share
the link: the first object arrives as late as the last, and nothing of it can be applied before.
Started one after the other, each request's round trip leaves the link idle. The rule here lies
between: the next download starts when the ones running have about one bandwidth-delay product
(BDP) left, the bytes the link carries in one round trip, so that the new request's first byte
arrives as the link frees up. On a bandwidth-bound link (objects larger than the BDP) downloads
run one after the other with no gap, the first object early; on a latency-bound one (objects
smaller than the BDP) several are in flight at once, their round trips overlapping, as many as
the receiver's ``prefetch`` allows.

The link is estimated from the downloads themselves (:class:`LinkEstimate`): the round trip is a
request's time to its first byte (the least of the recent ones; a receiver may add other small
requests, its HEAD read), the bandwidth the bytes that arrived over the time any download was
receiving (all of them together: parallel downloads share the link, and are counted once). A
first read's bytes are not counted (they end the round trip, not a stretch of receiving). Until
both are known, a download starts while the ones running have at most ``INITIAL_WINDOW`` left.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: bytes the running downloads may still have to come when the next starts, before the link is
#: known: objects smaller than this start together (a receiver's first sync of small objects is
#: latency-bound), larger ones one after another until the first reads say what the link is
INITIAL_WINDOW = 1 << 20
#: bytes counted before the bandwidth is believed (fewer: the first reads come from buffers)
MIN_BYTES = 64 << 10
ROUND_TRIPS = 8  # recent round trips kept (the least is the estimate: queueing only adds)


class LinkEstimate:
    """The round trip and bandwidth of a receiver's link, from its downloads. Kept across syncs
    (``age`` before each: older measurements count half)."""

    def __init__(self) -> None:
        self._rtts: deque[float] = deque(maxlen=ROUND_TRIPS)
        self.received = 0.0  # bytes counted ...
        self.busy = 0.0      # ... over seconds in which some download was receiving

    def round_trip(self, seconds: float) -> None:
        if seconds >= 0:
            self._rtts.append(seconds)

    @property
    def rtt(self) -> float | None:
        return min(self._rtts) if self._rtts else None

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second, once ``MIN_BYTES`` were counted."""
        return self.received / self.busy if self.busy > 0 and self.received >= MIN_BYTES else None

    def bdp(self) -> float | None:
        rtt, bw = self.rtt, self.bandwidth
        return None if rtt is None or bw is None else rtt * bw

    def age(self) -> None:
        self.received /= 2
        self.busy /= 2


@dataclass
class _Download:
    size: int
    started: float
    got: int = 0
    first: float | None = None  # when its first bytes came
    early: bool = False  # its request went out earlier (sync/speculate.py): no round trip measured


class Pacer:
    """Which download may start when, for one receiver's downloads (the caller serialises the
    calls: its own lock). ``started(i, size)`` when download ``i`` sends its request,
    ``received(i, n)`` with its bytes so far (a retry starts again from 0), ``ended(i)``;
    ``ready()``: whether the next may start now."""

    def __init__(self, link: LinkEstimate | None = None, clock: Callable[[], float] = time.monotonic):
        self.link = link if link is not None else LinkEstimate()
        self._clock = clock
        self._running: dict[int, _Download] = {}
        self._last = clock()

    def _account(self, now: float) -> None:
        """The time since the last event counts as busy if some download was receiving."""
        if any(d.first is not None for d in self._running.values()):
            self.link.busy += max(0.0, now - self._last)
        self._last = now

    def started(self, i: int, size: int, early: bool = False) -> None:
        """``early``: its request was sent before (a read beside HEAD): its time to a first byte
        is no round trip (the bytes may be waiting already). Its first read is not counted as
        bandwidth, as any download's; what it receives after that is."""
        now = self._clock()
        self._account(now)
        self._running[i] = _Download(int(size), now, early=early)

    def received(self, i: int, n: int) -> None:
        d = self._running.get(i)
        if d is None:
            return
        now = self._clock()
        self._account(now)
        if n < d.got:  # a retry: its bytes come again
            d.got = n
        elif d.first is None:
            d.first = now
            if not d.early:
                self.link.round_trip(now - d.started)
            d.got = n
        else:
            self.link.received += n - d.got
            d.got = n

    def ended(self, i: int) -> None:
        self._account(self._clock())
        self._running.pop(i, None)

    def left(self) -> int:
        """Bytes the running downloads still have to come."""
        return sum(max(0, d.size - d.got) for d in self._running.values())

    def window(self) -> float:
        """What the running downloads may have left when the next starts: one BDP (before the
        link is known, ``INITIAL_WINDOW``)."""
        bdp = self.link.bdp()
        return INITIAL_WINDOW if bdp is None else bdp

    def ready(self) -> bool:
        return not self._running or self.left() <= self.window()
