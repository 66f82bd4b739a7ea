"""`nemo-dcr pull` at the edges a new user meets (issue 22): tensors without elements, output
spellings, Hugging Face model directories, signed stores pulled again and again."""
import hashlib
import os

import pytest
import torch

from nemo_dcr.checkpoint.safetensors_io import Checkpoint, save_sharded


def files_sha(path):
    h = hashlib.sha256()
    for n in sorted(os.listdir(path)):
        if n.endswith(".safetensors") or n.endswith(".json"):
            h.update(n.encode() + open(os.path.join(path, n), "rb").read())
    return h.hexdigest()


def test_a_version_adding_a_tensor_without_elements_is_pulled_into_an_existing_checkpoint(tmp_path, cli):
    """A 0-element tensor adds nothing to the state digest, so the checkpoint at version 0 has
    version 1's digest too: the pull must still bring it (and every later version) to the
    version's files, also after a new keyframe."""
    g = torch.Generator().manual_seed(0)
    v0 = {"w": torch.randn(16, 8, generator=g)}
    v1 = {**v0, "e": torch.zeros(0, 4, dtype=torch.bfloat16)}
    v2 = {**v1, "w": v1["w"].clone()}
    v2["w"][1, 1] += 1
    v3 = {**v2, "w": v2["w"].clone()}
    v3["w"][2, 2] += 1
    cks = []
    for i, s in enumerate((v0, v1, v2, v3)):
        save_sharded(s, str(tmp_path / f"c{i}"))
        cks.append(tmp_path / f"c{i}")
    store, out = tmp_path / "store", tmp_path / "out"
    assert cli("publish", "--store", store, cks[0]).returncode == 0
    assert cli("pull", "--store", store, "--into", out).returncode == 0
    assert cli("publish", "--store", store, cks[1]).returncode == 0
    r = cli("pull", "--store", store, "--into", out)
    assert r.returncode == 0, r.stderr
    assert files_sha(out) == files_sha(cks[1]) and "e" in Checkpoint(str(out))

    stale = tmp_path / "stale"  # still at version 0 when the next versions come
    assert cli("pull", "--store", store, "--into", stale, "--version", "0").returncode == 0
    assert "e" not in Checkpoint(str(stale))
    assert cli("publish", "--store", store, cks[2]).returncode == 0
    r = cli("pull", "--store", store, "--into", stale)
    assert r.returncode == 0, r.stderr
    assert files_sha(stale) == files_sha(cks[2])
    assert cli("publish", "--store", store, cks[3], "--keyframe").returncode == 0
    for o in (out, stale):
        r = cli("pull", "--store", store, "--into", o)
        assert r.returncode == 0, r.stderr
        assert files_sha(o) == files_sha(cks[3])


def single_file_versions(tmp_path, cli, n=2):
    """Versions published from single files named v0.safetensors, v1.safetensors, ... -> their paths."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(1)
    s = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    paths = []
    for v in range(n):
        p = tmp_path / f"v{v}.safetensors"
        save_file(s, str(p), metadata={"format": "pt"})
        assert cli("publish", "--store", tmp_path / "store", p).returncode == 0
        paths.append(p)
        s = {k: t.clone() for k, t in s.items()}
        s["w"].view(-1)[::5] += 1
    return paths


def test_pull_into_a_path_with_a_trailing_slash_makes_a_directory(tmp_path, cli):
    v = single_file_versions(tmp_path, cli, 1)
    r = cli("pull", "--store", tmp_path / "store", "--into", f"{tmp_path / 'out'}/")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out").is_dir()
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == v[0].read_bytes()
    r = cli("pull", "--store", tmp_path / "store", "--into", f"{tmp_path / 'out'}/")
    assert r.returncode == 0 and "already at version 0" in r.stdout, r.stderr


def test_pull_into_a_model_directory_keeps_its_own_file_name(tmp_path, cli):
    """The published file's name (v0.safetensors, v1.safetensors) is not the directory's: a
    Hugging Face directory keeps its model.safetensors (or whatever one file it has), one file."""
    from safetensors.torch import save_file
    v = single_file_versions(tmp_path, cli, 2)
    hf, mine = tmp_path / "hf", tmp_path / "mine"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    mine.mkdir()
    save_file({"x": torch.zeros(2)}, str(mine / "weights.safetensors"))
    for d in (hf, mine):
        for i in (0, 1):
            r = cli("pull", "--store", tmp_path / "store", "--into", d, "--version", i)
            assert r.returncode == 0, r.stderr
            own = "weights.safetensors" if d == mine else "model.safetensors"
            assert sorted(os.listdir(d)) == sorted([own] + (["config.json"] if d == hf else []))
            assert (d / own).read_bytes() == v[i].read_bytes()
    r = cli("verify", "--store", tmp_path / "store", hf)
    assert r.returncode == 0 and "is version 1" in r.stdout


def test_pull_with_trusted_keys_refuses_a_replayed_head_across_commands(tmp_path, cli):
    """Each command starts a new verifier; the checkpoint remembers the newest HEAD verified and
    the namespace it follows, so an older signed HEAD put back (a rolled-back or replayed
    store), or another run's versions, are refused by the next pull too."""
    pytest.importorskip("cryptography")
    from safetensors.torch import save_file

    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.versions import HEAD_KEY
    key = tmp_path / "run.key"
    assert cli("keygen", key).returncode == 0
    g = torch.Generator().manual_seed(3)
    s = {"w": torch.randn(32, 4, generator=g)}
    store, other = LocalStore(tmp_path / "store"), LocalStore(tmp_path / "other")
    heads = []
    for v in range(3):
        s = {"w": s["w"] + v}
        save_file(s, str(tmp_path / f"m{v}.safetensors"))
        for st, ns in ((store, "run-a"), (other, "run-b")):
            r = cli("publish", "--store", st.root, "--signing-key", key, "--namespace", ns,
                    tmp_path / f"m{v}.safetensors")
            assert r.returncode == 0, r.stderr
        heads.append(store.get(HEAD_KEY))
    (tmp_path / "outdir").mkdir()
    for out in (tmp_path / "out.safetensors", tmp_path / "outdir"):
        pull = ("pull", "--store", store.root, "--into", out, "--trusted-key", f"{key}.pub")
        r = cli(*pull)
        assert r.returncode == 0, r.stderr
        before = files_sha(tmp_path) if out.suffix else files_sha(out)
        store.put(HEAD_KEY, heads[1])  # the attacker puts back version 1's signed HEAD
        r = cli(*pull)
        assert r.returncode == 1 and "older than version 2" in r.stderr, r.stderr
        assert (files_sha(tmp_path) if out.suffix else files_sha(out)) == before
        store.put(HEAD_KEY, heads[2])
        r = cli("pull", "--store", other.root, "--into", out, "--trusted-key", f"{key}.pub")  # another run
        assert r.returncode == 1 and "run-b" in r.stderr and "run-a" in r.stderr, r.stderr
        r = cli("pull", "--store", other.root, "--into", out, "--trusted-key", f"{key}.pub", "--namespace", "run-b")
        assert r.returncode == 0, r.stderr  # named on purpose: the checkpoint now follows run-b
        assert cli(*pull).returncode == 1  # and run-a is the other run now
    assert sorted(n for n in os.listdir(tmp_path / "outdir") if not n.startswith(".")) == ["model.safetensors"]


def test_publishing_an_unrelated_checkpoint_is_refused_and_going_back_is_calm(tmp_path, cli, caplog):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(4)
    model = {f"layer{i}.w": torch.randn(16, 16, generator=g).bfloat16() for i in range(13)}
    store = tmp_path / "store"
    for v in range(3):
        model = {k: t.clone() for k, t in model.items()}
        model["layer0.w"].view(-1)[v] += 1
        save_sharded(model, str(tmp_path / f"c{v}"))
        assert cli("publish", "--store", store, tmp_path / f"c{v}").returncode == 0
    save_file({"layer0.w": torch.zeros(4)}, str(tmp_path / "other.safetensors"))
    r = cli("publish", "--store", store, tmp_path / "other.safetensors")
    assert r.returncode == 1 and "not a next version" in r.stderr and "--new-model" in r.stderr, r.stderr
    assert "0 of its 1 tensor(s)" in r.stderr and "version 2's 13" in r.stderr
    r = cli("log", "--store", store, "--json")
    assert r.stdout.count('"version"') == 3  # nothing published
    r = cli("publish", "--store", store, tmp_path / "other.safetensors", "--new-model")
    assert r.returncode == 0 and "version 3" in r.stdout and "keyframe" in r.stdout, r.stderr

    out = tmp_path / "out"
    assert cli("pull", "--store", store, "--into", out, "--version", "2").returncode == 0
    caplog.clear()
    with caplog.at_level("INFO", logger="nemo_dcr"):
        r = cli("pull", "--store", store, "--into", out, "--version", "1")  # going back: from keyframe 0
    assert r.returncode == 0, r.stderr
    assert not [rec for rec in caplog.records if rec.levelname == "WARNING"], caplog.text
    assert "not on the chain" not in caplog.text and "going back from version 2 to version 1" in caplog.text
    assert "now at version 1 (from 2; keyframe 0, delta 1" in r.stdout
    assert files_sha(out) == files_sha(tmp_path / "c1")


def run_on_a_terminal(args, cwd):
    """``nemo-dcr ARGS`` as a process whose stderr is a terminal (a pseudo-terminal) -> (rc,
    what it wrote there)."""
    import fcntl
    import pty
    import struct
    import subprocess
    import sys
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a fresh pty is 0 columns wide
    p = subprocess.Popen([sys.executable, "-m", "nemo_dcr", *map(str, args)], stdout=subprocess.PIPE,
                         stderr=slave, cwd=cwd, env={**os.environ, "COLUMNS": "100"})
    os.close(slave)
    got = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the process closed its end
            break
        if not chunk:
            break
        got += chunk
    os.close(master)
    p.stdout.read()
    return p.wait(120), got.decode(errors="replace")


def test_publish_and_pull_show_a_progress_bar_on_a_terminal(tmp_path, cli):
    g = torch.Generator().manual_seed(5)
    s = {"w": torch.randn(512, 256, generator=g), "b": torch.randn(256, generator=g)}
    for v in range(2):
        save_sharded(s, str(tmp_path / f"c{v}"))
        s = {k: t + 1 for k, t in s.items()}
    store = tmp_path / "store"
    rc, err = run_on_a_terminal(["publish", "--store", store, tmp_path / "c0"], tmp_path)
    assert rc == 0 and "publish v0" in err and "525k" in err, err  # over the (512 + 1) x 256 x 4 bytes encoded
    rc, err = run_on_a_terminal(["publish", "--store", store, tmp_path / "c1"], tmp_path)
    assert rc == 0 and "publish v1" in err, err
    rc, err = run_on_a_terminal(["pull", "--store", store, "--into", tmp_path / "out"], tmp_path)
    assert rc == 0 and "pull v1" in err, err
    assert files_sha(tmp_path / "out") == files_sha(tmp_path / "c1")
    r = cli("pull", "--store", store, "--into", tmp_path / "o2")  # not a terminal: no bar
    assert r.returncode == 0 and r.stderr == ""
