"""``NEMO_DCR_NATIVE_CFLAGS`` (issue 14: the fuzz run's AddressSanitizer build of the C kernel): extra
compiler flags go into a build cached apart from the normal one, which they never replace."""
import os
import subprocess
import sys

import pytest

CODE = "from nemo_dcr.codec import native; print(native.backend()); print(native.build_error)"


def run(env):
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\n")[:2]


def test_extra_cflags_build_apart_and_bad_ones_fall_back(tmp_path):
    env = {**os.environ, "NEMO_DCR_CACHE": str(tmp_path)}
    env.pop("NEMO_DCR_NATIVE", None)
    env.pop("NEMO_DCR_NATIVE_CFLAGS", None)
    backend, err = run(env)
    if backend != "native":
        pytest.skip(f"no C compiler here: {err}")
    normal = set(os.listdir(tmp_path))
    assert run({**env, "NEMO_DCR_NATIVE_CFLAGS": "-O1 -g -DNEMO_DCR_FLAGS_TEST"})[0] == "native"
    both = set(os.listdir(tmp_path))
    assert len(both) == 2 and normal < both  # a second library; the first one untouched
    assert run(env)[0] == "native" and set(os.listdir(tmp_path)) == both  # the normal build is reused
    backend, err = run({**env, "NEMO_DCR_NATIVE_CFLAGS": "-fno-such-flag-at-all"})
    assert backend == "reference" and "failed" in err  # a flag the compiler refuses: the reference, said why
