"""Issue 13 (data loss, bad input) on the file commands: outputs replace only the checkpoint's own
files, atomically and crash-safely; inputs are never destroyed; crafted inputs get one-line errors.

Most tests call the CLI in process (``cli.main``); the crash tests SIGKILL a real ``nemo-dcr``
process at named I/O points (``NEMO_DCR_KILL_AT``, util/atomic.py) and check the next run."""
import hashlib
import json
import os
import stat
import struct
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import save_file

from dcr_testing import assert_bits_equal
from nemo_dcr.checkpoint.safetensors_io import INDEX_NAME, Checkpoint, save_sharded
from nemo_dcr.cli.main import main


def states(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    base = {f"l{i}.w": torch.randn(64, 32, generator=g).bfloat16() for i in range(n)}
    base["b"] = torch.randn(32, generator=g)
    target = {k: v.clone() for k, v in base.items()}
    for k in target:
        target[k].view(-1)[::7] += 1
    return base, target


def sha(path):
    """Digest of a file, or of a directory tree (names and contents, links as their targets; hidden
    names, such as temporaries, left out)."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for n in sorted(f for f in files if not f.startswith(".")):
            p = os.path.join(root, n)
            h.update(os.path.relpath(p, path).encode() + open(p, "rb").read())
    return h.hexdigest()


def cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc, err, *words):
    assert rc == 1, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("nemo-dcr: error: "), err
    assert "internal error" not in err, err
    for w in words:
        assert w in err, err


def hf_dir(path, state, shards=2):
    """A Hugging Face model directory: the checkpoint plus files that are not the checkpoint's."""
    save_sharded(state, str(path), shards=shards)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "original").mkdir()
    (path / "original" / "consolidated.00.pth").write_bytes(b"\x01" * 100)
    return path


def user_files(path):
    return {n: sha(path / n) for n in ("config.json", "tokenizer.json", "original")}


@pytest.fixture
def delta_dirs(tmp_path, capsys):
    base, target = states()
    b, t = tmp_path / "base", tmp_path / "target"
    save_sharded(base, str(b), shards=3)
    save_sharded(target, str(t), shards=2)
    assert cli(capsys, "diff", b, t, "-o", tmp_path / "d.dcr")[0] == 0
    return b, t, tmp_path / "d.dcr"


# ------------------------------------------------------------------ item 1: other files survive

def test_apply_into_hf_directory_keeps_the_users_files(tmp_path, capsys, delta_dirs):
    b, t, d = delta_dirs
    out = hf_dir(tmp_path / "hf", states(5)[0], shards=4)
    keep = user_files(out)
    rc, _, err = cli(capsys, "apply", b, d, "-o", out)
    assert rc == 0, err
    assert user_files(out) == keep
    # the old 4 shards are gone (the old index owned them), the target's 2 shards and index are there
    assert sorted(n for n in os.listdir(out) if "safetensors" in n) == sorted(os.listdir(t))
    for n in os.listdir(t):
        assert sha(out / n) == sha(t / n), n


def test_in_place_apply_on_hf_directory(tmp_path, capsys, delta_dirs):
    b, t, d = delta_dirs
    base = Checkpoint(str(b))
    hf = hf_dir(tmp_path / "hf", {k: base[k] for k in base}, shards=3)
    keep = user_files(hf)
    rc, _, err = cli(capsys, "apply", hf, d, "-o", hf)
    assert rc == 0, err
    assert user_files(hf) == keep
    for n in os.listdir(t):
        assert sha(hf / n) == sha(t / n), n
    assert not [n for n in os.listdir(hf) if n.startswith(".")]


def test_pull_into_hf_directory_keeps_the_users_files(tmp_path, capsys):
    base, target = states(1)
    for i, s in enumerate((base, target)):
        save_sharded(s, str(tmp_path / f"c{i}"), shards=2)
        assert cli(capsys, "publish", "--store", tmp_path / "store", tmp_path / f"c{i}")[0] == 0
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    rc, _, err = cli(capsys, "pull", "--store", tmp_path / "store", "--into", hf, "--version", "0")
    assert rc == 0, err  # a model directory with config files only: filled in
    (hf / "tokenizer.json").write_text("tok")
    rc, _, err = cli(capsys, "pull", "--store", tmp_path / "store", "--into", hf)
    assert rc == 0, err
    assert (hf / "config.json").read_text() == "{}" and (hf / "tokenizer.json").read_text() == "tok"
    for n in os.listdir(tmp_path / "c1"):
        assert sha(hf / n) == sha(tmp_path / "c1" / n), n


# ------------------------------------------------------------------ item 2: inputs are not outputs

def test_same_path_as_input_and_output_is_refused(tmp_path, capsys):
    base, target = states(2)
    b, t = tmp_path / "b.safetensors", tmp_path / "t.safetensors"
    save_file(base, b)
    save_file(target, t)
    d = tmp_path / "d.dcr"
    assert cli(capsys, "diff", b, t, "-o", d)[0] == 0
    os.symlink(b, tmp_path / "link-b.safetensors")
    os.link(t, tmp_path / "hard-t.safetensors")
    os.symlink(d, tmp_path / "link-d.dcr")
    before = {p: sha(p) for p in (b, t, d)}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for args in (["diff", b, t, "-o", b], ["diff", b, t, "-o", t], ["diff", b, t, "-o", "./b.safetensors"],
                     ["diff", b, t, "-o", tmp_path / "link-b.safetensors"],
                     ["diff", b, t, "-o", tmp_path / "hard-t.safetensors"],
                     ["apply", b, d, "-o", d], ["apply", b, d, "-o", "./d.dcr"],
                     ["apply", b, d, "-o", tmp_path / "link-d.dcr"]):
            one_line_error(*cli(capsys, *args)[::2], "input")
    finally:
        os.chdir(cwd)
    assert {p: sha(p) for p in (b, t, d)} == before
    # in place stays allowed, also spelled through a symlink
    rc, _, err = cli(capsys, "apply", b, d, "-o", tmp_path / "link-b.safetensors")
    assert rc == 0, err
    assert os.path.islink(tmp_path / "link-b.safetensors")  # written through the link, not replacing it
    assert sha(b) == sha(t)


def test_same_directory_as_input_and_output_is_refused(tmp_path, capsys, delta_dirs):
    b, t, d = delta_dirs
    before = sha(b), sha(t)
    one_line_error(*cli(capsys, "diff", b, t, "-o", b)[::2])
    one_line_error(*cli(capsys, "diff", b, t, "-o", b / "model-00001-of-00003.safetensors")[::2], "input")
    # the delta inside the output directory under a name the result would replace
    out = tmp_path / "out"
    out.mkdir()
    os.link(d, out / "model-00001-of-00002.safetensors")
    one_line_error(*cli(capsys, "apply", b, d, "-o", out)[::2], "input")
    assert (sha(b), sha(t)) == before and sha(d) == sha(out / "model-00001-of-00002.safetensors")


# ------------------------------------------------------------------ item 3: crash safety (real kills)

def nemo(*args, kill_at=None):
    env = dict(os.environ)
    env.pop("NEMO_DCR_KILL_AT", None)
    if kill_at:
        env["NEMO_DCR_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "nemo_dcr", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env)


def hidden(path):
    return sorted(n for n in os.listdir(path) if n.startswith("."))


@pytest.mark.parametrize("point", ["written", "committed", "mid-swap"])
def test_killed_in_place_apply_leaves_old_or_new_and_next_run_recovers(tmp_path, delta_dirs, point):
    b, t, d = delta_dirs
    (b / "config.json").write_text("{}")
    old = sha(b)
    r = nemo("apply", b, d, "-o", b, kill_at=point)
    assert r.returncode == -9, r.stderr
    assert hidden(b)  # temporaries, and after the commit point the journal
    if point == "written":  # before the commit point: the old checkpoint, whole
        assert sha(b) == old
        r = nemo("apply", b, d, "-o", b)  # the next run removes the full-size leftovers and works
    else:  # after it: the next command that opens the directory finishes the swap
        r = nemo("diff", b, t, "-o", tmp_path / "again.dcr")
    assert r.returncode == 0, r.stderr
    assert hidden(b) == []
    assert (b / "config.json").read_text() == "{}"
    for n in os.listdir(t):
        assert sha(b / n) == sha(t / n)


@pytest.mark.parametrize("point", ["committed", "mid-swap"])
def test_retrying_a_killed_in_place_apply_recognises_it_is_done(tmp_path, delta_dirs, point):
    """Killed after its commit point, the apply's swap is finished by the next command on the
    directory, the retry of the same apply included: it finds the target there and says so
    (it used to exit 1 with "base tensor is not the one this delta was built from")."""
    b, t, d = delta_dirs
    assert nemo("apply", b, d, "-o", b, kill_at=point).returncode == -9
    r = nemo("apply", b, d, "-o", b)
    assert r.returncode == 0, r.stderr
    assert "already the delta's target" in r.stdout
    assert hidden(b) == [] and sorted(os.listdir(b)) == sorted(os.listdir(t))
    for n in os.listdir(t):
        assert sha(b / n) == sha(t / n)
    (b / sorted(os.listdir(t))[0]).write_bytes(b"\0" * 16)  # not the target, not the base: still an error
    r = nemo("apply", b, d, "-o", b)
    assert r.returncode == 1 and "error" in r.stderr


@pytest.mark.parametrize("layout", ["file", "dir"])
def test_killed_pull_leaves_no_full_size_temporaries_after_the_next_run(tmp_path, layout):
    base, target = states(3)
    for i, s in enumerate((base, target)):
        p = tmp_path / (f"c{i}.safetensors" if layout == "file" else f"c{i}")
        save_file(s, p) if layout == "file" else save_sharded(s, str(p), shards=2)
        assert nemo("publish", "--store", tmp_path / "store", p).returncode == 0
    out = tmp_path / ("out.safetensors" if layout == "file" else "out")
    assert nemo("pull", "--store", tmp_path / "store", "--into", out, "--version", "0").returncode == 0
    old = sha(out)
    r = nemo("pull", "--store", tmp_path / "store", "--into", out, kill_at="written")
    assert r.returncode == -9
    where = tmp_path if layout == "file" else out
    assert [n for n in hidden(where) if ".tmp-" in n]
    assert sha(out) == old
    r = nemo("pull", "--store", tmp_path / "store", "--into", out)
    assert r.returncode == 0, r.stderr
    assert not [n for n in hidden(where) if ".tmp-" in n]
    assert sha(out) == sha(tmp_path / ("c1.safetensors" if layout == "file" else "c1"))


# ------------------------------------------------------------------ item 5: pull checks the file

def test_pull_checks_the_files_not_only_the_digest(tmp_path, capsys):
    base, _ = states(4)
    c = tmp_path / "c.safetensors"
    save_file(base, c, metadata={"step": "1"})
    assert cli(capsys, "publish", "--store", tmp_path / "store", c)[0] == 0
    out = tmp_path / "out.safetensors"
    assert cli(capsys, "pull", "--store", tmp_path / "store", "--into", out)[0] == 0
    assert sha(out) == sha(c)
    rc, msg, _ = cli(capsys, "pull", "--store", tmp_path / "store", "--into", out)
    assert rc == 0 and "already at version 0" in msg
    for change in ("metadata", "order", "empty"):
        if change == "metadata":
            save_file(base, out, metadata={"step": "999"})
        elif change == "order":
            save_file(dict(reversed(list(base.items()))), out, metadata={"step": "1"})
            if sha(out) == sha(c):  # safetensors sorts by itself: reorder the data by hand
                _reorder(out)
        else:
            save_file({**base, "extra": torch.empty(0, 3)}, out, metadata={"step": "1"})
        assert sha(out) != sha(c), change
        rc, msg, err = cli(capsys, "pull", "--store", tmp_path / "store", "--into", out)
        assert rc == 0, err
        assert "rewritten" in msg, (change, msg)
        assert sha(out) == sha(c), change


def _reorder(path):
    """Rewrite a safetensors file with its tensors' data in reverse order (same header keys)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: -h[k]["data_offsets"][0])
    out, pos = b"", 0
    for k in names:
        b, e = h[k]["data_offsets"]
        out += data[b:e]
        h[k]["data_offsets"] = [pos, pos + e - b]
        pos += e - b
    text = json.dumps(h).encode()
    text += b" " * (-len(text) % 8)
    open(path, "wb").write(struct.pack("<Q", len(text)) + text + out)


# ------------------------------------------------------------------ item 6: recorded layouts are checked

def crafted_delta(tmp_path, layout, name="crafted.dcr"):
    """A delta whose recorded file layout is ``layout`` (built through the public API, as an
    attacker could)."""
    from nemo_dcr import diff
    base, target = states(6, n=1)
    save_file(base, tmp_path / "base.safetensors")
    with open(tmp_path / name, "wb") as f:
        diff(base, target, meta={"layout": layout}, out=f)
    return tmp_path / "base.safetensors", tmp_path / name, target


def header_of(target, names=None, **override):
    h, off = {}, 0
    for k in sorted(names or target):
        t = target[k]
        n = t.numel() * t.element_size()
        h[k] = {"dtype": {torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype], "shape": list(t.shape),
                "data_offsets": [off, off + n]}
        off += n
    for k, v in override.items():
        h[k.replace("__", ".")].update(v)
    return json.dumps(h)


ABS_EVIL = "/tmp/nemo-dcr-test-absolute-evil.safetensors"  # must never be created
BAD_LAYOUTS = {
    "dotdot": lambda t: {"kind": "dir", "files": [{"name": "../evil.safetensors", "header": header_of(t)}],
                         "index": None},
    "absolute": lambda t: {"kind": "dir", "files": [{"name": ABS_EVIL, "header": header_of(t)}], "index": None},
    "not-safetensors": lambda t: {"kind": "dir", "files": [{"name": "config.json", "header": header_of(t)}],
                                  "index": None},
    "no-files": lambda t: {"kind": "dir", "files": [], "index": None},
    "missing-tensor": lambda t: {"kind": "file", "files": [{"name": "m.safetensors",
                                                             "header": header_of(t, names=["b"])}], "index": None},
    "twice": lambda t: {"kind": "dir", "files": [{"name": "a.safetensors", "header": header_of(t)},
                                                 {"name": "b.safetensors", "header": header_of(t)}], "index": None},
    "index-out": lambda t: {"kind": "dir", "files": [{"name": "a.safetensors", "header": header_of(t)}],
                            "index": json.dumps({"weight_map": {k: "../a.safetensors" for k in t}})},
    "bool-shape": lambda t: {"kind": "file", "files": [{"name": "m.safetensors",
                                                         "header": header_of(t, l0__w={"shape": [True, 32]})}]},
    "float-offsets": lambda t: {"kind": "file", "files": [{"name": "m.safetensors",
                                                            "header": header_of(t, b={"data_offsets": [0.0, 128.0]})}]},
    "not-a-dict": lambda t: ["kind", "file"],
    "file-entry-list": lambda t: {"kind": "file", "files": [["m.safetensors", "{}"]]},
}


@pytest.mark.parametrize("bad", sorted(BAD_LAYOUTS))
def test_crafted_layouts_are_refused_before_writing(tmp_path, capsys, bad):
    work = tmp_path / "work"
    work.mkdir()
    b, d, _ = crafted_delta(work, BAD_LAYOUTS[bad](states(6, n=1)[1]))
    out = work / "sub" / "out"
    rc, _, err = cli(capsys, "apply", b, d, "-o", out)
    one_line_error(rc, err)
    assert not out.exists() and not (work / "sub" / "evil.safetensors").exists()
    assert not os.path.exists(ABS_EVIL) and not (tmp_path / "evil.safetensors").exists()
    assert not (work / "a.safetensors").exists()


def test_index_pointing_outside_or_malformed_is_refused(tmp_path, capsys):
    base, target = states(7)
    b, t = tmp_path / "b", tmp_path / "t"
    save_sharded(base, str(b))
    save_sharded(target, str(t))
    idx = json.loads((b / INDEX_NAME).read_text())
    for content in (json.dumps({**idx, "weight_map": {k: "../x.safetensors" for k in idx["weight_map"]}}),
                    json.dumps([idx]), b"\xff\xfe not utf-8", json.dumps({"weight_map": ["a"]})):
        (b / INDEX_NAME).write_bytes(content if isinstance(content, bytes) else content.encode())
        one_line_error(*cli(capsys, "diff", b, t, "-o", tmp_path / "d.dcr")[::2], INDEX_NAME)
    assert not (tmp_path / "d.dcr").exists()


def test_malformed_checkpoint_headers_are_one_line_errors(tmp_path, capsys):
    base, target = states(8, n=1)
    save_file(target, tmp_path / "t.safetensors")
    for bad in ({"shape": [True, 32]}, {"data_offsets": [0.0, 4096.0]}, {"shape": "64x32"}):
        raw = open(tmp_path / "t.safetensors", "rb").read()
        (n,) = struct.unpack("<Q", raw[:8])
        h = json.loads(raw[8:8 + n])
        h["l0.w"].update(bad)
        text = json.dumps(h).encode()
        (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
        one_line_error(*cli(capsys, "diff", tmp_path / "b.safetensors", tmp_path / "t.safetensors",
                            "-o", tmp_path / "d.dcr")[::2], "malformed")


# ------------------------------------------------------------------ items 9, 10, 12: bad input, modes, stores

def test_fifo_inputs_get_a_clear_error(tmp_path, capsys, delta_dirs):
    b, t, d = delta_dirs
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = {}
    th = threading.Thread(target=lambda: result.update(r=cli(capsys, "apply", b, fifo, "-o", tmp_path / "o")),
                          daemon=True)
    th.start()
    th.join(60)
    if th.is_alive():  # unblock the reader so the test process can end, then fail
        with open(fifo, "wb"):
            pass
        th.join(10)
        pytest.fail("apply blocked on a FIFO given as the delta")
    one_line_error(*result["r"][::2], "FIFO")
    one_line_error(*cli(capsys, "apply", fifo, d, "-o", tmp_path / "o")[::2], "FIFO")
    one_line_error(*cli(capsys, "diff", fifo, t, "-o", tmp_path / "x.dcr")[::2], "FIFO")
    one_line_error(*cli(capsys, "inspect", fifo)[::2], "FIFO")


@pytest.mark.parametrize("args", [["diff", "B", "T", "-o", "X", "--level", "99"],
                                  ["diff", "B", "T", "-o", "X", "--chunk-elems", "0"],
                                  ["publish", "--store", "S", "B", "--retain", "-1"],
                                  ["publish", "--store", "S", "B", "--keyframe-every", "-1"],
                                  ["publish", "--store", "S", "B", "--level", "0"]])
def test_out_of_range_options_are_one_line_errors(tmp_path, capsys, args):
    base, _ = states(9, n=1)
    save_file(base, tmp_path / "B")
    save_file(base, tmp_path / "T")
    args = [str(tmp_path / a) if a in ("B", "T", "X", "S") else a for a in args]
    one_line_error(*cli(capsys, *args)[::2], "out of range")
    assert not (tmp_path / "S").exists() and not (tmp_path / "X").exists()


def test_modes_are_kept_in_place_and_new_files_follow_the_umask(tmp_path, capsys, delta_dirs):
    b, t, d = delta_dirs
    old = os.umask(0o022)
    try:
        for n in os.listdir(b):
            os.chmod(b / n, 0o644)
        rc, _, err = cli(capsys, "apply", b, d, "-o", tmp_path / "new" / "out")
        assert rc == 0, err
        assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o755
        assert stat.S_IMODE(os.stat(tmp_path / "new" / "out").st_mode) == 0o755
        for n in os.listdir(tmp_path / "new" / "out"):
            assert stat.S_IMODE(os.stat(tmp_path / "new" / "out" / n).st_mode) == 0o644, n
        os.chmod(b / INDEX_NAME, 0o640)
        rc, _, err = cli(capsys, "apply", b, d, "-o", b)
        assert rc == 0, err
        assert stat.S_IMODE(os.stat(b / INDEX_NAME).st_mode) == 0o640
        f1 = tmp_path / "one.safetensors"
        base, target = states(10)
        save_file(base, f1)
        save_file(target, tmp_path / "two.safetensors")
        assert cli(capsys, "diff", f1, tmp_path / "two.safetensors", "-o", tmp_path / "e.dcr")[0] == 0
        os.chmod(f1, 0o644)
        assert cli(capsys, "apply", f1, tmp_path / "e.dcr", "-o", f1)[0] == 0
        assert stat.S_IMODE(os.stat(f1).st_mode) == 0o644
    finally:
        os.umask(old)


def test_reads_do_not_create_a_store(tmp_path, capsys):
    missing = tmp_path / "no" / "such-store"
    one_line_error(*cli(capsys, "log", "--store", missing)[::2], "does not exist")
    one_line_error(*cli(capsys, "pull", "--store", missing, "--into", tmp_path / "o")[::2], "does not exist")
    one_line_error(*cli(capsys, "log", "--store", f"file://{missing}")[::2], "does not exist")
    assert not (tmp_path / "no").exists() and not (tmp_path / "o").exists()


def test_output_through_a_symlink_updates_the_file_it_points_to(tmp_path, capsys):
    base, target = states(11)
    save_file(base, tmp_path / "b.safetensors")
    save_file(target, tmp_path / "t.safetensors")
    assert cli(capsys, "diff", tmp_path / "b.safetensors", tmp_path / "t.safetensors", "-o", tmp_path / "d.dcr")[0] == 0
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"old")
    os.symlink(real, tmp_path / "link.safetensors")
    out = tmp_path / "link.safetensors"
    assert cli(capsys, "apply", tmp_path / "b.safetensors", tmp_path / "d.dcr", "-o", out)[0] == 0
    assert os.path.islink(tmp_path / "link.safetensors")
    assert sha(real) == sha(tmp_path / "t.safetensors")
    ck = Checkpoint(str(tmp_path / "link.safetensors"))
    for k in target:
        assert_bits_equal(ck[k], target[k], k)
