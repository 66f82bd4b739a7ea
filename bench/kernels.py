"""Issue #12's device-path benchmark: the whole encode and apply of one large shard, and the
keyframe publish, as multiples of one memcpy of the shard, measured side by side in this process.

    python bench/kernels.py                 # table on stdout
    python bench/kernels.py --json          # the same as JSON
    python bench/kernels.py --quick         # a 4M-element shard, one repetition (< 1 min)

The shard is synthetic and deterministic: ``--elems`` BF16 weights ~ N(0, 0.02), and targets in
which ``--changes`` of the elements (default 1 % and 5 %) changed: one optimizer-like step
``w + lr * z`` rounded to BF16 (see ``make_target``), so that, as in training, mostly the small
weights change. With ``--ulps K`` the step instead moves ``--changes`` of the elements, drawn at
random, by ``K 2^-8 z`` of their value (``w (1 + K 2^-8 z)``: ``K |z| / 2`` to ``K |z|`` units in the
last place, 2.1 on average at K = 3, and some round back): larger updates, for
which the ``classes`` coding costs more than a byte per change and ``auto`` tries the portable
codings too (xor, add, overwrite: ``codec/chunk.py``).
Timed (median of ``--reps``), per change rate, each result checked bit for bit:

* ``memcpy`` -- ``dst.copy_(shard)`` on one torch thread: the unit every ratio is in, the median
  of samples timed at the start and beside each row (``Memcpy``; each row keeps the one beside
  it, ``memcpy_seconds``, so that drift during the run shows);
* encode side (``diff+encode+snapshot-update``: what a publish costs before its upload):
  * ``reference`` -- the snapshot copied, then ``diff`` hashing base and target and summing the
    state digest's change (the publisher before issue #12: both whole-tensor digests every version);
  * ``fast`` -- the snapshot copied, then ``diff`` with the base's known digest (its private
    snapshot was hashed when it was published);
  * ``fast-scatter`` -- the publisher now: ``diff`` of the target in place against the snapshot,
    whose changes its encoder writes into the snapshot as it reads them (``write_base``,
    ``_Changes``: O(changes), no copy; before, ``_Changes`` scattered each chunk's after it);
  * ``fast-scatter-many`` -- the same, the shard cut into tensors of half a chunk each (views of
    it), as a model's tensors and a trainer rank's shards of them mostly are: their chunks share
    the workers as one tensor's do;
  * ``codec`` -- the chunk encode alone (no digests, no container): the floor of the codec;
* apply side (``decode+apply``):
  * ``reference`` -- plan (base digest), chunks, then the target digest as a second pass (apply
    before issue #12);
  * ``fast`` -- ``apply``: the target digest hashed while the chunks are written;
  * ``follower`` -- what ``Follower.sync`` runs: ``apply(verify=False)`` (per-chunk pre-image
    checks only) with the state digest moved by the changes (``ChangeDigest``) and compared with
    the target's: the O(changes) verification, no whole-tensor pass;
  * ``unverified`` -- ``apply(verify=False)``: the chunks alone;
* ``reference`` and ``fast`` write and read format version 2 (BLAKE3 tensor digests); ``fast-v1``
  rows (encode and apply): the same fast paths in format version 1 (SHA-256 tensor digests,
  BLAKE2b-64 chunk digests); ``fast-v3``: version 3 (segments, tensor digests summed from the
  changes); ``fast-v4``: version 4 (version 3 with the tensor digests the state digest's terms,
  so the publisher sums no state digest of its own); ``fast-v5`` and ``fast-scatter``: version 5,
  the default (version 4 under the state digest's definition 2: the base check of
  ``apply(verify=True)`` sums the base ~3x faster); ``follower-v5``: the follower's apply of it,
  its state digest moved by the changes under definition 2;
* tensor digest of the shard per algorithm: SHA-256, BLAKE3 on 1 and 2 threads; chunk values
  digests (pre/post images) over the whole shard in chunks, as a keyframe's make them, on
  ``--workers`` threads: BLAKE2b-64 (version 1) and BLAKE3-64 (version 2);
* state digest of the shard: the torch reference (timed on at most 8M elements, scaled) and the
  C kernel on ``--workers`` threads (``fast``; ``fast-def2``: the weights' second definition,
  docs/format.md); on one thread (``state_digest_1t``), the shard's bytes read as bytes, BF16,
  FP32 and FP64, in each build of the kernel the CPU runs (its best, AVX2, plain), under both
  definitions, with ns per element;
* keyframe publish into a local directory (a ``Publisher`` on a ``LocalStore``): a fresh
  publisher's first version with the state digest in C and in torch, and in format version 1,
  against writing (and fsyncing) the raw bytes of the shard there (``raw_write``;
  ``raw_write_writeback``: the same bytes written 8 MB at a time with each piece's writeback asked
  for, as the store's writer does); ``fast-v3`` and ``fast-v4`` (delta format 3 and 4) with their
  parts' checksums BLAKE3 (manifest format 4) and ``fast-v3-sha256`` with SHA-256 (format 3);
  ``fast-v5``: delta format 5 (the default: definition 2, manifest format 5);
  ``fast-v5-alternated`` and ``fast-v5-copy-first``: the same, alternated rep by rep with the
  publisher's snapshot copied whole before the encode (the path before the encode filled it as
  it went, ``diff(copy_into=...)``); ``fast-v5-next``
  (``fast-v4-next`` while version 4 was the default): a publisher's next version (1 % changed)
  as a keyframe, its delta part beside it, as ``keyframe_every`` makes them;
* keyframe sync: a follower's first sync of that keyframe from the local directory into fresh
  tensors (delta format 4), its parts checked with BLAKE3 (``v4``) and SHA-256 (``v4-sha256``;
  the rows were ``v3`` and ``v3-sha256`` while version 3 was the default), and in delta format 5
  (``v5``, the default: the keyframe's digests under definition 2).

GPU figures: ``DEVICE_PATHS`` is the hook. Each entry is ``fn(base, target, rate, workers, reps)
-> list of rows`` (the row fields of ``_row``: side, path, seconds, plus h2d/d2h bytes), run
after the CPU paths on the same tensors; tests/gpu registers its fused kernels there when CUDA
is present, and the rows land in the same table with their ratio to the same memcpy.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from nemo_dcr import apply, diff
from nemo_dcr.codec import native
from nemo_dcr.codec.chunk import encode_chunk
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.delta import DEFAULT_CHUNK, plan_entry, run_plan, verify_plan
from nemo_dcr.delta.apply import ApplyReport
from nemo_dcr.state import statedigest
from nemo_dcr.state.digest import RunningDigest, values_digest
from nemo_dcr.state.dtypes import dtype_name
from nemo_dcr.state.statedigest import ChangeDigest
from nemo_dcr.stores.local import LocalStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher, _Changes
from nemo_dcr.util.parallel import ordered_map
from nemo_dcr.util.writeback import KICK_EVERY, Writeback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from benchload import script  # noqa: E402

#: hook for device paths (see the module docstring): fn(base, target, rate, workers, reps) -> rows
DEVICE_PATHS: list[Callable] = []
_REF_DIGEST_MAX = 1 << 23  # the torch state digest is timed on at most this many elements


def _median(fn, reps, setup=None) -> float:
    """bench/codec.py's timer, one timer for every bench."""
    return script("codec")._median_time(fn, reps, setup)


def make_shard(elems: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(elems, generator=g) * 0.02).to(torch.bfloat16)


def _step(base: torch.Tensor, z: torch.Tensor, lr: float) -> torch.Tensor:
    return (base.float() + lr * z).to(torch.bfloat16)


def make_target(base: torch.Tensor, rate: float, seed: int = 1) -> torch.Tensor:
    """``base`` after one optimizer-like step ``w + lr * z`` (``z`` ~ N(0, 1), a normalised
    update), rounded to BF16, with ``lr`` chosen so that ``rate`` of the elements change. As in
    training, what changes are mostly the small weights (their unit in the last place is small):
    the changes are correlated with the exponent, as the ``classes`` coding expects."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(base.numel(), generator=g)
    sample, zs = base[:1 << 20], z[:1 << 20]
    lo, hi = 1e-9, 1.0
    for _ in range(40):  # bisection on a sample: the change rate grows with lr
        mid = (lo * hi) ** 0.5
        changed = float((_step(sample, zs, mid).view(torch.int16) != sample.view(torch.int16)).float().mean())
        lo, hi = (mid, hi) if changed < rate else (lo, mid)
    return _step(base, z, hi)


def make_wide_target(base: torch.Tensor, rate: float, ulps: float, seed: int = 1) -> torch.Tensor:
    """``base`` with ``rate`` of its elements (at random) moved by ``ulps 2^-8 z`` of their value
    (``z`` ~ N(0, 1)): ``ulps |z| / 2`` to ``ulps |z|`` units in the last place, as a BF16 ulp is
    2^-8 to 2^-7 of the value; rounded to BF16, so some of the drawn elements stay where they were
    (0.82 % of the elements move at ``rate`` 1 %, by 2.1 ulps on average at ``ulps`` 3)."""
    g = torch.Generator().manual_seed(seed)
    moved = torch.rand(base.numel(), generator=g) < rate
    z = torch.randn(base.numel(), generator=g) * moved
    return (base.float() * (1 + ulps * 2.0 ** -8 * z)).to(torch.bfloat16)


class Memcpy:
    """The unit of every ratio: ``dst.copy_(shard)`` on one torch thread. Timed at the start and
    again beside each row (right after the row's own timing, ``_row``; median of ``reps`` each);
    every ratio is to the median of all those samples (``run``), and each row keeps the one timed
    beside it (``memcpy_seconds``) so that drift shows. On this project's VM the memcpy of the
    134 MB shard took 8.5-29.6 ms within one hour (2026-12-03, nothing else running), and a ratio
    to a single memcpy timed at the start moved with it: the follower's apply read 1.9x in one
    run and 4.3x in another (docs/results.md, "Format version 3, fourth turn")."""

    def __init__(self, shard: torch.Tensor, reps: int = 3):
        self.shard, self.dst, self.reps = shard, torch.empty_like(shard), reps
        self.samples: list[float] = []

    def __call__(self, reps: int | None = None) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t = _median(lambda: self.dst.copy_(self.shard), reps or self.reps)
        finally:
            torch.set_num_threads(threads)
        self.samples.append(t)
        return t

    def unit(self) -> float:
        return statistics.median(self.samples)


def _row(side, path, seconds, memcpy, device="cpu", h2d_bytes=0, d2h_bytes=0, **extra) -> dict:
    """``memcpy``: the unit (seconds), or a ``Memcpy`` to time beside this row (``run`` then
    sets every row's ``x_memcpy`` to the median of its samples)."""
    beside = memcpy() if callable(memcpy) else memcpy
    return {"side": side, "path": path, "device": device, "seconds": seconds, "x_memcpy": seconds / beside,
            "memcpy_seconds": beside, "h2d_bytes": h2d_bytes, "d2h_bytes": d2h_bytes, **extra}


def _apply_reference(recv: dict, blob: bytes, workers: int) -> None:
    """``apply`` as it was before issue #12: the target digest a second pass after the writes."""
    reader = DeltaReader.open(blob)
    reader.check_payloads()
    report = ApplyReport()
    for e in reader.header.tensors:
        p = plan_entry(e, recv.get(e.name), None)
        verify_plan(p, run_plan(reader, p, report, workers))


def _entries(blob: bytes) -> list:
    """A delta's tensor entries, chunk offsets left out (format 3's move with the length of its
    opening segment, which holds the creation time)."""
    h = DeltaReader.open(blob).raw_header
    return [{**t, "chunks": [{k: v for k, v in c.items() if k != "off"} for c in t.get("chunks", ())]}
            for t in h["tensors"]]


def encode_apply(base: torch.Tensor, target: torch.Tensor, rate: float, workers: int, reps: int,
                 memcpy: Memcpy | float) -> list:
    n = base.numel()
    ob, nb = base.view(torch.int16), target.view(torch.int16)
    b, t = {"shard": base}, {"shard": target}
    # "reference" and "fast": format version 2 (BLAKE3 tensor digests); "fast-v3": version 3;
    # "fast-v4": version 4; "fast-v5" and "fast-scatter" (the publisher now): version 5, the default
    first = diff({}, b, encoding="overwrite", level=1, workers=workers, format_version=2)  # what published ``base``
    known = {e.name: e.target_digest for e in DeltaReader.open(first).header.tensors}
    first1 = diff({}, b, encoding="overwrite", level=1, workers=workers, format_version=1)
    known1 = {e.name: e.target_digest for e in DeltaReader.open(first1).header.tensors}
    first3 = diff({}, b, encoding="overwrite", level=1, workers=workers, format_version=3)
    known3 = {e.name: e.target_digest for e in DeltaReader.open(first3).header.tensors}
    first4 = diff({}, b, encoding="overwrite", level=1, workers=workers, format_version=4)
    known4 = {e.name: e.target_digest for e in DeltaReader.open(first4).header.tensors}
    first5 = diff({}, b, encoding="overwrite", level=1, workers=workers, format_version=5)
    known5 = {e.name: e.target_digest for e in DeltaReader.open(first5).header.tensors}
    snap = torch.empty_like(target)

    # both as the publisher calls diff: the state digest's change summed from the changed elements
    def enc_ref():
        snap.copy_(target)
        return diff(b, {"shard": snap}, workers=workers, on_change=ChangeDigest(), format_version=2)

    def enc_fast():
        snap.copy_(target)
        return diff(b, {"shard": snap}, workers=workers, base_digests=known, on_change=ChangeDigest(),
                    format_version=2)

    def enc_fast_v1():  # format version 1: SHA-256 and BLAKE2b-64 digests
        snap.copy_(target)
        return diff(b, {"shard": snap}, workers=workers, base_digests=known1, on_change=ChangeDigest(),
                    format_version=1)

    def enc_fast_v3():  # format version 3: segments, tensor digests summed from the changes
        snap.copy_(target)
        return diff(b, {"shard": snap}, workers=workers, base_digests=known3, on_change=ChangeDigest(),
                    format_version=3)

    def enc_fast_v4():  # format version 4: tensor digests the state digest's terms, no sum of its own
        snap.copy_(target)
        return diff(b, {"shard": snap}, workers=workers, base_digests=known4, format_version=4)

    def enc_fast_v5():  # format version 5: version 4 under the state digest's definition 2
        snap.copy_(target)
        return diff(b, {"shard": snap}, workers=workers, base_digests=known5, format_version=5)

    ranges = [(s, min(s + DEFAULT_CHUNK, n)) for s in range(0, n, DEFAULT_CHUNK)]

    def enc_codec():
        for _ in ordered_map(lambda r: encode_chunk(ob[r[0]:r[1]], nb[r[0]:r[1]], r[0], "auto",
                                                    dtype=torch.bfloat16), ranges, workers):
            pass

    blob = enc_fast()
    if _entries(blob) != _entries(enc_ref()):
        raise AssertionError("the fast encode does not write the reference's header")
    held = torch.empty_like(base)  # the publisher's snapshot, at the base before each rep

    def enc_scatter(_):
        keep = _Changes({"shard": held}, {}, early=True)
        out = diff({"shard": held}, t, workers=workers, base_digests=known5, on_change=keep.also(None),
                   write_base=keep.wants)
        keep.commit(t)
        return out

    blob1 = enc_fast_v1()
    blob3 = enc_fast_v3()
    blob4 = enc_fast_v4()
    blob5 = enc_fast_v5()
    held.copy_(base)
    if _entries(enc_scatter(None)) != _entries(blob5) \
            or not torch.equal(held.view(torch.int16), nb):
        raise AssertionError("the in-place encode differs, or its snapshot is not the target")
    # the same publisher's path with the shard cut into tensors of half a chunk each (views: the
    # same bytes), as a model's tensors and a trainer rank's shards of them mostly are
    cut = [(s, min(s + DEFAULT_CHUNK // 2, n)) for s in range(0, n, DEFAULT_CHUNK // 2)]
    many = lambda x: {f"t{i:05d}": x[s:e] for i, (s, e) in enumerate(cut)}  # noqa: E731
    t_many = many(target)
    known_many = {e.name: e.target_digest for e in DeltaReader.open(
        diff({}, many(base), encoding="overwrite", level=1, workers=workers, format_version=5)).header.tensors}

    def enc_scatter_many(_):
        mine = many(held)
        keep = _Changes(mine, {}, early=True)
        out = diff(mine, t_many, workers=workers, base_digests=known_many, on_change=keep.also(None),
                   write_base=keep.wants)
        keep.commit(t_many)
        return out

    held.copy_(base)
    enc_scatter_many(None)
    if not torch.equal(held.view(torch.int16), nb):
        raise AssertionError("the in-place encode of many tensors does not leave the snapshot at the target")
    rows = [_row("encode", "reference", _median(enc_ref, reps), memcpy),
            _row("encode", "fast", _median(enc_fast, reps), memcpy),
            _row("encode", "fast-v1", _median(enc_fast_v1, reps), memcpy),
            _row("encode", "fast-v3", _median(enc_fast_v3, reps), memcpy),
            _row("encode", "fast-v4", _median(enc_fast_v4, reps), memcpy),
            _row("encode", "fast-v5", _median(enc_fast_v5, reps), memcpy),
            _row("encode", "fast-scatter", _median(enc_scatter, reps, setup=lambda: held.copy_(base)), memcpy),
            _row("encode", "fast-scatter-many", _median(enc_scatter_many, reps, setup=lambda: held.copy_(base)),
                 memcpy),
            _row("encode", "codec", _median(enc_codec, reps), memcpy)]

    recv = {"shard": base.clone()}
    fresh = lambda: recv["shard"].copy_(base)  # noqa: E731  each apply on a fresh base, untimed
    d_base, d_target = (statedigest.state_contrib(s, workers=workers) for s in (b, t))

    d_base2, d_target2 = (statedigest.state_contrib(s, workers=workers, definition=2) for s in (b, t))

    def follower(_, blob=blob, d_base=d_base, d_target=d_target, definition=1):
        """The follower's check: per-chunk pre-images, then the state digest moved by the changes."""
        change = ChangeDigest(definition=definition)
        apply(recv, blob, workers=workers, verify=False, on_change=change)
        if d_base + change.total != d_target:
            raise AssertionError("the incremental state digest does not reach the target's")

    paths = {"reference": lambda _: _apply_reference(recv, blob, workers),
             "fast": lambda _: apply(recv, blob, workers=workers),
             "fast-v1": lambda _: apply(recv, blob1, workers=workers),
             "fast-v3": lambda _: apply(recv, blob3, workers=workers),
             "fast-v4": lambda _: apply(recv, blob4, workers=workers),
             "fast-v5": lambda _: apply(recv, blob5, workers=workers),
             "follower": follower,
             # format 5's follower: its state digest moved by the changes under definition 2
             "follower-v5": lambda _: follower(_, blob5, d_base2, d_target2, 2),
             "unverified": lambda _: apply(recv, blob, workers=workers, verify=False)}
    for name, fn in paths.items():
        s = _median(fn, reps, setup=fresh)
        if not torch.equal(recv["shard"].view(torch.int16), nb):
            raise AssertionError(f"apply ({name}) is not bit-exact")
        rows.append(_row("apply", name, s, memcpy))
    for fn in DEVICE_PATHS:
        rows.extend(fn(base, target, rate, workers, reps))
    changed = int((ob != nb).sum())
    for r in rows:
        r.update(change_rate=changed / n, delta_bytes_per_changed=len(blob) / changed)
    return rows


def tensor_digest_rows(base: torch.Tensor, workers: int, reps: int, memcpy: Memcpy | float) -> list:
    """The whole-tensor digest per algorithm (BLAKE3 on 1 and 2 threads), and the chunk values
    digests over the whole shard as a keyframe's overwrite chunks make them (one per chunk, on
    ``workers`` threads), per format version's algorithm."""
    rows = []
    for path, algo, threads in (("sha256", "sha256", 1), ("blake3-1t", "blake3", 1), ("blake3-2t", "blake3", 2)):
        def whole(algo=algo, threads=threads):
            RunningDigest(base, algo, threads).hexdigest()
        rows.append(_row("tensor_digest", path, _median(whole, reps), memcpy))
    bits, n = base.view(torch.int16), base.numel()
    ranges = [(s, min(s + DEFAULT_CHUNK, n)) for s in range(0, n, DEFAULT_CHUNK)]
    for algo in ("blake2b", "blake3"):
        def chunks(algo=algo):
            for _ in ordered_map(lambda r: values_digest(bits[r[0]:r[1]], algo), ranges, workers):
                pass
        rows.append(_row("values_digest", algo, _median(chunks, reps), memcpy))
    return rows


def digest_rows(base: torch.Tensor, workers: int, reps: int, memcpy: Memcpy | float) -> list:
    n = base.numel()
    part = base[:min(n, _REF_DIGEST_MAX)]
    lib = native.lib
    try:
        native.lib = lambda: None  # the torch reference (the digest before the C kernel)
        t_ref = _median(lambda: statedigest.tensor_contrib("shard", part), max(1, reps // 2)) * n / part.numel()
    finally:
        native.lib = lib
    rows = [_row("state_digest", "reference", t_ref, memcpy, scaled_from=part.numel())]
    if native.lib() is not None:
        rows.append(_row("state_digest", "fast", _median(
            lambda: statedigest.tensor_contrib("shard", base, workers=workers), reps), memcpy))
        rows.append(_row("state_digest", "fast-def2", _median(
            lambda: statedigest.tensor_contrib("shard", base, workers=workers, definition=2), reps), memcpy))
    return rows + digest_build_rows(base, reps, memcpy)


#: the widths the state digest's kernels take, each a dtype a model holds: the written-out
#: kernel's 1-, 2- and 4-byte elements and the compiler's loop's 8-byte ones
DIGEST_DTYPES = (torch.uint8, torch.bfloat16, torch.float32, torch.float64)
#: ``dcr_sd_build``'s answers
SD_BUILDS = {0: "plain", 1: "avx2", 2: "avx512"}


def digest_build_rows(base: torch.Tensor, reps: int, memcpy: Memcpy | float) -> list:
    """The state digest on one thread of the shard's bytes read as each of ``DIGEST_DTYPES``
    (the same bytes, so the memcpy is their unit too), in every build of the kernel this CPU
    runs: ``dcr_set_simd`` 1 (the best it has), 2 (AVX2 at most), 0 (plain), each build once
    (``dcr_sd_build`` names it), under both definitions of the weights (the second's builds:
    ``dcr_sdb_build``). Rows ``state_digest_1t``, path ``<dtype> <build>`` (``... def2``), with ns
    per element: where each build stands on this core against the others (docs/results.md, "Format
    version 4, seventh turn" on an Intel core, "eighth turn" on an AMD one)."""
    lib = native.lib()
    if lib is None:
        return []
    rows, seen = [], set()
    try:
        for setting in (1, 2, 0):
            lib.dcr_set_simd(setting)
            for definition, build, suffix in ((1, lib.dcr_sd_build(), ""), (2, lib.dcr_sdb_build(), " def2")):
                if (definition, build) in seen:
                    continue
                seen.add((definition, build))
                for dtype in DIGEST_DTYPES:
                    t = base.view(dtype)
                    secs = _median(lambda t=t, d=definition: statedigest.tensor_contrib("shard", t, workers=1,
                                                                                        definition=d), reps)
                    rows.append(_row("state_digest_1t", f"{dtype_name(dtype)} {SD_BUILDS.get(build, build)}{suffix}",
                                     secs, memcpy, ns_per_element=1e9 * secs / t.numel()))
    finally:
        lib.dcr_set_simd(1)
    return rows


def _raw_write(path: str, data, writeback: bool = False) -> None:
    """Write the raw bytes and fsync them: the baseline a keyframe publish is held to. With
    ``writeback``, written in pieces with the writeback of each asked for as the store's writer
    does (util/writeback.py): what the same technique gives a raw write, shown beside it."""
    mv = memoryview(data).cast("B")
    with open(path, "wb", buffering=0) as f:
        if writeback:
            wb = Writeback(f.fileno())
            for i in range(0, mv.nbytes, KICK_EVERY):
                wb.wrote(f.write(mv[i:i + KICK_EVERY]))
        else:
            f.write(mv)
        os.fsync(f.fileno())
    os.unlink(path)


def keyframe_rows(base: torch.Tensor, workers: int, reps: int, memcpy: Memcpy | float, tmp: str) -> list:
    state = {"shard": base}
    raw = base.view(torch.uint8).numpy().data
    k = [0]

    def publish(fv: int = 2, checksum: str | None = None):
        k[0] += 1
        Publisher(LocalStore(os.path.join(tmp, f"s{k[0]}")), workers=workers, format_version=fv,
                  object_checksum=checksum).publish(state, keyframe=True)

    def clear():
        # untimed: the stores written so far go, as the raw write's file does, so that no row
        # pays for the page cache's writeback of the rows before it (the last rows ran 1.5x slower)
        for name in os.listdir(tmp):
            if name.startswith("s"):
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)

    t_raw = _median(lambda: _raw_write(os.path.join(tmp, "raw.bin"), raw), reps)
    rows = [_row("keyframe", "raw_write", t_raw, memcpy),
            _row("keyframe", "raw_write_writeback", _median(
                lambda: _raw_write(os.path.join(tmp, "raw.bin"), raw, writeback=True), reps), memcpy)]
    lib = native.lib
    try:
        native.lib = lambda: None
        rows.append(_row("keyframe", "reference", _median(lambda _: publish(), max(1, reps // 2), clear), memcpy))
    finally:
        native.lib = lib
    rows.append(_row("keyframe", "fast", _median(lambda _: publish(), reps, clear), memcpy))
    rows.append(_row("keyframe", "fast-v1", _median(lambda _: publish(1), reps, clear), memcpy))
    rows.append(_row("keyframe", "fast-v3", _median(lambda _: publish(3), reps, clear), memcpy))
    rows.append(_row("keyframe", "fast-v4", _median(lambda _: publish(4), reps, clear), memcpy))
    rows.append(_row("keyframe", "fast-v5", _median(lambda _: publish(5), reps, clear), memcpy))
    # the same with the snapshot copied whole before the encode (the path before the encode
    # filled it, diff(copy_into=...)), alternated with ``fast-v5`` rep by rep: their difference
    # is that change alone
    first, copied = [], []

    def alternate():  # (each timed publish after clear() and a collection, as _median's)
        clear()
        gc.collect()
        t = time.perf_counter()
        publish(5)
        first.append(time.perf_counter() - t)
        clear()
        gc.collect()
        real = Publisher.__dict__["_keyframe_source"]  # (the staticmethod itself, put back as it was)
        Publisher._keyframe_source = staticmethod(lambda tensors: None)  # type: ignore[method-assign]
        try:
            t = time.perf_counter()
            publish(5)
            copied.append(time.perf_counter() - t)
        finally:
            Publisher._keyframe_source = real  # type: ignore[method-assign]

    for _ in range(max(3 * reps, 9)):  # (a 4-8 % difference: three pairs did not resolve it)
        alternate()
    rows.append(_row("keyframe", "fast-v5-alternated", statistics.median(first), memcpy))
    rows.append(_row("keyframe", "fast-v5-copy-first", statistics.median(copied), memcpy))
    rows.append(_row("keyframe", "fast-v3-sha256", _median(lambda _: publish(3, "sha256"), reps, clear), memcpy))
    target = {"shard": make_target(base, 0.01)}

    def published():  # untimed: a publisher with its first version out, the next one's step taken
        clear()
        k[0] += 1
        p = Publisher(LocalStore(os.path.join(tmp, f"s{k[0]}")), workers=workers, format_version=5)
        p.publish(state)
        return p

    # a keyframe every few versions (``keyframe_every``): the publisher's next version, its delta
    # part and its keyframe part, the tensor digests known from the delta
    rows.append(_row("keyframe", "fast-v5-next", _median(
        lambda p: p.publish(target, keyframe=True), reps, published), memcpy))
    for fv, checksum, name in ((4, "blake3", "v4"), (4, "sha256", "v4-sha256"), (5, "blake3", "v5")):
        rows.append(_row("keyframe_sync", name,
                         keyframe_sync(state, checksum, workers, reps, os.path.join(tmp, f"sync-{name}"), fv), memcpy))
    for r in rows:
        r["x_raw_write"] = r["seconds"] / t_raw
    return rows


def keyframe_sync(state: dict, checksum: str, workers: int, reps: int, root: str, fv: int = 4) -> float:
    """A follower's first sync (a keyframe) from a local store, into fresh tensors, checked bit
    for bit: the receiver's side of a keyframe; the store's parts checked with ``checksum``, in
    delta format ``fv``."""
    Publisher(LocalStore(root), workers=workers, object_checksum=checksum, format_version=fv).publish(
        state, keyframe=True)

    def fresh():  # untimed: the receiver's memory, faulted in before the sync
        return {k: torch.zeros_like(v) for k, v in state.items()}

    def sync(recv):
        Follower(LocalStore(root), recv, workers=workers).sync()
        for k, v in state.items():
            if not torch.equal(recv[k].view(torch.int16), v.view(torch.int16)):
                raise AssertionError(f"keyframe sync ({checksum}): {k} differs")

    t = _median(sync, reps, fresh)
    shutil.rmtree(root, ignore_errors=True)
    return t


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "?"


def run(elems: int, changes=(0.01, 0.05), reps: int = 3, workers: int = 2, quick: bool = False,
        ulps: float | None = None) -> dict:
    t0 = time.perf_counter()
    base = make_shard(elems)
    memcpy = Memcpy(base)
    memcpy(max(5, reps * 3))
    out = {"config": {"elements": elems, "bytes": 2 * elems, "dtype": "bfloat16", "changes": list(changes),
                      "reps": reps, "workers": workers, "quick": quick, "chunk_elems": DEFAULT_CHUNK,
                      "ulps": ulps},
           "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "torch": torch.__version__, "backend": native.backend(), "load_before": _load()},
           "memcpy_seconds": None, "rows": []}
    for rate in changes:
        target = make_target(base, rate) if ulps is None else make_wide_target(base, rate, ulps)
        for r in encode_apply(base, target, rate, workers, reps, memcpy):
            out["rows"].append({"change": rate, **r})
        del target
    for r in tensor_digest_rows(base, workers, reps, memcpy) + digest_rows(base, workers, reps, memcpy):
        out["rows"].append({"change": None, **r})
    with tempfile.TemporaryDirectory(prefix="dcr-bench-kernels-") as tmp:
        for r in keyframe_rows(base, workers, reps, memcpy, tmp):
            out["rows"].append({"change": None, **r})
    unit = out["memcpy_seconds"] = memcpy.unit()
    out["memcpy_samples"] = memcpy.samples
    for r in out["rows"]:
        r["x_memcpy"] = r["seconds"] / unit
    out["machine"]["load_after"] = _load()
    out["seconds_total"] = time.perf_counter() - t0
    return out


def format_table(r: dict) -> str:
    c = r["config"]
    lines = [f"shard: {c['elements'] / 1e6:.1f}M BF16 elements ({c['bytes'] / 1e6:.0f} MB), {c['workers']} workers, "
             f"memcpy {1e3 * r['memcpy_seconds']:.1f} ms "
             f"({c['bytes'] / r['memcpy_seconds'] / 1e9:.2f} GB/s, 1 thread); "
             f"load {r['machine']['load_before']} -> {r['machine']['load_after']}"
             + (f"; changes of {c['ulps']:g} 2^-8 z of the value (--ulps)" if c.get("ulps") else ""),
             "", "| change | side | path | device | ms | memcpy ms | x memcpy |", "|---|---|---|---|---:|---:|---:|"]
    for row in r["rows"]:
        ch = "" if row["change"] is None else f"{100 * row['change']:g} %"
        extra = f" ({row['x_raw_write']:.2f}x raw write)" if "x_raw_write" in row else \
            f" ({row['ns_per_element']:.2f} ns an element)" if "ns_per_element" in row else ""
        lines.append(f"| {ch} | {row['side']} | {row['path']} | {row['device']} | {1e3 * row['seconds']:.1f} | "
                     f"{1e3 * row['memcpy_seconds']:.1f} | {row['x_memcpy']:.2f}x{extra} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elems", type=int, default=1 << 26, help="shard size in BF16 elements (default 64M)")
    ap.add_argument("--changes", type=float, nargs="+", default=[0.01, 0.05])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4M elements, 1 repetition")
    ap.add_argument("--ulps", type=float, default=None,
                    help="move the changed elements by K 2^-8 z of their value, K |z| / 2 to K |z| ulps "
                         "(default: an optimizer-like step)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    elems, reps = (1 << 22, 1) if a.quick else (a.elems, a.reps)
    r = run(elems, tuple(a.changes), reps, a.workers, a.quick, a.ulps)
    print(json.dumps(r, indent=1) if a.json else format_table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
