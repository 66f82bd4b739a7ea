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
    """bench/<name>.py, loaded once. ``sys.path`` is as it was afterwards: a script puts bench/
    there as it loads (bench/kernels.py does), and left there, bench/kernels.py was found as the
    Hugging Face ``kernels`` package by a later ``transformers`` import in the same process (a
    test run of ``tests/test_bench_smoke.py`` before ``tests/test_callback_hf.py`` failed so)."""
    mod_name = f"nemo_dcr_bench_{name}"
    if mod_name not in sys.modules:
        path = list(sys.path)
        try:
            spec = importlib.util.spec_from_file_location(mod_name, os.path.join(HERE, f"{name}.py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = mod
            spec.loader.exec_module(mod)
        finally:
            sys.path[:] = path
    return sys.modules[mod_name]


def ratio_rows(cells: dict, counts: list, paths, key: str, **per_count) -> list:
    """One row per (count, path) of ``cells[count][path]`` seconds, ``x_one`` its ratio to the
    first count's cell of the same path; ``per_count``: more fields, each a function of the count."""
    return [{key: n, **{f: fn(n) for f, fn in per_count.items()}, "path": p, "seconds": cells[n][p],
             "x_one": cells[n][p] / cells[counts[0]][p]} for n in counts for p in paths]


def ratio_table(rows: list, key: str, counts: list, paths, label) -> list:
    """The markdown lines of ``ratio_rows``' table: a row per path, a column per count (``label(n)``)."""
    lines = ["| path | " + " | ".join(f"{label(n)}: ms (x one)" for n in counts) + " |",
             "|---|" + "---:|" * len(counts)]
    by = {(row[key], row["path"]): row for row in rows}
    for p in paths:
        lines.append(f"| {p} | " + " | ".join(f"{1e3 * by[n, p]['seconds']:.0f} ({by[n, p]['x_one']:.2f}x)"
                                              for n in counts) + " |")
    return lines
