"""A run you can watch: ``/metrics`` of a real relay process and of a follower's exporter, scraped
over HTTP and read with prometheus_client's own parser; the values are checked against what the
receiver actually fetched and holds."""
import math
import urllib.error
import urllib.request

import pytest

from dcr_testing import assert_state, zeros_like
from dcr_testing.relay import RelayProc, model, train_step
from nemo_dcr.stores import HttpStore, StoreError, open_store
from nemo_dcr.stores.passthrough import PassThroughStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher

pytest.importorskip("aiohttp")
parser = pytest.importorskip("prometheus_client.parser")


def scrape(url: str) -> dict:
    """``{(sample name, ((label, value), ...)): value}`` from ``url`` (a /metrics endpoint)."""
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Counting(PassThroughStore):
    """The receiver's store, counting the object bytes it reads (HEAD reads aside)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.bytes = 0

    def get(self, key):
        data = self.inner.get(key)
        if key != "HEAD":
            self.bytes += len(data)
        return data

    def get_stream(self, key, offset=0):
        size, chunks = self.inner.get_stream(key, offset)

        def counted():
            for b in chunks:
                if key != "HEAD":
                    self.bytes += len(b)
                yield b
        return size, counted()


def test_relay_and_follower_metrics_agree_with_what_the_receiver_fetched_and_holds(tmp_path):
    store = open_store(tmp_path / "store")
    state = model()
    pub = Publisher(store)
    pub.publish(state)
    train_step(state, 1)
    pub.publish(state)
    r = RelayProc(store.url)
    f = None
    try:
        seen = Counting(HttpStore(r.url))
        f = Follower(seen, zeros_like(state), name="rollout-1", metrics_port=0, verifier=None)
        furl = f.metrics_server.url
        fm = scrape(furl + "/metrics")
        assert math.isnan(fm[("nemo_dcr_follower_version", ())])  # nothing held yet
        assert health(furl) == (200, "ok: version none\n")

        res = f.sync()
        assert res.version == 1
        assert_state(f.tensors, state)
        train_step(state, 2)
        pub.publish(state)
        assert f.read_head().version == 2  # carries the report: rollout-1 holds version 1

        rm = scrape(r.url + "/metrics")
        assert rm[("nemo_dcr_relay_served_bytes_total", ())] == seen.bytes > 0
        assert rm[("nemo_dcr_relay_head_version", ())] == 2
        assert rm[("nemo_dcr_relay_receivers", ())] == 1
        assert rm[("nemo_dcr_relay_receiver_version", (("receiver", "rollout-1"),))] == 1
        assert rm[("nemo_dcr_relay_receiver_lag_versions", (("receiver", "rollout-1"),))] == 1
        st = HttpStore(r.url).stats()
        assert rm[("nemo_dcr_relay_upstream_fetches_total", ())] == st["upstream_fetches"] > 0
        assert rm[("nemo_dcr_relay_upstream_fetch_seconds_count", ())] == st["upstream_fetches"]
        assert rm[("nemo_dcr_relay_upstream_head_read_seconds_count", ())] >= 2
        assert st["receivers"][0]["receiver"] == "rollout-1" and st["receivers"][0]["lag"] == 1

        fm = scrape(furl + "/metrics")
        assert fm[("nemo_dcr_follower_version", ())] == 1
        assert fm[("nemo_dcr_follower_head_version", ())] == 2
        assert fm[("nemo_dcr_follower_lag_versions", ())] == 1
        assert fm[("nemo_dcr_follower_syncs_total", (("result", "ok"),))] == 1
        assert fm[("nemo_dcr_follower_syncs_total", (("result", "error"),))] == 0
        assert fm[("nemo_dcr_follower_fetched_bytes_total", ())] == res.bytes > 0
        assert fm[("nemo_dcr_follower_changed_elements_total", ())] == res.changed
        n_fetch = sum(1 for s in res.spans if s.stage == "fetch")
        assert fm[("nemo_dcr_follower_fetch_seconds_count", ())] == n_fetch > 0
        assert fm[("nemo_dcr_follower_apply_seconds_count", ())] == sum(1 for s in res.spans if s.stage == "apply")
        assert fm[("nemo_dcr_follower_sync_seconds_count", ())] == 1

        f.sync()
        assert_state(f.tensors, state)
        f.read_head()
        rm = scrape(r.url + "/metrics")
        assert rm[("nemo_dcr_relay_receiver_version", (("receiver", "rollout-1"),))] == 2
        assert rm[("nemo_dcr_relay_receiver_lag_versions", (("receiver", "rollout-1"),))] == 0
        assert rm[("nemo_dcr_relay_served_bytes_total", ())] == seen.bytes
        fm = scrape(furl + "/metrics")
        assert fm[("nemo_dcr_follower_version", ())] == 2 and fm[("nemo_dcr_follower_lag_versions", ())] == 0
        assert health(furl) == (200, "ok: version 2\n")
        assert health(r.url)[0] == 200
    finally:
        if f is not None and f.metrics_server is not None:
            f.metrics_server.close()
        r.stop()


def test_health_turns_503_when_the_upstream_or_the_last_sync_fails(tmp_path):
    store = open_store(tmp_path / "store")
    state = model()
    Publisher(store).publish(state)
    a = RelayProc(store.url)
    b = RelayProc(a.url)
    f = None
    try:
        assert health(b.url)[0] == 200
        f = Follower(HttpStore(b.url, timeout=5), zeros_like(state), metrics_port=0, verifier=None)
        assert f.sync().version == 0
        a.kill()  # B's upstream is gone
        status, text = health(b.url)
        assert status == 503 and "upstream" in text
        with pytest.raises(StoreError, match="502"):
            f.sync()
        status, text = health(f.metrics_server.url)
        assert status == 503 and text.startswith("last sync failed")
        fm = scrape(f.metrics_server.url + "/metrics")
        assert fm[("nemo_dcr_follower_syncs_total", (("result", "error"),))] == 1
        assert fm[("nemo_dcr_follower_version", ())] == 0  # still verified at 0
    finally:
        if f is not None and f.metrics_server is not None:
            f.metrics_server.close()
        b.stop()
        a.stop()


def test_metrics_need_the_token_health_does_not(tmp_path):
    store = open_store(tmp_path / "store")
    Publisher(store).publish(model())
    (tmp_path / "token").write_text("tok-123456789\n")
    r = RelayProc(store.url, "--token-file", tmp_path / "token", "--prefix", "run1")
    base = r.url.rsplit("/", 1)[0]  # /metrics and /healthz are at the root, whatever the prefix
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/metrics", timeout=30)
        assert e.value.code == 401
        req = urllib.request.Request(base + "/metrics", headers={"Authorization": "Bearer tok-123456789"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            families = {fam.name for fam in parser.text_string_to_metric_families(resp.read().decode())}
        assert "nemo_dcr_relay_requests" in families
        assert health(base)[0] == 200
    finally:
        r.stop()


def test_a_followers_default_name_is_a_valid_receiver_name_whatever_the_host_is_called(tmp_path, monkeypatch):
    import os
    import socket
    store = open_store(tmp_path / "store")
    Publisher(store).publish(model())
    for host in ("_weird host!", "", "node_1.cluster"):
        monkeypatch.setattr(socket, "gethostname", lambda h=host: h)
        f = Follower(store, zeros_like(model()), verifier=None)
        assert f.name.endswith(f"-{os.getpid()}") and " " not in f.name and not f.name.startswith(("_", "-"))
    with pytest.raises(StoreError, match="receiver name"):
        Follower(store, zeros_like(model()), name="bad name", verifier=None)
