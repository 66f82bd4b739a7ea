"""Packaging: the wheel holds the compiled C kernels and runs them where no compiler is (issues 9,
24); a missing optional dependency is a one-line error naming the extra; the CLI says which
codec backend runs."""
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from nemo_dcr.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SPEED = """
import time, torch
from nemo_dcr.codec import classes, native
assert native.backend() == "native", native.build_error
n = 1 << 20
g = torch.Generator().manual_seed(0)
old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16)
new = old.clone()
new[torch.randperm(n, generator=g)[: n // 100]] += 1
mant = classes.MANTISSA[torch.bfloat16]

def best(use_native):
    t = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        k, rows, pos, val = classes.encode(old, new, mant, use_native=use_native)
        classes.decode(old, rows, pos, val, k, mant, use_native=use_native)
        t = min(t, time.perf_counter() - t0)
    return t

print(best(False) / best(True))
"""


def test_wheel_holds_the_compiled_kernels_and_runs_them_without_a_compiler(tmp_path):
    """Issue 24: ``pip wheel .`` makes a platform wheel holding the library; installed into a
    fresh venv with no C compiler on PATH (and $CC a stand-in that records calls), the first call
    loads the native backend, compiles nothing, writes no cache, and the kernels run faster than
    the reference (a ratio in one process: the reference's time over the kernel's)."""
    from dcr_testing.wheel import FreshVenv, build_wheel, copy_sources

    (tmp_path / "wheels").mkdir()
    whl = build_wheel(copy_sources(tmp_path / "src"), tmp_path / "wheels")
    names = zipfile.ZipFile(whl).namelist()
    assert "nemo_dcr/codec/libdcr.so" in names, names
    for r in ("train_publish.yaml", "rollout.yaml", "nemo.py"):  # the recipes ship too (issue 22)
        assert f"nemo_dcr/recipes/{r}" in names, r
    assert whl.name.startswith("nemo_dcr-0.1.0-py3-none-") and not whl.name.endswith("-any.whl"), whl.name
    venv = FreshVenv(tmp_path / "venv", whl)
    assert venv.path_has_no_compiler()
    r = venv.run([venv.script("nemo-dcr"), "--version"])
    assert r.returncode == 0, r.stderr
    assert "codec backend: native" in r.stdout and "packaged" in r.stdout, r.stdout + r.stderr
    r = venv.run(["-c", "import nemo_dcr; print(nemo_dcr.__file__)"])
    assert r.stdout.strip().startswith(str(venv.path) + os.sep), r.stdout  # the wheel's copy, not the checkout
    r = venv.run(["-c", "from nemo_dcr.recipes import recipe_path; "
                        "assert 'submodule: model' in open(recipe_path('train_publish.yaml')).read()"])
    assert r.returncode == 0, r.stderr
    r = venv.run(["-c", SPEED])
    assert r.returncode == 0, r.stderr
    ratio = float(r.stdout.split()[-1])
    assert venv.compiled() == [] and not venv.cache.exists()  # nothing compiled, nothing cached
    assert "unavailable" not in r.stderr, r.stderr
    # measured ~1000x (1 % of 1M BF16 elements, encode + decode: the reference decoder loops in
    # Python per coded value); 20x leaves room for a loaded machine and a slower CPU
    assert ratio > 20, f"the packaged kernels ran only {ratio:.1f}x the reference's speed"


BLOCKER = textwrap.dedent("""
    import importlib.abc, os, sys

    BLOCKED = set(os.environ["BLOCK_MODULES"].split(","))

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
""")


def run_without(tmp_path, modules, *args):
    (tmp_path / "blocker").mkdir(exist_ok=True)
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "BLOCK_MODULES": ",".join(modules),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "blocker"), os.environ.get("PYTHONPATH", ROOT)])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(tmp_path))


def one_line(r, extra):
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nemo-dcr: error: "), r.stderr
    assert f'pip install "nemo-dcr[{extra}]"' in lines[0] and "internal error" not in lines[0], r.stderr


def test_missing_extras_are_one_line_errors_naming_the_extra(tmp_path):
    one_line(run_without(tmp_path, ["lightning"], "-m", "nemo_dcr", "demo", "--workdir", str(tmp_path / "d")),
             "lightning")
    one_line(run_without(tmp_path, ["boto3", "botocore"], "-m", "nemo_dcr", "log", "--store", "s3://bucket/run"),
             "s3")
    r = run_without(tmp_path, ["lightning"], "-c", textwrap.dedent("""
        from nemo_dcr.errors import MissingExtraError
        try:
            from nemo_dcr.callbacks import DeltaPublishCallback
        except MissingExtraError as e:
            print(e)
    """))
    assert r.returncode == 0 and 'pip install "nemo-dcr[lightning]"' in r.stdout, r.stdout + r.stderr
    r = run_without(tmp_path, ["megatron"], "-c", textwrap.dedent("""
        from nemo_dcr.errors import MissingExtraError
        from nemo_dcr.integrations.megatron import _pieces
        try:
            _pieces([], {})
        except MissingExtraError as e:
            print(e)
    """))
    assert r.returncode == 0 and 'pip install "nemo-dcr[megatron]"' in r.stdout, r.stdout + r.stderr


def test_version_and_inspect_name_the_codec_backend(tmp_path, capsys):
    import torch

    import nemo_dcr
    from nemo_dcr.codec import backend
    from nemo_dcr.codec.native import describe
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"nemo-dcr {nemo_dcr.__version__} (codec backend: {describe()})"
    assert describe().startswith(backend())
    a = {"w": torch.zeros(64, dtype=torch.bfloat16)}
    b = {"w": torch.ones(64, dtype=torch.bfloat16)}
    with open(tmp_path / "d.dcr", "wb") as f:
        nemo_dcr.diff(a, b, out=f)
    assert main(["inspect", "--json", str(tmp_path / "d.dcr")]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == backend() == "native"


def test_help_and_relay_run_without_torch(tmp_path):
    """A relay host needs no torch: ``import nemo_dcr.cli.main`` and ``--help`` leave it unimported,
    and a relay process started with torch unimportable serves a store's objects."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        import nemo_dcr.cli.main
        assert "torch" not in sys.modules, "import nemo_dcr.cli.main imported torch"
        for argv in (["--help"], ["relay", "--help"]):
            try:
                sys.modules["nemo_dcr.cli.main"].main(argv)
            except SystemExit as e:
                assert e.code == 0, (argv, e.code)
            assert "torch" not in sys.modules, f"nemo-dcr {' '.join(argv)} imported torch"
        print("ok")
    """)], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT}, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr

    from dcr_testing.relay import RelayProc, model
    from nemo_dcr.stores import HttpStore, open_store
    from nemo_dcr.sync.publisher import Publisher

    store = open_store(str(tmp_path / "store"))
    Publisher(store).publish(model())  # here, with torch; the relay below has none
    part = [k for k in store.list("versions/") if k.endswith(".dcr")][0]
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    env = {"BLOCK_MODULES": "torch", "PYTHONPATH": os.pathsep.join([str(tmp_path / "blocker"), ROOT])}
    relay = RelayProc(store.url, env=env)
    try:
        assert HttpStore(relay.url).get(part) == store.get(part)
    finally:
        relay.stop()
    assert "ModuleNotFoundError" not in relay.output(), relay.output()
