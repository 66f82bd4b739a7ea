"""``nemo-dcr status`` (and ``log``'s readable times) on a real store, a real relay process and
followers that report themselves to it."""
import json
import re

import pytest

from dcr_testing import zeros_like
from dcr_testing.cli import run_cli
from dcr_testing.relay import RelayProc, model, train_step
from nemo_dcr.cli.status import when
from nemo_dcr.stores import HttpStore, open_store
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher
from nemo_dcr.sync.retention import prune
from nemo_dcr.sync.versions import read_head, walk

pytest.importorskip("aiohttp")

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ"


@pytest.fixture
def run(tmp_path):
    """Versions 0..7 (keyframes at 0, 3, 6), retention down to keyframe 3, a relay, and two
    followers that reported: rollout-a at 7, rollout-b at 4."""
    store = open_store(tmp_path / "store")
    state = model()
    pub = Publisher(store, keyframe_every=3)
    for i in range(8):
        if i:
            train_step(state, i)
        pub.publish(state, step=100 + i)
    head, _ = read_head(store)
    prune(store, read_head(store)[0], keep=4)  # keeps 3..7
    r = RelayProc(store.url)
    try:
        a = Follower(HttpStore(r.url), zeros_like(state), name="rollout-a", verifier=None)
        b = Follower(HttpStore(r.url), zeros_like(state), name="rollout-b", verifier=None)
        assert a.sync().version == 7 and b.sync(4).version == 4
        a.read_head()
        b.read_head()  # the reports ride on HEAD reads
        yield store, r, head
    finally:
        r.stop()


def test_status_shows_head_recent_versions_retention_and_each_receivers_lag(run, capsys):
    store, relay, head = run
    manifests = list(walk(store, head))
    res = run_cli(capsys, "status", "--store", relay.url, "--json", "--limit", "3")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["head"]["version"] == 7 and s["head"]["keyframe_version"] == 6
    assert s["held"]["oldest"] == 3 and s["held"]["newest"] == 7 and s["held"]["count"] == 5
    assert [v["version"] for v in s["versions"]] == [7, 6, 5]
    for row, m in zip(s["versions"], manifests):
        assert (row["kind"], row["delta_bytes"], row["keyframe_bytes"], row["step"]) == \
            (m.kind, m.delta_bytes(), m.keyframe_bytes(), m.step)
        assert row["change_rate"] == m.change_rate and row["committed"] == when(m.created)
    got = {r["receiver"]: (r["version"], r["lag"]) for r in s["receivers"]}
    assert got == {"rollout-a": (7, 0), "rollout-b": (4, 3)}

    res = run_cli(capsys, "status", "--store", relay.url)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert re.search(rf"HEAD +version 7 \(keyframe 6\), committed {STAMP}, .* ago; unsigned", out), out
    assert "versions 3..7 (5)" in out
    assert re.search(r"rollout-a +7 +0 ", out) and re.search(r"rollout-b +4 +3 ", out), out
    for m in manifests[:5]:
        assert re.search(rf"^ +{m.version} +{re.escape(when(m.created))} ", out, re.M), (m.version, out)


def test_status_of_a_store_with_a_relay_watched(run, capsys):
    store, relay, _ = run
    res = run_cli(capsys, "status", "--store", store.url, "--relay", relay.url, "--watch", "0.01", "--count", "2")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("HEAD      version 7") == 2 and res.stdout.count("rollout-b") == 2
    res = run_cli(capsys, "status", "--store", store.url)  # no relay: no receivers section
    assert res.returncode == 0 and "receivers" not in res.stdout and "HEAD      version 7" in res.stdout


def test_status_of_an_empty_store_and_a_missing_one(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    res = run_cli(capsys, "status", "--store", tmp_path / "empty")
    assert res.returncode == 0 and "nothing committed yet" in res.stdout
    res = run_cli(capsys, "status", "--store", tmp_path / "missing")
    assert res.returncode == 1 and "does not exist" in res.stderr


def test_log_prints_readable_commit_times(tmp_path, capsys):
    store = open_store(tmp_path / "store")
    state = model()
    Publisher(store).publish(state)
    res = run_cli(capsys, "log", "--store", store.url)
    created = next(walk(store, read_head(store)[0])).created
    assert "committed (UTC)" in res.stdout and when(created) in res.stdout
    assert re.fullmatch(STAMP, json.loads(run_cli(capsys, "log", "--store", store.url, "--json").stdout)[0]
                        ["committed"])
