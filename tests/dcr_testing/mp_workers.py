"""Worker processes for tests/test_publish_multirank.py (importable, so a fork server or ``spawn`` can
start them).

Every process computes the same deterministic *global* state for a version and keeps only its
own shard of it, so publishers and receivers agree on what every version holds without
exchanging tensors. Each worker writes ``<out>/<rank>.json`` (what it saw, or the error it got);
the test process reads those and checks the store itself.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import traceback

import torch

from dcr_testing import bits as int_bits

# trainer: TP=4; W0 sharded on dim 0, W1 on dim 1, bias replicated (published by rank 0 only)
# receivers: TP=2 on dim 1 for both weights, bias held (and counted) by rank 0 only
SHAPES = {"W0": ((32, 24), torch.bfloat16), "W1": ((24, 32), torch.float32), "bias": ((24,), torch.float32)}
CHUNK = 64  # small chunks: several per shard, so chunk and shard boundaries cross
TIMEOUT = datetime.timedelta(seconds=20)  # collectives fail after this instead of hanging


# ----------------------------------------------------------------------------- state

def global_state(version: int) -> dict:
    """The whole model at ``version``: a random start, then one sparse update per version."""
    g = torch.Generator().manual_seed(1234)
    st = {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in SHAPES.items()}
    for v in range(1, version + 1):
        u = torch.Generator().manual_seed(5000 + v)
        for n in ("W0", "W1"):
            bits = int_bits(st[n])
            bits[torch.rand(bits.shape, generator=u) < 0.05] ^= 0x11  # low mantissa bits
        st["bias"][(7 * v) % 24] += 0.25 * v
    return st


def _split(shape, dim, parts, i):
    from nemo_dcr.state.index_map import ShardSpec
    n = shape[dim] // parts
    offsets = [0] * len(shape)
    local = list(shape)
    offsets[dim], local[dim] = i * n, n
    return ShardSpec.of(shape, offsets, local)


def trainer_layout(rank: int, tp: int = 4) -> dict:
    layout = {"W0": _split(SHAPES["W0"][0], 0, tp, rank), "W1": _split(SHAPES["W1"][0], 1, tp, rank)}
    if rank == 0:
        from nemo_dcr.state.index_map import ShardSpec
        layout["bias"] = ShardSpec.full(SHAPES["bias"][0])
    return layout


def receiver_layout(rank: int, tp: int = 2) -> dict:
    layout = {"W0": _split(SHAPES["W0"][0], 1, tp, rank), "W1": _split(SHAPES["W1"][0], 1, tp, rank)}
    if rank == 0:
        from nemo_dcr.state.index_map import ShardSpec
        layout["bias"] = ShardSpec.full(SHAPES["bias"][0])
    return layout


def local_state(version: int, layout: dict) -> dict:
    st = global_state(version)
    out = {}
    for n, spec in layout.items():
        sl = tuple(slice(o, o + s) for o, s in zip(spec.offsets, spec.shape))
        out[n] = st[n][sl].clone()
    return out


def mismatches(tensors: dict, expected: dict) -> list:
    bad = sorted(set(tensors) ^ set(expected))
    for n in sorted(set(tensors) & set(expected)):
        a, b = tensors[n], expected[n]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(int_bits(a), int_bits(b)):
            bad.append(n)
    return bad


# ----------------------------------------------------------------------------- stores

def open_spec(spec: dict):
    if spec["kind"] == "local":
        from nemo_dcr.stores import LocalStore
        return LocalStore(spec["root"])
    # the moto server's dummy credentials; the fork server's environment may predate them
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "NEMO_DCR_S3_ENDPOINT"):
        os.environ.pop(k, None)
    os.environ.update(spec.get("env", {}))
    from nemo_dcr.stores import S3Store
    return S3Store(spec["bucket"], spec["prefix"], endpoint_url=spec["endpoint"], max_attempts=2, retries=3,
                   backoff_base=0.01, backoff_max=0.1)


class FaultyStore:
    """The real store, except while ``armed``: the first ``put`` of a key containing ``match``
    fails (``die``: writes the first half of the object and kills the process, no exception, no
    cleanup, sockets closed by the OS; ``raise``: raises OSError), and with ``get_fails`` every
    ``get`` of a key containing ``match`` fails as a lost connection would."""

    def __init__(self, inner, match: str, action: str = "raise"):
        self.inner, self.match, self.action, self.armed, self.get_fails = inner, match, action, False, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key):
        if self.get_fails and self.match in key:
            from nemo_dcr.stores import StoreError
            raise StoreError(f"injected download failure for {key}")
        return self.inner.get(key)

    def put(self, key, data):
        if self.armed and self.match in key:
            self.armed = False
            if self.action == "die":
                self.inner.put(key, data[: len(data) // 2])
                os._exit(17)
            raise OSError(f"injected upload failure for {key}")
        return self.inner.put(key, data)


# ----------------------------------------------------------------------------- scenarios

def _joint_publish_and_follow(rank, world, spec, res, formats=(4, 4, 4)):
    """Ranks 0-3 publish (trainer group), ranks 4-5 follow (receiver group), in lock step; version
    v in delta format ``formats[v]``, a new trainer group (restored from the store) where it
    changes, as a restarted trainer would be."""
    import torch.distributed as dist

    from nemo_dcr.sync.follower import Follower
    from nemo_dcr.sync.publisher import Publisher

    trainers, receivers = dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5])
    store = open_spec(spec)
    res["versions"], res["steps"] = [], []
    if rank < 4:
        layout = trainer_layout(rank)
        # the receivers shard W0 on another dim than the trainers: they hold part of every sent
        # chunk, which 'classes' chunks cannot be decoded from (docs/user-guide.md)
        pub = Publisher(store, group=trainers, chunk_elems=CHUNK, encoding="portable", format_version=formats[0])
    else:
        layout = receiver_layout(rank - 4)
        recv = {n: torch.zeros(s.shape, dtype=SHAPES[n][1]) for n, s in layout.items()}
        f = Follower(store, recv, layout, group=receivers)
    for v, fv in enumerate(formats):
        if rank < 4:
            if fv != pub.format_version:
                pub = Publisher(store, group=trainers, chunk_elems=CHUNK, encoding="portable", format_version=fv)
            r = pub.publish(local_state(v, layout), layout, step=10 * v)
            res["versions"].append(r.version)
        dist.barrier()  # version v is committed
        if rank >= 4:
            s = f.sync()
            res["versions"].append(f.version)
            res["steps"].append([list(x) for x in s.steps])
            bad = mismatches(recv, local_state(v, layout))
            if bad:
                raise AssertionError(f"version {v}: receiver rank {rank - 4} differs in {bad}")
        dist.barrier()
    if rank >= 4:
        f.check()  # the whole state's digest, all-reduced over the receiver group
        res["held"] = sorted(recv)


def _die_mid_upload(rank, world, spec, res):
    from nemo_dcr.sync.publisher import Publisher

    store = FaultyStore(open_spec(spec), f"/part-{rank:05d}.dcr", "die") if rank == 1 else open_spec(spec)
    layout = trainer_layout(rank)
    pub = Publisher(store, chunk_elems=CHUNK)
    res["versions"] = [pub.publish(local_state(v, layout), layout).version for v in range(2)]
    if rank == 1:
        store.armed = True
    t0 = time.monotonic()
    res["group_broken"] = True
    try:
        pub.publish(local_state(2, layout), layout)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    else:
        res["error"] = None
    res["seconds_to_error"] = time.monotonic() - t0


def _fresh_group_publishes(rank, world, spec, res):
    from nemo_dcr.sync.publisher import Publisher

    layout = trainer_layout(rank)
    pub = Publisher(open_spec(spec), chunk_elems=CHUNK, retain=0)  # a restarted trainer: no base in memory
    r = pub.publish(local_state(2, layout), layout)
    res["versions"] = [r.version]
    res["kinds"] = [bool(r.manifest.parts), bool(r.manifest.keyframe_parts)]
    res["held"] = sorted(pub.published[0])


def _raise_mid_upload(rank, world, spec, res):
    from nemo_dcr.sync.publisher import Publisher, PublishError
    from nemo_dcr.sync.versions import read_head

    store = FaultyStore(open_spec(spec), f"/part-{rank:05d}.dcr", "raise") if rank == 2 else open_spec(spec)
    layout = trainer_layout(rank)
    pub = Publisher(store, chunk_elems=CHUNK)
    res["versions"] = [pub.publish(local_state(0, layout), layout).version]
    if rank == 2:
        store.armed = True
    try:
        pub.publish(local_state(1, layout), layout)
    except PublishError as e:
        res["error"] = str(e)
    else:
        res["error"] = None
    res["head_after_failure"] = read_head(store)[0].version
    res["versions"].append(pub.publish(local_state(1, layout), layout).version)  # the same group retries


def _restore_download_fails(rank, world, spec, res):
    """A restarted trainer rebuilds its base from the store over the group; one rank cannot
    download: every rank must fail the publish promptly, not wait in a collective for it."""
    from nemo_dcr.sync.publisher import Publisher, PublishError
    from nemo_dcr.sync.versions import read_head

    store = FaultyStore(open_spec(spec), ".dcr") if rank == 2 else open_spec(spec)
    layout = trainer_layout(rank)
    pub = Publisher(store, chunk_elems=CHUNK)
    res["versions"] = [pub.publish(local_state(v, layout), layout).version for v in range(2)]
    pub = Publisher(store, chunk_elems=CHUNK)  # the restart: nothing in memory
    if rank == 2:
        store.get_fails = True
    t0 = time.monotonic()
    try:
        pub.publish(local_state(2, layout), layout)
    except PublishError as e:
        res["error"] = str(e)
    else:
        res["error"] = None
    res["seconds_to_error"] = time.monotonic() - t0
    res["head_after_failure"] = read_head(store)[0].version
    if rank == 2:
        store.get_fails = False
    res["versions"].append(pub.publish(local_state(2, layout), layout).version)


def _gather_follow(rank, world, spec, res):
    from dcr_testing.gather_workers import follow
    follow(rank, world, spec, res)


def _gather_follow_located(rank, world, spec, res):
    from dcr_testing.gather_workers import follow_located
    follow_located(rank, world, spec, res)


def _gather_follow_widths(rank, world, spec, res):
    from dcr_testing.gather_workers import follow_widths
    follow_widths(rank, world, spec, res)


def _gather_follow_overlapping(rank, world, spec, res):
    from dcr_testing.gather_workers import follow_overlapping
    follow_overlapping(rank, world, spec, res)


def _gather_follow_one_width(rank, world, spec, res):
    from dcr_testing.gather_workers import follow_one_width
    follow_one_width(rank, world, spec, res)


def _gather_follow_device(rank, world, spec, res):
    from dcr_testing.gather_workers import follow_device
    follow_device(rank, world, spec, res)


SCENARIOS = {
    "gather": _gather_follow,
    "gather-located": _gather_follow_located,
    "gather-device": _gather_follow_device,
    "gather-overlapping": _gather_follow_overlapping,
    "gather-one-width": _gather_follow_one_width,
    "gather-widths": _gather_follow_widths,
    "restore": _restore_download_fails,
    "joint": _joint_publish_and_follow,
    "joint-4-to-5": lambda *a: _joint_publish_and_follow(*a, formats=(4, 4, 5, 5)),
    "die": _die_mid_upload,
    "fresh": _fresh_group_publishes,
    "raise": _raise_mid_upload,
}


def main(rank: int, world: int, port: int, spec: dict, scenario: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    res = {"rank": rank, "ok": False, "entered": time.time()}
    t0 = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=TIMEOUT)
        res["init_seconds"] = time.monotonic() - t0
        SCENARIOS[scenario](rank, world, spec, res)
        res["ok"] = True
        res["run_seconds"] = time.monotonic() - t0 - res["init_seconds"]
    except BaseException:
        res["traceback"] = traceback.format_exc()
    _write(out, rank, res)
    if res["ok"] and not res.get("group_broken"):
        dist.barrier()  # nobody leaves while a peer may still be reading from it
        dist.destroy_process_group()
    else:
        os._exit(0)  # a peer may be dead: tearing the group down could block


def _write(out: str, rank: int, res: dict) -> None:
    tmp = os.path.join(out, f"{rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(res, fh)
    os.replace(tmp, os.path.join(out, f"{rank}.json"))
