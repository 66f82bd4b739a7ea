"""The main job end to end, shortened: a Lightning trainer process publishes, a separate rollout
process follows and verifies every version bit-exactly."""
import json
import os

import pytest

pytest.importorskip("lightning")


def test_demo_end_to_end(tmp_path):
    from nemo_dcr.cli.demo import run_demo
    lines = []
    rows = run_demo(str(tmp_path / "demo"), steps=8, every=4, pretrain_steps=10, out=lines.append)
    assert [r["version"] for r in rows] == [0, 1, 2]
    assert all(r["verified"] for r in rows)
    assert rows[0]["change_rate"] is None and rows[1]["change_rate"] > 0
    assert all(r["delta_bytes"] < r["dense_bytes"] for r in rows[1:])
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary == rows
    assert any("verified every one bit-exactly" in line for line in lines)
    assert os.path.exists(tmp_path / "demo" / "rollout.jsonl")
