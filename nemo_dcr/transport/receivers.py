"""The receivers behind a relay, as they report themselves: each HEAD read may carry the
receiver's name and the version it holds (``X-Nemo-Dcr-Receiver``, ``X-Nemo-Dcr-Version``,
:meth:`nemo_dcr.stores.HttpStore.report`). The relay shows each one's version and its lag behind
the head (``/metrics``, ``.stats``, ``nemo-dcr status``). A receiver not heard from for ``ttl``
seconds is dropped (a long-polling follower asks at least once a minute); at most
``max_receivers`` are remembered, the longest silent going first."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from nemo_dcr.stores.base import StoreError
from nemo_dcr.stores.http import check_receiver_name

__all__ = ["Receivers", "Report"]

MAX_VERSION_DIGITS = 19


@dataclass
class Report:
    name: str
    version: int | None
    peer: str
    seen: float       # time.monotonic() of the last report
    seen_wall: float  # time.time() of the same


class Receivers:
    def __init__(self, ttl: float = 600.0, max_receivers: int = 10_000):
        self.ttl, self.max_receivers = float(ttl), int(max_receivers)
        self._by_name: OrderedDict[str, Report] = OrderedDict()

    def report(self, name: str | None, version: str | None, peer: str | None) -> bool:
        """Record a report (header values as sent); False if it is malformed (ignored)."""
        if not name:
            return False
        try:
            check_receiver_name(name)
        except StoreError:
            return False
        v = (version or "").strip()
        if v == "none":
            held = None
        elif v.isdigit() and len(v) <= MAX_VERSION_DIGITS:
            held = int(v)
        else:
            return False
        self._by_name[name] = Report(name, held, peer or "", time.monotonic(), time.time())
        self._by_name.move_to_end(name)
        while len(self._by_name) > self.max_receivers:
            self._by_name.popitem(last=False)
        return True

    def current(self) -> list:
        """The receivers heard from within ``ttl`` seconds, most recently heard last."""
        cutoff = time.monotonic() - self.ttl
        while self._by_name:
            first = next(iter(self._by_name.values()))
            if first.seen >= cutoff:
                break
            self._by_name.popitem(last=False)
        return list(self._by_name.values())

    def snapshot(self, head_version: int | None) -> list:
        """``[{"receiver", "version", "lag", "seen_seconds_ago", "peer"}]`` (lag in versions
        behind ``head_version``; None when either is unknown), sorted by name."""
        now = time.monotonic()
        out = []
        for r in sorted(self.current(), key=lambda r: r.name):
            lag = head_version - r.version if head_version is not None and r.version is not None else None
            out.append({"receiver": r.name, "version": r.version, "lag": max(0, lag) if lag is not None else None,
                        "seen_seconds_ago": round(now - r.seen, 3), "peer": r.peer})
        return out
