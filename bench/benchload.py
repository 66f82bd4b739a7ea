"""One benchmark script's functions from another (a shared shard, step, timer). bench/ is not a
package, and a script imported by its own name may be found as another package's module
(bench/kernels.py as Hugging Face's ``kernels`` in a test process), so each is loaded by path as
``nemo_dcr_bench_<script>``, once per process: the names tests/dcr_testing/bench.py gives them."""
from __future__ import annotations

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def script(name: str):
    """bench/<name>.py, loaded once."""
    mod_name = f"nemo_dcr_bench_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, os.path.join(HERE, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[mod_name]
