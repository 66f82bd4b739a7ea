"""Where the C kernels come from (nemo_dcr/codec/native.py, issue 24): the package's library when
it is there; in a source checkout, a build of csrc/ when the library is missing or was built from
other sources, and ``NEMO_DCR_NATIVE_CFLAGS`` variants (issue 14: the fuzz run's AddressSanitizer
build) cached apart from the normal one, which they never replace; an installed package without
the library says once, loudly, that the reference runs and how to get the kernels."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_dcr.codec import native

ROOT = Path(__file__).resolve().parents[1]
CODE = ("from nemo_dcr.codec import native; print(native.backend()); print(native.origin); "
        "print(native.build_error); native.lib(); native.lib()")


def run(env, cwd=None):
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    backend, origin, err = r.stdout.split("\n")[:3]
    return backend, origin, err, r.stderr


def base_env(tmp_path, pythonpath=str(ROOT)):
    env = {**os.environ, "NEMO_DCR_CACHE": str(tmp_path / "cache"), "PYTHONPATH": pythonpath}
    for k in ("NEMO_DCR_NATIVE", "NEMO_DCR_NATIVE_CFLAGS"):
        env.pop(k, None)
    return env


def cached(tmp_path):
    return set(os.listdir(tmp_path / "cache")) if (tmp_path / "cache").exists() else set()


def test_extra_cflags_build_apart_and_bad_ones_fall_back(tmp_path):
    env = base_env(tmp_path)
    backend, origin, err, _ = run(env)
    if backend != "native":
        pytest.skip(f"no C kernels here: {err}")
    normal = cached(tmp_path)  # empty where `pip install -e .` built the library into the checkout
    assert (origin == "packaged") == (not normal)
    backend, origin, _, _ = run({**env, "NEMO_DCR_NATIVE_CFLAGS": "-O1 -g -DNEMO_DCR_FLAGS_TEST"})
    assert (backend, origin) == ("native", "variant build")
    both = cached(tmp_path)
    assert len(both) == len(normal) + 1 and normal < both  # a library of its own; the normal one untouched
    assert run(env)[:2] == ("native", "packaged" if not normal else "checkout build")
    assert cached(tmp_path) == both  # nothing rebuilt
    backend, origin, err, _ = run({**env, "NEMO_DCR_NATIVE_CFLAGS": "-fno-such-flag-at-all"})
    assert backend == "reference" and "failed" in err  # a flag the compiler refuses: the reference, said why


@pytest.mark.skipif(not native.LIBRARY.exists(), reason="the checkout's library is not built (pip install -e .)")
def test_a_checkout_rebuilds_a_library_built_from_other_sources(tmp_path):
    """A developer edits csrc/ after `pip install -e .`: the library in the tree no longer matches
    the sources, and a stale kernel could disagree with the reference; the checkout builds its
    current sources instead, and says so."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "nemo_dcr", tree / "nemo_dcr", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "csrc", tree / "csrc")
    shutil.copy(ROOT / "setup.py", tree / "setup.py")
    env = base_env(tmp_path, str(tree))
    assert run(env, cwd=tmp_path)[:2] == ("native", "packaged")  # the same sources: the library as it is
    src = tree / "csrc" / "dcr_classes.c"
    src.write_text(src.read_text() + "\n/* edited */\n")
    backend, origin, _, stderr = run(env, cwd=tmp_path)
    assert (backend, origin) == ("native", "checkout build"), stderr
    assert "built from other sources" in stderr and len(cached(tmp_path)) == 1


def test_an_install_without_the_library_says_so_once_and_how_to_get_it(tmp_path):
    """The package alone (no library, no checkout around it): the reference runs, and the first
    use warns once with the slowdown and the remedy; nothing is compiled."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "nemo_dcr", site / "nemo_dcr", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {**base_env(tmp_path, str(site)), "CC": "/bin/false"}
    backend, origin, err, stderr = run(env, cwd=tmp_path)
    assert backend == "reference" and "libdcr.so is not in the installed package" in err
    warnings = [line for line in stderr.splitlines() if "compiled kernels are unavailable" in line]
    assert len(warnings) == 1, stderr  # once, though asked three times
    assert "150-200x slower" in warnings[0] and "pip install" in warnings[0] and "wheel" in warnings[0]
    assert not cached(tmp_path)
