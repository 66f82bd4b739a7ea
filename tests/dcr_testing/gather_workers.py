"""Receiver ranks for tests/test_classes_gather.py: a ``RolloutLoader`` group over gloo whose ranks
hold the published tensors sharded differently from the trainer (which publishes them whole), so
every ``classes`` chunk of a sharded tensor is held by several ranks (nemo_dcr/sync/chunk_gather.py).

Every process computes the same deterministic global state for a version and keeps only its own
shard of it. The trainer (the test process) publishes versions 0..2 before the ranks start."""
from __future__ import annotations

import importlib

import torch

from dcr_testing import bits as int_bits

WORLD = 3
CHUNK = 64  # small chunks: several per tensor, crossing the receivers' shard boundaries
# name -> (global shape, dtype, split dim, boundaries of the ranks' slices along that dim; None: whole)
LAYOUT = {
    # columns: every chunk of a row-major chunking crosses every rank
    "cols_bf16": ((24, 40), torch.bfloat16, 1, (0, 13, 27, 40)),
    # rows, boundaries 7 and 19 rows of 16 elements: not multiples of the 64-element chunks
    "rows_f32": ((30, 16), torch.float32, 0, (0, 7, 19, 30)),
    # two ranks only (rank 2 holds none of it), by columns
    "cols_f16": ((16, 20), torch.float16, 1, (0, 9, 20, 20)),
    "rows_fp8": ((20, 24), torch.float8_e4m3fn, 0, (0, 5, 11, 20)),
    "cols_e5m2": ((8, 30), torch.float8_e5m2, 1, (0, 10, 17, 30)),
    "norm": ((40,), torch.float32, None, None),  # whole on every rank (a replica: one rank applies it)
}
# bit patterns (unsigned, wrapped into the integer view) that must survive: NaN payloads (quiet and
# signalling, both signs), -0.0, subnormals, inf
SPECIAL = {
    torch.bfloat16: [0x7FC1, 0xFF81, 0x7F81, 0x8000, 0x0001, 0x807F, 0x7F80],
    torch.float16: [0x7E01, 0xFC01, 0x7C05, 0x8000, 0x0001, 0x83FF, 0xFC00],
    torch.float32: [0x7FC00001, 0xFFA00005, 0x7F800003, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000],
    torch.float8_e4m3fn: [0x7F, 0xFF, 0x80, 0x01, 0x87, 0x07],
    torch.float8_e5m2: [0x7D, 0xFE, 0x80, 0x01, 0x83, 0x7C],
}


def _patterns(dtype: torch.dtype, bits_dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(SPECIAL.get(dtype, []), dtype=torch.int64).to(bits_dtype)  # (wraps)


def global_state(version: int) -> dict:
    """The whole model at ``version``: random values with the special patterns mixed in, then
    sparse changes per version (low mantissa bits, and special patterns written and replaced)."""
    g = torch.Generator().manual_seed(77)
    st = {}
    for n, (shape, dtype, _, _) in LAYOUT.items():
        t = (torch.randn(shape, generator=g) * 0.5).to(dtype)
        b = int_bits(t).reshape(-1)
        pats = _patterns(dtype, b.dtype)
        if pats.numel():
            at = torch.randperm(b.numel(), generator=g)[: 4 * pats.numel()]
            b[at] = pats.repeat(4)
        st[n] = t
    for v in range(1, version + 1):
        u = torch.Generator().manual_seed(9000 + v)
        for t in st.values():
            b = int_bits(t).reshape(-1)
            flip = torch.rand(b.shape, generator=u) < 0.06
            b[flip] ^= 0x3
            pats = _patterns(t.dtype, b.dtype)
            if pats.numel():
                at = torch.randperm(b.numel(), generator=u)[: pats.numel()]
                b[at] = pats[torch.randperm(pats.numel(), generator=u)]
    return st


def shard_spec(name: str, rank: int):
    """This rank's ShardSpec of ``name`` (None: it holds none of it)."""
    from nemo_dcr.state.index_map import ShardSpec
    shape, _, dim, bounds = LAYOUT[name]
    if dim is None:
        return ShardSpec.full(shape)
    lo, hi = bounds[rank], bounds[rank + 1]
    if hi == lo:
        return None
    offsets, local = [0] * len(shape), list(shape)
    offsets[dim], local[dim] = lo, hi - lo
    return ShardSpec.of(shape, offsets, local)


def local_state(version: int, rank: int) -> tuple[dict, dict]:
    st = global_state(version)
    tensors, shards = {}, {}
    for n in LAYOUT:
        spec = shard_spec(n, rank)
        if spec is None:
            continue
        part = st[n][tuple(slice(o, o + s) for o, s in zip(spec.offsets, spec.shape))]
        if n == "cols_f16":  # held column-major, as a transposed weight is: not contiguous
            part = part.t().contiguous().t()
        tensors[n] = part.clone(memory_format=torch.preserve_format)
        shards[n] = spec
    return tensors, shards


def _bits_of(tensors: dict) -> dict:
    return {n: int_bits(t).clone() for n, t in tensors.items()}


def _differs(tensors: dict, expected: dict) -> list:
    return sorted(n for n in expected if not torch.equal(int_bits(tensors[n]), int_bits(expected[n])))


def _update_to(loader, tensors: dict, version: int, rank: int, res: dict) -> None:
    assert loader.update(version) == version
    res["versions"].append(loader.version)
    res["gathered"].append(loader.last_result.gathered)
    bad = _differs(tensors, local_state(version, rank)[0])
    if bad:
        raise AssertionError(f"version {version}: rank {rank} differs in {bad}")


def follow(rank, world, spec, res):
    """Start at version 0, follow to 1; then rank 1 scribbles on a position version 2 changes:
    every rank must refuse version 2 with the same error and write nothing; repaired, version 2."""
    import torch.distributed as dist

    from dcr_testing.mp_workers import open_spec
    from nemo_dcr.integrations.rollout import RolloutLoader

    group = dist.new_group(list(range(world)))
    tensors, shards = local_state(0, rank)
    loader = RolloutLoader(open_spec(spec), tensors, shards, group=group, version=0)
    res["versions"], res["gathered"] = [], []
    _update_to(loader, tensors, 1, rank, res)

    # a base that is not version 1 on one rank, where version 2 changes it
    if rank == 1:
        v1, v2 = global_state(1)["cols_bf16"], global_state(2)["cols_bf16"]
        sp = shard_spec("cols_bf16", 1)
        sl = tuple(slice(o, o + s) for o, s in zip(sp.offsets, sp.shape))
        changed = (int_bits(v1[sl]) != int_bits(v2[sl])).reshape(-1).nonzero()
        at = int(changed[len(changed) // 2])
        int_bits(tensors["cols_bf16"]).reshape(-1)[at] ^= 0x4000  # an exponent bit: another class too
    before = _bits_of(tensors)
    try:
        loader.update(2)
    except Exception as e:  # noqa: BLE001 - reported to the test
        res["error"] = f"{type(e).__name__}: {e}"
    else:
        res["error"] = None
    res["unchanged"] = all(torch.equal(before[n], int_bits(t)) for n, t in tensors.items())
    res["version_after_error"] = loader.version
    if rank == 1:
        int_bits(tensors["cols_bf16"]).reshape(-1)[at] ^= 0x4000
    _update_to(loader, tensors, 2, rank, res)
    loader.check()  # the whole state's digest, all-reduced over the group
    res["held"] = sorted(tensors)


def follow_located(rank, world, spec, res):
    """``follow`` as it runs for tensors on a GPU (a vLLM engine's TP workers, ``staging=False``):
    every chunk held whole is located against the bits where they are (``chunk.locate_chunk``,
    the streams decoded on the host without the base), in ``apply`` and in the group's decode
    alike; chosen here for CPU tensors, so that the test can read them. Counts the locates."""
    from nemo_dcr.codec import classes
    from nemo_dcr.sync import chunk_gather

    apply_mod = importlib.import_module("nemo_dcr.delta.apply")  # (nemo_dcr.delta.apply is also a function)
    apply_mod.on_host = chunk_gather.on_host = lambda t: False
    calls = {"locate": 0, "group_locate": 0}
    real_locate, real_chunk_locate = classes.locate, chunk_gather.locate_chunk

    def locate(*a):
        calls["locate"] += 1
        return real_locate(*a)

    def group_locate(*a):
        calls["group_locate"] += 1
        return real_chunk_locate(*a)

    classes.locate, chunk_gather.locate_chunk = locate, group_locate
    follow(rank, world, spec, res)
    res["located"] = calls


def follow_widths(rank, world, spec, res):
    """``follow`` with the class counts sent 4, 2 and 1 bytes wide in turn, chunk by chunk (every
    rank the same: each works out the same chunks in the same order), where the test's short runs
    would all go as 1 byte: the exchange's mixed widths and the 2- and 4-byte ones."""
    import itertools

    from nemo_dcr.sync import chunk_gather
    widths = itertools.cycle((4, 2, 1))
    chunk_gather._count_width = lambda longest: next(widths)
    follow(rank, world, spec, res)


# cols_bf16's columns held overlapping (not a replica): positions two or three ranks hold are
# answered for by the lowest; the others find them through the index maps
OVERLAP = {0: (0, 25), 1: (10, 30), 2: (5, 25)}  # rank -> (first column, columns)


def follow_overlapping(rank, world, spec, res):
    """Versions 1 and 2 decoded by the group (``decode_partial``) and applied by each rank to its
    columns of ``cols_bf16``, which overlap the others': no rank's bits may differ from the target
    (the follower's state digest, summed over the ranks, counts such positions twice; the rollout
    loader hides only exact replicas from it, so this runs the decode and apply themselves)."""
    _follow_columns(rank, world, spec, res, OVERLAP)


# cols_bf16's columns split between the ranks (disjoint), alone: every chunk the group decodes is
# of one element width, as in a model of one dtype (chunk_gather's single-width paths)
DISJOINT = {0: (0, 13), 1: (13, 14), 2: (27, 13)}


def follow_one_width(rank, world, spec, res):
    """``follow_overlapping``'s decode and apply, on disjoint columns of ``cols_bf16`` alone."""
    _follow_columns(rank, world, spec, res, DISJOINT)


def _follow_columns(rank, world, spec, res, columns):
    import torch.distributed as dist

    from dcr_testing.mp_workers import open_spec
    from nemo_dcr.delta import apply
    from nemo_dcr.state.index_map import ShardSpec
    from nemo_dcr.sync.chunk_gather import decode_partial
    from nemo_dcr.sync.group import Group
    from nemo_dcr.sync.versions import manifest_at

    group = Group(dist.new_group(list(range(world))))
    lo, n = columns[rank]
    shards = {"cols_bf16": ShardSpec.of((24, 40), (0, lo), (24, n))}
    tensors = {"cols_bf16": global_state(0)["cols_bf16"][:, lo:lo + n].clone()}
    store = open_spec(spec)
    res["versions"], res["gathered"], res["local"] = [], [], []
    for v in (1, 2):
        blobs = [store.get(p.key) for p in manifest_at(store, v).parts]
        got = decode_partial(blobs, tensors, shards, group)
        res["local"].append(sum(d.local is not None for part in got.decoded for d in part.values()))
        for blob, dec in zip(blobs, got.decoded):
            apply(tensors, blob, shards=shards, verify=False, resume=True, held_only=True, decoded=dec)
        if not torch.equal(int_bits(tensors["cols_bf16"]), int_bits(global_state(v)["cols_bf16"][:, lo:lo + n])):
            raise AssertionError(f"version {v}: rank {rank}'s columns differ from the target")
        res["versions"].append(v)
        res["gathered"].append(got.received)


def follow_device(rank, world, spec, res):
    """The group on the device, as a GPU engine's TP workers run it: each rank's shards moved to
    ``$DCR_GROUP_DEVICE`` (tests/gpu/run_gpu.py: ``cuda``, the ranks sharing one GPU), a
    ``RolloutLoader(staging=False)`` following versions 1 and 2 in place there, the bytes each
    update moved between host and device counted (``Traffic``, every thread) and each version
    compared bit for bit with the rank's shards of the trainer's state."""
    import os

    import torch.distributed as dist

    from dcr_testing.mp_workers import open_spec
    from dcr_testing.traffic import Traffic
    from nemo_dcr.integrations.rollout import RolloutLoader

    device = torch.device(os.environ.get("DCR_GROUP_DEVICE", "cpu"))
    group = dist.new_group(list(range(world)))
    host, shards = local_state(0, rank)
    tensors = {n: t.to(device) for n, t in host.items()}
    loader = RolloutLoader(open_spec(spec), tensors, shards, group=group, version=0, staging=False)
    res["versions"], res["traffic"] = [], []
    res["held_bytes"] = sum(t.numel() * t.element_size() for t in host.values())
    res["held_elements"] = sum(t.numel() for t in host.values())
    for v in (1, 2):
        with Traffic() as moved:
            assert loader.update(v) == v
        res["versions"].append(loader.version)
        res["traffic"].append({"version": v, "h2d": moved.h2d, "d2h": moved.d2h})
        bad = _differs({n: t.cpu() for n, t in tensors.items()}, local_state(v, rank)[0])
        if bad:
            raise AssertionError(f"version {v}: rank {rank} differs on {device} in {bad}")
    loader.check()
    res["device"] = str(next(iter(tensors.values())).device)
