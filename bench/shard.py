"""Speed budget of issue #5: encode and decode of one large shard at ~1 % change, as a multiple of
one memcpy of the shard, measured side by side in this process.

    python bench/shard.py                 # table on stdout
    python bench/shard.py --json

The shard is real: the BF16 weights of the bench model (bench/train.py, warm-up cached under
runs/bench-cache) before and after fine-tune step ``--step`` at ``--lr`` (step 2 at 3e-7: 1.00 %
of the elements change, the issue's "1 %"; step 1: 1.45 %), all tensors flattened and concatenated,
tiled ``--copies`` times (default: ~64M elements, 128 MB, far
larger than the caches). Timed, median of ``--reps``:

* memcpy -- ``dst.copy_(shard)`` with 1 torch thread (one memcpy) and with all threads;
* chunk encode -- ``encode_chunk`` over the 1M-element chunks ``diff`` would make, ``auto``
  (classes taken), 1 worker and all workers: the codec, no container or tensor digests;
* chunk decode+apply -- ``decode_chunk`` of each and the write of the changed values into a copy
  of the base: the codec's share of ``apply``;
* diff / apply -- the whole library calls, with the BLAKE2b tensor digests they compute and check.

Every decode is checked bit for bit against the target.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

from nemo_dcr import apply, diff
from nemo_dcr.codec.chunk import decode_chunk, encode_chunk
from nemo_dcr.delta import DEFAULT_CHUNK
from nemo_dcr.util.parallel import default_workers, ordered_map


def _codec():
    """bench/codec.py, loaded by path (bench/ is not a package): its train loader and timer."""
    name = "nemo_dcr_bench_codec"
    if name not in sys.modules:
        here = os.path.dirname(os.path.abspath(__file__))
        spec = importlib.util.spec_from_file_location(name, os.path.join(here, "codec.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _median(fn, reps):
    return _codec()._median_time(fn, reps)


def make_shard(lr: float, copies: int, cache_dir: str, warmup_steps: int, step: int = 2):
    train = _codec()._load_train()
    ck = train.make_checkpoints(step, lr, warmup_steps, 0, 1, cache_dir=cache_dir)
    a, b = ck[step - 1], ck[step]
    flat = lambda ck: torch.cat([ck[n].reshape(-1) for n in sorted(ck)])  # noqa: E731
    return flat(a).repeat(copies), flat(b).repeat(copies)


def run(lr=3e-7, copies=10, reps=3, warmup_steps=300, cache_dir=None, workers=None, step=2) -> dict:
    """``cache_dir``: the warm-up's disk cache (None: none; the command line uses runs/bench-cache)."""
    base, target = make_shard(lr, copies, cache_dir, warmup_steps, step)
    n = base.numel()
    ob, nb = base.view(torch.int16), target.view(torch.int16)
    changed = int((ob != nb).sum())
    ranges = [(s, min(s + DEFAULT_CHUNK, n)) for s in range(0, n, DEFAULT_CHUNK)]
    workers = workers or default_workers()
    out = {"elements": n, "bytes": 2 * n, "change_rate": changed / n, "lr": lr, "step": step, "copies": copies,
           "workers": workers, "torch_threads": torch.get_num_threads()}

    dst = torch.empty_like(base)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t_mem1 = _median(lambda: dst.copy_(base), reps * 3)
    torch.set_num_threads(threads)
    t_mem = _median(lambda: dst.copy_(base), reps * 3)

    chunks = {}

    def enc(r):
        s, e = r
        return encode_chunk(ob[s:e], nb[s:e], s, "auto", dtype=torch.bfloat16)

    def enc_all(w):
        for r, c in zip(ranges, ordered_map(enc, ranges, w)):
            chunks[r] = c

    t_enc1 = _median(lambda: enc_all(1), reps)
    t_enc = _median(lambda: enc_all(workers), reps)
    encs = sorted({c.enc for c in chunks.values() if c is not None})
    payload = sum(len(c.pos_bytes) + len(c.val_bytes) for c in chunks.values() if c is not None)

    work = ob.clone()

    def dec(r):
        c = chunks[r]
        if c is None:
            return
        h = c.entry(0)
        idx, vals = decode_chunk(h, c.pos_bytes + c.val_bytes, 2, base=ob[r[0]:r[1]], dtype=torch.bfloat16)
        work[r[0]:r[1]][idx] = vals

    def dec_all(w):
        for _ in ordered_map(dec, ranges, w):
            pass

    t_dec1 = _median(lambda: dec_all(1), reps)
    t_dec = _median(lambda: dec_all(workers), reps)
    if not torch.equal(work, nb):
        raise AssertionError("chunk decode is not bit-exact")

    blob = diff({"shard": base}, {"shard": target}, workers=workers)
    t_diff = _median(lambda: diff({"shard": base}, {"shard": target}, workers=workers), reps)
    recv = {"shard": base.clone()}
    t_apply = _codec()._median_time(lambda _: apply(recv, blob, workers=workers), reps,
                                    setup=lambda: recv["shard"].copy_(base))  # each apply on a fresh base
    if not torch.equal(recv["shard"].view(torch.int16), nb):
        raise AssertionError("apply is not bit-exact")
    out.update({
        "chunk_encodings": encs, "payload_bytes_per_changed": payload / changed,
        "delta_bytes_per_changed": len(blob) / changed,
        "seconds": {"memcpy_1thread": t_mem1, "memcpy": t_mem, "chunk_encode_1worker": t_enc1, "chunk_encode": t_enc,
                    "chunk_decode_apply_1worker": t_dec1, "chunk_decode_apply": t_dec,
                    "diff": t_diff, "apply": t_apply},
    })
    out["x_memcpy"] = {k: v / t_mem1 for k, v in out["seconds"].items()}
    return out


def format_table(r: dict) -> str:
    lines = [f"shard: {r['elements'] / 1e6:.1f}M BF16 elements ({r['bytes'] / 1e6:.0f} MB), "
             f"{100 * r['change_rate']:.2f} % changed, chunks coded {', '.join(r['chunk_encodings'])}, "
             f"{r['delta_bytes_per_changed']:.3f} B per changed element; {r['workers']} workers",
             "", "| step | ms | x one memcpy (1 thread) |", "|---|---:|---:|"]
    for k, v in r["seconds"].items():
        lines.append(f"| {k} | {1e3 * v:.1f} | {r['x_memcpy'][k]:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=3e-7)
    ap.add_argument("--step", type=int, default=2, help="the pair (step-1, step) of the fine-tune")
    ap.add_argument("--copies", type=int, default=10, help="tile the 6.6M-element model this many times")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--cache-dir", default=None, help="warm-up disk cache (default runs/bench-cache; '' for none)")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cache_dir = _codec()._load_train().DEFAULT_CACHE_DIR if a.cache_dir is None else (a.cache_dir or None)
    r = run(a.lr, a.copies, a.reps, a.warmup_steps, cache_dir, a.workers, a.step)
    print(json.dumps(r, indent=1) if a.json else format_table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
