"""tests/gpu/run_gpu.py, the one script a lent GPU runs, must not rot between loans: here it runs
on CPU tensors under TRITON_INTERPRET=1 (``--interpret``, tiny sizes, no bench) and every check must
pass. (Format 3 moved chunk offsets with the creation time's length, and the script's byte-equality
check failed with no GPU to show it; this catches the next such change.) The host<->device byte
bounds are checked only on a GPU: on CPU nothing crosses."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_script_passes_under_the_interpreter(tmp_path):
    out = tmp_path / "gpu.json"
    log = tmp_path / "log"
    with open(log, "w") as f:  # (a file, not a pipe: the script starts receiver processes)
        rc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "run_gpu.py"), "--interpret",
                             "--no-bench", "--json", str(out)], stdout=f, stderr=subprocess.STDOUT, timeout=600,
                            cwd=ROOT).returncode
    text = log.read_text()
    assert rc == 0, text[-4000:]
    res = json.loads(out.read_text())
    assert not res["failures"] and len(res["checks"]) >= 100, res["failures"]
    assert res["e2e"]["group"], "the receiver group's check did not run"
