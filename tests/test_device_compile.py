"""Every device-path Triton kernel compiles to a cubin for sm_90 (the H200 the project's device
machine has) on this machine, without a GPU: the lowering the CPU interpreter skips
(dcr_testing/device_compile.py). In a child process: this suite runs the kernels interpreted,
and a kernel's mode is fixed when it is defined."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(TESTS), TESTS, env.get("PYTHONPATH", "")])
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (no float arithmetic here; silences triton 3.9's notice)
    r = subprocess.run([sys.executable, "-m", "dcr_testing.device_compile", "--arch", "90"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 19 and all(" cubin " in x for x in lines), r.stdout
