"""Diff and apply on dicts of tensors: the Python API the CLI and the callbacks call.

    blob = diff(base, target)                 # bytes of one delta
    report = apply(tensors, blob)             # in place, verified bit-exactly

``base``/``target`` may be any Mapping (a lazy one that loads a tensor per lookup keeps memory
at one tensor). ``shards`` gives, per name, where a local tensor sits in the canonical tensor
(``ShardSpec``); without it every tensor is whole. Sender and receiver may shard differently.
"""
from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Mapping, MutableMapping

import torch

from nemo_dcr import __version__
from nemo_dcr.codec import ordered
from nemo_dcr.codec.chunk import ADD, AUTO, CHOICES, CLASSES, OVERWRITE, decode_chunk, encode_chunk
from nemo_dcr.state.digest import state_digest, tensor_digest, tensor_digest_like, values_digest
from nemo_dcr.state.dtypes import dtype_from_name, dtype_name, itemsize
from nemo_dcr.errors import BaseMismatchError, DcrError, DeltaFormatError, PartialApplyError, TargetMismatchError
from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.codec.format import FORMAT_VERSION, DeltaReader, DeltaWriter
from nemo_dcr.state.index_map import IndexMap, ShardSpec
from nemo_dcr.util.parallel import ordered_map
from nemo_dcr.util.progress import NullProgress, Progress

DEFAULT_CHUNK = 1 << 20  # elements per chunk: bounds encode/apply scratch
DEFAULT_LEVEL = 3


# ----------------------------------------------------------------------------- encode

def diff(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], *, encoding: str = AUTO,
         level: int = DEFAULT_LEVEL, chunk_elems: int = DEFAULT_CHUNK, shards: Mapping[str, ShardSpec] | None = None,
         workers: int | None = None, meta: dict | None = None, out: BinaryIO | None = None,
         progress: bool | None = None, on_change=None):
    """Encode ``target`` as a delta against ``base``.

    Returns the delta bytes, or, when ``out`` (a writable binary file) is given, streams the
    delta into it and returns the header dict. ``on_change(name, dtype, global_shape,
    global_idx, old_bits, new_bits)`` sees every changed element (old_bits None for a tensor
    sent whole), from worker threads: it must be thread-safe.
    """
    if encoding not in CHOICES:
        raise DcrError(f"encoding must be one of {', '.join(CHOICES)}, not {encoding!r}")
    if chunk_elems < 1:
        raise DcrError("chunk_elems must be >= 1")
    shards = shards or {}
    sink = out if out is not None else io.BytesIO()
    w = DeltaWriter(sink)
    names = sorted(set(base.keys()) | set(target.keys()))
    total = getattr(target, "total_bytes", None)
    if total is None and isinstance(target, dict):
        total = sum(t.numel() * t.element_size() for t in target.values())
    total = total or 0
    entries, base_digests, target_digests = [], {}, {}
    bar = Progress(total, "diff") if progress or (progress is None and total) else NullProgress(0, "")
    with bar:
        for name in names:
            entry = _encode_tensor(name, base, target, shards.get(name), w, encoding, level, chunk_elems, workers, bar,
                                   on_change)
            entries.append(entry)
            if "base_digest" in entry:
                base_digests[name] = entry["base_digest"]
            if entry["kind"] != "removed":
                target_digests[name] = entry["target_digest"]
    header = {
        "format": FORMAT_VERSION,
        "tool": f"nemo-dcr {__version__}",
        "created": round(time.time(), 3),
        "byte_order": "little",
        "encoding": encoding,
        "level": level,
        "chunk_elems": chunk_elems,
        "base_digest": state_digest(base_digests),
        "target_digest": state_digest(target_digests),
        "tensors": entries,
        "meta": meta or {},
    }
    w.finish(header)
    return header if out is not None else sink.getvalue()


def _encode_tensor(name, base, target, spec, w, encoding, level, chunk_elems, workers, bar, on_change=None):
    if name not in target:
        return {"name": name, "kind": "removed", "base_digest": tensor_digest(base[name])}
    new = target[name]
    dtype_name(new.dtype)
    if spec is None:
        spec = ShardSpec.full(new.shape)
    if tuple(new.shape) != spec.shape:
        raise DcrError(f"{name}: tensor shape {tuple(new.shape)} differs from its shard shape {spec.shape}")
    old = base[name] if name in base else None
    if old is not None and (old.dtype != new.dtype or old.shape != new.shape):
        old = None  # dtype or shape changed: send whole
    kind = "delta" if old is not None else "full"
    nf = FlatAccess(new)
    of = FlatAccess(old) if old is not None else None
    n = nf.numel
    ranges = [(s, min(s + chunk_elems, n)) for s in range(0, n, chunk_elems)]

    region_map = IndexMap(spec) if on_change is not None else None

    digests = {}

    def job(r):
        if r[0] == "digest":  # the two whole-tensor digests hash beside the chunks (hashlib drops the GIL)
            digests[r[1]] = tensor_digest(new if r[1] == "target" else old)
            return None, 0
        s, e = r
        c = encode_chunk(of.read(s, e) if of is not None else None, nf.read(s, e), s, encoding, level,
                         keep_changes=on_change is not None, is_float=new.dtype.is_floating_point, dtype=new.dtype)
        if c is not None and on_change is not None:
            idx, oldv, newv = c.changes
            on_change(name, new.dtype, spec.global_shape, region_map.to_global(idx + s), oldv, newv)
            c.changes = None
        return c, (e - s) * new.element_size()

    chunks = []
    jobs = [("digest", "target")] + ([("digest", "base")] if old is not None else []) + ranges
    for c, nbytes in ordered_map(job, jobs, workers):
        bar.update(nbytes)
        if c is not None:
            off = w.add_payload(c.pos_bytes, c.val_bytes)
            chunks.append(c.header(off))
    entry = {
        "name": name, "kind": kind, "dtype": dtype_name(new.dtype), "shape": list(spec.global_shape),
        "region": spec.to_json(), "target_digest": digests["target"], "chunks": chunks,
    }
    if old is not None:
        entry["base_digest"] = digests["base"]
    return entry


# ----------------------------------------------------------------------------- apply

@dataclass
class ApplyReport:
    tensors_changed: int = 0
    tensors_skipped: int = 0  # already at the target
    tensors_added: list = field(default_factory=list)
    tensors_removed: list = field(default_factory=list)
    chunks_applied: int = 0
    chunks_already_applied: int = 0
    elements_changed: int = 0
    unverified: list = field(default_factory=list)  # entries only partly held: no digest check possible
    seconds: float = 0.0


@dataclass
class _Plan:
    entry: dict
    tensor: torch.Tensor | None
    recv: ShardSpec | None
    region: ShardSpec | None
    covered: bool
    action: str  # apply | skip | resume | unverified | create | remove | ignore


def plan_entry(entry: dict, tensor: torch.Tensor | None, recv: ShardSpec | None, *, verify: bool = True,
               resume: bool = False) -> _Plan:
    """Decide what to do with one delta entry, checking the base. Mutates nothing."""
    name, kind = entry["name"], entry["kind"]
    if kind == "removed":
        if tensor is not None and verify and entry.get("base_digest") and (recv is None or recv.is_full) \
                and tensor_digest_like(tensor, entry["base_digest"]) != entry["base_digest"]:
            raise BaseMismatchError(f"{name}: the delta removes this tensor, but the receiver's is not the base's")
        return _Plan(entry, tensor, recv, None, False, "remove" if tensor is not None else "ignore")
    dtype = dtype_from_name(entry["dtype"])
    region = ShardSpec.of(entry["shape"], entry["region"]["offsets"], entry["region"]["shape"])
    if kind == "full" and (tensor is None or tensor.dtype != dtype
                           or tuple((recv or ShardSpec.full(tensor.shape)).global_shape) != region.global_shape):
        # new tensor (or new dtype/shape): only a whole tensor can be created from a whole region
        if not region.is_full or (recv is not None and not recv.is_full):
            raise DcrError(f"{name}: the receiver has no matching tensor to write this shard into")
        return _Plan(entry, tensor, recv, region, True, "create")
    if tensor is None:
        raise BaseMismatchError(f"{name}: the delta changes this tensor but the receiver has none")
    if tensor.dtype != dtype:
        raise BaseMismatchError(f"{name}: receiver dtype {tensor.dtype} but the delta was built on {dtype}")
    if recv is None:
        recv = ShardSpec.full(tensor.shape)
    if tuple(tensor.shape) != recv.shape:
        raise DcrError(f"{name}: tensor shape {tuple(tensor.shape)} differs from its shard shape {recv.shape}")
    if tuple(recv.global_shape) != tuple(region.global_shape):
        raise BaseMismatchError(f"{name}: receiver's global shape {recv.global_shape} but the delta's is {region.global_shape}")
    covered = recv.contains(region)
    if not covered and not _overlaps(recv, region):
        return _Plan(entry, tensor, recv, region, False, "ignore")
    if kind == "full":  # the region's whole content, written over whatever is there
        if covered and verify and tensor_digest_like(tensor[recv.slices_of(region)], entry["target_digest"]) \
                == entry["target_digest"]:
            return _Plan(entry, tensor, recv, region, True, "skip")
        return _Plan(entry, tensor, recv, region, covered, "overwrite")
    if not covered:
        return _Plan(entry, tensor, recv, region, False, "unverified")
    if not verify:
        return _Plan(entry, tensor, recv, region, True, "resume")
    d = tensor_digest_like(tensor[recv.slices_of(region)], entry["base_digest"])
    if d == entry["base_digest"]:
        action = "apply" if entry["chunks"] else "skip"
    elif d == entry["target_digest"]:
        action = "skip"
    elif resume:
        action = "resume"
    else:
        raise BaseMismatchError(f"{name}: receiver tensor is not the base this delta was built from "
                                f"(digest {d}, expected {entry['base_digest']})")
    return _Plan(entry, tensor, recv, region, True, action)


def _overlaps(a: ShardSpec, b: ShardSpec) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.shape, b.offsets, b.shape)) \
        and a.numel > 0 and b.numel > 0


def run_plan(reader: DeltaReader, plan: _Plan, report: ApplyReport, workers: int | None = None, bar=None,
             journal: set | None = None, on_change=None):
    """Apply one planned entry in place. Returns the tensor (a new one for ``create``).

    ``journal``: a set of ``(name, chunk start)`` already applied; those chunks are skipped and
    each chunk applied is added (re-delivery safety where pre-images cannot be checked).
    ``on_change(name, dtype, global_shape, global_idx, old_bits, new_bits)`` is called for every
    chunk written (``old_bits`` is None for a new tensor): incremental digests hang off it.
    """
    entry = plan.entry
    name = entry["name"]
    if plan.action in ("ignore", "remove"):
        return plan.tensor
    if plan.action == "skip" or (plan.action != "create" and not entry["chunks"]):
        report.tensors_skipped += 1
        return plan.tensor
    dtype = dtype_from_name(entry["dtype"])
    gshape = tuple(entry["shape"])
    w = itemsize(dtype)
    if plan.action == "create":
        try:
            tensor = torch.empty(plan.region.shape, dtype=dtype)
        except RuntimeError as e:
            raise DcrError(f"{name}: cannot allocate the new tensor {plan.region.shape}: {e}") from None
        recv = plan.region
    else:
        tensor, recv = plan.tensor, plan.recv
    fa = FlatAccess(tensor)
    region_map = IndexMap(plan.region)
    recv_map = IndexMap(recv)
    identity = region_map.identity and recv_map.identity
    check = plan.covered and plan.action in ("apply", "resume")
    xor_ok = plan.action in ("apply", "resume", "unverified")

    def one(c):
        key = (name, c["start"])
        in_journal = journal is not None and key in journal
        if in_journal and not check:  # pre-images, where checkable, are stronger
            return "already", 0
        if c["enc"] == CLASSES:
            idx, vals = _decode_classes(c, reader.payload(c), w, dtype, fa, plan, region_map, recv_map, identity, check)
        else:
            idx, vals = decode_chunk(c, reader.payload(c), w)
        glob = region_map.to_global(idx + c["start"])
        if identity:
            local = glob
        else:
            local, mask = recv_map.to_local(glob)
            if not bool(mask.all()):
                vals, glob = vals[mask], glob[mask]
        cur = fa.gather(local) if (xor_ok or on_change is not None) and plan.action != "create" else None
        if check:
            d = values_digest(cur)
            if d == c["post"] or (d != c["pre"] and in_journal):
                return "already", 0  # (a classes chunk's post-image is not always recognisable)
            if d != c["pre"]:
                extra = (" (or it was applied already and changed the classes its positions are coded in: "
                         "resume with the journal of the first attempt)") if c["enc"] == CLASSES else ""
                raise BaseMismatchError(f"{name}: chunk at element {c['start']} does not match its base{extra}")
        if c["enc"] in (OVERWRITE, CLASSES):
            new = vals
        elif not xor_ok:
            raise DeltaFormatError(f"{name}: a {c['enc']} chunk in a whole-tensor entry")
        elif c["enc"] == ADD:
            if w not in ordered.WIDTHS:
                raise DeltaFormatError(f"{name}: an add chunk for a {w}-byte dtype")
            new = ordered.decode(cur, vals, dtype.is_floating_point)
        else:
            new = torch.bitwise_xor(cur, vals)
        fa.scatter(local, new)
        if journal is not None:
            journal.add(key)
        if on_change is not None:
            on_change(name, dtype, gshape, glob, cur, new)
        return "applied", int(local.numel())

    for status, k in ordered_map(one, entry["chunks"], workers):
        if status == "applied":
            report.chunks_applied += 1
            report.elements_changed += k
        else:
            report.chunks_already_applied += 1
    if bar:
        bar.update(1)
    if plan.action == "create":
        report.tensors_added.append(name)
    else:
        report.tensors_changed += 1
    if plan.action == "unverified" or (plan.action == "overwrite" and not plan.covered):
        report.unverified.append(name)
    return tensor


def _decode_classes(c, payload, w, dtype, fa, plan, region_map, recv_map, identity, check):
    """A classes chunk decodes against the receiver's bits of the *whole* chunk."""
    name = plan.entry["name"]
    if not plan.covered or plan.action not in ("apply", "resume"):
        raise DcrError(f"{name}: chunk at element {c['start']} is coded against the whole base chunk, which this "
                       "receiver does not hold; publish with encoding 'portable' for receivers sharded differently")
    if identity:
        base = fa.read(c["start"], c["start"] + c["n"])
    else:
        local, _ = recv_map.to_local(region_map.to_global(torch.arange(c["start"], c["start"] + c["n"])))
        base = fa.gather(local)
    try:
        return decode_chunk(c, payload, w, base=base, dtype=dtype)
    except DeltaFormatError:
        if not check:
            raise
        # a checksum-valid chunk that does not decode against what is held: not this base (or
        # applied already); the digest check that follows reports it
        return torch.empty(0, dtype=torch.int64), base[:0]


def verify_plan(plan: _Plan, tensor: torch.Tensor) -> None:
    if plan.action in ("ignore", "remove", "unverified") or not plan.covered:
        return
    view = tensor if plan.action == "create" else tensor[plan.recv.slices_of(plan.region)]
    d = tensor_digest_like(view, plan.entry["target_digest"])
    if d != plan.entry["target_digest"]:
        raise TargetMismatchError(f"{plan.entry['name']}: result does not match the target digest "
                                  f"(got {d}, expected {plan.entry['target_digest']})")


def apply(tensors: MutableMapping[str, torch.Tensor], delta, *, shards: Mapping[str, ShardSpec] | None = None,
          verify: bool = True, resume: bool = False, workers: int | None = None,
          progress: bool | None = None, journal: set | None = None, on_change=None,
          held_only: bool = False) -> ApplyReport:
    """Apply ``delta`` (bytes, a path, or a DeltaReader) to ``tensors`` in place.

    Before anything is changed: the container and every chunk checksum are checked, and every
    entry's base digest (where the receiver holds the entry's whole region). While applying,
    each chunk's pre-image is checked; a chunk already applied is skipped, so re-delivery of
    an XOR delta is harmless. After applying, target digests are checked. ``held_only``: skip
    entries for tensors ``tensors`` does not have (instead of creating them or refusing). A failure after the
    first write raises ``PartialApplyError``; calling again with ``resume=True`` finishes.
    """
    t0 = time.perf_counter()
    reader = DeltaReader.open(delta)
    reader.check_payloads()
    shards = shards or {}
    entries = reader.header["tensors"]
    if held_only:  # one rank of a group: tensors it does not hold are other ranks' to apply
        entries = [e for e in entries if e["name"] in tensors]
    # the base digests of all entries, hashed on the worker threads; nothing is changed yet
    plans = list(ordered_map(lambda e: plan_entry(e, tensors.get(e["name"]), shards.get(e["name"]), verify=verify,
                                                  resume=resume), entries, workers))
    report = ApplyReport()
    started = False
    try:
        with (Progress(len(plans), "apply", unit="tensor") if progress else NullProgress(0, "")) as bar:
            for p in plans:
                if p.action in ("apply", "resume", "unverified", "create", "overwrite"):
                    started = True
                out = run_plan(reader, p, report, workers, bar, journal=journal, on_change=on_change)
                if verify:
                    verify_plan(p, out)
                if p.action == "create":
                    tensors[p.entry["name"]] = out
                elif p.action == "remove":
                    del tensors[p.entry["name"]]
                    report.tensors_removed.append(p.entry["name"])
    except (DcrError, DeltaFormatError) as e:
        if started:
            raise PartialApplyError(f"apply stopped after changing tensors in place: {e}. "
                                    "Call apply again with resume=True to finish, or reload the base.") from e
        raise
    report.seconds = time.perf_counter() - t0
    return report
