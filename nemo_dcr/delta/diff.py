"""Encode: a target state as a delta against a base state (snapshot → diff → encode).

    blob = diff(base, target)                 # bytes of one delta

``base``/``target`` may be any Mapping (a lazy one that loads a tensor per lookup keeps memory
at the few tensors the workers' window spans). ``shards`` gives, per name, where a local tensor
sits in the canonical tensor (``ShardSpec``); without it every tensor is whole. Sender and
receiver may shard differently.
"""
from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import BinaryIO

import torch

from nemo_dcr import __version__
from nemo_dcr.codec.chunk import AUTO, CHOICES, LIGHT_DENSE, EncodedChunk, encode_chunk, light
from nemo_dcr.codec.format import FORMAT_VERSION, SEGMENTED, DeltaWriter
from nemo_dcr.codec.header import MAX_CHUNK_ELEMS
from nemo_dcr.codec.names import DEFAULT_CHUNK, DEFAULT_LEVEL  # re-exported by nemo_dcr.delta
from nemo_dcr.codec.versions import REGION_OF_REMOVED, Version, version
from nemo_dcr.delta.changes import OnChange, report_gone, spec_of
from nemo_dcr.errors import DcrError
from nemo_dcr.state.digest import SUMMED, Place, SumKey, algo_of, state_digest, tensor_digest
from nemo_dcr.state.dtypes import dtype_name
from nemo_dcr.state.flat import FlatAccess
from nemo_dcr.state.index_map import IndexMap, ShardSpec
from nemo_dcr.state.statedigest import MANY_JOB, RunningSum, many_contrib, one_range
from nemo_dcr.util.gc_pause import pausing
from nemo_dcr.util.parallel import background, in_jobs, ordered_map
from nemo_dcr.util.progress import NullProgress, Progress

#: ``chunker(name, old, new, chunk_elems, encoding, level, keep_changes)``: a tensor's chunks
#: found elsewhere (the device path), or None (the reference encodes it); see ``diff``.
Chunker = Callable[[str, torch.Tensor, torch.Tensor, int, str, int, bool], "list[EncodedChunk] | None"]


@pausing
def diff(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], *, encoding: str = AUTO,
         level: int = DEFAULT_LEVEL, chunk_elems: int = DEFAULT_CHUNK, shards: Mapping[str, ShardSpec] | None = None,
         base_shards: Mapping[str, ShardSpec] | None = None, workers: int | None = None, meta: dict | None = None,
         out: BinaryIO | None = None, progress: bool | Progress | None = None,
         on_change: OnChange | None = None, base_digests: Mapping[str, str] | None = None,
         chunker: Chunker | None = None, format_version: int = FORMAT_VERSION,
         target_digests: Mapping[str, str] | None = None, copy_into: Mapping[str, torch.Tensor] | None = None,
         write_base: Callable[[], bool] | None = None):
    """Encode ``target`` as a delta against ``base``.

    Returns the delta bytes, or, when ``out`` (a writable binary file) is given, streams the
    delta into it and returns the header dict. ``shards`` places the target's tensors;
    ``base_shards`` the base's (default: ``shards``; a tensor whose shape changed is taken whole
    where no spec fits it). ``on_change(name, dtype, global_shape, global_idx, old_bits,
    new_bits)`` sees every changed element, from worker threads (it must be thread-safe):
    ``old_bits`` None for a tensor sent whole, ``new_bits`` None for the elements of a tensor
    that is removed or replaced by one of another dtype or shape (``delta/changes.py``). In
    formats 3 to 5 (segmented) a chunk's base elements are read only before its changes are reported,
    so ``on_change`` may write them into ``base`` (the publisher's snapshot does); versions 1 and
    2 may still be hashing the base beside the chunks.
    ``base_digests``: name -> the tensor digest of ``base[name]`` as a previous ``diff`` wrote it
    (its ``target_digest``), for a base the caller keeps private and unchanged since (the
    publisher's snapshot): that base is then not hashed again. A name missing is hashed.
    ``chunker(name, old, new, chunk_elems, encoding, level, keep_changes)``: the chunks of a
    tensor in delta (same dtype and shape) found elsewhere, the same ``EncodedChunk``s the
    reference would make (the device path, ``nemo_dcr/device/trainer.py``), or None to let the
    reference encode that tensor.
    ``format_version``: the delta's format version (``codec/versions.py``): 5 (default) in
    segments, its tensor digests summed from the changes, each the tensor's share of the state
    digest under its definition 2; 4 the same under definition 1; 3 with digests keyed apart
    from it; 2 digests with BLAKE3; 1 with SHA-256 and BLAKE2b-64, for receivers older than
    version 2. A known base digest of another algorithm
    than the version's is not reused (the base is hashed).
    ``target_digests``: name -> the tensor digest of ``target[name]``, computed elsewhere (the
    trainer's device capture hashes on the device when it captures, ``device/capture.py``): that
    target is then not hashed, and may be a meta tensor where ``chunker`` also finds its chunks.
    ``copy_into``: name -> a contiguous CPU tensor of the target's dtype and shape, into which
    each chunk of the target is copied as it is encoded, while its bits are in cache (the
    publisher's snapshot of a first keyframe: no pass over the model of its own before the
    encode, and the fresh snapshot's pages are faulted in on the workers); ``DcrError`` where a
    tensor's chunks did not cover it.
    ``write_base``: asked on the worker before each chunk of a tensor in delta is encoded (formats
    3 to 5); where it says yes, the chunk's changes are written into ``base`` before the chunk's
    ``on_change`` report, by the encoder's pass as it reads them where the base is contiguous host
    memory (the publisher's snapshot brought to the target while the chunk is in cache; a scatter
    afterwards found it out of cache), else after the encode. A chunk written whose report does not
    return (an error) is written back first.
    """
    fv = version(format_version)
    if fv.values_digest != version(FORMAT_VERSION).values_digest:
        chunker = None  # the device path makes the default version's chunk digests; the reference, any
    if encoding not in CHOICES:
        raise DcrError(f"encoding must be one of {', '.join(CHOICES)}, not {encoding!r}")
    if not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
        raise DcrError(f"chunk_elems must be in [1, {MAX_CHUNK_ELEMS}], not {chunk_elems}")
    if write_base is not None and fv.number < SEGMENTED:
        # (versions 1 and 2 may hash the base beside its chunks: a write would reach the hash)
        raise DcrError(f"write_base needs a segmented delta (format 3 or later), not format {fv.number}")
    shards = shards or {}
    base_shards = shards if base_shards is None else base_shards
    buf = io.BytesIO()
    w = DeltaWriter(out if out is not None else buf, fv.number, keyframe=len(base) == 0)
    names = sorted(set(base.keys()) | set(target.keys()))
    total = getattr(target, "total_bytes", None)
    if total is None and isinstance(target, dict):
        total = sum(t.numel() * t.element_size() for t in target.values())
    total = total or 0
    known = {k: d for k, d in (base_digests or {}).items() if _algo(d) == fv.tensor_digest}
    known_targets = {k: d for k, d in (target_digests or {}).items() if _algo(d) == fv.tensor_digest}
    entries, base_digests, target_digests = [], {}, {}
    created = round(time.time(), 3)
    w.open({"format": fv.number, "tool": f"nemo-dcr {__version__}", "created": created, "byte_order": "little",
            "encoding": encoding, "level": level, "chunk_elems": chunk_elems, "meta": meta or {}})
    if isinstance(progress, Progress):  # the caller's bar, over more than this delta (a publish): left open
        bar: Progress = progress
        owned: contextlib.AbstractContextManager = contextlib.nullcontext()
    else:
        bar = Progress(total, "diff") if progress or (progress is None and total) else NullProgress(0, "")
        owned = bar
    with owned:
        for entry in _stream(names, base, target, shards, base_shards, w, encoding, level, chunk_elems, workers,
                             bar, on_change, known, chunker, fv, known_targets, copy_into or {}, write_base):
            entries.append(entry)
            name = entry["name"]
            if "base_digest" in entry:
                base_digests[name] = entry["base_digest"]
            if entry["kind"] != "removed":
                target_digests[name] = entry["target_digest"]
    header = {
        "format": fv.number,
        "tool": f"nemo-dcr {__version__}",
        "created": created,
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
    return header if out is not None else buf.getvalue()


def _algo(digest: str) -> str | None:
    try:
        return algo_of(digest)
    except ValueError:
        return None  # not reusable: hashed


def _stream(names, base, target, shards, base_shards, w, encoding, level, chunk_elems, workers, bar, on_change,
            known, chunker, fv: Version, known_targets, copy_into, write_base):
    """The tensors' entries, in name order, their chunks encoded in one stream over the workers:
    the workers go on to the next tensors' chunks while the last ones of a tensor are written.
    Each tensor a map of its own waited at its end for its last chunk, so a tensor of one chunk
    (a model's tensors are mostly under 4M elements, a trainer rank's shards of them smaller
    still) kept every worker but one idle. Tensors are prepared in order on the calling thread
    as the window moves on, and written in order (``DeltaWriter`` takes one tensor at a time)."""
    hashing: list = []  # every prepared tensor's whole-tensor digests (futures), maybe running
    # (the futures, not the tensors: a lazy mapping's tensors go once written)
    ahead = _digests_ahead(names, base, target, shards, chunk_elems, workers, fv, known_targets)
    hashing.extend({id(f): f for f, _ in ahead.values()}.values())

    def items():
        for name in names:
            t = _Tensor(name, base, target, shards.get(name), base_shards.get(name), encoding, level, chunk_elems,
                        workers, on_change, known.get(name), chunker, fv, known_targets.get(name), w.segmented,
                        ahead.get(name), copy_into.get(name), write_base)
            hashing.extend(t.hashing)
            if not t.items:
                yield t, None
            for it in t.items:
                yield t, it

    def one(item):
        t, it = item
        return t, None if it is None else t.job(it)

    cur: _Tensor | None = None
    try:
        for t, res in ordered_map(one, items(), workers, light=_light):
            if t is not cur:
                if cur is not None:
                    yield cur.finish(w)
                cur = t
                t.begin(w)
            if res is not None:
                t.add(w, res, bar)
        if cur is not None:
            yield cur.finish(w)
    finally:
        for f in hashing:  # nothing of this call runs on past it; the first error is raised above
            f.exception()


def _digests_ahead(names, base, target, shards, chunk_elems, workers, fv: Version, known_targets) -> dict:
    """name -> (future, i): the summed target digest (format 3 to 5) of each small tensor sent
    whole, item ``i`` of the future's list, summed on the workers in jobs of up to
    ``statedigest.MANY_JOB`` elements, all queued now. Such a tensor is one light chunk
    (``codec.chunk.light``), encoded on the calling thread, and its digest was summed there after
    it, one tensor at a time, while the other core idled (a keyframe of 4096 tensors of 32K BF16:
    ~90 us a tensor). The jobs run far ahead of the stream, which takes a digest when its tensor
    ends. Only for a plain dict of contiguous host tensors: a lazy mapping's tensors would be loaded
    ahead of their turn."""
    if fv.tensor_digest not in SUMMED or type(target) is not dict:
        return {}
    most = min(chunk_elems, LIGHT_DENSE)
    ranges = []
    for name in names:
        t = target.get(name)
        if t is None or name in base or name in known_targets or t.device.type != "cpu" \
                or not t.is_contiguous() or not 0 < t.numel() <= most:
            continue  # (a strided tensor's bits would be gathered into a copy now, all of them at once)
        spec = shards.get(name) or ShardSpec.full(t.shape)
        key = SumKey(fv.tensor_digest, t.dtype, t.shape, Place(name, spec)) if tuple(t.shape) == spec.shape else None
        if key is None or key.imap is not None:
            continue  # refused when its turn comes (_Tensor), or a region of another index shape
        ranges.append((name, (key.name, t.dtype, key.shape, FlatAccess(t).read(0, t.numel()), 0)))
    out = {}
    for job in in_jobs(ranges, lambda r: r[1][3].numel(), MANY_JOB):
        # each job's keys and checks made here, its sums in one C call on a worker
        f = background(many_contrib([r for _, r in job], definition=fv.definition), workers)
        for i, (name, _) in enumerate(job):
            out[name] = (f, i)
    return out


def _light(item) -> bool:
    """``_stream``'s items run on the calling thread: a tensor without chunks, a chunk found
    already (the chunker's: only its changes are reported), a small chunk (``codec.chunk.light``),
    unless its base is still being hashed: the calling thread would wait for that digest at the
    tensor's first piece before preparing the next tensors, whose base digests run beside it."""
    t, it = item
    if t.early is not None and not t.early.done():
        return False
    if it is None or isinstance(it, EncodedChunk):
        return True
    s, e = it
    return light(e - s, t.old is None)


class _Tensor:
    """One tensor on its way through ``diff``: prepared on the calling thread (what it is, its
    base digest or its future, its ranges or the chunks the chunker found), its chunks encoded
    on the workers (``job``), then written in order (``begin``, ``add`` per chunk, ``finish``)."""

    def __init__(self, name, base, target, spec, base_spec, encoding, level, chunk_elems, workers,
                 on_change: OnChange | None, known_base: str | None, chunker: Chunker | None, fv: Version,
                 known_target: str | None, segmented: bool, ahead: tuple | None = None,
                 copy_to: torch.Tensor | None = None, write_base: Callable[[], bool] | None = None):
        self.name = name
        self.hashing: list = []
        self.items: list = []
        self.gone: dict | None = None
        self.early: Future | None = None  # the base digest, hashed beside the chunks before it
        if name not in target:
            old = base[name]
            report_gone(name, old, base_spec, on_change)
            held = spec_of(old, base_spec)
            self.gone = {"name": name, "kind": "removed",
                         "base_digest": known_base or tensor_digest(old, fv.tensor_digest, place=Place(name, held))}
            if not held.is_full and fv.number >= REGION_OF_REMOVED:
                # the part of it this sender held: a receiver holding more checks that part (a
                # base digest of a part compared with the whole tensor's refused a good base)
                self.gone.update(shape=list(held.global_shape), region=held.to_json())
            return
        new = target[name]
        dtype_name(new.dtype)
        if spec is None:
            spec = ShardSpec.full(new.shape)
        if tuple(new.shape) != spec.shape:
            raise DcrError(f"{name}: tensor shape {tuple(new.shape)} differs from its shard shape {spec.shape}")
        old = base[name] if name in base else None
        if old is not None and (old.dtype != new.dtype or old.shape != new.shape
                                or spec_of(old, base_spec).global_shape != spec.global_shape):
            # dtype or shape changed: the old elements leave the state and the tensor is sent whole
            report_gone(name, old, base_spec, on_change)
            old = None
        self.new, self.old, self.spec, self.fv, self.on_change = new, old, spec, fv, on_change
        self.write_base = write_base if old is not None else None
        self.encoding, self.level = encoding, level
        self.kind = "delta" if old is not None else "full"
        self.nf = FlatAccess(new)
        self.of = FlatAccess(old) if old is not None else None
        # write_base's writes by the encoder's own pass: a chunk read from the base is the base's memory
        self.in_place = self.of is not None and self.of.contiguous and old.is_cpu
        n = self.nf.numel
        self.copy_to: torch.Tensor | None = None  # copy_into's flat bits for this tensor
        self.copied: list = []  # elements copied, a count per chunk (list.append: from any worker)
        if copy_to is not None:
            if copy_to.dtype != new.dtype or copy_to.shape != new.shape or copy_to.device.type != "cpu" \
                    or not copy_to.is_contiguous():
                raise DcrError(f"{name}: copy_into needs a contiguous CPU tensor of {new.dtype} {tuple(new.shape)}")
            self.copy_to = FlatAccess(copy_to).read(0, n)
        ranges = [(s, min(s + chunk_elems, n)) for s in range(0, n, chunk_elems)]
        # format 3's to 5's tensor digests are sums over elements ("sd", "sdn", "sdb": state/digest.py):
        # the target's is the base's plus the chunks' changes, O(changes); a tensor sent whole sums
        # its chunks. Both of a tensor's digests are of its region in the target (where the
        # receiver checks them), the base's too
        self.place = Place(name, spec)
        self.summed = summed = fv.tensor_digest in SUMMED
        self.sum_key = SumKey(fv.tensor_digest, new.dtype, new.shape, self.place) if summed else None
        # (a chunk written into the base by write_base carries its changes: a written-back one needs them)
        self.keep = keep = on_change is not None or (summed and old is not None) or self.write_base is not None
        found = None if chunker is None or old is None else chunker(name, old, new, chunk_elems, encoding, level,
                                                                     keep)
        self.region_map = IndexMap(spec) if on_change is not None else None
        self.digests = digests = {"base": known_base} if old is not None and known_base else {}
        # a target digest known already: the device capture's (its chunks found there too), or, for
        # a tensor sent whole in format 3 or 4, the sum a delta of the same version reached from the
        # changes (a keyframe published beside a delta: its chunks are not summed a second time)
        self.reuse = reuse = known_target is not None and (found is not None or (summed and old is None))
        if known_target is not None and reuse:
            digests["target"] = known_target
        # (future, i): its target digest summed on a worker ahead of the stream (_digests_ahead)
        self.ahead = ahead if summed and old is None and not reuse else None
        early = None
        if old is not None and "base" not in digests and segmented:
            # a segmented delta (version 3 to 5) names the base digest in the tensor's first piece, which
            # may be written before its last chunk is encoded: it is there by ``begin``. A tensor
            # summed in one range is so on one thread anyway: beside the chunks of the tensors
            # before it (the calling thread waited for each, one tensor after another: a
            # checkpoint's diff spent a third of its time so); a longer one on all the workers now
            if summed and one_range(old.numel()):
                early = background(lambda: self._digest("base"), workers)
            else:
                digests["base"] = tensor_digest(old, fv.tensor_digest, threads=workers, place=self.place)
        self.items = ranges if found is None else found
        self.chunks: list = []
        # a summed target digest's parts: the chunks' changes, or dense ranges
        self.target_sum = RunningSum(definition=self.sum_key.definition if self.sum_key is not None else 1)
        # the whole-tensor digests hash beside the chunks (the hashers drop the GIL), on one thread
        # each (state/digest.py, THREADS), outside the chunks' ordered window (util/parallel.background)
        wanted = ([] if summed or "target" in digests else ["target"]) \
            + (["base"] if old is not None and "base" not in digests and early is None else [])
        self.hashing = [background(lambda which=which: self._digest(which), workers) for which in wanted]
        self.early = early
        if early is not None:
            self.hashing.append(early)

    def _digest(self, which: str) -> None:
        self.digests[which] = tensor_digest(self.new if which == "target" else self.old, self.fv.tensor_digest,
                                            threads=1, place=self.place)

    def job(self, r):
        """One chunk, on a worker: (the encoded chunk or None, its dense bytes, its share of a summed
        target digest or None)."""
        new, fv, keep = self.new, self.fv, self.keep
        c: EncodedChunk | None
        part = None
        write = self.write_base is not None and self.write_base()
        if write and self.early is not None:
            # the base's digest, summed beside the chunks, reads every base element: none is
            # written before that sum is done (it was queued before this tensor's chunks)
            self.early.result()
        if isinstance(r, EncodedChunk):  # found by the chunker
            c, s, e = r, r.start, r.start + r.n
            if self.copy_to is not None:
                self.copy_to[s:e].copy_(self.nf.read(s, e))
                self.copied.append(e - s)
        else:
            s, e = r
            # .cpu(): the encoder's kernels read host memory; a tensor on a device is brought
            # over one chunk at a time (the device path, nemo_dcr/device, avoids even that)
            nb = self.nf.read(s, e).cpu()
            if self.copy_to is not None:
                self.copy_to[s:e].copy_(nb)
                self.copied.append(e - s)
            c = encode_chunk(self.of.read(s, e).cpu() if self.of is not None else None, nb, s, self.encoding,
                             self.level, keep_changes=keep, is_float=new.dtype.is_floating_point,
                             dtype=new.dtype, values_algo=fv.values_digest, write_base=write and self.in_place)
            if self.summed and self.old is None and not self.reuse and self.ahead is None:
                assert self.sum_key is not None  # made with summed
                part = self.sum_key.range(nb, s)
        if c is None or not keep:
            return c, (e - s) * new.element_size(), part
        # keep_changes=True (and the chunker is told the same): every chunk carries its changes
        assert c.changes is not None
        idx, oldv, newv = c.changes
        if write and (not self.in_place or isinstance(r, EncodedChunk)):
            self._write(idx + s, newv)  # not by the encoder's pass: here, before the report
        try:
            gidx = None
            if self.early is not None and self.on_change is not None:
                # the base's digest, summed beside the chunks, reads every base element, and
                # ``on_change`` may write the changes into the base (the publisher's snapshot:
                # ``sync/publisher._Changes``): none is reported before that sum is done. (It was
                # queued on the pool before this tensor's chunks, so it runs or has run.) Without
                # the wait a publisher's first delta after a restore could name a base digest of
                # a base half-way to the target
                self.early.result()
            if self.on_change is not None:
                assert self.region_map is not None
                gidx = self.region_map.to_global(idx + s)
                self.on_change(self.name, new.dtype, self.spec.global_shape, gidx, oldv, newv)
            if self.summed and self.old is not None and not self.reuse:
                assert self.sum_key is not None  # made with summed
                self.target_sum.add_change(*self.sum_key.at((idx + s).cpu(), None if gidx is None else gidx.cpu()),
                                           oldv.cpu(), newv.cpu())
        except BaseException:
            if write:
                self._write(idx + s, oldv)  # written, and maybe not reported: written back
            raise
        c.changes = None
        return c, (e - s) * new.element_size(), part

    def _write(self, idx: torch.Tensor, bits: torch.Tensor) -> None:
        """``bits`` into the base tensor at its flat positions ``idx`` (write_base's writes the
        encoder's pass did not make)."""
        assert self.of is not None and self.old is not None
        dev = self.old.device
        self.of.scatter(idx.to(dev), bits.to(dev))

    def begin(self, w) -> None:
        if self.gone is not None:
            w.begin_tensor(self.gone)
            return
        if self.early is not None:
            self.early.result()
        d = self.digests
        w.begin_tensor({"name": self.name, "kind": self.kind, "dtype": dtype_name(self.new.dtype),
                        "shape": list(self.spec.global_shape), "region": self.spec.to_json(),
                        **({"base_digest": d["base"]} if "base" in d else {})})

    def add(self, w, res, bar) -> None:
        c, nbytes, part = res
        bar.update(nbytes)
        if part is not None:
            self.target_sum.add(part)
        if c is not None:
            self.chunks.append(w.add_chunk(c))

    def finish(self, w) -> dict:
        if self.gone is not None:
            w.end_tensor(self.gone)
            return self.gone
        for f in self.hashing:
            f.result()
        if self.copy_to is not None and sum(self.copied) != self.nf.numel:
            raise DcrError(f"{self.name}: {sum(self.copied)} of its {self.nf.numel} elements were copied into "
                           "copy_into")
        d = self.digests
        if self.summed and not self.reuse:
            assert self.sum_key is not None  # made with summed
            total = self.ahead[0].result()[self.ahead[1]] if self.ahead is not None else self.target_sum.total
            d["target"] = self.sum_key.text(self.sum_key.parse(d["base"]) + total if self.old is not None else total)
        entry = {
            "name": self.name, "kind": self.kind, "dtype": dtype_name(self.new.dtype),
            "shape": list(self.spec.global_shape), "region": self.spec.to_json(), "target_digest": d["target"],
            "chunks": self.chunks,
        }
        if self.old is not None:
            entry["base_digest"] = d["base"]
        w.end_tensor(entry)
        return entry
