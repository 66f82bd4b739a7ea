"""A version published by a trainer's ranks, each its row shard of every tensor, and synced by a
follower that holds the tensors whole and by a TP=2 receiver group: the ranks' delta publish, the
follower's delta and keyframe sync and the group's delta sync for 1, 2, 4 and 8 ranks, each as a
multiple of the one-rank time, in one run.

    python bench/ranks.py             # 64M BF16 elements as 512 (256, 512) tensors, 1, 2, 4 and 8 ranks
    python bench/ranks.py --json      # the same as JSON
    python bench/ranks.py --quick     # 8M elements as 64 tensors, 1 and 4 ranks, one repetition
    python bench/ranks.py --trainer-cut columns   # each trainer rank holds its columns (tensor parallel)

A trainer sharded as FSDP shards (dim 0, one row shard per rank; ``--trainer-cut columns``: one
column block per rank, as a tensor-parallel trainer holds its row-parallel weights) publishes each
tensor as one entry per rank; a follower holding the tensors whole (a rollout engine without tensor parallelism)
applies them all. The changes are the same at every rank count; the bytes grow with it
(``delta bytes``: the second version's parts and manifest in the store), as each shard has its own
entry in the segment index, ~100 bytes. What a row shard costs beyond its bytes shows as the ratio
over 1.00 (docs/results.md, twenty-fourth turn: before a row shard held as one run was decoded in
place, 2 to 8 ranks' shards took a follower 11-20x one rank's whole tensors).

The model is ``bench/kernels.py``'s shard and its optimizer-like step (``--change``, 1 %), cut
into ``--tensors`` tensors of (256, elements / tensors / 256). For each rank count, on a fresh
local store: that many processes (``--publish-rank``, gloo on 127.0.0.1) each publish their row
shard of every tensor (a keyframe, then the step: ``delta publish`` is the slowest rank's second
publish), and in this process ``--reps`` fresh ``Follower``s holding the first version sync to the
second (``delta sync``, the median), and as many holding zeros (``keyframe sync``: the keyframe,
then the delta); each follower's tensors are compared with the target's bits. Then two
processes (``--follow-rank``, a TP=2 receiver group on gloo, as a vLLM engine's workers) each
holding its columns (``TP=2 columns``: a row-parallel layer) or its rows (``TP=2 rows``: a
column-parallel one) of every tensor sync the delta and the keyframe ``--reps`` times each (the
median of the slower rank's times): a rank holding part of a ``classes`` chunk decodes it with the
group's help (sync/chunk_gather.py), and a keyframe's chunks are copied into it run by run
(docs/results.md, twenty-fifth turn: the group's delta sync took 70-180x one follower's time
before chunks were mapped by runs).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from benchload import ratio_rows, ratio_table, script  # noqa: E402

CUTS = ("columns", "rows")  # how a TP receiver group holds each tensor
PATHS = ("delta publish", "delta sync", "keyframe sync",
         *(f"{sync} sync, TP=2 {cut}" for cut in CUTS for sync in ("delta", "keyframe")))
ROWS = 256  # each tensor's rows: every rank count divides them
TP = 2  # the receiver group's ranks (a vLLM engine at tensor parallelism 2)


def _kernels():
    """bench/kernels.py, for its shard, its step and its load reading."""
    return script("kernels")


def model(elems: int, tensors: int, rate: float) -> tuple[dict, dict]:
    """(base, target): ``tensors`` (ROWS, cols) BF16 tensors of the shard and its step."""
    k = _kernels()
    flat_base = k.make_shard(elems)
    flat_target = k.make_target(flat_base, rate)
    n = elems // tensors

    def cut(flat: torch.Tensor) -> dict:
        return {f"layers.{i:04d}.weight": flat[i * n:(i + 1) * n].clone().view(ROWS, n // ROWS) for i in range(tensors)}
    return cut(flat_base), cut(flat_target)


def publish_rank(rank: int, world: int, port: int, store: str, data: str, out: str, cut: str = "rows") -> None:
    """One rank (``--publish-rank``): its row (or column) shards of the first version, then of the second."""
    import torch.distributed as dist

    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.publisher import Publisher
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        d = torch.load(data, weights_only=True)
        specs = {n: shard_spec(tuple(t.shape), rank, world, cut) for n, t in d["base"].items()}
        live = {n: _cut(t, specs[n]) for n, t in d["base"].items()}
        pub = Publisher(LocalStore(store), signer=None, group=dist.group.WORLD)
        pub.publish(live, specs)
        for n, t in live.items():
            t.copy_(_cut(d["target"][n], specs[n]))
        t0 = time.perf_counter()
        pub.publish(live, specs)
        seconds = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "delta_publish_seconds": seconds}, f)


def shard_spec(shape: tuple, rank: int, world: int, cut: str):
    """A rank's shard of a (ROWS, cols) tensor: its columns (a receiver group rank's row-parallel
    layer of a TP engine; a tensor-parallel trainer rank's, ``--trainer-cut columns``: a run per
    row) or its rows (a column-parallel layer; an FSDP trainer rank's, the default)."""
    from nemo_dcr import ShardSpec
    rows, cols = shape
    if cut == "columns":
        return ShardSpec(tuple(shape), (0, rank * cols // world), (rows, cols // world))
    return ShardSpec(tuple(shape), (rank * rows // world, 0), (rows // world, cols))


def _cut(t: torch.Tensor, s) -> torch.Tensor:
    """The part of a (ROWS, cols) tensor that the shard ``s`` holds, as a tensor of its own."""
    return t[s.offsets[0]:s.offsets[0] + s.shape[0], s.offsets[1]:s.offsets[1] + s.shape[1]].clone()


def follow_rank(rank: int, world: int, port: int, store: str, data: str, out: str, cut: str, reps: int) -> None:
    """One rank of a receiver group (``--follow-rank``): ``reps`` fresh followers holding this
    rank's ``cut`` of the first version sync to the second (``delta``), and as many holding zeros
    (``keyframe``: the keyframe, then the delta), each checked against the target's bits; the group
    decodes the classes chunks its ranks hold in part together (sync/chunk_gather.py)."""
    import torch.distributed as dist

    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.follower import Follower
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        d = torch.load(data, weights_only=True)
        specs = {n: shard_spec(tuple(t.shape), rank, world, cut) for n, t in d["base"].items()}
        times: dict = {"delta": [], "keyframe": []}
        for sync in times:
            for _ in range(reps):
                held = {n: _cut(t, specs[n]) for n, t in d["base"].items()}
                if sync == "keyframe":
                    held = {n: torch.zeros_like(t) for n, t in held.items()}
                    f = Follower(LocalStore(store), held, specs, group=dist.group.WORLD)
                else:
                    f = Follower(LocalStore(store), held, specs, version=0, verify_initial=False,
                                 group=dist.group.WORLD)
                dist.barrier()
                t0 = time.perf_counter()
                r = f.sync()
                times[sync].append(time.perf_counter() - t0)
                if r.version != 1 or not all(torch.equal(held[n].view(torch.int16), _cut(d["target"][n], specs[n])
                                                          .view(torch.int16)) for n in held):
                    raise AssertionError(f"a receiver rank's {sync} sync did not end at the target's bits")
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "seconds": times}, f)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(world: int, tmp: str, tag: str, args: list) -> list:
    """``world`` processes of this script, rank ``r`` with ``args`` and ``--world``, ``--port``,
    ``--out``, on one gloo group -> each rank's JSON. Their output goes to files (a pipe read while
    they run could fill and hold them)."""
    port = _port()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = []
    for r in range(world):
        log = open(os.path.join(tmp, f"{tag}-{r}.log"), "w")
        cmd = [sys.executable, os.path.abspath(__file__), *args, str(r), "--world", str(world), "--port", str(port),
               "--out", os.path.join(tmp, f"{tag}-{r}.json")]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    failed = []
    for r, (p, log) in enumerate(procs):
        if p.wait(timeout=900) != 0:
            failed.append(r)
        log.close()
    if failed:
        with open(os.path.join(tmp, f"{tag}-{failed[0]}.log")) as f:
            raise RuntimeError(f"{tag}: rank {failed[0]} failed:\n{f.read()[-3000:]}")
    out = []
    for r in range(world):
        with open(os.path.join(tmp, f"{tag}-{r}.json")) as f:
            out.append(json.load(f))
    return out


def publish(world: int, store: str, data: str, tmp: str, cut: str = "rows") -> float:
    """``world`` rank processes publish both versions -> the slowest rank's delta publish, s."""
    got = _ranks(world, tmp, f"rank-{world}", ["--store", store, "--data", data, "--cut", cut, "--publish-rank"])
    return max(g["delta_publish_seconds"] for g in got)


def follow_group(store: str, data: str, tmp: str, cut: str, reps: int) -> dict:
    """A receiver group of TP ranks, each holding its ``cut`` of every tensor, syncs the delta and
    the keyframe ``reps`` times each -> per path, the median over the syncs of the slowest rank's
    time, s."""
    got = _ranks(TP, tmp, f"follow-{cut}", ["--store", store, "--data", data, "--cut", cut, "--reps", str(reps),
                                            "--follow-rank"])
    return {f"{sync} sync, TP={TP} {cut}": statistics.median(max(g["seconds"][sync][i] for g in got)
                                                          for i in range(reps)) for sync in ("delta", "keyframe")}


def delta_bytes(store: str) -> int:
    """The bytes of the store's second version (version 1: the ranks' delta parts and its manifest)."""
    root = os.path.join(store, "versions", f"{1:012d}")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def follow(store: str, base: dict, target: dict, reps: int, keyframe: bool = False) -> float:
    """The median of ``reps`` fresh followers' delta syncs (``keyframe``: followers holding zeros,
    of the tensors' shapes, sync to the second version: the keyframe, then the delta), s; each
    ends at the target's bits."""
    from nemo_dcr.stores import LocalStore
    from nemo_dcr.sync.follower import Follower
    times = []
    for _ in range(reps):
        if keyframe:
            held = {n: torch.zeros_like(t) for n, t in base.items()}
            f = Follower(LocalStore(store), held)
        else:
            held = {n: t.clone() for n, t in base.items()}
            f = Follower(LocalStore(store), held, version=0, verify_initial=False)
        t0 = time.perf_counter()
        r = f.sync()
        times.append(time.perf_counter() - t0)
        if r.version != 1 or not all(torch.equal(held[n].view(torch.int16), target[n].view(torch.int16))
                                     for n in held):
            raise AssertionError("the follower did not end at the target's bits")
    return statistics.median(times)


def run(elems: int, tensors: int, counts: list, rate: float, reps: int, quick: bool = False,
        trainer: str = "rows") -> dict:
    t0 = time.perf_counter()
    k = _kernels()
    out = {"config": {"elements": elems, "bytes": 2 * elems, "tensors": tensors, "ranks": counts, "dtype": "bfloat16",
                      "change": rate, "reps": reps, "quick": quick, "trainer_cut": trainer},
           "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "torch": torch.__version__, "load_before": k._load()}, "rows": []}
    base, target = model(elems, tensors, rate)
    cells: dict = {}
    sizes: dict = {}  # ranks -> the second version's bytes in the store (its parts and manifest)
    with tempfile.TemporaryDirectory(prefix="dcr-bench-ranks-") as tmp:
        data = os.path.join(tmp, "model.pt")
        torch.save({"base": base, "target": target}, data)
        for world in counts:
            store = os.path.join(tmp, f"store-{world}")
            cells[world] = {"delta publish": publish(world, store, data, tmp, trainer),
                            "delta sync": follow(store, base, target, reps),
                            "keyframe sync": follow(store, base, target, reps, keyframe=True),
                            **{k: v for cut in CUTS for k, v in follow_group(store, data, tmp, cut, reps).items()}}
            sizes[world] = delta_bytes(store)
    out["rows"] = ratio_rows(cells, counts, PATHS, "ranks", entries=lambda n: n * tensors,
                             delta_bytes=sizes.__getitem__)
    out["machine"]["load_after"] = k._load()
    out["seconds_total"] = time.perf_counter() - t0
    return out


def format_table(r: dict) -> str:
    c = r["config"]
    counts = c["ranks"]
    by_n = {row["ranks"]: row["delta_bytes"] for row in r["rows"]}
    lines = [f"model: {c['elements'] / 1e6:.0f}M BF16 elements ({c['bytes'] / 1e6:.0f} MB) as {c['tensors']} tensors, "
             f"{100 * c['change']:g} % changed, published as 1 {c.get('trainer_cut', 'rows')[:-1]} shard per rank "
             f"of each; local store; follower "
             f"holds the tensors whole; medians of {c['reps']}; load {r['machine']['load_before']} -> "
             f"{r['machine']['load_after']}",
             "delta bytes: " + ", ".join(f"{n} rank{'s' if n > 1 else ''} {by_n[n] / 1e3:.0f} KB" for n in counts), ""]
    return "\n".join(lines + ratio_table(r["rows"], "ranks", counts, PATHS,
                                         lambda n: f"{n} rank{'s' if n > 1 else ''}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elems", type=int, default=64 << 20, help="BF16 elements in all (default 64M)")
    ap.add_argument("--tensors", type=int, default=512, help="tensors of (256, cols) to cut them into")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="rank counts (each divides 256; the first is the unit of the ratios)")
    ap.add_argument("--change", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8M elements as 64 tensors, 1 and 4 ranks, 1 repetition")
    ap.add_argument("--trainer-cut", choices=CUTS, default="rows",
                    help="how each trainer rank holds every tensor: its rows (FSDP, the default) or its columns "
                         "(a tensor-parallel trainer's row-parallel weights)")
    ap.add_argument("--json", action="store_true")
    for hidden in ("--publish-rank", "--follow-rank", "--world", "--port"):
        ap.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    for hidden in ("--store", "--data", "--out", "--cut"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.publish_rank is not None:
        publish_rank(a.publish_rank, a.world, a.port, a.store, a.data, a.out, a.cut or "rows")
        return 0
    if a.follow_rank is not None:
        follow_rank(a.follow_rank, a.world, a.port, a.store, a.data, a.out, a.cut, a.reps)
        return 0
    elems, tensors, counts, reps = (8 << 20, 64, [1, 4], 1) if a.quick else (a.elems, a.tensors, a.ranks, a.reps)
    cols = elems // (tensors * ROWS)
    if elems % (tensors * ROWS) or any(ROWS % n or cols % n for n in counts):
        ap.error(f"--elems {elems} must cut into {tensors} tensors of {ROWS} rows, and each rank count divide {ROWS} "
                 f"and the {cols} columns")
    r = run(elems, tensors, counts, a.change, reps, a.quick, a.trainer_cut)
    print(json.dumps(r, indent=1) if a.json else format_table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
