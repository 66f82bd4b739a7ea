"""publish / pull / log / verify on real safetensors checkpoints, through a local directory
store and a real S3 server over HTTP.

In-process through ``nemo_dcr.cli.main`` (the ``cli`` fixture); the console script itself is
run once per command in test_cli_smoke.py."""
import hashlib
import json
import os

import pytest
import torch

from nemo_dcr.checkpoint.safetensors_io import save_sharded


def tree_sha(path):
    h = hashlib.sha256()
    for n in sorted(os.listdir(path)):
        h.update(n.encode() + open(os.path.join(path, n), "rb").read())
    return h.hexdigest()


def checkpoints(tmp_path, n=3):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(128, 64, generator=g).bfloat16(), "b": torch.randn(64, generator=g),
             "n": torch.tensor(1)}
    paths = []
    for i in range(n):
        p = tmp_path / f"ckpt{i}"
        save_sharded(state, str(p), shards=2)
        paths.append(p)
        state["w"].view(torch.int16)[torch.rand(128, 64, generator=g) < 0.02] += 1
        state["b"][i] = -0.0
        state["n"] += 1
    return paths


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path, monkeypatch):
    if request.param == "local":
        return str(tmp_path / "store")
    moto = request.getfixturevalue("moto_s3")
    monkeypatch.setenv("NEMO_DCR_S3_ENDPOINT", moto.endpoint_url)
    return f"s3://{moto.bucket}/cli-{request.node.name.replace('[', '-').strip(']')}"


def test_publish_pull_log_verify(tmp_path, cli, store_url):
    ck = checkpoints(tmp_path)
    for i, p in enumerate(ck):
        r = cli("publish", "--store", store_url, p, "--keyframe-every", "2")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"published version {i}")
    log = json.loads(cli("log", "--store", store_url, "--json").stdout)
    assert [e["version"] for e in log] == [2, 1, 0]
    assert [e["kind"] for e in log] == ["delta+keyframe", "delta", "keyframe"]
    assert 0 < log[1]["change_rate"] < 0.1
    assert "version" in cli("log", "--store", store_url).stdout

    out = tmp_path / "rollout"
    r = cli("pull", "--store", store_url, "--into", out, "--version", "1")
    assert r.returncode == 0, r.stderr
    assert tree_sha(out) == tree_sha(ck[1])
    r = cli("pull", "--store", store_url, "--into", out)
    assert r.returncode == 0, r.stderr
    assert "delta 2" in r.stdout and "keyframe" not in r.stdout  # an update, not a reload
    assert tree_sha(out) == tree_sha(ck[2])
    assert "already at version 2" in cli("pull", "--store", store_url, "--into", out).stdout

    r = cli("verify", "--store", store_url, ck[1])
    assert r.returncode == 0 and "is version 1" in r.stdout
    other = tmp_path / "other"
    save_sharded({"w": torch.zeros(3)}, str(other))
    r = cli("verify", "--store", store_url, other)
    assert r.returncode == 1 and "matches no version" in r.stderr


def test_pull_failure_leaves_output_unchanged(tmp_path, cli):
    store = tmp_path / "store"
    ck = checkpoints(tmp_path, 2)
    for p in ck:
        assert cli("publish", "--store", store, p).returncode == 0
    out = tmp_path / "rollout"
    assert cli("pull", "--store", store, "--into", out, "--version", "0").returncode == 0
    before = tree_sha(out)
    part = next(p for p in (store / "versions" / "000000000001").rglob("part-*.dcr"))
    blob = bytearray(part.read_bytes())
    blob[len(blob) // 2] ^= 1
    part.write_bytes(bytes(blob))
    r = cli("pull", "--store", store, "--into", out)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "corrupt" in r.stderr and "part-" in r.stderr
    assert tree_sha(out) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt0", "ckpt1", "rollout", "store"]
    r = cli("pull", "--store", tmp_path / "empty", "--into", tmp_path / "x")
    assert r.returncode == 1 and "no committed version" in r.stderr
