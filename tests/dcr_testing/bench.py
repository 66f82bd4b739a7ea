"""The benchmark scripts (``bench/*.py``, not a package) imported as modules, once per session."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def load(script: str):
    """``bench/<script>.py`` as the module ``nemo_dcr_bench_<script>``, with bench/ on sys.path
    while it loads, for the modules the scripts share (netenv: imported once, kept in
    ``sys.modules``). Not after: bench/kernels.py there was found as the Hugging Face ``kernels``
    package by every later ``transformers`` import of the test process, which then failed."""
    name = f"nemo_dcr_bench_{script}"
    if name not in sys.modules:
        path = list(sys.path)
        sys.path.insert(0, str(BENCH))
        try:
            spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        finally:
            sys.path[:] = path  # (a script may put bench/ there itself: it goes too)
    return sys.modules[name]
