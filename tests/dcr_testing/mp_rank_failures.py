"""Worker processes for test_rank_failures.py (importable, so the fork server can start them).

Each rank runs every scenario in turn in one gloo group and records, per scenario, the error it
saw: its class, message, the failed ranks it names, and its ``__cause__``'s class. The test then
checks that every rank saw the same typed error."""
from __future__ import annotations

import os
import traceback

import torch

from dcr_testing import mp_workers as W


def _seen(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e),
            "ranks": sorted(int(r) for r in getattr(e, "rank_failures", {}) or {}),
            "failure_types": {str(r): f[1] for r, f in (getattr(e, "rank_failures", {}) or {}).items()},
            "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None}


def _record(res, name, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        res[name] = _seen(e)
    else:
        res[name] = None


def _run_typed(rank, res):
    from nemo_dcr.errors import CorruptObjectError
    from nemo_dcr.sync.group import Group

    g = Group()

    def step():
        if rank == 2:
            raise CorruptObjectError("object versions/x/part-00002.dcr is corrupt (injected)")
        return rank * 10

    _record(res, "typed", lambda: g.run(step, "download version 7"))

    def mixed():
        if rank == 1:
            raise OSError("disk full (injected)")
        if rank == 2:
            raise ValueError("bad value (injected)")

    _record(res, "mixed", lambda: g.run(mixed, "write the shards"))
    res["gathered"] = g.run(lambda: rank * 10, "gather", gather=True)
    res["from_src"] = g.run(lambda: f"rank {rank}" if rank == 1 else None, "from rank 1", src=1)

    def nested():  # a nested run's verdict keeps naming the rank that failed first
        g.run(step, "inner step")

    _record(res, "nested", lambda: g.run(nested, "outer step"))


def _follower_download_fails(rank, spec, res):
    """Every rank of a receiver group downloads every part; rank 1 cannot (all retries fail)."""
    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.publisher import Publisher

    store = W.open_spec(spec)
    layout = W.trainer_layout(rank)
    Publisher(store, chunk_elems=W.CHUNK).publish(W.local_state(0, layout), layout)  # jointly, every rank
    if rank == 1:
        store = W.FaultyStore(store, ".dcr")
        store.get_fails = True
    # rank 0 holds the whole state, the others nothing: the download fails before any apply
    recv = {n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in W.SHAPES.items()} if rank == 0 else {}
    f = Follower(store, recv, retries=0, backoff=0.0)
    _record(res, "follower", f.sync)
    res["follower_version"] = f.version


def _publisher_upload_fails(rank, spec, res):
    from nemo_dcr.sync.publisher import Publisher

    spec = dict(spec, root=spec["root"] + "-publish")
    store = W.FaultyStore(W.open_spec(spec), f"/part-{rank:05d}.dcr", "raise") if rank == 1 else W.open_spec(spec)
    layout = W.trainer_layout(rank)
    pub = Publisher(store, chunk_elems=W.CHUNK)
    pub.publish(W.local_state(1, layout), layout)
    if rank == 1:
        store.armed = True
    _record(res, "publish", lambda: pub.publish(W.local_state(2, layout), layout))


def main(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    res = {"rank": rank, "ok": False}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=W.TIMEOUT)
        _run_typed(rank, res)
        _follower_download_fails(rank, spec, res)
        _publisher_upload_fails(rank, spec, res)
        res["ok"] = True
    except BaseException:
        res["traceback"] = traceback.format_exc()
    W._write(out, rank, res)
    if res["ok"]:
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(0)
