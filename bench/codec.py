"""Codec benchmark: delta size and encode/apply speed on consecutive BF16 checkpoints of a real
(small) training run, against a memcpy of the same bytes measured in the same process.

    python bench/codec.py                      # full setting, tables on stdout
    python bench/codec.py --json               # the same as JSON
    python bench/codec.py --quick --json       # tiny model, seconds (smoke test)
    python bench/codec.py --plot out.png       # also plot bytes per change against change rate

The model (bench/train.py) is warmed up ``--warmup-steps`` steps at a high learning rate (the
warmed-up fp32 weights are cached on disk under runs/bench-cache/, so a re-run does not train
them again; --quick skips the disk cache), then, for every learning rate in ``--lrs``,
fine-tuned ``--steps`` steps at that rate, publishing the BF16 weights after every step. Each
publish cadence in ``--every`` (default 1 and 4) reads that one run as a series -- every
``every``-th checkpoint, warm-up end first -- and every consecutive pair of a series is one row
(``every`` = 4: 0->4, 4->8). Per pair:

* change rate -- fraction of BF16 elements whose bits changed (int16 views);
* bytes per changed element of the whole delta (container, header and all) encoded
  overwrite-only, XOR-only, add-only, classes-only and mixed (``auto``: per chunk, the smallest);
  an encoding this build of nemo_dcr does not offer (not in ``nemo_dcr.chunk.CHOICES``) is
  skipped: null in JSON, "n/a" in the tables, and a note says so;
* entropy yardsticks (``entropy_bounds``), bytes per changed element: positions order-0 (a
  Bernoulli rate per tensor), given the base value's exponent, given the exponent and the
  element's change direction in the previous pair of the same series (null for a series' first
  pair); the add values order-0 and given the base exponent (pooled over the model); and the
  sign of the change, order-0 and given the previous direction, in bits per change;
* dense / delta -- dense BF16 bytes (sum of numel * 2) over mixed delta bytes;
* encode (``diff``, mixed) and ``apply`` (on a clone of the base, verification on) wall time,
  as GB/s of dense bytes and as a multiple of the time a plain per-tensor ``copy_`` of the same
  bytes takes (the memcpy baseline; a ``torch.cat`` of them is reported in JSON too);
* the chunk codec kernel alone for the "classes" encoding: ``nemo_dcr.chunk.encode_chunk`` /
  ``decode_chunk`` over every tensor as one chunk, single-threaded, no container (null, with
  the error, when the kernel is not there or its call fails).

Every delta (all encodings) is applied and the result compared with the target bit for bit; a
mismatch raises and the benchmark exits non-zero.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

from nemo_dcr import apply, diff, inspect
from nemo_dcr.codec import chunk, ordered
from nemo_dcr.delta import DEFAULT_CHUNK, DEFAULT_LEVEL
from nemo_dcr.util.parallel import default_workers

CLASSES = getattr(chunk, "CLASSES", "classes")
ENCODINGS = ("overwrite", "xor", "add", CLASSES, "auto")  # auto = mixed, the default
LABEL = {"overwrite": "overwrite", "xor": "xor", "add": "add", CLASSES: "classes", "auto": "mixed"}
KERNEL_ENCODING = CLASSES  # the encoding whose chunk kernel is timed alone
FULL = dict(steps=8, lrs=(3e-7, 1e-6, 5e-6, 1e-5), warmup_steps=300, reps=5, every=(1, 4))
QUICK = dict(steps=4, lrs=(1e-6, 1e-5), warmup_steps=30, reps=1, every=(1, 4))


def available_encodings() -> tuple:
    """The encodings of ENCODINGS this nemo_dcr offers (others are skipped, with a note)."""
    return tuple(e for e in ENCODINGS if e in chunk.CHOICES)


def _load_train():
    """bench/train.py, loaded by path (bench/ is not a package)."""
    name = "nemo_dcr_bench_train"
    if name in sys.modules:
        return sys.modules[name]
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(name, os.path.join(here, "train.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class BenchError(AssertionError):
    pass


# ----------------------------------------------------------------------------- helpers

def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 2:
        return t.view(torch.int16)
    return t.view({1: torch.uint8, 4: torch.int32, 8: torch.int64}[t.element_size()])


def count_changed(a: dict, b: dict) -> int:
    return sum(int((_bits(a[n]) != _bits(b[n])).sum()) for n in b)


def check_equal(got: dict, want: dict, what: str) -> None:
    if set(got) != set(want):
        raise BenchError(f"{what}: tensor names differ after apply")
    bad = [n for n in want if got[n].dtype != want[n].dtype or got[n].shape != want[n].shape
           or not torch.equal(_bits(got[n]), _bits(want[n]))]
    if bad:
        raise BenchError(f"{what}: APPLY IS NOT BIT-EXACT for {len(bad)} tensors, e.g. {bad[:3]}")


ENTROPY_KEYS = ("positions", "positions_given_exponent", "positions_given_exponent_prev", "values", "values_add",
                "values_add_given_exponent", "sign", "sign_given_prev")
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def entropy_bounds(base: dict, target: dict, prev_dir: dict | None = None, dirs_out: dict | None = None) -> dict:
    """Empirical entropy yardsticks of one pair, in bytes (whole model). Not achievable bounds for
    a real coder (they ignore the cost of the model), just a measure of what a context could save.

    * ``positions``: each tensor's changed positions as independent Bernoulli draws at the
      tensor's own rate (sum of numel * H(k/numel) bits);
    * ``positions_given_exponent``: one rate per (tensor, base value's exponent) -- what the
      receiver knows before decoding;
    * ``positions_given_exponent_prev``: one rate per (tensor, exponent, the element's change
      direction in the previous pair: -1/0/+1); None without ``prev_dir``;
    * ``values``: order-0 of the XOR bit patterns, ``values_add``: of the zigzag add values,
      ``values_add_given_exponent``: of the add values given the base exponent -- histograms
      pooled over the model (one value model for all tensors);
    * ``sign``: the direction of each change in the monotone order, order-0, and
      ``sign_given_prev`` given the previous direction (None without ``prev_dir``), pooled.

    Per-tensor quantities are summed over tensors (bits), so dividing by the total number of
    changes gives the pooled bytes per change. ``prev_dir``: per tensor, the previous pair's
    direction per element (int8 -1/0/+1, as written to ``dirs_out``, which, if given, receives
    this pair's directions for the next pair of the series)."""
    bits = dict.fromkeys(ENTROPY_KEYS, 0.0)
    xs, adds, add_exp, sign_keys = [], [], [], []
    for n in target:
        b, t = _bits(base[n]).reshape(-1), _bits(target[n]).reshape(-1)
        w = b.element_size()
        x = torch.bitwise_xor(b, t)
        changed = x != 0
        k, size = int(changed.sum()), x.numel()
        bits["positions"] += _bernoulli_bits(torch.tensor([k]), torch.tensor([size]))
        mant = _MANTISSA_BITS.get(target[n].dtype)
        if mant is None:  # no exponent: one context
            e, n_exp = torch.zeros(size, dtype=torch.int64), 1
        else:
            ebits = 8 * w - 1 - mant
            e, n_exp = (_unsigned(b) >> mant) & ((1 << ebits) - 1), 1 << ebits
        e_ch = e[changed]
        bits["positions_given_exponent"] += _bernoulli_bits(torch.bincount(e_ch, minlength=n_exp),
                                                           torch.bincount(e, minlength=n_exp))
        xs.append(_unsigned(x[changed]))
        d = torch.zeros(size, dtype=torch.int8)
        if k and w in ordered.WIDTHS:
            z = _unsigned(ordered.encode(b[changed], t[changed], target[n].dtype.is_floating_point))
            adds.append(z)
            add_exp.append(e_ch)
            down = z & 1  # zigzag: odd = the value went down in the monotone order
            d[changed] = (1 - 2 * down).to(torch.int8)
        else:  # no add coding for this width: direction unknown, "changed"
            down = None
            d[changed] = 1
        if prev_dir is not None:
            pd = prev_dir[n].reshape(-1).to(torch.int64) + 1  # 0, 1, 2
            ctx = e * 3 + pd
            bits["positions_given_exponent_prev"] += _bernoulli_bits(torch.bincount(ctx[changed], minlength=3 * n_exp),
                                                                     torch.bincount(ctx, minlength=3 * n_exp))
            if down is not None:
                sign_keys.append(pd[changed] * 2 + down)
        elif down is not None:
            sign_keys.append(down)
        if dirs_out is not None:
            dirs_out[n] = d
    bits["values"] = _empirical_bits(xs)
    bits["values_add"] = _empirical_bits(adds)
    if adds:
        za, ea = torch.cat(adds), torch.cat(add_exp)
        bits["values_add_given_exponent"] = _entropy_of(ea << 32 | za) - _entropy_of(ea)
        sk = torch.cat(sign_keys)
        if prev_dir is not None:
            bits["sign"] = _entropy_of(sk & 1)
            bits["sign_given_prev"] = _entropy_of(sk) - _entropy_of(sk >> 1)
        else:
            bits["sign"] = _entropy_of(sk)
    if prev_dir is None:
        bits["positions_given_exponent_prev"] = bits["sign_given_prev"] = None
    return {key: (v / 8 if v is not None else None) for key, v in bits.items()}


def _unsigned(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int64) & ((1 << (8 * bits.element_size())) - 1)


def _bernoulli_bits(k: torch.Tensor, n: torch.Tensor) -> float:
    """Sum over groups of n * H(k/n) bits."""
    k, n = k.to(torch.float64), n.to(torch.float64)
    keep = (k > 0) & (k < n)
    p = k[keep] / n[keep]
    return float((n[keep] * (-p * torch.log2(p) - (1 - p) * torch.log2(1 - p))).sum())


def _entropy_of(keys: torch.Tensor) -> float:
    """Total empirical (order-0) entropy of a sequence of int64 symbols, in bits."""
    if not keys.numel():
        return 0.0
    counts = torch.unique(keys, return_counts=True)[1].to(torch.float64)
    return float(-(counts * torch.log2(counts / keys.numel())).sum())


def _empirical_bits(parts: list) -> float:
    allx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    if not allx.numel():
        return 0.0
    if int(allx.max()) >= 1 << 20:  # 4-byte values: no histogram of 2^32 bins
        return _entropy_of(allx)
    counts = torch.bincount(allx).to(torch.float64)
    counts = counts[counts > 0]
    return float(-(counts * torch.log2(counts / allx.numel())).sum())


def _median_time(fn, reps: int, setup=None) -> float:
    ts = []
    for _ in range(reps):
        arg = setup() if setup else None
        # untimed: the garbage earlier rows left is collected now, not by a full collection that
        # the timed call's first allocations happen to trigger (one took 79 ms of a 300 ms keyframe
        # publish, in the Publisher's constructor); what the call itself leaves still counts
        gc.collect()
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


# ----------------------------------------------------------------------------- chunk kernel

def chunk_kernel_times(base: dict, target: dict, *, encoding: str, level: int, reps: int) -> dict:
    """The chunk codec alone: ``encode_chunk`` of every tensor as one chunk (1-D integer views,
    contiguous), then ``decode_chunk`` of each encoded chunk with the base bits; medians over
    ``reps`` of the total over tensors, single-threaded, no container. The decoded positions (and
    a classes chunk's values) are checked against the target. Returns encode_s/decode_s (None
    where the call failed, with ``error``)."""
    names = list(target)
    olds = [_bits(base[n]).reshape(-1).contiguous() for n in names]
    news = [_bits(target[n]).reshape(-1).contiguous() for n in names]
    out = {"encoding": encoding, "encode_s": None, "decode_s": None, "error": None}

    def enc_all():
        return [chunk.encode_chunk(o, nw, start=0, encoding=encoding, level=level,
                                   is_float=target[n].dtype.is_floating_point, dtype=target[n].dtype)
                for n, o, nw in zip(names, olds, news)]

    try:
        encoded = enc_all()  # warm-up, and the chunks to decode
        out["encode_s"] = _median_time(enc_all, reps)
    except Exception as e:  # the kernel is not there (yet) or its signature changed
        out["error"] = f"encode_chunk: {type(e).__name__}: {e}"
        return out
    jobs = []
    for n, c, o, nw in zip(names, encoded, olds, news):
        if c is None:
            continue
        payload = c.payload() if callable(getattr(c, "payload", None)) else c.pos_bytes + c.val_bytes
        jobs.append((c.entry(0), payload, nw.element_size(), o, nw, target[n].dtype))

    def dec_all():
        return [chunk.decode_chunk(h, pl, w, base=o, dtype=dt) for h, pl, w, o, _, dt in jobs]

    try:
        decoded = dec_all()
        # a check of the kernel's output where it returns (positions, values): the positions must
        # be the changes, and a classes chunk's values the new bits
        for got, (h, _, _, o, nw, _) in zip(decoded, jobs):
            if isinstance(got, tuple) and len(got) == 2:
                idx = torch.nonzero(o != nw).squeeze(1)
                if not torch.equal(got[0].to(torch.int64), idx):
                    raise BenchError(f"decode_chunk({encoding!r}) returns other positions than the changes")
                if h.enc == CLASSES and not torch.equal(got[1].reshape(-1).view(nw.dtype), nw[idx]):
                    raise BenchError(f"decode_chunk({encoding!r}) returns other values than the new bits")
        out["decode_s"] = _median_time(dec_all, reps)
    except BenchError:
        raise
    except Exception as e:
        out["error"] = f"decode_chunk: {type(e).__name__}: {e}"
    return out


# ----------------------------------------------------------------------------- one pair

def bench_pair(base: dict, target: dict, *, level: int, chunk_elems: int, workers: int, reps: int,
               memcpy_reps: int, prev_dir: dict | None = None, dirs_out: dict | None = None,
               encodings: tuple | None = None) -> dict:
    """One checkpoint pair: sizes of every encoding (each applied and checked bit for bit),
    entropy yardsticks (``prev_dir``/``dirs_out``: see ``entropy_bounds``), timings."""
    encodings = encodings or available_encodings()
    elements = sum(t.numel() for t in target.values())
    dense = sum(t.numel() * t.element_size() for t in target.values())
    changed = count_changed(base, target)
    r = {"elements": elements, "dense_bytes": dense, "changed": changed,
         "change_rate": changed / elements if elements else 0.0}

    blobs, stats = {}, {}
    for enc in encodings:
        blobs[enc] = diff(base, target, encoding=enc, level=level, chunk_elems=chunk_elems, workers=workers,
                          progress=False)
        stats[enc] = inspect(blobs[enc])
        if stats[enc]["changed"] != changed:
            raise BenchError(f"{enc} delta counts {stats[enc]['changed']} changed elements, "
                             f"the int16 compare {changed}")
        work = {n: t.clone() for n, t in base.items()}
        apply(work, blobs[enc], workers=workers)
        check_equal(work, target, f"{enc} delta")

    def per_enc(fn):
        return {e: (fn(e) if e in blobs else None) for e in ENCODINGS}

    size = per_enc(lambda e: len(blobs[e]))
    hdr = per_enc(lambda e: stats[e]["bytes_by_stream"]["header"])
    payload = per_enc(lambda e: sum(v for k, v in stats[e]["bytes_by_stream"].items() if k != "header"))
    m = stats["auto"]
    ent = entropy_bounds(base, target, prev_dir, dirs_out)
    per_chg = lambda v: (v / changed if changed and v is not None else None)  # noqa: E731
    r.update({
        "bytes": size,
        "payload_bytes": payload,
        "header_bytes": hdr,
        "bytes_per_changed": {e: per_chg(v) for e, v in size.items()},
        "ratio_dense_to_mixed": dense / size["auto"],
        "mixed_saving_vs_overwrite": 1 - size["auto"] / size["overwrite"],
        "mixed_saving_vs_xor": 1 - size["auto"] / size["xor"],
        "mixed_streams": m["bytes_by_stream"],
        "mixed_position_bytes_by_coding": m["position_bytes_by_coding"],
        "mixed_chunks_by_encoding": m["chunks_by_encoding"],
        "mixed_value_bytes_by_encoding": m["bytes_by_encoding"],
        "order0_bytes": ent,
        "order0_bytes_per_changed": {k: per_chg(v) for k, v in ent.items()},
        "sign_bits_per_changed": {"order0": per_chg(8 * ent["sign"]),
                                  "given_prev": per_chg(None if ent["sign_given_prev"] is None
                                                        else 8 * ent["sign_given_prev"])},
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
    kern = chunk_kernel_times(base, target, encoding=KERNEL_ENCODING, level=level, reps=reps)
    gb = dense / 1e9
    opt = lambda t, f: None if t is None else f(t)  # noqa: E731
    r.update({
        "time_s": {"memcpy": mc["copy"], "cat": mc["cat"], "diff": t_diff, "apply": t_apply,
                   "chunk_encode": kern["encode_s"], "chunk_decode": kern["decode_s"]},
        "gbps": {"memcpy": gb / mc["copy"], "cat": gb / mc["cat"], "diff": gb / t_diff, "apply": gb / t_apply,
                 "chunk_encode": opt(kern["encode_s"], lambda t: gb / t),
                 "chunk_decode": opt(kern["decode_s"], lambda t: gb / t)},
        "x_memcpy": {"diff": t_diff / mc["copy"], "apply": t_apply / mc["copy"],
                     "chunk_encode": opt(kern["encode_s"], lambda t: t / mc["copy"]),
                     "chunk_decode": opt(kern["decode_s"], lambda t: t / mc["copy"])},
        "chunk_kernel": {"encoding": kern["encoding"], "error": kern["error"]},
        "apply_verified": True,
    })
    return r


# ----------------------------------------------------------------------------- driver

def run(*, steps: int, lrs, warmup_steps: int, workers: int | None, reps: int, level: int = DEFAULT_LEVEL,
        chunk_elems: int = DEFAULT_CHUNK, seed: int = 0, quick: bool = False, every=(1, 4),
        cache_dir: str | None = None, log=None) -> dict:
    """One fine-tune run per lr, published every step; each cadence in ``every`` reads it as the
    series ckpts[0], ckpts[every], ckpts[2 * every], ... (the same as publishing every
    ``every`` steps)."""
    train = _load_train()
    config = train.SMALL if quick else train.Config()
    workers = workers or default_workers()
    every = tuple(sorted(set(every)))
    if not every or min(every) < 1:
        raise ValueError("every: positive publish cadences")
    encodings = available_encodings()
    notes = [f"encoding {e!r} skipped: not offered by this nemo_dcr (nemo_dcr.chunk.CHOICES = {tuple(chunk.CHOICES)})"
             for e in ENCODINGS if e not in encodings]
    for nt in notes:
        if log:
            log(nt)
    t_start = time.perf_counter()
    pairs = []
    for lr in lrs:
        t0 = time.perf_counter()
        losses: list = []
        ckpts = train.make_checkpoints(steps, lr, warmup_steps, seed, 1, config=config, log=log, losses=losses,
                                       cache_dir=cache_dir)
        t_train = time.perf_counter() - t0
        if log:
            log(f"lr {lr:g}: {len(ckpts)} checkpoints in {t_train:.1f}s")
        for ev in every:
            series = list(range(0, len(ckpts), ev))
            prev_dir = None
            for j in range(1, len(series)):
                a, b = series[j - 1], series[j]
                dirs: dict = {}
                p = bench_pair(ckpts[a], ckpts[b], level=level, chunk_elems=chunk_elems, workers=workers,
                               reps=reps, memcpy_reps=max(5, 5 * reps), prev_dir=prev_dir, dirs_out=dirs,
                               encodings=encodings)
                prev_dir = dirs
                p.update({"lr": lr, "every": ev, "step_from": a, "step_to": b, "series_index": j,
                          "loss": losses[b - 1]})
                pairs.append(p)
                if log:
                    log(f"  every {ev} pair {a}->{b}: {100 * p['change_rate']:.3f}% changed, "
                        f"{p['bytes_per_changed']['auto'] or 0:.3f} B/changed mixed")
        del ckpts
    kerr = sorted({p["chunk_kernel"]["error"] for p in pairs if p["chunk_kernel"]["error"]})
    notes += [f"chunk kernel timing ({KERNEL_ENCODING!r}) null: {e}" for e in kerr]
    return {
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()},
        "config": {"model": dataclasses.asdict(config),
                   "params": train.n_params(config), "steps": steps, "lrs": list(lrs), "every": list(every),
                   "warmup_steps": warmup_steps, "warmup_lr": train.WARMUP_LR, "seed": seed, "workers": workers,
                   "reps": reps, "level": level, "chunk_elems": chunk_elems, "quick": quick,
                   "encodings": list(ENCODINGS), "encodings_measured": list(encodings),
                   "kernel_encoding": KERNEL_ENCODING, "warmup_cache_dir": cache_dir},
        "notes": notes,
        "pairs": pairs,
        "summary": summarize(pairs),
        "wall_s": time.perf_counter() - t_start,
    }


def summarize(pairs) -> dict:
    """Per publish cadence (all lrs: ``every=N``) and per (lr, cadence: ``lr=X every=N``):
    aggregates weighted by bytes and changes (totals over the pairs, then divided), timing
    medians. The |prev entropy keys count a series' first pair (which has no previous
    direction) at pos|exp and the order-0 sign."""
    def tot(ps, get):
        """Sum of get(p) over the pairs where it is not None, and the changes of those pairs."""
        vals = [(get(p), p["changed"]) for p in ps]
        vals = [(v, c) for v, c in vals if v is not None]
        return (sum(v for v, _ in vals), sum(c for _, c in vals)) if vals else (None, 0)

    def ratio(num, den):
        return num / den if num is not None and den else None

    def med(vals):
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    def agg(ps):
        ch = sum(p["changed"] for p in ps)
        el = sum(p["elements"] for p in ps)
        dense = sum(p["dense_bytes"] for p in ps)
        b = {e: tot(ps, lambda p, e=e: p["bytes"][e])[0] for e in ENCODINGS}
        streams = {k: sum(p["mixed_streams"].get(k, 0) for p in ps) for k in ("positions", "values", "header")}
        # |prev keys: a series' first pair has no previous direction, and a coder would code it
        # without one -- count it at pos|exp and the order-0 sign, so all pairs are covered
        fallback = {"positions_given_exponent_prev": "positions_given_exponent", "sign_given_prev": "sign"}

        def o0_of(p, k):
            v = p["order0_bytes"][k]
            return p["order0_bytes"][fallback[k]] if v is None and k in fallback else v

        o0 = {k: ratio(*tot(ps, lambda p, k=k: o0_of(p, k))) for k in ENTROPY_KEYS}
        return {
            "pairs": len(ps), "change_rate": ch / el if el else 0.0,
            "bytes_per_changed": {e: ratio(b[e], ch) for e in ENCODINGS},
            "ratio_dense_to_mixed": dense / b["auto"] if b["auto"] else None,
            "mixed_saving_vs_overwrite": 1 - b["auto"] / b["overwrite"],
            "xor_saving_vs_overwrite": 1 - b["xor"] / b["overwrite"],
            "mixed_stream_share": {k: v / b["auto"] for k, v in streams.items()},
            "mixed_stream_bytes_per_changed": {k: (v / ch if ch else None) for k, v in streams.items()},
            "order0_bytes_per_changed": o0,
            "sign_bits_per_changed": {k: (None if o0[src] is None else 8 * o0[src])
                                      for k, src in (("order0", "sign"), ("given_prev", "sign_given_prev"))},
            "x_memcpy_median": {k: med(p["x_memcpy"][k] for p in ps)
                                for k in ("diff", "apply", "chunk_encode", "chunk_decode")},
            "gbps_median": {k: med(p["gbps"][k] for p in ps)
                            for k in ("memcpy", "diff", "apply", "chunk_encode", "chunk_decode")},
        }

    out = {}
    for ev in sorted({p["every"] for p in pairs}):
        out[f"every={ev}"] = agg([p for p in pairs if p["every"] == ev])
    for lr in sorted({p["lr"] for p in pairs}):
        for ev in sorted({p["every"] for p in pairs}):
            ps = [p for p in pairs if p["lr"] == lr and p["every"] == ev]
            if ps:
                out[f"lr={lr:g} every={ev}"] = agg(ps)
    return out


# ----------------------------------------------------------------------------- output

def _table(header, rows) -> str:
    # a "|" inside a cell ("pos|exp") escaped: else Markdown splits the cell there, and a header of
    # more cells than its separator row is no table at all (tests/test_docs_agree.py)
    header = [str(x).replace("|", "\\|") for x in header]
    rows = [[str(x).replace("|", "\\|") for x in r] for r in rows]
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).rjust(n) for x, n in zip(r, w)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (n + 1) + ":" for n in w) + "|"] + [line(r) for r in rows])


def format_tables(res: dict) -> str:
    c, m = res["config"], res["machine"]
    f = lambda x, d=3: "n/a" if x is None else f"{x:.{d}f}"  # noqa: E731
    fx = lambda x: "n/a" if x is None else f"{x:.0f}x"  # noqa: E731
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    pair = lambda p: f"{p['step_from']}->{p['step_to']}"  # noqa: E731
    out = [f"# nemo-dcr codec benchmark: {c['params']:,}-parameter model, BF16, {c['steps']} fine-tune steps per lr "
           f"after {c['warmup_steps']} warm-up steps at {c['warmup_lr']:g}; published every "
           f"{' and every '.join(str(e) for e in c['every'])} step(s)",
           f"# machine: {m['cpus']} CPUs ({m['cpu']}), torch {m['torch']} ({m['torch_threads']} threads), "
           f"workers {c['workers']}, zstd level {c['level']}, chunk {c['chunk_elems']:,} elements, "
           f"median of {c['reps']} timing reps"]
    out += [f"# note: {nt}" for nt in res.get("notes", [])]
    out.append("")
    encs = [e for e in ENCODINGS]
    out.append("## Size (bytes per changed element = whole delta bytes / changed BF16 elements)\n")
    rows = []
    for p in res["pairs"]:
        s = p["mixed_streams"]
        tot = p["bytes"]["auto"]
        enc = p["mixed_chunks_by_encoding"]
        rows.append([f"{p['lr']:g}", p["every"], pair(p), f"{100 * p['change_rate']:.3f}"]
                    + [f(p["bytes_per_changed"][e]) for e in encs]
                    + [f"{100 * p['mixed_saving_vs_overwrite']:.1f}%", f"{p['ratio_dense_to_mixed']:.1f}x",
                       f"{100 * s['positions'] / tot:.0f}/{100 * s['values'] / tot:.0f}/{100 * s['header'] / tot:.0f}",
                       "/".join(str(enc.get(e, 0)) for e in ("xor", "add", CLASSES, "overwrite"))])
    out.append(_table(["lr", "every", "pair", "changed %"] + [f"B/chg {LABEL[e]}" for e in encs]
                      + ["mixed vs ow", "dense/delta", "pos/val/hdr %", "chunks xor/add/cls/ow"], rows))
    out.append("\n## Entropy yardsticks (bytes per changed element; sign: bits per change; "
               "|prev = given the element's direction in the previous pair of the series; see entropy_bounds())\n")
    rows = []
    for p in res["pairs"]:
        o, sg = p["order0_bytes_per_changed"], p["sign_bits_per_changed"]
        rows.append([f"{p['lr']:g}", p["every"], pair(p), f"{100 * p['change_rate']:.3f}",
                     f(o["positions"]), f(o["positions_given_exponent"]), f(o["positions_given_exponent_prev"]),
                     f(o["values_add"]), f(o["values_add_given_exponent"]),
                     f(o["positions_given_exponent"] + o["values_add_given_exponent"]),
                     f(p["bytes_per_changed"]["auto"]), f(sg["order0"]), f(sg["given_prev"])])
    out.append(_table(["lr", "every", "pair", "changed %", "pos order-0", "pos|exp", "pos|exp,prev",
                       "val add order-0", "val|exp", "pos|exp + val|exp", "mixed actual", "sign bits",
                       "sign|prev bits"], rows))
    out.append("\n## Speed (dense BF16 bytes per second; x memcpy = time / per-tensor copy_ time of the same bytes; "
               f"chunk = the {c['kernel_encoding']!r} chunk kernel alone, single-threaded)\n")
    rows = []
    for p in res["pairs"]:
        t, g, x = p["time_s"], p["gbps"], p["x_memcpy"]
        rows.append([f"{p['lr']:g}", p["every"], pair(p), f"{p['dense_bytes'] / 1e6:.1f}",
                     f"{1e3 * t['memcpy']:.2f}", f(g["memcpy"], 2),
                     f"{1e3 * t['diff']:.1f}", f(g["diff"], 3), fx(x["diff"]),
                     f"{1e3 * t['apply']:.1f}", f(g["apply"], 3), fx(x["apply"]),
                     fx(x["chunk_encode"]), fx(x["chunk_decode"]),
                     "yes" if p["apply_verified"] else "NO"])
    out.append(_table(["lr", "every", "pair", "dense MB", "memcpy ms", "memcpy GB/s", "encode ms", "encode GB/s",
                       "encode x memcpy", "apply ms", "apply GB/s", "apply x memcpy", "chunk enc x memcpy",
                       "chunk dec x memcpy", "bit-exact"], rows))
    out.append("\n## Summary (totals over the pairs of each cadence, all lrs, and of each lr and cadence)\n")
    rows = []
    for k, s in res["summary"].items():
        b = s["bytes_per_changed"]
        sh = s["mixed_stream_share"]
        xm = s["x_memcpy_median"]
        rows.append([k, f"{100 * s['change_rate']:.3f}"] + [f(b[e]) for e in encs]
                    + [pct(s["xor_saving_vs_overwrite"]), pct(s["mixed_saving_vs_overwrite"]),
                       f"{s['ratio_dense_to_mixed']:.1f}x",
                       f"{100 * sh['positions']:.0f}/{100 * sh['values']:.0f}/{100 * sh['header']:.0f}",
                       fx(xm["diff"]), fx(xm["apply"]), fx(xm["chunk_encode"]), fx(xm["chunk_decode"])])
    out.append(_table(["", "changed %"] + [f"B/chg {LABEL[e]}" for e in encs]
                      + ["xor vs ow", "mixed vs ow", "dense/delta", "pos/val/hdr %", "encode x memcpy",
                         "apply x memcpy", "chunk enc x memcpy", "chunk dec x memcpy"], rows))
    out.append("\n## Where the mixed bytes go, against the entropy yardsticks (bytes per changed element; sign in "
               "bits; |prev: a series' first pair counted without prev)\n")
    rows = []
    for k, s in res["summary"].items():
        st, o, sg = s["mixed_stream_bytes_per_changed"], s["order0_bytes_per_changed"], s["sign_bits_per_changed"]
        rows.append([k, f(st["positions"]), f(o["positions"]), f(o["positions_given_exponent"]),
                     f(o["positions_given_exponent_prev"]), f(st["values"]), f(o["values"]), f(o["values_add"]),
                     f(o["values_add_given_exponent"]), f(sg["order0"]), f(sg["given_prev"]), f(st["header"], 4)])
    out.append(_table(["", "positions", "pos order-0", "pos|exp", "pos|exp,prev", "values", "val xor order-0",
                       "val add order-0", "val|exp", "sign bits", "sign|prev bits", "header"], rows))
    out.append(f"\nall applies verified bit-exact; wall time {res['wall_s']:.0f}s")
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    """Bytes per changed element against change rate (log), per encoding, with the entropy
    yardstick pos|exp + val|exp as a line. Filled markers: published every step; hollow: the
    longest cadence. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ps = sorted(res["pairs"], key=lambda p: p["change_rate"])
    x = [100 * p["change_rate"] for p in ps]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    ymax = 0.0
    for enc, marker in (("xor", "^"), ("add", "v"), (CLASSES, "D"), ("auto", "o")):
        ys = [p["bytes_per_changed"][enc] for p in ps]
        if all(y is None for y in ys):
            continue
        ymax = max([ymax] + [y for y in ys if y is not None])
        line, = ax.plot(x, [math.nan if y is None else y for y in ys], "-", alpha=.5, label=LABEL[enc])
        for ev, fill in ((1, True), (max(res["config"]["every"]), False)):
            sel = [(xi, y) for xi, y, p in zip(x, ys, ps) if p["every"] == ev and y is not None]
            if sel:
                ax.plot(*zip(*sel), marker, color=line.get_color(), mfc=line.get_color() if fill else "none",
                        ls="none")
    bound = [p["order0_bytes_per_changed"]["positions_given_exponent"]
             + p["order0_bytes_per_changed"]["values_add_given_exponent"] for p in ps]
    ax.plot(x, bound, "k--", lw=1, label="entropy: pos|exp + val|exp")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.5, 1, 2, 5, 10, 20, 50]))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("changed BF16 elements per publish (%), log")
    ax.set_ylabel("delta bytes per changed element")
    ax.set_ylim(0, 1.15 * max([ymax] + bound))
    ax.grid(alpha=.3, which="both")
    c = res["config"]
    ax.set_title(f"{c['params'] / 1e6:.1f}M-param model, lr {', '.join(f'{lr:g}' for lr in c['lrs'])}; "
                 f"filled: every step, hollow: every {max(c['every'])}", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, help=f"fine-tune steps per lr (default {FULL['steps']})")
    ap.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")],
                    help="comma-separated fine-tune learning rates (default "
                         f"{','.join(f'{x:g}' for x in FULL['lrs'])})")
    ap.add_argument("--every", type=lambda s: [int(x) for x in s.split(",")],
                    help="comma-separated publish cadences, in steps (default 1,4)")
    ap.add_argument("--warmup-steps", type=int, help=f"warm-up steps at high lr (default {FULL['warmup_steps']})")
    ap.add_argument("--cache-dir", default=None,
                    help="disk cache of the warmed-up weights (default runs/bench-cache; --quick: none); '' for none")
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
    if a.cache_dir is None:
        cache_dir = None if a.quick else _load_train().DEFAULT_CACHE_DIR
    else:
        cache_dir = a.cache_dir or None
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        res = run(steps=a.steps if a.steps is not None else d["steps"], lrs=a.lrs or d["lrs"],
                  warmup_steps=a.warmup_steps if a.warmup_steps is not None else d["warmup_steps"],
                  workers=a.workers, reps=a.reps or d["reps"], level=a.level, chunk_elems=a.chunk_elems,
                  seed=a.seed, quick=a.quick, every=a.every or d["every"], cache_dir=cache_dir, log=log)
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
