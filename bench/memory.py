"""Memory benchmark (issue 25): resident memory of a follower's delta sync and keyframe sync, and
of a publisher, as multiples of the model's bytes, one process per case.

    python bench/memory.py                    # 0.25, 1 and 3 GiB BF16 models
    python bench/memory.py --sizes 0.25 --json
    python bench/memory.py --quick            # 0.125 GiB

Each case runs in a fresh interpreter (``--case``), so that one case's freed memory does not sit
in the next one's arenas. In it: the interpreter's resident size once torch and nemo-dcr are
imported (``interp``), the model built (deterministic: the same bits in every process), then the
peak resident size (``VmHWM``, reset with ``/proc/self/clear_refs`` before the timed step) and
the resident size after it. Cases, per size, on a local store in a temporary directory:

* ``publish``: a Publisher publishes the model (version 0, a keyframe), then a 1 % change of it
  (version 1, a delta); ``extra`` = (peak - interp - model) / model, the copies the publisher
  holds beyond the caller's tensors (target: one copy of the last version plus O(chunk) buffers,
  i.e. about 1.0);
* ``delta``: a follower holding version 0 syncs to version 1; ``peak`` = (peak - interp) / model
  (target <= 1.25);
* ``keyframe``: a follower holding nothing syncs to version 1 (keyframe 0 + delta 1);
  ``peak`` as above, ``after`` = (resident after - interp) / model (target: no 2x retention).

Ratios print per size; the targets are issue 25's. Single receiver, ``stream=False`` (the default)
and ``stream=True`` (``--stream``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSOR_ELEMS = 16 << 20  # 32 MB BF16 tensors
TARGETS = {"publish_extra": 1.25, "delta_peak": 1.25, "keyframe_after": 1.25}


def _status(field: str) -> int:
    """A ``/proc/self/status`` field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss() -> int:
    return _status("VmRSS")


def reset_peak() -> None:
    """Start a new peak: ``VmHWM`` from here on (Linux: "5" to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    return _status("VmHWM")


def model(gb: float, version: int = 0, elems: int | None = None) -> dict:
    """``gb`` GiB of BF16 in tensors of TENSOR_ELEMS, deterministic; version 1: 1 % of each
    tensor's elements nudged (made in place, one tensor at a time: no second copy)."""
    import torch
    elems = elems or TENSOR_ELEMS
    out = {}
    for i in range(tensors_of(gb, elems)):
        g = torch.Generator().manual_seed(i)
        t = torch.randn(elems, generator=g, dtype=torch.bfloat16)
        if version:
            step(t, i)
        out[f"layers.{i:04d}.weight"] = t
    return out


def tensors_of(gb: float, elems: int | None = None) -> int:
    return max(1, round(gb * (1 << 30) / 2 / (elems or TENSOR_ELEMS)))


def step(t, i: int) -> None:
    import torch
    g = torch.Generator().manual_seed(10_000 + i)
    idx = torch.randint(0, t.numel(), (t.numel() // 100,), generator=g)
    t[idx] = (t[idx].float() * 1.01 + 1e-3).to(t.dtype)


def nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def case(name: str, gb: float, store_dir: str, stream: bool, elems: int | None = None) -> dict:
    """One case, in this process (``elems``: per tensor, default TENSOR_ELEMS)."""
    import torch  # noqa: F401  (what the interpreter holds once it is imported)

    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.publisher import Publisher
    interp = rss()
    store = LocalStore(store_dir)
    out: dict = {"case": name, "gb": gb, "interp": interp}
    if name == "publish":
        live = model(gb, 0, elems)
        out["model"] = m = nbytes(live)
        pub = Publisher(store, signer=None)
        reset_peak()
        t = time.perf_counter()
        pub.publish(live)
        out["keyframe_s"] = time.perf_counter() - t
        out["keyframe_peak"], out["keyframe_after"] = peak(), rss()
        for i, v in enumerate(live.values()):
            step(v, i)
        reset_peak()
        t = time.perf_counter()
        r = pub.publish(live)
        out["delta_s"], out["delta_bytes"] = time.perf_counter() - t, r.delta_bytes
        out["delta_peak"], out["delta_after"] = peak(), rss()
        out["ratios"] = {"keyframe_extra": (out["keyframe_peak"] - interp - m) / m,
                         "publish_extra": (out["delta_peak"] - interp - m) / m,
                         "held_extra": (out["delta_after"] - interp - m) / m}
    elif name == "delta":
        held = model(gb, 0, elems)
        out["model"] = m = nbytes(held)
        f = Follower(store, held, version=0, verify_initial=False, stream=stream)
        reset_peak()
        t = time.perf_counter()
        r = f.sync()
        out["seconds"], out["bytes"] = time.perf_counter() - t, r.bytes
        out["peak"], out["after"] = peak(), rss()
        assert r.version == 1, r
        out["ratios"] = {"delta_peak": (out["peak"] - interp) / m, "delta_after": (out["after"] - interp) / m}
    elif name == "keyframe":
        m = tensors_of(gb, elems) * (elems or TENSOR_ELEMS) * 2
        out["model"] = m
        tensors: dict = {}
        f = Follower(store, tensors, stream=stream)
        reset_peak()
        t = time.perf_counter()
        r = f.sync()
        out["seconds"], out["bytes"] = time.perf_counter() - t, r.bytes
        out["peak"], out["after"] = peak(), rss()
        assert r.version == 1 and nbytes(tensors) == m, r
        out["ratios"] = {"keyframe_peak": (out["peak"] - interp) / m, "keyframe_after": (out["after"] - interp) / m}
    else:
        raise SystemExit(f"unknown case {name!r}")
    return out


def run_case(name: str, gb: float, store_dir: str, stream: bool, elems: int | None = None) -> dict:
    """``case`` in a fresh interpreter -> its figures."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", name, "--gb", str(gb), "--store", store_dir]
    if stream:
        cmd.append("--stream")
    if elems:
        cmd += ["--elems", str(elems)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"case {name} at {gb} GB failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(sizes: list, stream: bool) -> list:
    rows = []
    for gb in sizes:
        with tempfile.TemporaryDirectory(prefix="nemo-dcr-memory-") as d:
            store = os.path.join(d, "store")
            for name in ("publish", "delta", "keyframe"):
                r = run_case(name, gb, store, stream)
                rows.append(r)
                print(_line(r), file=sys.stderr, flush=True)
    return rows


def _line(r: dict) -> str:
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in r["ratios"].items())
    return (f"{r['gb']:g} GiB {r['case']}: model {r['model'] / 2**30:.2f} GiB, interpreter {r['interp'] / 1e6:.0f} MB; "
            f"{ratios}")


def table(rows: list, stream: bool) -> str:
    L = [f"MEASURED (one process per case; stream={stream}; load {os.getloadavg()[0]:.2f}, "
         f"{os.cpu_count()} CPUs)",
         "| model GiB | interpreter MB | publisher: extra copies at the delta (<=1.25) | publisher: extra after "
         "| delta sync: peak / model (<=1.25) | keyframe sync: peak / model | keyframe sync: after / model "
         "(<=1.25) | delta sync s | keyframe sync s |",
         "|---|---|---|---|---|---|---|---|---|"]
    for gb in dict.fromkeys(r["gb"] for r in rows):
        by = {r["case"]: r for r in rows if r["gb"] == gb}
        p, d, k = by["publish"], by["delta"], by["keyframe"]
        L.append(f"| {p['model'] / 2**30:.2f} | {d['interp'] / 1e6:.0f} | {p['ratios']['publish_extra']:.2f} | "
                 f"{p['ratios']['held_extra']:.2f} | {d['ratios']['delta_peak']:.2f} | "
                 f"{k['ratios']['keyframe_peak']:.2f} | {k['ratios']['keyframe_after']:.2f} | "
                 f"{d['seconds']:.2f} | {k['seconds']:.2f} |")
    return "\n".join(L)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=None, help="model sizes, GiB (default 0.25 1 3)")
    ap.add_argument("--quick", action="store_true", help="0.125 GiB only")
    ap.add_argument("--stream", action="store_true", help="followers with stream=True")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--gb", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--elems", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.case:
        print(json.dumps(case(a.case, a.gb, a.store, a.stream, a.elems)))
        return 0
    sizes = a.sizes or ([0.125] if a.quick else [0.25, 1.0, 3.0])
    rows = measure(sizes, a.stream)
    print(json.dumps({"rows": rows, "stream": a.stream, "targets": TARGETS}, indent=1) if a.json
          else table(rows, a.stream))
    return 0


if __name__ == "__main__":
    sys.exit(main())
