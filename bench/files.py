"""The checkpoint-file commands (``nemo-dcr diff`` and ``nemo-dcr apply``) on a sharded safetensors
checkpoint of many tensors, as multiples of copying its files, measured side by side in this process.

    python bench/files.py             # 64 tensors of 2M BF16 elements (256 MB) in 2 shards, 1 % changed
    python bench/files.py --json      # the same as JSON
    python bench/files.py --quick     # 16 tensors of 256K elements, one repetition

A model's tensors are mostly one delta chunk (4M elements) or less, so each one alone keeps one
worker busy: the commands must work on several at once (docs/results.md, "twenty-first turn").
The checkpoint is synthetic and deterministic: ``bench/kernels.py``'s shard and its
optimizer-like step (``make_shard``, ``make_target``), cut into ``--tensors`` tensors. Timed
(median of ``--reps``):

* ``copy`` -- every file read into memory and written to a new directory, fsynced: what an apply
  cannot do without (it reads the base and writes the result), the unit of every ratio;
* ``diff`` -- ``diff_checkpoints`` base -> target (both read, the bases hashed, the delta written);
* ``apply`` -- ``apply_checkpoint`` of that delta into a new directory (every base and result tensor
  checked, the files written as temporaries and moved into place); its files are compared with the
  target's byte for byte.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

from nemo_dcr.checkpoint.files import apply_checkpoint, diff_checkpoints
from nemo_dcr.checkpoint.safetensors_io import save_sharded

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from benchload import script  # noqa: E402


def _kernels():
    """bench/kernels.py, for its shard, its step, its timer and its load reading."""
    return script("kernels")


def make_checkpoints(root: str, tensors: int, elems: int, rate: float, shards: int = 2) -> tuple[str, str]:
    """A base and a target checkpoint of ``tensors`` BF16 tensors of ``elems`` elements each,
    ``rate`` of the elements changed, in ``shards`` files each -> their directories."""
    k = _kernels()
    base = k.make_shard(tensors * elems)
    target = k.make_target(base, rate)
    out = []
    for name, flat in (("base", base), ("target", target)):
        state = {f"layers.{i:03d}.weight": flat[i * elems:(i + 1) * elems].clone() for i in range(tensors)}
        save_sharded(state, os.path.join(root, name), shards=shards)
        out.append(os.path.join(root, name))
    return out[0], out[1]


def copy_files(src: str, dst: str) -> None:
    os.makedirs(dst)
    for n in sorted(os.listdir(src)):
        with open(os.path.join(src, n), "rb") as f:
            data = f.read()
        with open(os.path.join(dst, n), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _files(d: str) -> dict:
    out = {}
    for n in sorted(os.listdir(d)):
        with open(os.path.join(d, n), "rb") as f:
            out[n] = f.read()
    return out


def run(tensors: int, elems: int, rate: float, reps: int, workers: int | None, quick: bool = False) -> dict:
    t0 = time.perf_counter()
    k = _kernels()
    median, load = k._median, k._load
    out = {"config": {"tensors": tensors, "elements_per_tensor": elems, "bytes": 2 * tensors * elems,
                      "dtype": "bfloat16", "change": rate, "reps": reps, "workers": workers, "quick": quick},
           "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "torch": torch.__version__, "load_before": load()}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="dcr-bench-files-") as tmp:
        base, target = make_checkpoints(tmp, tensors, elems, rate)
        delta, out_dir = os.path.join(tmp, "step.dcr"), os.path.join(tmp, "out")

        def fresh():
            shutil.rmtree(out_dir, ignore_errors=True)

        timings = {
            "copy": median(lambda _: copy_files(base, out_dir), reps, fresh),
            "diff": median(lambda: diff_checkpoints(base, target, delta, workers=workers, progress=False), reps),
            "apply": median(lambda _: apply_checkpoint(base, delta, out_dir, workers=workers, progress=False), reps,
                            fresh),
        }
        if _files(out_dir) != _files(target):
            raise AssertionError("apply_checkpoint did not rebuild the target's files byte for byte")
        out["delta_bytes"] = os.path.getsize(delta)
    for path, s in timings.items():
        out["rows"].append({"path": path, "seconds": s, "x_copy": s / timings["copy"]})
    out["machine"]["load_after"] = load()
    out["seconds_total"] = time.perf_counter() - t0
    return out


def format_table(r: dict) -> str:
    c = r["config"]
    lines = [f"checkpoint: {c['tensors']} tensors of {c['elements_per_tensor'] / 1e6:.2f}M BF16 elements "
             f"({c['bytes'] / 1e6:.0f} MB) in 2 files, {100 * c['change']:g} % changed, delta "
             f"{r['delta_bytes'] / 1e6:.2f} MB; workers {c['workers'] or 'default'}; "
             f"load {r['machine']['load_before']} -> {r['machine']['load_after']}",
             "", "| path | ms | x copy |", "|---|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['path']} | {1e3 * row['seconds']:.1f} | {row['x_copy']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--elems", type=int, default=2 << 20, help="elements per tensor (default 2M)")
    ap.add_argument("--change", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=None, help="the commands' workers (default: theirs)")
    ap.add_argument("--quick", action="store_true", help="16 tensors of 256K elements, 1 repetition")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    tensors, elems, reps = (16, 1 << 18, 1) if a.quick else (a.tensors, a.elems, a.reps)
    r = run(tensors, elems, a.change, reps, a.workers, a.quick)
    print(json.dumps(r, indent=1) if a.json else format_table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
