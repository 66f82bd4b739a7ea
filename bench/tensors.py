"""The same bytes as one tensor and as many: a publisher's keyframe and delta publish and a
follower's delta and keyframe sync, each as a multiple of its one-tensor time, in one process.

    python bench/tensors.py             # 128M BF16 elements (256 MB) as 1, 64, 512 and 4096 tensors
    python bench/tensors.py --json      # the same as JSON
    python bench/tensors.py --quick     # 8M elements as 1, 16 and 256 tensors, one repetition

Time should follow the bytes, not the number of tensors; what a tensor costs besides its bytes
(its header entry, its chunk's Python, its digests' keys) shows here as the ratio over 1.00. A
model of many small tensors: a LoRA adapter, a small model, a trainer rank's shards of a mixture
of experts (docs/results.md, twenty-second turn). The model is synthetic and deterministic:
``bench/kernels.py``'s shard and its optimizer-like step (``make_shard``, ``make_target``), cut
into ``--tensors`` equal tensors. Per repetition, on a fresh local store (a temporary directory):

* ``keyframe publish`` -- a ``Publisher``'s first version (a keyframe);
* ``delta publish`` -- its second, the step's changes (``--change``, 1 % by default);
* ``delta sync`` -- a ``Follower`` holding the first version syncs to the second;
* ``keyframe sync`` -- a ``Follower`` holding nothing syncs to the second (the keyframe, then the
  delta); both followers' tensors are compared with the target's bits.

Each cell is the median of ``--reps``; ``x one`` is the cell over the same row's one-tensor cell.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from benchload import ratio_rows, ratio_table, script  # noqa: E402

PATHS = ("keyframe publish", "delta publish", "delta sync", "keyframe sync")


def _kernels():
    """bench/kernels.py, for its shard, its step, its timer and its load reading."""
    return script("kernels")


def cut(flat: torch.Tensor, tensors: int) -> dict:
    """``flat`` as ``tensors`` equal tensors of their own memory, named as a model's layers."""
    n = flat.numel() // tensors
    return {f"layers.{i:05d}.weight": flat[i * n:(i + 1) * n].clone() for i in range(tensors)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def one_rep(base: dict, target: dict, workers: int | None) -> dict:
    """The four paths once, on a fresh store -> seconds by path."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="dcr-bench-tensors-") as d:
        store = LocalStore(d)
        live = {k: v.clone() for k, v in base.items()}
        pub = Publisher(store, signer=None, workers=workers)
        t = time.perf_counter()
        pub.publish(live)
        out["keyframe publish"] = time.perf_counter() - t
        for k, v in live.items():
            v.copy_(target[k])
        t = time.perf_counter()
        pub.publish(live)
        out["delta publish"] = time.perf_counter() - t
        held = {k: v.clone() for k, v in base.items()}
        f = Follower(store, held, version=0, verify_initial=False, workers=workers)
        t = time.perf_counter()
        r = f.sync()
        out["delta sync"] = time.perf_counter() - t
        fresh: dict = {}
        g = Follower(store, fresh, workers=workers)
        t = time.perf_counter()
        r2 = g.sync()
        out["keyframe sync"] = time.perf_counter() - t
        if not (r.version == r2.version == 1 and _same(held, target) and _same(fresh, target)):
            raise AssertionError("a follower did not end at the target's bits")
    return out


def run(elems: int, counts: list, rate: float, reps: int, workers: int | None, quick: bool = False) -> dict:
    t0 = time.perf_counter()
    k = _kernels()
    out = {"config": {"elements": elems, "bytes": 2 * elems, "tensors": counts, "dtype": "bfloat16", "change": rate,
                      "reps": reps, "workers": workers, "quick": quick},
           "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "torch": torch.__version__, "load_before": k._load()}, "rows": []}
    flat_base = k.make_shard(elems)
    flat_target = k.make_target(flat_base, rate)
    cells: dict = {}
    for n in counts:
        base, target = cut(flat_base, n), cut(flat_target, n)
        times = [one_rep(base, target, workers) for _ in range(reps)]
        cells[n] = {p: statistics.median(t[p] for t in times) for p in PATHS}
    out["rows"] = ratio_rows(cells, counts, PATHS, "tensors")
    out["machine"]["load_after"] = k._load()
    out["seconds_total"] = time.perf_counter() - t0
    return out


def format_table(r: dict) -> str:
    c = r["config"]
    counts = c["tensors"]
    lines = [f"model: {c['elements'] / 1e6:.0f}M BF16 elements ({c['bytes'] / 1e6:.0f} MB), {100 * c['change']:g} % "
             f"changed, as {', '.join(map(str, counts))} tensors; local store; workers {c['workers'] or 'default'}; "
             f"medians of {c['reps']}; load {r['machine']['load_before']} -> {r['machine']['load_after']}", ""]
    return "\n".join(lines + ratio_table(r["rows"], "tensors", counts, PATHS, lambda n: f"{n} tensors"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elems", type=int, default=128 << 20, help="BF16 elements in all (default 128M)")
    ap.add_argument("--tensors", type=int, nargs="+", default=[1, 64, 512, 4096],
                    help="tensor counts to cut them into (the first is the unit of the ratios)")
    ap.add_argument("--change", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None, help="the publisher's and followers' workers")
    ap.add_argument("--quick", action="store_true", help="8M elements as 1, 16 and 256 tensors, 1 repetition")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    elems, counts, reps = (8 << 20, [1, 16, 256], 1) if a.quick else (a.elems, a.tensors, a.reps)
    if any(elems % n for n in counts):
        ap.error(f"--elems {elems} does not cut into {counts} equal tensors")
    r = run(elems, counts, a.change, reps, a.workers, a.quick)
    print(json.dumps(r, indent=1) if a.json else format_table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
