"""Long, coverage-guided fuzz run (atheris / libFuzzer) of everything that parses bytes a store,
a relay or a peer hands us: the delta decoder (Python reference and the C kernel, the latter built
with AddressSanitizer), the manifest parser and the HEAD parser.

    pip install "nemo-dcr[fuzz]"                                   # atheris
    python bench/fuzz.py --inputs 1000000                          # every target, split evenly
    python bench/fuzz.py --target delta-payload --backend native --inputs 200000
    python bench/fuzz.py --list

Each target runs in its own process (libFuzzer runs one target per process). ``--backend native``
rebuilds the C kernel with ``NEMO_DCR_NATIVE_CFLAGS="-fsanitize=address ..."`` (cached apart from
the normal build), preloads the ASan runtime and sets ``PYTHONMALLOC=malloc`` (so that the
``bytes`` the kernel reads, small ones too, have redzones), so an out-of-bounds read or write in
the kernel aborts the run with ASan's report. (gcc's ASan runtime then supplies the coverage
hooks atheris would use: the native runs are not coverage-guided; they start from the corpus the
reference run of the same target grew, which is why ``--backend both`` runs the reference first.)
Invariant checked on every input: the target returns, or raises
a ``DcrError`` (a typed error); any other exception, a crash, a hang (``--timeout`` seconds per
input) or memory past ``--rss-limit-mb`` is a finding, and libFuzzer writes the input that caused
it under ``--artifacts``. A JSON summary per target (inputs, coverage counters, findings) is
printed at the end; docs/reliability.md "Security and fuzzing" records a run.

Targets:
* ``chunk``: one chunk of a real delta (every encoding: the classes coding goes to the C kernel)
  whose payload bytes, change count and classes table the input rewrites, checksum fixed, decoded
  alone against its base: many inputs a second, the decoders' own bounds.
* ``delta-bytes``: the raw bytes of a delta (seeded with real deltas): container, header, crcs.
* ``delta-payload``: real deltas whose chunk payload bytes the input rewrites, checksum fixed, so
  the position/value decoders (and the C kernel) see the damage.
* ``delta-header``: real deltas whose header fields the input replaces by hostile values, every
  checksum valid: the header's bounds and the apply plan.
* ``manifest``: raw bytes to ``Manifest.from_bytes`` (seeded with real manifests, signed too).
* ``manifest-fields``: a real manifest with one field replaced by an input-chosen value and its
  checksum recomputed, so the checks behind the checksum are what is fuzzed.
* ``head``: raw bytes to ``Head.from_bytes`` (seeded with real HEADs, signed too), then the
  signature check of a follower configured with a key.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["chunk", "delta-bytes", "delta-payload", "delta-header", "manifest", "manifest-fields", "head"]
DELTA = {"chunk", "delta-bytes", "delta-payload", "delta-header"}
ASAN_CFLAGS = "-fsanitize=address -fno-omit-frame-pointer -g -O1"

# ----------------------------------------------------------------------------- fixtures


def _states():
    """The tests' fuzz pair (tests/dcr_testing/fuzz_cases.py): one definition for both fuzzers."""
    tests = os.path.join(ROOT, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from dcr_testing.fuzz_cases import fuzz_states
    return fuzz_states()


class DeltaFixtures:
    def __init__(self):
        from nemo_dcr import DeltaReader, diff
        from nemo_dcr.codec.format import PREAMBLE
        self.base, self.target = _states()
        self.blobs = {
            "auto": diff(self.base, self.target, chunk_elems=64, workers=1),
            "classes": diff(self.base, self.target, encoding="classes", chunk_elems=64, workers=1),
            "portable": diff(self.base, self.target, encoding="portable", chunk_elems=64, workers=1),
            "keyframe": diff({}, self.target, encoding="overwrite", chunk_elems=64, workers=1),
            "auto-v2": diff(self.base, self.target, chunk_elems=64, workers=1, format_version=2),
        }
        self.names = sorted(self.blobs)
        self.readers = {n: DeltaReader(b) for n, b in self.blobs.items()}
        self.areas = {n: bytes(r.buf[PREAMBLE.size:r.payload_end]) for n, r in self.readers.items()}

    def receiver(self, name):
        return {k: v.clone() for k, v in (self.base if name != "keyframe" else {}).items()}


def craft(blob: bytes, raw_header, area: bytes) -> bytes:
    """``blob`` with this payload area and header, every checksum valid, in its own format
    version (the tests' crafting: tests/dcr_testing/deltas.py)."""
    from dcr_testing.deltas import rewrite  # (on the path: _states put it there)
    return rewrite(blob, raw_header, area)


HOSTILE = [0, 1, -1, 2 ** 31, 2 ** 63, 2 ** 64 + 1, 1e308, float("nan"), True, None, "x", [], {}, [1, 2],
           "classes", "gaps", "bitmap", "dense", "xor", "add", "overwrite", "delta", "full", "removed",
           "bfloat16", "float8_e4m3fn", "0" * 16, "", [2 ** 40, 2 ** 40], [-1], [0] * 65]


def hostile_value(fdp, current):
    pick = fdp.ConsumeIntInRange(0, len(HOSTILE) + 2)
    if pick < len(HOSTILE):
        return HOSTILE[pick]
    if pick == len(HOSTILE) and isinstance(current, int) and not isinstance(current, bool):
        return current + fdp.ConsumeIntInRange(-(2 ** 20), 2 ** 20)  # near miss
    if pick == len(HOSTILE) + 1:
        return fdp.ConsumeInt(8)
    return fdp.ConsumeUnicodeNoSurrogates(24)


# ----------------------------------------------------------------------------- targets


def make_delta_target(kind: str):
    from nemo_dcr import DcrError, apply, inspect
    fx = DeltaFixtures()

    def run(blob: bytes, name: str):
        recv = fx.receiver(name)
        try:
            inspect(blob)
            apply(recv, blob, workers=1)
        except DcrError:
            pass

    if kind == "delta-bytes":
        def one(data: bytes):
            run(data, "auto")  # a base receiver; keyframe-shaped inputs are refused or create tensors
        return one, list(fx.blobs.values())

    import atheris

    if kind == "chunk":
        import dataclasses

        from nemo_dcr.codec.chunk import decode_chunk
        from nemo_dcr.state.dtypes import int_view
        chunks = []  # (entry, payload, width, base bits of the chunk or None, dtype)
        for name in fx.names:
            r = fx.readers[name]
            for t in r.header.tensors:
                for c in t.chunks:
                    dt = t.torch_dtype
                    base = fx.base.get(t.name)
                    bits = int_view(base).reshape(-1)[c.start:c.start + c.n] if base is not None else None
                    chunks.append((c, bytes(r.payload(c)), dt.itemsize, bits, dt))

        def one(data: bytes):
            fdp = atheris.FuzzedDataProvider(data)
            c, payload, w, bits, dt = chunks[fdp.ConsumeIntInRange(0, len(chunks) - 1)]
            p = bytearray(payload)
            for _ in range(fdp.ConsumeIntInRange(0, 8)):
                if p and fdp.remaining_bytes():
                    p[fdp.ConsumeIntInRange(0, len(p) - 1)] = fdp.ConsumeInt(1) & 0xFF
            if fdp.ConsumeIntInRange(0, 7) == 0:
                p = p[:fdp.ConsumeIntInRange(0, len(p))] + fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
            change = {"crc": zlib.crc32(bytes(p))}
            if fdp.ConsumeIntInRange(0, 3) == 0:
                change["k"] = fdp.ConsumeIntInRange(0, c.n)
            if c.cls and fdp.ConsumeIntInRange(0, 3) == 0:
                rows = [list(r) for r in c.cls]
                row = rows[fdp.ConsumeIntInRange(0, len(rows) - 1)]
                row[fdp.ConsumeIntInRange(0, len(row) - 1)] = fdp.ConsumeInt(4)
                change["cls"] = tuple(tuple(r) for r in rows)
            if c.enc != "classes":
                change.update(plen=min(c.plen, len(p)), vlen=len(p) - min(c.plen, len(p)))
            else:
                change.update(plen=min(c.plen, len(p)), vlen=len(p) - min(c.plen, len(p)),
                              praw=min(c.plen, len(p)), vraw=len(p) - min(c.plen, len(p)))
            e = dataclasses.replace(c, **change)
            try:
                decode_chunk(e, bytes(p), w, base=bits, dtype=dt)
            except DcrError:
                pass  # anything else (torch's ValueError, say) propagates: a finding
        return one, []

    if kind == "delta-payload":
        def one(data: bytes):
            fdp = atheris.FuzzedDataProvider(data)
            name = fx.names[fdp.ConsumeIntInRange(0, len(fx.names) - 1)]
            h = copy.deepcopy(fx.readers[name].raw_header)
            area = bytearray(fx.areas[name])
            chunks = [c for t in h["tensors"] for c in t.get("chunks", ())]
            c = chunks[fdp.ConsumeIntInRange(0, len(chunks) - 1)]
            from nemo_dcr.codec.format import PREAMBLE
            lo, n = c["off"] - PREAMBLE.size, c["plen"] + c["vlen"]
            for _ in range(fdp.ConsumeIntInRange(1, 8)):
                if n and fdp.remaining_bytes():
                    area[lo + fdp.ConsumeIntInRange(0, n - 1)] = fdp.ConsumeInt(1) & 0xFF
            c["crc"] = zlib.crc32(bytes(area[lo:lo + n]))
            run(craft(fx.blobs[name], h, bytes(area)), name)
        return one, []

    def one(data: bytes):  # delta-header
        fdp = atheris.FuzzedDataProvider(data)
        name = fx.names[fdp.ConsumeIntInRange(0, len(fx.names) - 1)]
        h = copy.deepcopy(fx.readers[name].raw_header)
        for _ in range(fdp.ConsumeIntInRange(1, 3)):
            tensors = h.get("tensors")
            if not isinstance(tensors, list) or not tensors:
                break  # (an earlier change replaced or emptied the list)
            t = tensors[fdp.ConsumeIntInRange(0, len(tensors) - 1)]
            chunks = t.get("chunks") if isinstance(t, dict) else None
            places = [h, t, *(chunks if isinstance(chunks, list) else [])]
            where = places[fdp.ConsumeIntInRange(0, len(places) - 1)]
            if not isinstance(where, dict) or not where:
                continue
            keys = sorted(where)
            key = keys[fdp.ConsumeIntInRange(0, len(keys) - 1)]
            if fdp.ConsumeIntInRange(0, 9) == 0:
                del where[key]
            else:
                where[key] = hostile_value(fdp, where[key])
        run(craft(fx.blobs[name], h, fx.areas[name]), name)
    return one, []


class VersionFixtures:
    """Real manifests and HEADs of a small published store: unsigned and signed."""

    def __init__(self):
        import torch

        from nemo_dcr.stores import LocalStore
        from nemo_dcr.sync.publisher import Publisher
        from nemo_dcr.sync.signing import Signer, Verifier, generate_key
        from nemo_dcr.sync.versions import HEAD_KEY
        key = generate_key()
        self.verifier = Verifier([key.public_key()], namespace="fuzz")
        self.manifests, self.heads = [], []
        for signer in (None, Signer(key, "fuzz")):
            # only the bytes are kept: the store goes (a directory per fixture was left in /tmp
            # by every run of the version targets)
            with tempfile.TemporaryDirectory(prefix="nemo-dcr-fuzz-") as d:
                store = LocalStore(d)
                pub = Publisher(store, keyframe_every=2, signer=signer)
                st = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.bfloat16)}
                for i in range(3):
                    st["w"][i] += 1
                    pub.publish(st)
                    self.heads.append(store.get(HEAD_KEY))
                self.manifests += [(k, store.get(k)) for k in store.list("versions/") if k.endswith("manifest.json")]


def make_version_target(kind: str):
    from nemo_dcr.errors import DcrError
    from nemo_dcr.sync.versions import Head, Manifest, canonical_sha256
    fx = VersionFixtures()

    if kind == "manifest":
        def one(data: bytes):
            for key in ("<manifest>", fx.manifests[len(data) % len(fx.manifests)][0]):
                try:
                    m = Manifest.from_bytes(data, key)
                    fx.verifier.check_manifest(m)
                except DcrError:
                    pass
        return one, [b for _, b in fx.manifests]

    if kind == "head":
        def one(data: bytes):
            try:
                h = Head.from_bytes(data)
                fx.verifier.check_head(h, remember=False)
            except DcrError:
                pass
        return one, list(fx.heads)

    import atheris

    def one(data: bytes):  # manifest-fields
        fdp = atheris.FuzzedDataProvider(data)
        key, raw = fx.manifests[fdp.ConsumeIntInRange(0, len(fx.manifests) - 1)]
        d = json.loads(raw)
        for _ in range(fdp.ConsumeIntInRange(1, 3)):
            lists = [x for x in (d.get("parts"), d.get("keyframe_parts")) if isinstance(x, list)]
            places = [d, *[p for x in lists for p in x if isinstance(p, dict)]]
            if isinstance(d.get("signature"), dict):
                places.append(d["signature"])
            where = places[fdp.ConsumeIntInRange(0, len(places) - 1)]
            keys = sorted(k for k in where if k != "checksum")
            if not keys:
                continue
            k = keys[fdp.ConsumeIntInRange(0, len(keys) - 1)]
            where[k] = hostile_value(fdp, where[k])
        d.pop("checksum", None)
        try:
            d["checksum"] = canonical_sha256(d)
        except ValueError:
            pass  # (a NaN: not canonical JSON; the parser sees it without a valid checksum)
        try:
            m = Manifest.from_bytes(json.dumps(d, allow_nan=True).encode(), key)
            fx.verifier.check_manifest(m)
        except DcrError:
            pass
    return one, []


# ----------------------------------------------------------------------------- driver


def child(args) -> None:
    """Runs in the fuzzing process: instrument, seed, fuzz."""
    import atheris
    with atheris.instrument_imports(include=["nemo_dcr"]):
        import nemo_dcr.codec.format  # noqa: F401
        import nemo_dcr.delta  # noqa: F401
        if args.target not in DELTA:
            import nemo_dcr.sync.signing  # noqa: F401
            import nemo_dcr.sync.versions  # noqa: F401
    if args.backend == "reference":
        from nemo_dcr.codec import native
        native.lib = lambda: None
    elif args.target in DELTA:
        from nemo_dcr.codec import native
        if native.lib() is None:
            raise SystemExit(f"the C kernel did not build: {native.build_error}")
    one, seeds = (make_delta_target if args.target in DELTA else make_version_target)(args.target)
    corpus = os.path.join(args.corpus, args.target)
    os.makedirs(corpus, exist_ok=True)
    for i, s in enumerate(seeds):
        with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
            f.write(s)
    os.makedirs(args.artifacts, exist_ok=True)
    argv = [sys.argv[0], corpus, f"-runs={args.inputs}", f"-timeout={args.timeout}",
            f"-rss_limit_mb={args.rss_limit_mb}", f"-max_len={args.max_len}", "-print_final_stats=1",
            f"-artifact_prefix={os.path.join(args.artifacts, args.target + '-')}", f"-seed={args.seed}"]
    if args.max_time:
        argv.append(f"-max_total_time={args.max_time}")
    atheris.Setup(argv, one)
    atheris.Fuzz()


_STAT = re.compile(r"stat::(\w+):\s+(\d+)")
_COV = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+)")


def run_target(args, target: str, inputs: int) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    backend = args.backend if target in DELTA else "-"
    if target in DELTA and args.backend == "native":
        env["NEMO_DCR_NATIVE_CFLAGS"] = ASAN_CFLAGS
        libasan = subprocess.run([os.environ.get("CC", "cc"), "-print-file-name=libasan.so"],
                                 capture_output=True, text=True).stdout.strip()
        env["LD_PRELOAD"] = libasan
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1"
        env["PYTHONMALLOC"] = "malloc"  # Python's small objects (the kernel's input streams) get redzones too
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--target", target, "--backend", args.backend,
           "--inputs", str(inputs), "--timeout", str(args.timeout), "--rss-limit-mb", str(args.rss_limit_mb),
           "--max-len", str(args.max_len), "--corpus", args.corpus, "--artifacts", args.artifacts,
           "--seed", str(args.seed), "--max-time", str(args.max_time)]
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    out = p.stdout + p.stderr
    stats = {k: int(v) for k, v in _STAT.findall(out)}
    cov = _COV.findall(out)
    findings = [line for line in out.splitlines()
                if "ERROR: AddressSanitizer" in line or "Uncaught Python exception" in line
                or "ERROR: libFuzzer" in line]
    res = {"target": target, "backend": backend, "inputs": stats.get("number_of_executed_units", 0),
           "coverage": int(cov[-1][1]) if cov else None, "features": int(cov[-1][2]) if cov else None,
           "corpus": len(os.listdir(os.path.join(args.corpus, target))) if os.path.isdir(
               os.path.join(args.corpus, target)) else 0,
           "peak_rss_mb": stats.get("peak_rss_mb"), "seconds": round(time.time() - t0, 1),
           "exit": p.returncode, "findings": findings[:5]}
    if p.returncode != 0 and not findings:  # a run that failed before fuzzing: say why, not only "exit 1"
        res["error"] = next((line for line in reversed(out.splitlines()) if line.strip()), "no output")[-300:]
    with open(os.path.join(args.artifacts, f"{target}-{backend}.log"), "w") as f:
        f.write(out[-200000:])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", choices=TARGETS, help="repeatable; default: every target")
    ap.add_argument("--backend", choices=["native", "reference", "both"], default="both",
                    help="delta targets: the ASan-built C kernel, the PyTorch reference, or each in turn")
    ap.add_argument("--inputs", type=int, default=100000, help="inputs in all, split evenly over the runs")
    ap.add_argument("--max-time", type=int, default=0, help="seconds per run (0: no limit)")
    ap.add_argument("--timeout", type=int, default=20, help="seconds one input may take (a hang)")
    ap.add_argument("--rss-limit-mb", type=int, default=3072)
    ap.add_argument("--max-len", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--corpus", default=os.path.join(ROOT, "runs", "fuzz", "corpus"))
    ap.add_argument("--artifacts", default=os.path.join(ROOT, "runs", "fuzz", "artifacts"))
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(TARGETS))
        return 0
    if args.child:
        args.target = args.target[0]
        child(args)
        return 0
    if importlib.util.find_spec("atheris") is None:  # every run would fail at its first line, one by one
        print('bench/fuzz.py needs atheris: pip install "nemo-dcr[fuzz]" (or pip install atheris)', file=sys.stderr)
        return 2
    runs = []
    for t in args.target or TARGETS:
        for b in (["reference", "native"] if args.backend == "both" else [args.backend]) if t in DELTA else ["-"]:
            runs.append((t, b))
    os.makedirs(args.artifacts, exist_ok=True)
    results = []
    for t, b in runs:
        sub = argparse.Namespace(**{**vars(args), "backend": b if b != "-" else "reference"})
        r = run_target(sub, t, max(1, args.inputs // len(runs)))
        results.append(r)
        print(json.dumps(r), flush=True)
    total = {"inputs": sum(r["inputs"] for r in results),
             "findings": sum(len(r["findings"]) for r in results),
             "failed_runs": [f"{r['target']}/{r['backend']}" for r in results if r["exit"] != 0]}
    print(json.dumps({"total": total}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "total": total}, f, indent=1)
    return 1 if total["findings"] or total["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
