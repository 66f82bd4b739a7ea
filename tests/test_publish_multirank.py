"""Publisher/Follower across processes: a TP=4 trainer group commits versions jointly over gloo,
a TP=2 receiver group (and a single unsharded receiver) follows them bit-exactly; a publishing
rank that dies or raises mid-upload leaves no version, and a fresh group carries on.

Workers live in mp_workers.py and are started from a fork server (a clean, single-threaded
process that has imported torch once; nothing is inherited from this pytest process but what
the arguments carry, so the S3 credentials travel in the store spec); every collective has a timeout
(mp_workers.TIMEOUT) and every group a deadline here, so a hang fails the test instead of
blocking CI."""
import os
import time

import pytest
import torch

from dcr_testing import assert_bits_equal
from dcr_testing import mp_workers as W
from dcr_testing.procs import launch
from dcr_testing.s3 import make_s3_store
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.versions import read_head, read_manifest

DEADLINE = 60.0  # seconds for one group of processes, start-up included
AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
           "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path):
    """(store for this process, spec the workers open the same store from)."""
    if request.param == "local":
        from nemo_dcr.stores import LocalStore
        root = str(tmp_path / "store")
        return LocalStore(root), {"kind": "local", "root": root}
    moto = request.getfixturevalue("moto_s3")
    store = make_s3_store(moto, request)
    return store, {"kind": "s3", "bucket": store.bucket, "prefix": store.prefix, "endpoint": moto.endpoint_url,
                   "env": {k: os.environ[k] for k in AWS_ENV if k in os.environ}}


def run_group(world, spec, scenario, tmp_path, deadline=DEADLINE):
    """Start ``world`` ranks of ``scenario``; wait for all (killing stragglers at the deadline).
    -> ({rank: result dict}, {rank: exit code})."""
    out = tmp_path / f"out-{scenario}-{time.monotonic_ns()}"
    out.mkdir()
    results, codes, hung = launch(W.main, world, lambda r, port: (r, world, port, spec, scenario, str(out)), out,
                                  deadline)
    assert not hung, f"ranks {hung} of {scenario!r} still running after {deadline}s; exit codes {codes}, " \
                     f"results so far: {results}"
    return results, codes


def assert_ok(results, ranks):
    missing = [r for r in ranks if r not in results]
    assert not missing, f"ranks {missing} wrote no result"
    failed = [r for r in ranks if not results[r]["ok"]]
    # a rank that failed on its own makes its peers fail in the next collective: show it first
    failed.sort(key=lambda r: "typically caused by a remote worker" in results[r]["traceback"])
    assert not failed, "\n".join(f"rank {r} failed:\n{results[r]['traceback']}" for r in failed)


def assert_global(recv, version):
    exp = W.global_state(version)
    assert sorted(recv) == sorted(exp)
    for n in exp:
        assert_bits_equal(recv[n], exp[n], f"{n}@v{version}")


def zeros():
    return {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in W.SHAPES.items()}


def test_tp4_joint_commit_followed_by_tp2_group_and_unsharded_receiver(backend, tmp_path):
    store, spec = backend
    res, codes = run_group(6, spec, "joint", tmp_path)
    assert_ok(res, range(6))
    for r in range(4):
        assert res[r]["versions"] == [0, 1, 2]
    for r in (4, 5):  # the receiver group, following each version as it was committed
        assert res[r]["versions"] == [0, 1, 2]
        assert res[r]["steps"] == [[["keyframe", 0]], [["delta", 1]], [["delta", 2]]]
    assert res[4]["held"] == ["W0", "W1", "bias"] and res[5]["held"] == ["W0", "W1"]

    head = read_head(store)[0]
    assert head.version == 2 and head.keyframe_version == 0
    m = read_manifest(store, head.manifest)
    assert m.world_size == 4 and m.step == 20 and m.base_version == 1
    assert sorted(p.rank for p in m.parts) == [0, 1, 2, 3]  # one part per rank, committed together
    assert sorted(p.rank for p in read_manifest(store, m.base_manifest).parts) == [0, 1, 2, 3]

    recv = zeros()  # an unsharded receiver, version by version, then a late one in one go
    f = Follower(store, recv)
    for v in range(3):
        assert f.sync(v).steps == [("keyframe" if v == 0 else "delta", v)]
        assert_global(recv, v)
    f.check()
    late = zeros()
    assert Follower(store, late).sync().steps == [("keyframe", 0), ("delta", 1), ("delta", 2)]
    assert_global(late, 2)


def test_a_group_moving_to_format_5_keeps_a_receiver_group_on_deltas(tmp_path):
    """A restarted TP=4 trainer group publishes on in format 5 (state digests of definition 2):
    each rank sums its part of the base once (its restore), the first format-5 manifest names the
    base's digest under definition 2, and the TP=2 receiver group, which held a format-4 version,
    sums its state once (all-reduced over the group) and goes on by deltas."""
    from nemo_dcr.state.statedigest import state_contrib
    from nemo_dcr.stores import LocalStore
    root = str(tmp_path / "store")
    res, codes = run_group(6, {"kind": "local", "root": root}, "joint-4-to-5", tmp_path)
    assert_ok(res, range(6))
    for r in (4, 5):
        assert res[r]["versions"] == [0, 1, 2, 3]
        assert res[r]["steps"] == [[["keyframe", 0]], [["delta", 1]], [["delta", 2]], [["delta", 3]]]
    store = LocalStore(root)
    m = read_manifest(store, read_head(store)[0].manifest)
    base = read_manifest(store, m.base_manifest)
    assert (m.format, base.format) == (5, 5) and read_manifest(store, base.base_manifest).format == 4
    assert base.base_digest == state_contrib(W.global_state(1), definition=2).hex()
    assert m.target_digest == state_contrib(W.global_state(3), definition=2).hex()
    late = zeros()
    assert Follower(store, late).sync().steps == [("keyframe", 0), ("delta", 1), ("delta", 2), ("delta", 3)]
    assert_global(late, 3)


def test_rank_killed_mid_upload_commits_nothing_and_a_fresh_group_carries_on(backend, tmp_path):
    store, spec = backend
    res, codes = run_group(4, spec, "die", tmp_path)
    assert codes[1] == 17 and 1 not in res  # rank 1 died inside put(), half its part written
    assert_ok(res, [0, 2, 3])
    for r in (0, 2, 3):
        assert res[r]["versions"] == [0, 1]
        assert res[r]["error"], f"rank {r} published version 2 without rank 1"
        # the dead peer is noticed (closed sockets), not waited out: TIMEOUT is only the backstop
        assert res[r]["seconds_to_error"] < W.TIMEOUT.total_seconds() / 2
    head = read_head(store)[0]
    assert head.version == 1  # nothing committed
    orphans = [k for k in store.list("versions/") if k.startswith("versions/000000000002/")]
    assert any(k.endswith("part-00001.dcr") for k in orphans)  # the dead rank's half object is there
    assert not any(k.endswith("manifest.json") for k in orphans)
    failed_id = {k.split("/")[2] for k in orphans}
    assert len(failed_id) == 1

    early = zeros()  # a receiver that followed up to version 1
    fe = Follower(store, early)
    fe.sync()
    assert_global(early, 1)

    res, codes = run_group(4, spec, "fresh", tmp_path)  # a restarted trainer: new processes
    assert_ok(res, range(4))
    for r in range(4):
        assert res[r]["versions"] == [head.version + 1]
        assert res[r]["kinds"] == [True, False]  # a delta built on the restored version 1
    assert res[0]["held"] == ["W0", "W1", "bias"] and res[1]["held"] == ["W0", "W1"]
    head = read_head(store)[0]
    assert head.version == 2
    keys = store.list("versions/")
    assert not [k for k in keys if failed_id <= set(k.split("/"))]  # retention removed the orphans

    assert fe.sync().steps == [("delta", 2)]
    assert_global(early, 2)
    late = zeros()
    assert Follower(store, late).sync().steps == [("keyframe", 0), ("delta", 1), ("delta", 2)]
    assert_global(late, 2)


def test_rank_raising_mid_upload_fails_every_rank_then_retry_commits(backend, tmp_path):
    store, spec = backend
    res, codes = run_group(4, spec, "raise", tmp_path)
    assert_ok(res, range(4))
    for r in range(4):
        err = res[r]["error"]
        assert err is not None, f"rank {r} saw no PublishError"
        assert "rank 2: OSError: injected upload failure" in err and "no version committed" in err
        assert "rank 0:" not in err and "rank 1:" not in err and "rank 3:" not in err
        assert res[r]["head_after_failure"] == 0
        assert res[r]["versions"] == [0, 1]  # the same group's retry commits version 1
    assert read_head(store)[0].version == 1
    recv = zeros()
    assert Follower(store, recv).sync().steps == [("keyframe", 0), ("delta", 1)]
    assert_global(recv, 1)


def test_rank_failing_to_download_while_a_restarted_group_restores_fails_all_promptly(backend, tmp_path):
    """Regression: a rank whose download failed used to skip the follower's next collective and
    enter the publisher's, so its peers waited out the collective timeout (30 min by default)."""
    store, spec = backend
    res, codes = run_group(4, spec, "restore", tmp_path)
    assert_ok(res, range(4))
    for r in range(4):
        err = res[r]["error"]
        assert err is not None and "rank 2: CorruptObjectError" in err and "injected download failure" in err
        assert res[r]["seconds_to_error"] < W.TIMEOUT.total_seconds() / 2
        assert res[r]["head_after_failure"] == 1
        assert res[r]["versions"] == [0, 1, 2]  # once it can download, the restored group publishes
    recv = zeros()
    assert Follower(store, recv).sync().steps == [("keyframe", 0), ("delta", 1), ("delta", 2)]
    assert_global(recv, 2)


def test_pull_bootstraps_a_checkpoint_from_a_store_a_group_published_as_shards(backend, tmp_path):
    # found by the chaos campaign: a store that several ranks published holds every tensor as
    # shards (one part per rank); `nemo-dcr pull` into a new directory had nothing to write the
    # shards into ("the receiver has no matching tensor to write this shard into")
    from safetensors.torch import load_file

    from nemo_dcr.checkpoint.sync import pull_checkpoint
    store, spec = backend
    res, codes = run_group(6, spec, "joint", tmp_path)
    assert_ok(res, range(6))
    out = tmp_path / "pulled"
    r = pull_checkpoint(store, str(out))
    assert r.sync.version == 2 and r.sync.steps == [("keyframe", 0), ("delta", 1), ("delta", 2)]
    files = [out] if out.is_file() else sorted(out.glob("*.safetensors"))
    assert files
    pulled = {}
    for f in files:
        pulled.update(load_file(str(f)))
    assert_global(pulled, 2)
    assert not pull_checkpoint(store, str(out)).sync.updated  # and it is then recognised as version 2
