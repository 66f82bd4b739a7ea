"""The offline CLI on real safetensors files: single files and sharded directories.

In-process through ``nemo_dcr.cli.main`` (the ``cli`` fixture); the console script itself is
run once per command in test_cli_smoke.py."""
import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dcr_testing import assert_bits_equal
from nemo_dcr.checkpoint.safetensors_io import save_sharded


def sha(path):
    if os.path.isdir(path):
        h = hashlib.sha256()
        for n in sorted(os.listdir(path)):
            h.update(n.encode() + open(os.path.join(path, n), "rb").read())
        return h.hexdigest()
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def states(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = {
        "layers.0.w": torch.randn(257, 129, generator=g).bfloat16(),
        "layers.0.b": torch.randn(129, generator=g),
        "emb": torch.randn(100, 64, generator=g).half(),
        "steps": torch.tensor(7),
        "mask": torch.rand(33, generator=g) > 0.5,
        "f8": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 5),
    }
    target = {k: v.clone() for k, v in base.items()}
    m = torch.rand(257, 129, generator=g) < 0.02
    target["layers.0.w"].view(torch.int16)[m] ^= 1
    target["layers.0.b"][5] = float("nan")
    target["layers.0.b"][6] = -0.0
    target["emb"][3:5] += 1
    target["steps"] = torch.tensor(8)
    target["f8"].view(torch.uint8)[::7] ^= 0x80
    return base, target


def test_single_file_round_trip_is_byte_identical(tmp_path, cli):
    base, target = states()
    save_file(base, tmp_path / "base.safetensors", metadata={"step": "1"})
    save_file(target, tmp_path / "target.safetensors", metadata={"step": "2"})
    r = cli("diff", str(tmp_path / "base.safetensors"), str(tmp_path / "target.safetensors"),
            "-o", str(tmp_path / "d.dcr"))
    assert r.returncode == 0, r.stderr
    r = cli("apply", str(tmp_path / "base.safetensors"), str(tmp_path / "d.dcr"),
            "-o", str(tmp_path / "out.safetensors"))
    assert r.returncode == 0, r.stderr
    assert sha(tmp_path / "out.safetensors") == sha(tmp_path / "target.safetensors")
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        assert f.metadata() == {"step": "2"}
        for k in target:
            assert_bits_equal(f.get_tensor(k), target[k], k)


@pytest.mark.parametrize("encoding", ["auto", "portable", "classes", "xor", "overwrite", "add"])
def test_sharded_directory_round_trip(tmp_path, cli, encoding):
    base, target = states(1)
    target["new.tensor"] = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    del target["mask"]
    save_sharded(base, str(tmp_path / "base"), shards=3)
    save_sharded(target, str(tmp_path / "target"), shards=2)
    r = cli("diff", str(tmp_path / "base"), str(tmp_path / "target"), "-o", str(tmp_path / "d.dcr"),
            "--encoding", encoding, "--level", "5")
    assert r.returncode == 0, r.stderr
    r = cli("apply", str(tmp_path / "base"), str(tmp_path / "d.dcr"), "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(tmp_path / "target"))
    assert sha(tmp_path / "out") == sha(tmp_path / "target")
    r = cli("inspect", str(tmp_path / "d.dcr"), "--json")
    s = json.loads(r.stdout)
    assert s["encoding"] == encoding
    if encoding in ("xor", "overwrite", "add"):
        allowed = {encoding, "overwrite"} | ({"xor"} if encoding == "add" else set())  # add: not 8-byte
        assert set(s["bytes_by_encoding"]) <= allowed  # new tensors are always overwrite
    if encoding == "portable":
        assert "classes" not in s["bytes_by_encoding"]


def test_diff_picks_classes_by_default_on_small_updates(tmp_path, cli):
    """Weights moved a step in the monotone order, more often the smaller they are (as under
    Adam at a small learning rate): the default coding is ``classes``, smaller than ``portable``."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(512, 512, generator=g) * 0.02).bfloat16()
    step = (1e-4 * torch.randn(512, 512, generator=g))
    base, target = {"w": w}, {"w": (w.float() + step).bfloat16()}
    save_file(base, tmp_path / "a.safetensors")
    save_file(target, tmp_path / "b.safetensors")
    sizes = {}
    for enc in ("auto", "portable"):
        out = tmp_path / f"{enc}.dcr"
        r = cli("diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "-o", str(out),
                *(["--encoding", enc] if enc != "auto" else []))
        assert r.returncode == 0, r.stderr
        sizes[enc] = os.path.getsize(out)
    s = json.loads(cli("inspect", str(tmp_path / "auto.dcr"), "--json").stdout)
    assert set(s["bytes_by_encoding"]) == {"classes"}
    # (0.91x here: portable's zstd streams gained 1-3 % from the fast parameters of
    # codec/chunk._fast_params; classes streams are not zstd-compressed)
    assert sizes["auto"] < 0.95 * sizes["portable"]
    r = cli("apply", str(tmp_path / "a.safetensors"), str(tmp_path / "auto.dcr"), "-o", str(tmp_path / "o.safetensors"))
    assert r.returncode == 0, r.stderr
    assert sha(tmp_path / "o.safetensors") == sha(tmp_path / "b.safetensors")


def test_apply_in_place_over_base_directory(tmp_path, cli):
    base, target = states(2)
    save_sharded(base, str(tmp_path / "rollout"))
    save_sharded(base, str(tmp_path / "base"))
    save_sharded(target, str(tmp_path / "target"))
    assert cli("diff", str(tmp_path / "base"), str(tmp_path / "target"), "-o",
               str(tmp_path / "d.dcr")).returncode == 0
    r = cli("apply", str(tmp_path / "rollout"), str(tmp_path / "d.dcr"), "-o", str(tmp_path / "rollout"))
    assert r.returncode == 0, r.stderr
    assert sha(tmp_path / "rollout") == sha(tmp_path / "target")
    assert sorted(os.listdir(tmp_path)) == ["base", "d.dcr", "rollout", "target"]  # no temp left behind


def _prepare(tmp_path, cli):
    base, target = states(3)
    save_file(base, tmp_path / "base.safetensors")
    save_file(target, tmp_path / "target.safetensors")
    assert cli("diff", str(tmp_path / "base.safetensors"), str(tmp_path / "target.safetensors"),
               "-o", str(tmp_path / "d.dcr")).returncode == 0
    return base, target


def _assert_failed_cleanly(r, tmp_path, before):
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nemo-dcr: error:"), r.stderr
    assert sorted(os.listdir(tmp_path)) == before  # no OUT, no temp file


def test_wrong_base_fails_without_output(tmp_path, cli):
    base, target = _prepare(tmp_path, cli)
    wrong = dict(base)
    wrong["layers.0.b"] = base["layers.0.b"].clone()
    wrong["layers.0.b"][0] = -wrong["layers.0.b"][0]  # one sign bit
    save_file(wrong, tmp_path / "wrong.safetensors")
    before = sorted(os.listdir(tmp_path))
    r = cli("apply", str(tmp_path / "wrong.safetensors"), str(tmp_path / "d.dcr"),
            "-o", str(tmp_path / "out.safetensors"))
    _assert_failed_cleanly(r, tmp_path, before)
    assert "layers.0.b" in r.stderr

    extra = dict(base, intruder=torch.zeros(3))
    save_file(extra, tmp_path / "extra.safetensors")
    before = sorted(os.listdir(tmp_path))
    r = cli("apply", str(tmp_path / "extra.safetensors"), str(tmp_path / "d.dcr"),
            "-o", str(tmp_path / "out.safetensors"))
    _assert_failed_cleanly(r, tmp_path, before)
    assert "intruder" in r.stderr


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "empty"])
def test_damaged_delta_fails_and_leaves_existing_output_untouched(tmp_path, cli, damage):
    _prepare(tmp_path, cli)
    blob = (tmp_path / "d.dcr").read_bytes()
    if damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "flip":
        blob = bytearray(blob)
        blob[40] ^= 0x10  # inside the first chunk's payload
        blob = bytes(blob)
    elif damage == "foreign":
        blob = (tmp_path / "base.safetensors").read_bytes()
    else:
        blob = b""
    (tmp_path / "bad.dcr").write_bytes(blob)
    (tmp_path / "out.safetensors").write_bytes(b"previous contents")
    before = sorted(os.listdir(tmp_path))
    r = cli("apply", str(tmp_path / "base.safetensors"), str(tmp_path / "bad.dcr"),
            "-o", str(tmp_path / "out.safetensors"))
    _assert_failed_cleanly(r, tmp_path, before)
    assert (tmp_path / "out.safetensors").read_bytes() == b"previous contents"
    r = cli("inspect", str(tmp_path / "bad.dcr"))
    assert r.returncode != 0 and r.stderr.startswith("nemo-dcr: error:")


def test_not_a_checkpoint(tmp_path, cli):
    (tmp_path / "junk.safetensors").write_bytes(os.urandom(100))
    r = cli("diff", str(tmp_path / "junk.safetensors"), str(tmp_path / "junk.safetensors"),
            "-o", str(tmp_path / "d.dcr"))
    assert r.returncode == 1 and "not a safetensors file" in r.stderr
    assert not (tmp_path / "d.dcr").exists()
    r = cli("diff", str(tmp_path / "missing"), str(tmp_path / "junk.safetensors"),
            "-o", str(tmp_path / "d.dcr"))
    assert r.returncode == 1 and "no such file" in r.stderr


def test_inspect_reports_streams_and_rates(tmp_path, cli):
    base, target = _prepare(tmp_path, cli)
    s = json.loads(cli("inspect", str(tmp_path / "d.dcr"), "--json").stdout)
    from nemo_dcr.state.dtypes import int_view
    changed = sum(int((int_view(base[k]) != int_view(target[k])).sum()) for k in base)
    assert s["changed"] == changed
    assert s["elements"] == sum(t.numel() for t in target.values())
    assert s["bytes"] == os.path.getsize(tmp_path / "d.dcr")
    assert sum(s["bytes_by_stream"].values()) == s["bytes"]
    assert s["bytes_per_changed"] == pytest.approx(s["bytes"] / changed)
    text = cli("inspect", str(tmp_path / "d.dcr")).stdout
    assert "bytes per change" in text and "by stream" in text
