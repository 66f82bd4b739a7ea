"""Codec benchmark: delta size and encode/apply speed on consecutive BF16 checkpoints of a real
(small) training run, against a memcpy of the same bytes measured in the same process.

    python bench/codec.py                      # full setting, tables on stdout
    python bench/codec.py --json               # the same as JSON
    python bench/codec.py --quick --json       # tiny model, seconds (smoke test)

For every learning rate in ``--lrs`` the model (bench/train.py) is warmed up at a high learning
rate, then fine-tuned ``--steps`` steps at that rate; every consecutive pair of published
checkpoints (warm-up end -> step 1 -> step 2 ...) is one row. Per pair:

* change rate -- fraction of BF16 elements whose bits changed (int16 views);
* bytes per changed element of the whole delta (container, header and all) encoded
  overwrite-only, XOR-only and mixed (``auto``: per chunk, the smaller);
* dense / delta -- dense BF16 bytes (sum of numel * 2) over mixed delta bytes;
* encode (``diff``, mixed) and ``apply`` (on a clone of the base, verification on) wall time,
  as GB/s of dense bytes and as a multiple of the time a plain per-tensor ``copy_`` of the same
  bytes takes (the memcpy baseline; a ``torch.cat`` of them is reported in JSON too).

Every delta (all three encodings) is applied and the result compared with the target bit for
bit; a mismatch raises and the benchmark exits non-zero.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

from nemo_dcr import apply, diff, inspect, ordered
from nemo_dcr.delta import DEFAULT_CHUNK, DEFAULT_LEVEL
from nemo_dcr.parallel import default_workers

ENCODINGS = ("overwrite", "xor", "add", "auto")
FULL = dict(steps=4, lrs=(1e-6, 5e-6, 1e-5), warmup_steps=100, reps=5)
QUICK = dict(steps=2, lrs=(1e-6, 1e-5), warmup_steps=30, reps=1)


def _load_train():
    """bench/train.py, loaded by path (bench/ is not a package)."""
    name = "nemo_dcr_bench_train"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class BenchError(AssertionError):
    pass


# ----------------------------------------------------------------------------- helpers

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view({1: torch.uint8, 4: torch.int32, 8: torch.int64}[t.element_size()])


def count_changed(a: dict, b: dict) -> int:
    return sum(int((_bits(a[n]) != _bits(b[n])).sum()) for n in b)


def check_equal(got: dict, want: dict, what: str) -> None:
    if set(got) != set(want):
        raise BenchError(f"{what}: tensor names differ after apply")
    bad = [n for n in want if got[n].dtype != want[n].dtype or got[n].shape != want[n].shape
           or not torch.equal(_bits(got[n]), _bits(want[n]))]
    if bad:
        raise BenchError(f"{what}: APPLY IS NOT BIT-EXACT for {len(bad)} tensors, e.g. {bad[:3]}")


def entropy_bounds(base: dict, target: dict) -> dict:
    """Order-0 reference sizes, in bytes: positions as independent Bernoulli draws at each
    tensor's own change rate (sum of numel * H(k/numel) bits), values as the empirical entropy
    of the XOR bit patterns pooled over the model. Not achievable bounds for a real coder (they
    ignore the cost of the model), just a yardstick for how much a better coder could save."""
    pos_bits, cond_bits, xs, adds = 0.0, 0.0, [], []
    for n in target:
        b, t = _bits(base[n]).reshape(-1), _bits(target[n]).reshape(-1)
        x = torch.bitwise_xor(b, t)
        changed = x != 0
        nz = x[changed]
        k, size = nz.numel(), x.numel()
        pos_bits += _bernoulli_bits(torch.tensor([k]), torch.tensor([size]))
        # positions given the base value's exponent (what the receiver knows): one Bernoulli
        # rate per exponent; a yardstick for exponent-conditioned position coding (issue #5)
        mant = _MANTISSA_BITS.get(target[n].dtype)
        if mant is None:
            cond_bits += _bernoulli_bits(torch.tensor([k]), torch.tensor([size]))
        else:
            u = b.to(torch.int64) & ((1 << (8 * b.element_size())) - 1)
            e = (u >> mant) & ((1 << (8 * b.element_size() - 1 - mant)) - 1)
            cond_bits += _bernoulli_bits(torch.bincount(e[changed], minlength=int(e.max()) + 1 if e.numel() else 1),
                                         torch.bincount(e, minlength=int(e.max()) + 1 if e.numel() else 1))
        xs.append(nz.to(torch.int64) & ((1 << (8 * x.element_size())) - 1))
        if k and x.element_size() in ordered.WIDTHS:
            z = ordered.encode(b[changed], t[changed], target[n].dtype.is_floating_point)
            adds.append(z.to(torch.int64) & ((1 << (8 * x.element_size())) - 1))
    return {"positions": pos_bits / 8, "positions_given_exponent": cond_bits / 8,
            "values": _empirical_bits(xs) / 8, "values_add": _empirical_bits(adds) / 8}


_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def _bernoulli_bits(k: torch.Tensor, n: torch.Tensor) -> float:
    """Sum over groups of n * H(k/n) bits."""
    k, n = k.to(torch.float64), n.to(torch.float64)
    keep = (k > 0) & (k < n)
    p = k[keep] / n[keep]
    return float((n[keep] * (-p * torch.log2(p) - (1 - p) * torch.log2(1 - p))).sum())


def _empirical_bits(parts: list) -> float:
    allx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    if not allx.numel():
        return 0.0
    counts = torch.bincount(allx).to(torch.float64)
    counts = counts[counts > 0]
    return float(-(counts * torch.log2(counts / allx.numel())).sum())


def _median_time(fn, reps: int, setup=None) -> float:
    ts = []
    for _ in range(reps):
        arg = setup() if setup else None
        t0 = time.perf_counter()
        fn(arg) if setup else fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def memcpy_times(target: dict, reps: int) -> dict:
    """Per-tensor copy_ into preallocated buffers, and a torch.cat of the flat tensors."""
    dst = {n: torch.empty_like(t) for n, t in target.items()}
    flat = [t.reshape(-1) for t in target.values()]

    def copy_all():
        for n, t in target.items():
            dst[n].copy_(t)

    copy_all()
    torch.cat(flat)  # warm both paths
    return {"copy": _median_time(copy_all, reps), "cat": _median_time(lambda: torch.cat(flat), reps)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ----------------------------------------------------------------------------- one pair

def bench_pair(base: dict, target: dict, *, level: int, chunk_elems: int, workers: int, reps: int,
               memcpy_reps: int) -> dict:
    elements = sum(t.numel() for t in target.values())
    dense = sum(t.numel() * t.element_size() for t in target.values())
    changed = count_changed(base, target)
    r = {"elements": elements, "dense_bytes": dense, "changed": changed,
         "change_rate": changed / elements if elements else 0.0}

    blobs, stats = {}, {}
    for enc in ENCODINGS:
        blobs[enc] = diff(base, target, encoding=enc, level=level, chunk_elems=chunk_elems, workers=workers,
                          progress=False)
        stats[enc] = inspect(blobs[enc])
        if stats[enc]["changed"] != changed:
            raise BenchError(f"{enc} delta counts {stats[enc]['changed']} changed elements, the int16 compare {changed}")
        work = {n: t.clone() for n, t in base.items()}
        apply(work, blobs[enc], workers=workers)
        check_equal(work, target, f"{enc} delta")

    size = {e: len(blobs[e]) for e in ENCODINGS}
    payload = {e: stats[e]["bytes_by_stream"]["positions"] + stats[e]["bytes_by_stream"]["values"] for e in ENCODINGS}
    m = stats["auto"]
    ent = entropy_bounds(base, target)
    r.update({
        "bytes": size,
        "payload_bytes": payload,
        "header_bytes": {e: stats[e]["bytes_by_stream"]["header"] for e in ENCODINGS},
        "bytes_per_changed": {e: (size[e] / changed if changed else None) for e in ENCODINGS},
        "ratio_dense_to_mixed": dense / size["auto"],
        "mixed_saving_vs_overwrite": 1 - size["auto"] / size["overwrite"],
        "mixed_saving_vs_xor": 1 - size["auto"] / size["xor"],
        "mixed_streams": m["bytes_by_stream"],
        "mixed_position_bytes_by_coding": m["position_bytes_by_coding"],
        "mixed_chunks_by_encoding": m["chunks_by_encoding"],
        "mixed_value_bytes_by_encoding": m["bytes_by_encoding"],
        "order0_bytes": ent,
        "order0_bytes_per_changed": {k: (v / changed if changed else None) for k, v in ent.items()},
    })

    # ---- timing (mixed delta), each against a memcpy of the same bytes measured right here
    mc = memcpy_times(target, memcpy_reps)
    t_diff = _median_time(lambda: diff(base, target, encoding="auto", level=level, chunk_elems=chunk_elems,
                                       workers=workers, progress=False), reps)
    holder = {}

    def fresh():
        holder["w"] = {n: t.clone() for n, t in base.items()}
        return holder["w"]

    t_apply = _median_time(lambda w: apply(w, blobs["auto"], workers=workers), reps, setup=fresh)
    check_equal(holder["w"], target, "timed mixed apply")
    gb = dense / 1e9
    r.update({
        "time_s": {"memcpy": mc["copy"], "cat": mc["cat"], "diff": t_diff, "apply": t_apply},
        "gbps": {"memcpy": gb / mc["copy"], "cat": gb / mc["cat"], "diff": gb / t_diff, "apply": gb / t_apply},
        "x_memcpy": {"diff": t_diff / mc["copy"], "apply": t_apply / mc["copy"]},
        "apply_verified": True,
    })
    return r


# ----------------------------------------------------------------------------- driver

def run(*, steps: int, lrs, warmup_steps: int, workers: int | None, reps: int, level: int = DEFAULT_LEVEL,
        chunk_elems: int = DEFAULT_CHUNK, seed: int = 0, quick: bool = False, log=None) -> dict:
    train = _load_train()
    config = train.SMALL if quick else train.Config()
    workers = workers or default_workers()
    t_start = time.perf_counter()
    pairs = []
    for lr in lrs:
        t0 = time.perf_counter()
        losses: list = []
        ckpts = train.make_checkpoints(steps, lr, warmup_steps, seed, config=config, log=log, losses=losses)
        t_train = time.perf_counter() - t0
        if log:
            log(f"lr {lr:g}: {len(ckpts)} checkpoints in {t_train:.1f}s")
        for i in range(1, len(ckpts)):
            p = bench_pair(ckpts[i - 1], ckpts[i], level=level, chunk_elems=chunk_elems, workers=workers,
                           reps=reps, memcpy_reps=max(5, 5 * reps))
            p.update({"lr": lr, "step_from": i - 1, "step_to": i, "loss": losses[i - 1]})
            pairs.append(p)
            if log:
                log(f"  pair {i - 1}->{i}: {100 * p['change_rate']:.3f}% changed, "
                    f"{p['bytes_per_changed']['auto'] or 0:.3f} B/changed mixed")
        del ckpts
    return {
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()},
        "config": {"model": dataclasses.asdict(config),
                   "params": train.n_params(config), "steps": steps, "lrs": list(lrs), "warmup_steps": warmup_steps,
                   "warmup_lr": train.WARMUP_LR, "seed": seed, "workers": workers, "reps": reps, "level": level,
                   "chunk_elems": chunk_elems, "quick": quick},
        "pairs": pairs,
        "summary": summarize(pairs),
        "wall_s": time.perf_counter() - t_start,
    }


def summarize(pairs) -> dict:
    """Per learning rate and overall: byte-weighted aggregates (totals over pairs)."""
    def agg(ps):
        ch = sum(p["changed"] for p in ps)
        el = sum(p["elements"] for p in ps)
        dense = sum(p["dense_bytes"] for p in ps)
        b = {e: sum(p["bytes"][e] for p in ps) for e in ENCODINGS}
        streams = {k: sum(p["mixed_streams"].get(k, 0) for p in ps) for k in ("positions", "values", "header")}
        return {
            "pairs": len(ps), "change_rate": ch / el if el else 0.0,
            "bytes_per_changed": {e: (b[e] / ch if ch else None) for e in ENCODINGS},
            "ratio_dense_to_mixed": dense / b["auto"] if b["auto"] else None,
            "mixed_saving_vs_overwrite": 1 - b["auto"] / b["overwrite"],
            "xor_saving_vs_overwrite": 1 - b["xor"] / b["overwrite"],
            "mixed_stream_share": {k: v / b["auto"] for k, v in streams.items()},
            "mixed_stream_bytes_per_changed": {k: (v / ch if ch else None) for k, v in streams.items()},
            "order0_bytes_per_changed": {k: (sum(p["order0_bytes"][k] for p in ps) / ch if ch else None)
                                         for k in ps[0]["order0_bytes"]},
            "x_memcpy_median": {k: statistics.median(p["x_memcpy"][k] for p in ps) for k in ("diff", "apply")},
            "gbps_median": {k: statistics.median(p["gbps"][k] for p in ps) for k in ("memcpy", "diff", "apply")},
        }

    out = {"all": agg(pairs)} if pairs else {}
    for lr in sorted({p["lr"] for p in pairs}):
        out[f"lr={lr:g}"] = agg([p for p in pairs if p["lr"] == lr])
    return out


# ----------------------------------------------------------------------------- output

def _table(header, rows) -> str:
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).rjust(n) for x, n in zip(r, w)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (n + 1) + ":" for n in w) + "|"] + [line(r) for r in rows])


def format_tables(res: dict) -> str:
    c, m = res["config"], res["machine"]
    f = lambda x, d=3: "n/a" if x is None else f"{x:.{d}f}"  # noqa: E731
    out = [f"# nemo-dcr codec benchmark: {c['params']:,}-parameter model, BF16, {c['steps']} fine-tune steps per lr "
           f"after {c['warmup_steps']} warm-up steps at {c['warmup_lr']:g}",
           f"# machine: {m['cpus']} CPUs ({m['cpu']}), torch {m['torch']} ({m['torch_threads']} threads), "
           f"workers {c['workers']}, zstd level {c['level']}, chunk {c['chunk_elems']:,} elements, "
           f"median of {c['reps']} timing reps", ""]
    out.append("## Size (bytes per changed element = whole delta bytes / changed BF16 elements)\n")
    rows = []
    for p in res["pairs"]:
        s = p["mixed_streams"]
        tot = p["bytes"]["auto"]
        enc = p["mixed_chunks_by_encoding"]
        rows.append([f"{p['lr']:g}", f"{p['step_from']}->{p['step_to']}", f"{100 * p['change_rate']:.3f}",
                     f(p["bytes_per_changed"]["overwrite"]), f(p["bytes_per_changed"]["xor"]),
                     f(p["bytes_per_changed"]["add"]),
                     f(p["bytes_per_changed"]["auto"]), f"{100 * p['mixed_saving_vs_overwrite']:.1f}%",
                     f"{p['ratio_dense_to_mixed']:.1f}x",
                     f"{100 * s['positions'] / tot:.0f}/{100 * s['values'] / tot:.0f}/{100 * s['header'] / tot:.0f}",
                     f"{enc.get('xor', 0)}/{enc.get('add', 0)}/{enc.get('overwrite', 0)}"])
    out.append(_table(["lr", "pair", "changed %", "B/chg overwrite", "B/chg xor", "B/chg add", "B/chg mixed",
                       "mixed vs ow", "dense/delta", "pos/val/hdr %", "chunks xor/add/ow"], rows))
    out.append("\n## Speed (dense BF16 bytes per second; x memcpy = time / per-tensor copy_ time of the same bytes)\n")
    rows = []
    for p in res["pairs"]:
        t, g, x = p["time_s"], p["gbps"], p["x_memcpy"]
        rows.append([f"{p['lr']:g}", f"{p['step_from']}->{p['step_to']}", f"{p['dense_bytes'] / 1e6:.1f}",
                     f"{1e3 * t['memcpy']:.2f}", f(g["memcpy"], 2),
                     f"{1e3 * t['diff']:.1f}", f(g["diff"], 3), f"{x['diff']:.0f}x",
                     f"{1e3 * t['apply']:.1f}", f(g["apply"], 3), f"{x['apply']:.0f}x",
                     "yes" if p["apply_verified"] else "NO"])
    out.append(_table(["lr", "pair", "dense MB", "memcpy ms", "memcpy GB/s", "encode ms", "encode GB/s",
                       "encode x memcpy", "apply ms", "apply GB/s", "apply x memcpy", "bit-exact"], rows))
    out.append("\n## Summary (totals over the pairs of each lr)\n")
    rows = []
    for k, s in res["summary"].items():
        b = s["bytes_per_changed"]
        sh = s["mixed_stream_share"]
        rows.append([k, f"{100 * s['change_rate']:.3f}", f(b["overwrite"]), f(b["xor"]), f(b["add"]), f(b["auto"]),
                     f"{100 * s['xor_saving_vs_overwrite']:.1f}%", f"{100 * s['mixed_saving_vs_overwrite']:.1f}%",
                     f"{s['ratio_dense_to_mixed']:.1f}x",
                     f"{100 * sh['positions']:.0f}/{100 * sh['values']:.0f}/{100 * sh['header']:.0f}",
                     f"{s['x_memcpy_median']['diff']:.0f}x", f"{s['x_memcpy_median']['apply']:.0f}x"])
    out.append(_table(["", "changed %", "B/chg overwrite", "B/chg xor", "B/chg add", "B/chg mixed", "xor vs ow",
                       "mixed vs ow",
                       "dense/delta", "pos/val/hdr %", "encode x memcpy", "apply x memcpy"], rows))
    out.append("\n## Where the mixed bytes go (bytes per changed element; order-0 = entropy yardstick, see entropy_bounds())\n")
    rows = []
    for k, s in res["summary"].items():
        st, o0 = s["mixed_stream_bytes_per_changed"], s["order0_bytes_per_changed"]
        rows.append([k, f(st["positions"]), f(o0["positions"]), f(o0["positions_given_exponent"]), f(st["values"]),
                     f(o0["values"]), f(o0["values_add"]), f(st["header"], 4)])
    out.append(_table(["", "positions", "order-0 positions", "given base exponent", "values",
                       "order-0 xor values", "order-0 add values", "header"], rows))
    out.append(f"\nall applies verified bit-exact; wall time {res['wall_s']:.0f}s")
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    """Bytes per changed element against change rate, per encoding, with the mixed delta split
    into positions and values. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted(res["pairs"], key=lambda p: p["change_rate"])
    x = [100 * p["change_rate"] for p in ps]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for enc, style in (("overwrite", "s-"), ("xor", "^-"), ("add", "v-"), ("auto", "o-")):
        ax.plot(x, [p["bytes_per_changed"][enc] for p in ps], style, label=f"{enc if enc != 'auto' else 'mixed'} (total)")
    ax.plot(x, [p["mixed_streams"]["positions"] / p["changed"] for p in ps], "o--", alpha=.6, label="mixed: positions")
    ax.plot(x, [p["mixed_streams"]["values"] / p["changed"] for p in ps], "o:", alpha=.6, label="mixed: values")
    ax.plot(x, [p["order0_bytes_per_changed"]["positions"] for p in ps], "k--", lw=.8, alpha=.5,
            label="order-0 entropy: positions")
    ax.set_xlabel("changed BF16 elements per step (%)")
    ax.set_ylabel("delta bytes per changed element")
    ax.set_ylim(0, 1.3 * max(p["bytes_per_changed"]["overwrite"] for p in ps))
    ax.grid(alpha=.3)
    c = res["config"]
    ax.set_title(f"{c['params'] / 1e6:.1f}M-param model, lr {', '.join(f'{lr:g}' for lr in c['lrs'])}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, help=f"fine-tune steps per lr (default {FULL['steps']})")
    ap.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")],
                    help="comma-separated fine-tune learning rates (default 1e-6,5e-6,1e-5)")
    ap.add_argument("--warmup-steps", type=int, help=f"warm-up steps at high lr (default {FULL['warmup_steps']})")
    ap.add_argument("--workers", type=int, default=None, help="diff/apply worker threads (default: nemo_dcr's)")
    ap.add_argument("--reps", type=int, help="timing repetitions, median reported (default 5)")
    ap.add_argument("--level", type=int, default=DEFAULT_LEVEL, help="zstd level")
    ap.add_argument("--chunk-elems", type=int, default=DEFAULT_CHUNK)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--plot", metavar="PNG", help="also write a plot of bytes per change (needs matplotlib)")
    a = ap.parse_args(argv)
    d = QUICK if a.quick else FULL
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        res = run(steps=a.steps if a.steps is not None else d["steps"], lrs=a.lrs or d["lrs"],
                  warmup_steps=a.warmup_steps if a.warmup_steps is not None else d["warmup_steps"],
                  workers=a.workers, reps=a.reps or d["reps"], level=a.level, chunk_elems=a.chunk_elems,
                  seed=a.seed, quick=a.quick, log=log)
    except BenchError as e:
        print(f"BENCHMARK FAILED: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1) if a.json else format_tables(res))
    if a.plot:
        plot(res, a.plot)
        log(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
