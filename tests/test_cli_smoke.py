"""The installed ``nemo-dcr`` console script, one new process per command: the entry point, the
argument parsing and the exit code really work from a shell. What each command does is tested
in-process (test_cli_files.py, test_cli_store.py). The inputs are made in-process and the eight
processes run at once, so the module pays for process starts only, shared over the cores."""
import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from dcr_testing.cli import run_scripts
from nemo_dcr.checkpoint.files import apply_checkpoint, diff_checkpoints
from nemo_dcr.checkpoint.safetensors_io import save_sharded
from nemo_dcr.checkpoint.sync import history, publish_checkpoint


def tree_sha(path):
    h = hashlib.sha256()
    for n in sorted(os.listdir(path)):
        h.update(n.encode() + open(os.path.join(path, n), "rb").read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Two safetensors files, the delta between them, two checkpoints and a store holding both."""
    d = tmp_path_factory.mktemp("smoke")
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(64, 32, generator=g).bfloat16(), "b": torch.randn(32, generator=g)}
    target = {k: v.clone() for k, v in base.items()}
    target["w"].view(torch.int16)[::5, ::3] ^= 1
    target["b"][3] = -0.0
    save_file(base, d / "base.safetensors")
    save_file(target, d / "target.safetensors")
    diff_checkpoints(str(d / "base.safetensors"), str(d / "target.safetensors"), str(d / "d.dcr"))
    for i, state in enumerate((base, target)):
        save_sharded(state, str(d / f"ckpt{i}"), shards=2)
        publish_checkpoint(str(d / "store"), str(d / f"ckpt{i}"))
    save_sharded({"w": torch.zeros(3)}, str(d / "other"))
    return d


@pytest.fixture(scope="module")
def runs(work):
    """Every command once through the console script; each writes only where nothing else reads."""
    return run_scripts({
        "diff": ["diff", work / "base.safetensors", work / "target.safetensors", "-o", work / "new.dcr"],
        "apply": ["apply", work / "base.safetensors", work / "d.dcr", "-o", work / "applied.safetensors"],
        "inspect": ["inspect", work / "d.dcr", "--json"],
        "publish": ["publish", "--store", work / "new-store", work / "ckpt0"],
        "pull": ["pull", "--store", work / "store", "--into", work / "rollout"],
        "log": ["log", "--store", work / "store", "--json"],
        "verify": ["verify", "--store", work / "store", work / "other"],
        "demo": ["demo", "--help"],
    })


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


def test_diff(work, runs, tmp_path):
    assert ok(runs["diff"]).stdout.startswith(f"wrote {work / 'new.dcr'}")
    apply_checkpoint(str(work / "base.safetensors"), str(work / "new.dcr"), str(tmp_path / "out.safetensors"))
    assert (tmp_path / "out.safetensors").read_bytes() == (work / "target.safetensors").read_bytes()


def test_apply(work, runs):
    ok(runs["apply"])
    assert (work / "applied.safetensors").read_bytes() == (work / "target.safetensors").read_bytes()


def test_inspect(work, runs):
    s = json.loads(ok(runs["inspect"]).stdout)
    assert s["bytes"] == os.path.getsize(work / "d.dcr") and s["changed"] > 0


def test_publish(work, runs):
    assert ok(runs["publish"]).stdout.startswith("published version 0")
    assert [m.version for m in history(str(work / "new-store"))] == [0]


def test_pull(work, runs):
    assert "is now at version 1" in ok(runs["pull"]).stdout
    assert tree_sha(work / "rollout") == tree_sha(work / "ckpt1")


def test_log(runs):
    assert [r["version"] for r in json.loads(ok(runs["log"]).stdout)] == [1, 0]


def test_verify_exit_code(runs):
    """The failing case: the script's exit status is the command's (1), with one line on stderr."""
    r = runs["verify"]
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "matches no version" in r.stderr


def test_demo_help(runs):
    r = ok(runs["demo"])
    assert "--workdir" in r.stdout and "--steps" in r.stdout
