"""The benchmark scripts (``bench/*.py``, not a package) imported as modules, once per session."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def load(script: str):
    """``bench/<script>.py`` as the module ``nemo_dcr_bench_<script>`` (with bench/ on sys.path
    for the modules the scripts share, e.g. netenv)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    name = f"nemo_dcr_bench_{script}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]
