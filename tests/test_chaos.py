"""The fault campaign's fast subset: seeded end-to-end runs (gloo publisher ranks, local and S3
stores, a fault proxy, relays, RolloutLoader receivers) covering every fault kind, with 0 silent
corruptions and every run converging; a signed subset (forged versions refused, a stale HEAD
refused rather than followed); and a self-test that the campaign does see a receiver
holding bits other than the version it reports, so it cannot pass vacuously.

The long campaign (>= 500 runs) is a documented command (docs/reliability.md)."""
import os
from collections import Counter

import pytest

pytest.importorskip("moto.moto_server.werkzeug_app", reason="the campaign needs moto[server]")
pytest.importorskip("aiohttp", reason="the campaign needs aiohttp")

from nemo_dcr.chaos.campaign import SIGNED_ONLY, Campaign, kinds

DISK = {"disk_full_pub", "disk_full_recv", "readonly_pub", "readonly_recv"}


@pytest.fixture(scope="module")
def campaign():
    # one start-up (S3 server, proxies, relays, publisher group, receivers) for both tests:
    # each batch of runs is counted afresh and depends only on its own seed
    c = Campaign(fast=True)
    yield c
    c.close()


def test_fast_campaign_every_fault_kind_no_silent_corruption_all_converge(campaign):
    ks = kinds(sign=False)
    out = campaign.batch(len(ks), seed=7)
    assert out["runs"] == len(ks)
    skipped = Counter()
    for why, n in out["skipped"].items():
        skipped[why.split(":")[0]] += n
    injected = {k for k, n in out["faults"].items() if n > skipped[k]}  # at least once, somewhere
    expected = set(ks) if os.geteuid() == 0 else set(ks) - DISK  # tmpfs faults need root
    assert expected <= injected, f"fault kinds never injected: {expected - injected} (skipped: {dict(out['skipped'])})"
    assert out["silent_corruptions"] == 0, out["violations"]
    assert out["violations"] == []
    assert out["aborted"] == []
    assert out["not_converged"] == 0 and out["convergence_rate"] == 1.0
    assert out["bit_checks"] > 3 * out["steps"]  # every receiver compared after every step
    # the faults reached the receivers: some updates failed (and said so), some re-keyed
    assert out["errors_reported"] > 0
    assert sum(out["proxy_injected"].values()) > 0


def test_signed_campaign_refuses_forged_versions_and_never_goes_back(campaign):
    # the publisher signs, every receiver trusts its key; a version written by someone with
    # store access but not the key (another key, or none) is refused at HEAD, before any part is
    # fetched; a stale HEAD is refused (ReplayError) instead of taking a receiver back
    out = campaign.batch(len(SIGNED_ONLY) + 1, seed=5, sign=True)
    assert set(SIGNED_ONLY) | {"reorder_head"} <= set(out["faults"])
    assert out["silent_corruptions"] == 0, out["violations"]
    assert out["violations"] == [] and out["aborted"] == []
    assert out["not_converged"] == 0 and out["convergence_rate"] == 1.0
    assert out["refused_forged"] > 0
    assert out["went_back_on_stale_head"] == 0


def test_campaign_with_publishers_moving_between_formats_4_and_5(campaign):
    # a format drawn at each publisher (re)start: the store moves between state digest
    # definitions mid-run, under the faults, with its followers and relays on it
    out = campaign.batch(6, seed=56, formats=(4, 5), force=("pub_restart",))
    assert out["silent_corruptions"] == 0, out["violations"]
    assert out["violations"] == [] and out["aborted"] == []
    assert out["not_converged"] == 0 and out["convergence_rate"] == 1.0
    assert set(out["publisher_formats"]) == {4, 5} and out["format_moves"] > 0


def test_campaign_detects_a_receiver_whose_bits_are_not_its_version(campaign):
    # an engine write that goes wrong after the follower verified (RolloutLoader's on_update
    # seam flips one bit): only the harness's own raw-bit comparison can catch it
    out = campaign.batch(2, seed=3, sabotage="flip-after-update")
    assert out["silent_corruptions"] > 0
    assert any("SILENT CORRUPTION" in v and "proj.weight" in v for v in out["violations"])


def test_engine_mode_without_the_vllm_venv_is_refused_before_anything_starts(monkeypatch, tmp_path):
    # engine mode (tests/test_vllm_engine_chaos.py runs it in the vLLM venv) needs that venv's
    # python: without it, a clear typed error and no process, mount or directory left behind
    from nemo_dcr.errors import DcrError
    monkeypatch.setenv("NEMO_DCR_VLLM_PYTHON", str(tmp_path / "no-python"))
    with pytest.raises(DcrError, match="make venv-vllm"):
        Campaign(engine="vllm", workdir=str(tmp_path / "work"))
    assert not (tmp_path / "work").exists()
    assert kinds(sign=False, engine=True) == [f if f != "kill_follower" else "kill_engine" for f in kinds(sign=False)]


def test_a_format_version_with_versions_is_refused_before_anything_starts(tmp_path, capsys):
    # --versions is one run with one publisher start: there is nothing to draw a format at
    from nemo_dcr.cli.main import main
    assert main(["chaos", "--versions", "3", "--format-version", "5"]) == 1
    assert "--format-version is not supported with --versions" in capsys.readouterr().err


def test_a_disk_made_read_only_first_refuses_the_filler_without_raising(tmp_path):
    """A step that draws both a read-only and a full-disk fault for one disk: the filler cannot
    be written (EROFS), the fault is reported as not made, and the disk comes back writable."""
    from nemo_dcr.chaos.campaign import _Disk
    d = _Disk(str(tmp_path / "disk"), 4)
    if not d.mounted:
        pytest.skip(f"no tmpfs here: {d.why}")
    try:
        assert d.readonly(True)
        assert d.fill() is False
        assert d.readonly(False)
        d.unfill()  # (as the campaign lifts a step's disk faults: writable first)
        assert d.fill() is True
        d.unfill()
        with open(tmp_path / "disk" / "after", "wb") as f:
            f.write(b"x")
    finally:
        d.close()
