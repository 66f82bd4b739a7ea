"""The main job end to end, shortened: an RL loop. A Lightning trainer process takes GRPO steps on
the rollouts and publishes every step; a separate rollout process samples one version behind,
scores the samples, and verifies every version bit-exactly (the store's digest and the trainer's
own bits)."""
import json
import os

import pytest

pytest.importorskip("lightning")


def test_demo_rl_loop(tmp_path):
    from nemo_dcr.cli.demo import _trend, run_demo
    lines = []
    steps = 15
    # a larger step than the demo's (1e-3, not 3e-4): the reward must rise within 15 steps
    rows = run_demo(str(tmp_path / "demo"), steps=steps, lr=1e-3, out=lines.append)
    assert [r["version"] for r in rows] == list(range(steps + 1))
    assert [r["step"] for r in rows] == list(range(steps + 1))
    assert all(r["verified"] for r in rows)  # the loader's digest check and the trainer's bits, per version
    assert rows[0]["change_rate"] is None and all(r["change_rate"] > 0 for r in rows[1:])
    assert all(r["delta_bytes"] < r["dense_bytes"] for r in rows[1:])
    assert all(r["wait_s"] is not None and r["wait_s"] >= r["apply_s"] > 0 for r in rows)
    early, late = _trend(rows)
    assert late > early + 0.15, [r["reward"] for r in rows]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary == rows
    assert any("verified every one bit-exactly" in line for line in lines)
    assert os.path.exists(tmp_path / "demo" / "demo.png") or not _has_matplotlib()

    # one step off-policy: batch b was sampled on version b - 1 (the trainer took step b + 1 on it);
    # the last two versions, which no batch was due on, were scored too
    batches = [json.loads(line) for line in (tmp_path / "demo" / "rollout.jsonl").read_text().splitlines()]
    assert [r["version"] for r in batches] == [0] + list(range(steps + 1))
    assert [r["final"] for r in batches] == [False] * steps + [True] * 2
    assert all(r["reward"] is not None for r in batches)


def test_rollout_stops_on_bits_that_differ_from_the_trainers(tmp_path):
    """The rollout's own check against the trainer's bits can fail: a version whose bits are not
    the ones the trainer recorded for its step stops the rollout before it samples."""
    import torch

    from nemo_dcr.cli.demo import bits_digest, rollout_main
    from nemo_dcr.cli.demo_policy import PolicyLM
    from nemo_dcr.integrations import module_tensors
    from nemo_dcr.sync.publisher import Publisher

    torch.manual_seed(0)
    published = module_tensors(PolicyLM().to(torch.bfloat16))
    Publisher(str(tmp_path / "store")).publish(published, step=0)
    other = {k: v.clone() for k, v in published.items()}
    other["head.weight"][0, 0] = -other["head.weight"][0, 0]  # the trainer held other bits
    bits = tmp_path / "trainer_bits.jsonl"
    bits.write_text(json.dumps({"step": 0, "digest": bits_digest(other)}) + "\n")
    with pytest.raises(SystemExit, match="version 0 \\(step 0\\) holds bits"):
        rollout_main(str(tmp_path / "store"), str(tmp_path), batches=2, first=0, prompts=2, group=2, deadline_s=60)
    assert not os.listdir(tmp_path / "rollouts")  # nothing was sampled from it

    bits.write_text(json.dumps({"step": 0, "digest": bits_digest(published)}) + "\n")  # the same bits pass
    with pytest.raises(SystemExit, match="gave up waiting for version 1"):  # (no trainer publishes version 1)
        rollout_main(str(tmp_path / "store"), str(tmp_path), batches=2, first=0, prompts=2, group=2, deadline_s=0)
    assert sorted(os.listdir(tmp_path / "rollouts")) == ["batch-00000.pt", "batch-00001.pt"]


def test_trainer_stops_when_the_rollout_process_is_gone(tmp_path):
    """The trainer waits for a batch only while the rollout process runs: one that exited is a clear
    error naming its status and the batch, not a hang."""
    import subprocess
    import sys

    from nemo_dcr.cli.demo import RolloutFiles
    files = RolloutFiles(str(tmp_path / "rollouts"))
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait()
    with pytest.raises(SystemExit, match="exited \\(status 3\\) before batch 0"):
        files.get(0, gone)
    files.put(0, {"batch": 0})
    assert files.get(0, gone) == {"batch": 0}  # a batch it wrote before exiting is still read


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
