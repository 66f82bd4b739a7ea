"""Issue 9, packaging: the wheel ships the C kernel and uses it; a missing optional dependency is a
one-line error naming the extra; the CLI says which codec backend runs."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from nemo_dcr.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_ships_the_kernel_and_uses_it(tmp_path):
    # built from a copy of the sources: the build writes build/ and *.egg-info next to them, and a
    # stale build/ in the checkout could hide what a clean build ships
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "nemo_dcr"), src / "nemo_dcr", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                        "-w", str(wheels)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = wheels.glob("nemo_dcr-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "nemo_dcr/codec/csrc/dcr_classes.c" in names
    for r in ("train_publish.yaml", "rollout.yaml", "nemo.py"):  # the recipes ship too (issue 22)
        assert f"nemo_dcr/recipes/{r}" in names, r
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(whl)],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site), "NEMO_DCR_CACHE": str(tmp_path / "cache")}
    env.pop("NEMO_DCR_NATIVE", None)
    code = ("import nemo_dcr, nemo_dcr.codec as c, nemo_dcr.codec.native as n; "
            "print(nemo_dcr.__file__); print(c.backend()); print(n.build_error); "
            "from nemo_dcr.recipes import add_dcr_callback, recipe_path; "
            "assert 'submodule: model' in open(recipe_path('train_publish.yaml')).read()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(tmp_path))  # outside the repository: nothing of the checkout can be found
    assert r.returncode == 0, r.stderr
    where, backend, err = r.stdout.split("\n")[:3]
    assert where.startswith(str(site) + os.sep), where
    assert backend == "native", err


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
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"nemo-dcr {nemo_dcr.__version__} (codec backend: {backend()})"
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

    from dcr_testing.relay import RelayProc
    from nemo_dcr.stores import HttpStore, open_store

    store = open_store(str(tmp_path / "store"))
    store.put("run/blob.bin", os.urandom(1000) * 3)
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    env = {"BLOCK_MODULES": "torch", "PYTHONPATH": os.pathsep.join([str(tmp_path / "blocker"), ROOT])}
    relay = RelayProc(store.url, env=env)
    try:
        assert HttpStore(relay.url).get("run/blob.bin") == store.get("run/blob.bin")
    finally:
        relay.stop()
    assert "ModuleNotFoundError" not in relay.output(), relay.output()
