#!/usr/bin/env python
"""The first call of a freshly installed wheel (issue 24): what every new container, pod and CI
job pays before its first delta.

    python bench/first_call.py                       # a wheel of this checkout, no compiler on PATH
    python bench/first_call.py --src DIR --compiler  # another tree (e.g. an older commit), compiler on PATH
    python bench/first_call.py --json OUT.json

Builds a wheel of the source tree (``pip wheel``, in a copy), installs it into a fresh venv
(tests/dcr_testing/wheel.py: its own site-packages, torch and the other dependencies read from
this interpreter's, an empty ``$NEMO_DCR_CACHE``, no C compiler on PATH unless ``--compiler``),
then times, each in a new process:

* ``nemo-dcr --version`` twice (the first is the first call; the second what every later one costs);
* a first diff and apply (``--elems`` BF16 elements, 1 % changed, ``classes`` coding), in a
  process of its own with an empty cache of its own, and the same with the PyTorch reference
  (``NEMO_DCR_NATIVE=0``, another process): the native/reference ratio.

Prints one JSON object (and writes it with ``--json``): seconds, the backend each run reported,
and the compiler calls the runs made (the stand-ins record them).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from dcr_testing.wheel import FreshVenv, build_wheel, copy_sources  # noqa: E402

DIFF = """
import sys, time
t0 = time.perf_counter()
import torch, nemo_dcr
from nemo_dcr.codec import backend
n = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
a = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
b = a.clone()
idx = torch.randperm(n, generator=g)[: n // 100]
b.view(torch.int16)[idx] += 1
t1 = time.perf_counter()
blob = nemo_dcr.diff({"w": a}, {"w": b}, encoding="classes", progress=False)
t2 = time.perf_counter()
c = {"w": a.clone()}
nemo_dcr.apply(c, blob, progress=False)
t3 = time.perf_counter()
assert torch.equal(c["w"].view(torch.int16), b.view(torch.int16))
print(backend(), round(t1 - t0, 3), round(t2 - t1, 3), round(t3 - t2, 3), len(blob))
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=str(HERE.parent), help="source tree to build (default: this checkout)")
    ap.add_argument("--compiler", action="store_true", help="leave the system's compiler on PATH")
    ap.add_argument("--elems", type=int, default=1 << 22, help="BF16 elements of the first diff")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out: dict = {"src": args.src, "compiler_on_path": args.compiler, "elems": args.elems}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "wheels").mkdir()
        whl = build_wheel(copy_sources(t / "src", Path(args.src)), t / "wheels")
        out["wheel"] = whl.name
        env = FreshVenv(t / "venv", whl)
        kw = {"compiler": args.compiler}
        # each first call with an empty cache of its own, as a new container has
        for i, cache in ((1, "c1"), (2, "c1")):
            s, r = env.timed([env.script("nemo-dcr"), "--version"], **kw, NEMO_DCR_CACHE=str(t / cache))
            out[f"version_{i}_s"] = round(s, 2)
            out[f"version_{i}_out"] = (r.stdout.strip() or r.stderr.strip())[-300:]
        for label, extra in (("diff", {}), ("diff_reference", {"NEMO_DCR_NATIVE": "0"})):
            s, r = env.timed(["-c", DIFF, str(args.elems)], **kw, **extra, NEMO_DCR_CACHE=str(t / label))
            if r.returncode != 0:
                raise SystemExit(f"{label} failed:\n{r.stderr[-3000:]}")
            backend, imp, d, a, size = r.stdout.split()
            out[label] = {"process_s": round(s, 2), "backend": backend, "import_s": float(imp), "diff_s": float(d),
                          "apply_s": float(a), "delta_bytes": int(size), "warnings": r.stderr.strip()[-500:]}
        out["native_vs_reference_diff"] = round(out["diff_reference"]["diff_s"] / out["diff"]["diff_s"], 1)
        out["native_vs_reference_apply"] = round(out["diff_reference"]["apply_s"] / out["diff"]["apply_s"], 1)
        out["compiler_calls"] = env.compiled()
        out["load_1min"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
