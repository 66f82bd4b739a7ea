"""Prometheus metrics of a relay and a follower, and a small exporter for a follower's
(``prometheus_client``: ``pip install "nemo-dcr[relay]"``).

A relay serves its own at ``/metrics`` (and ``/healthz``). A follower's::

    f = Follower(store, tensors, name="rollout-3", metrics_port=9464)   # /metrics, /healthz
    # or: m = FollowerMetrics(); Follower(..., metrics=m); srv = serve(m, 9464)

Relay (``nemo_dcr_relay_*``): requests, bytes served, cache hits, coalesced requests, upstream
fetches and errors, objects refused or withdrawn, cache size, the head version, and per receiver
(as receivers report themselves, :meth:`nemo_dcr.stores.HttpStore.report`) its version and lag;
histograms of upstream object fetches and HEAD reads. Follower (``nemo_dcr_follower_*``): the
version held, the newest version seen at HEAD and the lag between them, syncs by result, bytes
fetched, elements changed, paths given up; histograms of object fetches, applies and whole syncs.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from nemo_dcr.util.extras import require

__all__ = ["RelayMetrics", "FollowerMetrics", "MetricsServer", "serve", "available"]

# seconds: from a cached object on a LAN to a large part over a slow link
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _prom() -> Any:
    return require("prometheus_client", "relay", "metrics")


def available() -> bool:
    """Whether prometheus_client is installed."""
    try:
        _prom()
    except ImportError:
        return False
    return True


def _nan(v) -> float:
    return float("nan") if v is None else float(v)


class RelayMetrics:
    """A relay's metrics: its counters (``stats()``, read at each scrape) and two histograms the
    relay observes into."""

    COUNTERS = {  # .stats field -> (metric, help)
        "requests": ("requests", "requests received"),
        "refused": ("refused_requests", "requests refused (token, path, method)"),
        "served_bytes": ("served_bytes", "object bytes sent to children"),
        "cache_hits": ("cache_hits", "object requests served from the cache"),
        "coalesced": ("coalesced_requests", "object requests that joined a download in flight"),
        "upstream_fetches": ("upstream_fetches", "objects downloaded from the upstream"),
        "upstream_errors": ("upstream_errors", "upstream downloads that failed"),
        "bad_objects": ("bad_objects", "objects not kept: not what their vouched manifest (or HEAD) records"),
        "withdrawn_objects": ("withdrawn_objects", "cached objects dropped when HEAD recorded another identity"),
        "upstream_head_reads": ("upstream_head_reads", "HEAD reads of the upstream"),
        "head_waits": ("head_waits", "long polls parked"),
        "head_not_modified": ("head_not_modified", "HEAD reads answered 304: the child held that HEAD"),
        "guesses_answered": ("guesses_answered", "reads of a version not yet committed answered here, not upstream"),
        "evicted_old_versions": ("evicted_old_version_objects", "objects of versions retention removed, dropped"),
    }
    GAUGES = {
        "cache_bytes": ("cache_bytes", "bytes in the cache"),
        "cache_entries": ("cache_objects", "objects in the cache"),
        "cache_max_bytes": ("cache_max_bytes", "the cache's size cap"),
        "head_waiters": ("head_waiters", "long polls parked now"),
    }

    def __init__(self, stats: Callable[[], dict]):
        p = _prom()
        self.registry = p.CollectorRegistry()
        self.fetch_seconds = p.Histogram("nemo_dcr_relay_upstream_fetch_seconds",
                                         "seconds to download one object from the upstream",
                                         buckets=_BUCKETS, registry=self.registry)
        self.head_read_seconds = p.Histogram("nemo_dcr_relay_upstream_head_read_seconds",
                                             "seconds to read the upstream's HEAD", buckets=_BUCKETS,
                                             registry=self.registry)
        self._stats = stats
        self.registry.register(self)

    def collect(self):  # the prometheus_client collector protocol
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        s = self._stats()
        for field, (name, doc) in self.COUNTERS.items():
            yield CounterMetricFamily(f"nemo_dcr_relay_{name}", doc, value=s.get(field, 0))
        for field, (name, doc) in self.GAUGES.items():
            yield GaugeMetricFamily(f"nemo_dcr_relay_{name}", doc, value=s.get(field, 0))
        yield GaugeMetricFamily("nemo_dcr_relay_head_version", "the version the upstream's HEAD names (NaN: none)",
                                value=_nan(s.get("head_version")))
        receivers = s.get("receivers", [])
        yield GaugeMetricFamily("nemo_dcr_relay_receivers", "receivers that reported within the last 10 minutes",
                                value=len(receivers))
        version = GaugeMetricFamily("nemo_dcr_relay_receiver_version", "the version a receiver reported holding "
                                    "(NaN: none yet)", labels=["receiver"])
        lag = GaugeMetricFamily("nemo_dcr_relay_receiver_lag_versions", "versions a receiver is behind the head",
                                labels=["receiver"])
        seen = GaugeMetricFamily("nemo_dcr_relay_receiver_last_report_seconds", "seconds since a receiver's "
                                 "last report", labels=["receiver"])
        for r in receivers:
            version.add_metric([r["receiver"]], _nan(r["version"]))
            lag.add_metric([r["receiver"]], _nan(r["lag"]))
            seen.add_metric([r["receiver"]], r["seen_seconds_ago"])
        yield version
        yield lag
        yield seen

    def render(self) -> tuple[bytes, str]:
        """(the exposition text, its content type)."""
        p = _prom()
        return p.generate_latest(self.registry), p.CONTENT_TYPE_LATEST


class FollowerMetrics:
    """A follower's metrics, in ``registry`` (default: a registry of its own)."""

    def __init__(self, registry=None):
        p = _prom()
        self.registry = registry if registry is not None else p.CollectorRegistry()
        r = self.registry
        self.version = p.Gauge("nemo_dcr_follower_version", "the verified version held (NaN: none)", registry=r)
        self.head_version = p.Gauge("nemo_dcr_follower_head_version", "the newest version seen at HEAD (NaN: none)",
                                    registry=r)
        self.lag = p.Gauge("nemo_dcr_follower_lag_versions", "versions the follower is behind the newest seen "
                           "(NaN: unknown)", registry=r)
        self.syncs = p.Counter("nemo_dcr_follower_syncs", "syncs, by result", ["result"], registry=r)
        self.fetched_bytes = p.Counter("nemo_dcr_follower_fetched_bytes", "object bytes fetched and applied",
                                       registry=r)
        self.changed = p.Counter("nemo_dcr_follower_changed_elements", "tensor elements changed", registry=r)
        self.fallbacks = p.Counter("nemo_dcr_follower_fallbacks", "paths given up (missing or corrupt objects)",
                                   registry=r)
        self.fetch_seconds = p.Histogram("nemo_dcr_follower_fetch_seconds", "seconds to fetch one object",
                                         buckets=_BUCKETS, registry=r)
        self.apply_seconds = p.Histogram("nemo_dcr_follower_apply_seconds", "seconds to apply one part",
                                         buckets=_BUCKETS, registry=r)
        self.sync_seconds = p.Histogram("nemo_dcr_follower_sync_seconds", "seconds per sync that changed the "
                                        "tensors", buckets=_BUCKETS, registry=r)
        for result in ("ok", "error"):
            self.syncs.labels(result)  # both series exist from the start
        self._held: int | None = None
        self._newest: int | None = None
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._set()

    def _set(self) -> None:
        self.version.set(_nan(self._held))
        self.head_version.set(_nan(self._newest))
        held, newest = self._held, self._newest
        self.lag.set(max(0, newest - held) if held is not None and newest is not None else float("nan"))

    def seen_head(self, version: int | None) -> None:
        with self._lock:
            if version is not None and (self._newest is None or version > self._newest):
                self._newest = version
            self._set()

    def held(self, version: int | None) -> None:
        with self._lock:
            self._held = version
            if version is not None and (self._newest is None or version > self._newest):
                self._newest = version
            self._set()

    def synced(self, res) -> None:
        """A sync that returned ``res`` (a SyncResult)."""
        self.syncs.labels("ok").inc()
        self.fetched_bytes.inc(res.bytes)
        self.changed.inc(res.changed)
        self.fallbacks.inc(len(res.fallbacks))
        for span in res.spans:
            if span.stage == "fetch":
                self.fetch_seconds.observe(span.seconds)
            elif span.stage == "apply":
                self.apply_seconds.observe(span.seconds)
        if res.updated:
            self.sync_seconds.observe(res.seconds)
        self.last_error = None
        self.held(res.version)

    def failed(self, error: BaseException, version: int | None) -> None:
        self.syncs.labels("error").inc()
        self.last_error = f"{type(error).__name__}: {error}"
        self.held(version)

    def health(self) -> tuple[bool, str]:
        """(healthy, one line): unhealthy while the last sync failed."""
        with self._lock:
            held = self._held
        if self.last_error is not None:
            return False, f"last sync failed: {self.last_error.splitlines()[0][:300]}"
        return True, f"ok: version {held if held is not None else 'none'}"


class MetricsServer:
    """``/metrics`` and ``/healthz`` over HTTP on a daemon thread; ``close()`` stops it."""

    def __init__(self, metrics, port: int = 0, host: str = "127.0.0.1"):
        p = _prom()
        registry, health = metrics.registry, getattr(metrics, "health", None)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # scrapes are not news
                pass

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    status, body, ctype = 200, p.generate_latest(registry), p.CONTENT_TYPE_LATEST
                elif path == "/healthz":
                    ok, text = health() if health is not None else (True, "ok")
                    status, body, ctype = (200 if ok else 503), (text + "\n").encode(), "text/plain; charset=utf-8"
                else:
                    status, body, ctype = 404, b"not found: /metrics and /healthz are served here\n", "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        h = f"[{host}]" if ":" in host else host
        self.url = f"http://{h}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="nemo-dcr-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(metrics, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``metrics`` (a FollowerMetrics or RelayMetrics: anything with a ``registry``) at
    ``http://host:port/metrics``, and its health at ``/healthz`` (port 0: a free one)."""
    return MetricsServer(metrics, port, host)
