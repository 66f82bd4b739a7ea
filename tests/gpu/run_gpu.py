#!/usr/bin/env python
"""GPU check of the device path (issue 12), not collected by pytest: one script, one call.

    python tests/gpu/run_gpu.py [--quick] [--json OUT.json] [--bench-elems N] [--no-bench]
    python tests/gpu/run_gpu.py --interpret     # the script itself, on CPU, under TRITON_INTERPRET=1

Skips cleanly (exit 0, "SKIP: ..." on stdout) without CUDA or triton. Otherwise:

1. **Kernels against the reference**, on the GPU: every dtype (floats with NaN payloads, +-inf,
   +-0.0 and subnormals in base and changes; ints, bool, float64), odd sizes (1, 1023, 100 003,
   2 000 003), odd and default chunkings, 1 % and 30 % change. ``diff_`` finds exactly the
   changed elements (raw bits) and updates the snapshot; the chunks coded from the compact
   stream equal ``codec/chunk.encode_chunk``'s (every encoding on the small sizes; auto and
   classes on the large); ``apply_`` rebuilds the target and refuses a wrong pre-image with
   nothing written; ``digest_change`` is the digest difference; a non-contiguous input is
   refused with DcrError (the publisher sends those through the reference).
2. **Trainer -> store -> GPU receiver, end to end**: ``Publisher(device="on")`` (snapshot kept
   on the device, and again in pinned host memory) publishes 3 versions of CUDA tensors (one
   of them non-contiguous, one added, a keyframe) into a local store; every part is
   byte-identical (but creation time and publish id) to a reference publisher's on host copies;
   a reference ``Follower`` on CPU and the device receiver (``receive.apply_delta_`` on CUDA
   tensors, state digest updated from the changes alone) both end bit-exact at the trainer's
   state and digest.
2b. **The callback's device path** (issue 24, ``device/capture.py``): 4 versions of CUDA tensors
   captured on the device (the kept snapshot in device memory, and again in pinned host memory)
   and published later from the captures alone by ``Publisher(device=capture.base)``; every part
   byte-identical to a reference publisher's on host copies; the device-to-host bytes of each
   capture that is not a keyframe counted (Traffic) and held to O(changes) (the streams plus 16
   bytes of digest per tensor); the capture's time (the training stall) against a device memcpy
   of the state and against the host path's copy of it. And the device BLAKE3 digest
   (``device/blake3.py``) against the host's on sizes across chunk and program boundaries.
2c. **A receiver group on the device** (issue 24): three ranks over gloo sharing the GPU hold
   the tensors of tests/dcr_testing/gather_workers.py sharded differently from the trainer
   (``classes`` chunks held in part by several ranks), on the device with ``staging=False`` (the
   vLLM worker at TP>1); each update bit-exact, each rank's host<->device bytes counted and held
   to O(changes) down and the packed classes plus O(changes) up.
3. **Bench** (``--bench-elems`` BF16 elements, default 256M; ``--quick`` 64M), 1 % and 5 %
   change: device memcpy of the shard; the fused diff (compact only, and with the ``classes``
   class/rank pass) with the snapshot update; the host coder on the compact stream; the device
   receiver (host decode + device apply); host<->device bytes per version for the device path
   and for the reference path (which copies the shard to the host: measured, D2H); the device
   BLAKE3 digest of the shard (GB/s, against memcpy) and the host's.

Prints one line per check and a summary; ``--json`` writes every figure. Exit 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def parse(argv=None):
    ap = argparse.ArgumentParser(description="GPU check of the nemo-dcr device path")
    ap.add_argument("--quick", action="store_true", help="fewer sizes, a 64M-element bench")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--bench-elems", type=int, default=None, help="BF16 elements of the bench shard")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--interpret", action="store_true",
                    help="run on CPU tensors under TRITON_INTERPRET=1 with tiny sizes (checks the script)")
    return ap.parse_args(argv)


ARGS = parse()
if ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402

RESULTS = {"checks": [], "failures": [], "bench": [], "e2e": {}}


def skip(why: str):
    print(f"SKIP: {why}")
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump({"skipped": why}, f)
    sys.exit(0)


if not ARGS.interpret and not torch.cuda.is_available():
    skip("no CUDA device")
try:
    import triton  # noqa: E402,F401
except ImportError:
    skip('triton is not installed (pip install "nemo-dcr[gpu]")')

from dcr_testing.deltas import same_delta  # noqa: E402
from dcr_testing.device_cases import FLOATS, INTS, make_pair  # noqa: E402
from dcr_testing.traffic import Traffic  # noqa: E402 (counts every thread's copies: receivers apply on workers)
from nemo_dcr.codec.chunk import CHOICES, encode_chunk  # noqa: E402
from nemo_dcr.codec.format import DeltaReader  # noqa: E402
from nemo_dcr.delta import diff  # noqa: E402
from nemo_dcr.device.apply import PreImageMismatch, apply_, digest_change  # noqa: E402
from nemo_dcr.device.blake3 import tensor_digest as device_digest  # noqa: E402
from nemo_dcr.device.capture import DeviceCapture  # noqa: E402
from nemo_dcr.device.diff import bits, diff_  # noqa: E402
from nemo_dcr.device.encode import encode_changes_chunks  # noqa: E402
from nemo_dcr.device.receive import apply_delta_  # noqa: E402
from nemo_dcr.errors import DcrError  # noqa: E402
from nemo_dcr.state.digest import tensor_digest  # noqa: E402
from nemo_dcr.state.statedigest import StateDigest, tensor_contrib  # noqa: E402
from nemo_dcr.stores import LocalStore  # noqa: E402
from nemo_dcr.sync.follower import Follower  # noqa: E402
from nemo_dcr.sync.publisher import Publisher  # noqa: E402

DEV = torch.device("cpu") if ARGS.interpret else torch.device("cuda")


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def check(name: str, fn):
    t0 = time.perf_counter()
    try:
        fn()
        ok, err = True, None
    except Exception as e:  # a check that fails is reported, the others still run
        ok, err = False, f"{type(e).__name__}: {e}"
        RESULTS["failures"].append({"check": name, "error": err, "traceback": traceback.format_exc()[-4000:]})
    dt = time.perf_counter() - t0
    RESULTS["checks"].append({"check": name, "ok": ok, "seconds": round(dt, 3)})
    print(f"{'ok  ' if ok else 'FAIL'} {name} ({dt:.1f} s){'' if ok else ': ' + err}", flush=True)


def eq_bits(a, b, what):
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a.contiguous()), bits(b.contiguous())):
        raise AssertionError(f"{what}: bits differ")


def _header(c):
    return c.header(0), c.pos_bytes, c.val_bytes, c.alt_val_len


# ----------------------------------------------------------------------------- 1. kernels

def kernel_case(dtype, n, rate, chunk, encodings):
    base, live = make_pair(dtype, n, rate if n > 1 else 1.0, seed=n % 1000 + int(rate * 100))
    snap, live_d = base.to(DEV, copy=True), live.to(DEV, copy=True)
    ch = diff_(snap, live_d, chunk_elems=chunk)
    ob, nb = bits(base), bits(live)
    idx = torch.nonzero(ob != nb).squeeze(1)
    if not (torch.equal(ch.pos.cpu(), idx) and torch.equal(ch.old.cpu(), ob[idx])
            and torch.equal(ch.new.cpu(), nb[idx])):
        raise AssertionError("changes differ from the reference's")
    eq_bits(snap, live, "snapshot after the update")
    chunk = chunk or max(n, 1)
    for enc in encodings:
        got = encode_changes_chunks(ch, enc, 3)
        ref = [c for s in range(0, n, chunk)
               if (c := encode_chunk(ob[s:s + chunk], nb[s:s + chunk], s, enc, 3, is_float=dtype.is_floating_point,
                                     dtype=dtype)) is not None]
        if [_header(c) for c in got] != [_header(c) for c in ref]:
            raise AssertionError(f"encoding {enc}: chunks differ from encode_chunk's")
    target = base.to(DEV, copy=True)
    apply_(target, ch.pos, ch.new, ch.old)
    eq_bits(target, live, "apply")
    if ch.k:
        target = base.to(DEV, copy=True)
        wrong = ch.old.clone()
        wrong[-1] ^= 1
        try:
            apply_(target, ch.pos, ch.new, wrong)
            raise AssertionError("a wrong pre-image was not refused")
        except PreImageMismatch:
            pass
        eq_bits(target, base, "target after a refused apply")
    d = digest_change("t", dtype, (n,), ch.pos, ch.old, ch.new)
    if tensor_contrib("t", base) + d != tensor_contrib("t", live):
        raise AssertionError("digest_change is not the digest difference")


def kernels_section():
    sizes = [1, 1023] if ARGS.interpret else [1, 1023, 100_003]
    if not ARGS.quick and not ARGS.interpret:
        sizes.append(2_000_003)
    for dtype in FLOATS + INTS:
        for n in sizes:
            for rate in (0.01, 0.3):
                for chunk in ((None, 4099) if n > 4099 else (None, 100)):
                    encs = CHOICES if n <= 100_003 else ("auto", "classes")
                    name = f"kernels {str(dtype).removeprefix('torch.')} n={n} rate={rate} chunk={chunk}"
                    check(name, lambda dtype=dtype, n=n, rate=rate, chunk=chunk, encs=encs:
                          kernel_case(dtype, n, rate, chunk, encs))

    def noncontig():
        a = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEV)
        try:
            diff_(a.clone().t(), a.t())
            raise AssertionError("a non-contiguous input was taken")
        except DcrError:
            pass
    check("kernels refuse non-contiguous inputs", noncontig)


# ----------------------------------------------------------------------------- 2. end to end

def _same_part(a: bytes, b: bytes):
    try:
        same_delta(a, b)  # but for the creation time and publish id (format 3: chunk offsets too)
    except AssertionError:
        raise AssertionError("a part differs from the reference publisher's") from None


def _versions():
    n = 1 << 14 if ARGS.interpret else 1 << 22
    w0, w1 = make_pair(torch.bfloat16, n, 0.01, 1)
    x0, x1 = make_pair(torch.float32, 300 * 333, 0.05, 2)
    i0, i1 = make_pair(torch.int32, 10_001, 0.1, 3)
    f0, f1 = make_pair(torch.float8_e4m3fn, 5000, 0.05, 4)
    v0 = {"w": w0, "x": x0.view(300, 333), "i": i0, "f8": f0, "nc": torch.arange(64.0).view(8, 8)}
    v1 = {"w": w1, "x": x1.view(300, 333), "i": i1, "f8": f1, "nc": torch.arange(64.0).view(8, 8) + 1,
          "new": torch.ones(7, dtype=torch.float16)}
    v2 = {k: v.clone() for k, v in v1.items()}
    v2["w"][::5] = w0[::5]
    return [v0, v1, v2]


def e2e(keep: str):
    versions = _versions()
    with tempfile.TemporaryDirectory() as tmp:
        ref = Publisher(LocalStore(os.path.join(tmp, "ref")), keyframe_every=2, chunk_elems=1 << 16)
        pub = Publisher(LocalStore(os.path.join(tmp, "dev")), keyframe_every=2, chunk_elems=1 << 16,
                        device="on", keep=keep)
        live, recv, digest = {}, None, None
        for v, state in enumerate(versions):
            live.clear()
            for k, t in state.items():
                d = t.to(DEV, copy=True)
                live[k] = d.t().contiguous().t() if k == "nc" else d  # "nc": a non-contiguous CUDA tensor
            a, b = ref.publish({k: t.cpu() for k, t in live.items()}), pub.publish(live)
            if a.manifest.target_digest != b.manifest.target_digest:
                raise AssertionError(f"version {v}: target digests differ")
            for pa, pb in zip(a.manifest.parts + a.manifest.keyframe_parts,
                              b.manifest.parts + b.manifest.keyframe_parts, strict=True):
                _same_part(ref.store.get(pa.key), pub.store.get(pb.key))
            if v == 0:  # the device receiver starts where a keyframe load leaves it: version 0
                recv = {k: t.to(DEV, copy=True).contiguous() for k, t in state.items()}
                digest = StateDigest.from_hex(b.manifest.target_digest, b.manifest.definition)
                continue
            for p in b.manifest.parts:  # host decode, device apply, O(changes) digest update
                blob = pub.store.get(p.key)
                with Traffic() as moved:
                    digest = digest + apply_delta_(recv, blob, device=DEV)
                changed = sum(c.k for e in DeltaReader.open(blob).header.tensors for c in e.chunks
                              if e.kind == "delta")
                whole = sum(t.numel() * t.element_size() for k, t in state.items() if k in ("new", "retyped"))
                # per change: positions and new bits (or the decoded streams) down, pre-image
                # bits up; tensors sent whole go down whole
                if moved.d2h > 16 * changed + 4096 or moved.h2d > 32 * changed + whole + 4096:
                    raise AssertionError(f"version {v}: the device receiver moved {moved.d2h} B up and "
                                         f"{moved.h2d} B down for {changed} changes: not O(changes)")
            if digest.hex() != b.manifest.target_digest:
                raise AssertionError(f"version {v}: the device receiver's state digest differs")
        for k, t in versions[-1].items():
            eq_bits(recv[k], t, f"device receiver {k}")
        eq_bits(pub.published[0]["w"], versions[-1]["w"], "the trainer's snapshot")
        cpu_recv = {k: torch.zeros_like(t) for k, t in versions[0].items()}
        Follower(LocalStore(os.path.join(tmp, "dev")), cpu_recv).sync()
        for k, t in versions[-1].items():
            eq_bits(cpu_recv[k], t, f"reference follower {k}")
        # a receiver's tensors on the device with no CPU staging copy (what RolloutLoader(...,
        # staging=False) runs): it holds version 0 and follows the deltas in place there
        # (delta/apply decodes each chunk on the host and moves only its changes)
        engine = {k: t.to(DEV, copy=True).contiguous() for k, t in versions[0].items()}
        with Traffic() as moved:
            Follower(LocalStore(os.path.join(tmp, "dev")), engine, version=0).sync()
        for k, t in versions[-1].items():
            eq_bits(engine[k], t, f"follower on the device {k}")
        dense = sum(t.numel() * t.element_size() for t in versions[-1].values())
        if DEV.type == "cuda" and moved.h2d + moved.d2h > dense // 4:
            raise AssertionError(f"the follower moved {moved.h2d} B down and {moved.d2h} B up for {len(versions) - 1} "
                                 f"deltas of a {dense} B state: not O(changes)")
        RESULTS["e2e"][keep] = {"versions": len(versions), "ok": True, "follower_h2d_bytes": moved.h2d,
                                "follower_d2h_bytes": moved.d2h, "state_bytes": dense}


def e2e_section():
    check("end to end, snapshot on the device", lambda: e2e("device"))
    check("end to end, snapshot in pinned host memory", lambda: e2e("pinned"))


# ----------------------------------------------------------------------------- 2b. the callback's capture

def digest_case(n: int):
    g = torch.Generator().manual_seed(n)
    t = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(DEV)
    if device_digest(t) != tensor_digest(t.cpu(), "blake3"):
        raise AssertionError(f"device BLAKE3 of {n} bytes differs from the host's")


def capture_case(keep: str):
    """Versions captured on the device, published later from the captures alone: the same parts
    as a reference publisher's, O(changes) to the host per non-keyframe capture."""
    versions = _versions()
    versions.append({k: v.clone() for k, v in versions[-1].items()})
    versions[-1]["w"][1::7] = versions[0]["w"][1::7]
    with tempfile.TemporaryDirectory() as tmp:
        ref = Publisher(LocalStore(os.path.join(tmp, "ref")), keyframe_every=3, chunk_elems=1 << 16)
        cap = DeviceCapture(keep, chunk_elems=1 << 16)
        pub = Publisher(LocalStore(os.path.join(tmp, "cap")), keyframe_every=3, chunk_elems=1 << 16, device=cap.base)
        live = {k: t.to(DEV, copy=True) for k, t in versions[0].items()}
        jobs, stats = [], []
        for v, state in enumerate(versions):
            for k, t in state.items():  # the trainer writes its weights in place
                if k in live and live[k].shape == t.shape and live[k].dtype == t.dtype:
                    live[k].copy_(t.to(DEV))
                else:
                    live[k] = t.to(DEV, copy=True)
            for k in [k for k in live if k not in state]:
                del live[k]
            sync()
            t0 = time.perf_counter()
            with Traffic() as moved:
                job = cap.capture(live, full=v % 3 == 0)
                sync()
            stall = time.perf_counter() - t0
            t0 = time.perf_counter()
            host = {k: t.to("cpu", copy=True) for k, t in live.items()}  # what the host path copies
            host_copy = time.perf_counter() - t0
            changes = sum(s.k for s in job.streams.values())
            if not job.full and moved.d2h > 28 * changes + 64 * len(live) + 4096 + sum(
                    t.numel() * t.element_size() for t in job.host.values()):
                raise AssertionError(f"capture {v} moved {moved.d2h} B to the host for {changes} changes")
            stats.append({"version": v, "full": job.full, "changes": changes, "d2h_bytes": moved.d2h,
                          "h2d_bytes": moved.h2d, "capture_s": stall, "host_copy_s": host_copy})
            jobs.append((job, host))
        for v, (job, host) in enumerate(jobs):  # the publishes run later: the live tensors moved on
            a, b = ref.publish(host), pub.publish(job)
            if a.manifest.target_digest != b.manifest.target_digest:
                raise AssertionError(f"version {v}: target digests differ")
            for pa, pb in zip(a.manifest.parts + a.manifest.keyframe_parts,
                              b.manifest.parts + b.manifest.keyframe_parts, strict=True):
                _same_part(ref.store.get(pa.key), pub.store.get(pb.key))
        follower = {k: torch.zeros_like(t) for k, t in versions[0].items()}
        Follower(LocalStore(os.path.join(tmp, "cap")), follower).sync()
        for k, t in versions[-1].items():
            eq_bits(follower[k], t, f"follower of the captured versions {k}")
        RESULTS["e2e"][f"capture_{keep}"] = {"captures": stats, "kept_bytes": cap.kept_bytes()}
        print(f"capture ({keep}): " + ", ".join(
            f"v{s['version']} {'full' if s['full'] else str(s['changes']) + ' ch'} {s['d2h_bytes']} B up "
            f"{s['capture_s'] * 1e3:.1f} ms (host copy {s['host_copy_s'] * 1e3:.1f} ms)" for s in stats), flush=True)


def capture_section():
    for n in ([0, 1100, 4200] if ARGS.interpret else [0, 1, 1023, 1024, 1025, 3000, 65 * 1024, 1 << 22, 5_000_003]):
        check(f"device BLAKE3 digest of {n} bytes", lambda n=n: digest_case(n))
    check("callback capture, kept on the device", lambda: capture_case("device"))
    check("callback capture, kept in pinned host memory", lambda: capture_case("pinned"))


# ----------------------------------------------------------------------------- 2c. a receiver group

def group_case():
    """Three receiver ranks (gloo; on a GPU machine they share the one device) hold the tensors of
    tests/dcr_testing/gather_workers.py sharded differently from the trainer, which publishes them
    whole with ``classes`` chunks: every chunk of a column-split tensor is held in part by every
    rank. On the device with ``staging=False`` (what the vLLM worker runs at TP>1), each update is
    bit-exact, and the bytes each rank moved are O(changes) down (decoded changes and streams) and
    up the packed classes of the chunks it holds in part plus O(changes), never a staging copy."""
    import pathlib

    from dcr_testing import gather_workers as G
    from dcr_testing import mp_workers as W
    from dcr_testing.procs import launch
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "store")
        pub = Publisher(root, chunk_elems=G.CHUNK, encoding="classes")
        for v in range(3):
            pub.publish(G.global_state(v), step=v)
        store = LocalStore(root)
        from nemo_dcr.sync.versions import manifest_at
        changes = {v: sum(c.k for p in manifest_at(store, v).parts
                          for e in DeltaReader.open(store.get(p.key)).header.tensors for c in e.chunks)
                   for v in (1, 2)}
        out = pathlib.Path(tmp) / "out"
        out.mkdir()
        os.environ["DCR_GROUP_DEVICE"] = DEV.type
        res, codes, hung = launch(W.main, G.WORLD, lambda r, port: (r, G.WORLD, port, {"kind": "local", "root": root},
                                                                    "gather-device", str(out)), out, 300.0)
        if hung or any(not res.get(r, {}).get("ok") for r in range(G.WORLD)):
            raise AssertionError(f"hung {hung}; " + "; ".join(str(res.get(r, {}).get("traceback"))[-800:]
                                                             for r in range(G.WORLD)))
        rows = []
        for r in range(G.WORLD):
            if res[r]["versions"] != [1, 2] or res[r]["device"].split(":")[0] != DEV.type:
                raise AssertionError(f"rank {r}: {res[r]}")
            for t in res[r]["traffic"]:
                k = changes[t["version"]]
                rows.append({"rank": r, **t, "changes": k, "held_bytes": res[r]["held_bytes"]})
                print(f"     rank {r} version {t['version']}: {t['h2d']} B down, {t['d2h']} B up, {k} changes, "
                      f"{res[r]['held_bytes']} B held", flush=True)
                # down: per change of a chunk decoded here or by the group, its position and old
                # and new bits, or its decoded streams; up: the classes (<= 1 B per element held)
                # and the base bits at the changes
                up_bound = res[r]["held_elements"] + 32 * k + 2048
                if DEV.type != "cpu" and (t["h2d"] > 64 * k + 2048 or t["d2h"] > up_bound):
                    raise AssertionError(f"rank {r}, version {t['version']}: {t['h2d']} B down, {t['d2h']} B up for "
                                         f"{k} changes, {res[r]['held_bytes']} B held: not O(changes)")
        RESULTS["e2e"]["group"] = rows


def group_section():
    check("receiver group (3 ranks, classes chunks held in part) on the device, staging=False", group_case)


# ----------------------------------------------------------------------------- 3. bench

def timed(fn, reps=3):
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_section():
    n = ARGS.bench_elems or ((1 << 14) if ARGS.interpret else (64 << 20 if ARGS.quick else 256 << 20))
    nbytes = 2 * n
    g = torch.Generator(device=DEV).manual_seed(0)
    base = (torch.randn(n, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    dst = torch.empty_like(base)
    t_memcpy = timed(lambda: dst.copy_(base))
    memcpy_gbs = 2 * nbytes / t_memcpy / 1e9  # read + write
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=DEV.type == "cuda")
    t_d2h = timed(lambda: host.copy_(base), reps=2)
    print(f"bench: {n} BF16 elements ({nbytes / 1e9:.2f} GB); device memcpy {memcpy_gbs:.0f} GB/s; "
          f"D2H of the shard (what the reference path copies per version) {nbytes / t_d2h / 1e9:.1f} GB/s", flush=True)
    for rate in (0.01, 0.05):
        live = base.clone()
        k = int(rate * n)
        idx = torch.randperm(n, device=DEV, generator=g)[:k]
        bv = bits(live)
        bv[idx] = bv[idx] + torch.where(torch.rand(k, device=DEV, generator=g) < 0.5, 1, -1).to(bv.dtype)
        snap = base.clone()
        t_compact = timed(lambda snap=snap, live=live:
                          diff_(snap, live, chunk_elems=1 << 20, use_classes=False, update=False))
        t_fused = timed(lambda snap=snap, live=live:
                        diff_(snap, live, chunk_elems=1 << 20, use_classes=True, update=False))
        ch = diff_(snap, live, chunk_elems=1 << 20, use_classes=True, update=False)
        # the snapshot update after a commit: the changes written (checked), then undone, timed as pairs
        t_update = timed(lambda snap=snap, ch=ch: (apply_(snap, ch.pos, ch.new, ch.old),
                                                   apply_(snap, ch.pos, ch.old, ch.new))) / 2
        t0 = time.perf_counter()
        ch_host = ch.cpu()
        t_stream_d2h = time.perf_counter() - t0
        t0 = time.perf_counter()
        chunks = encode_changes_chunks(ch_host, "classes", 3)
        t_host_code = time.perf_counter() - t0
        # the receiver: a delta of those chunks, host decode + device apply
        # (diff with the chunks found on the device; its tensor digests read the shard on the host)
        blob = diff({"w": base}, {"w": live}, encoding="classes", chunk_elems=1 << 20, progress=False,
                    chunker=lambda *a, chunks=chunks: chunks)
        target = base.clone()
        t0 = time.perf_counter()
        with Traffic() as moved:
            apply_delta_({"w": target}, blob)
            sync()
        t_recv = time.perf_counter() - t0
        eq_bits(target, live, "bench receiver")
        row = {
            "elements": n, "rate": rate, "changes": ch.k, "shard_bytes": nbytes,
            "memcpy_s": t_memcpy, "memcpy_GBps": memcpy_gbs,
            "compact_s": t_compact, "compact_GBps_read": 2 * nbytes / t_compact / 1e9,
            "fused_classes_s": t_fused, "fused_classes_GBps_read": 2 * nbytes / t_fused / 1e9,
            "fused_vs_memcpy_bw": (2 * nbytes / t_fused) / (2 * nbytes / t_memcpy),
            "snapshot_update_s": t_update, "stream_d2h_s": t_stream_d2h, "host_code_s": t_host_code,
            "delta_bytes": len(blob), "receiver_decode_apply_s": t_recv,
            # trainer: the compact stream comes up; receiver (counted by Traffic): the decoded
            # classes streams go down, the pre-image bits come up for the chunk digests
            "device_path_d2h_bytes": ch.nbytes(), "receiver_h2d_bytes": moved.h2d, "receiver_d2h_bytes": moved.d2h,
            "reference_path_d2h_bytes": nbytes, "reference_d2h_s": t_d2h,
        }
        t_dig = timed(lambda live=live: device_digest(live), reps=2)
        t_hdig = timed(lambda: tensor_digest(host, "blake3"), reps=1)
        row.update({"device_digest_s": t_dig, "device_digest_GBps": nbytes / t_dig / 1e9,
                    "device_digest_vs_memcpy_bw": (nbytes / t_dig) / (2 * nbytes / t_memcpy),
                    "host_digest_s": t_hdig})
        RESULTS["bench"].append(row)
        print(f"bench rate {rate}: compact {row['compact_GBps_read']:.0f} GB/s read, fused+classes "
              f"{row['fused_classes_GBps_read']:.0f} GB/s ({row['fused_vs_memcpy_bw']:.0%} of memcpy), host coder "
              f"{t_host_code:.2f} s, receiver {t_recv:.2f} s, D2H {ch.nbytes() / 1e6:.1f} MB vs {nbytes / 1e6:.0f} MB",
              flush=True)


def main():
    info = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "quick": ARGS.quick}
    RESULTS["info"] = info
    print(json.dumps(info), flush=True)
    t0 = time.perf_counter()
    kernels_section()
    e2e_section()
    capture_section()
    group_section()
    if not ARGS.no_bench:
        check("bench", bench_section)
    RESULTS["seconds"] = time.perf_counter() - t0
    n_ok = sum(c["ok"] for c in RESULTS["checks"])
    print(f"{n_ok}/{len(RESULTS['checks'])} checks passed in {RESULTS['seconds']:.0f} s", flush=True)
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0 if not RESULTS["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
