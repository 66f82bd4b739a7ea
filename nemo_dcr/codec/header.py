"""The delta header as typed, immutable objects: parsed and checked once, at the format boundary.

``DeltaReader`` turns the JSON header into a ``DeltaHeader`` (``parse_header``); everything above
the format (apply, inspect, the file layer) reads these objects, never the JSON dicts. Parsing
checks every type and range a decoder relies on, and bounds every size it will allocate by what
the container and the header allow (``format.py``'s limits), so a crafted header is a
``DeltaFormatError`` before anything is decoded or allocated. The writer still writes the JSON
dicts of ``EncodedChunk.header`` and ``delta.diff``: the bytes are unchanged.
"""
from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from nemo_dcr.codec import chunk as _c
from nemo_dcr.codec import classes as _cl
from nemo_dcr.codec import positions as _p
from nemo_dcr.codec.versions import FORMAT_VERSION, VERSIONS, Version
from nemo_dcr.errors import DeltaFormatError
from nemo_dcr.state.digest import algo_of
from nemo_dcr.state.dtypes import DTYPES
from nemo_dcr.state.index_map import ShardSpec

# bounds on every declared size (also the writer's limits); see docs/format.md "Limits"
MAX_DIMS = 64
MAX_ELEMENTS = 1 << 48  # elements of one tensor
MAX_CHUNK_ELEMS = 1 << 26  # elements of one chunk: bounds a decoder's scratch (512 MiB at 8 bytes)
MAX_CLASS_ROWS = 256
_U32 = (1 << 32) - 1
# the file's first bytes (docs/format.md): magic, format version, flags. Defined here, where the
# chunk checks bound every payload offset by it; codec/format.py (which imports this module) uses it
PREAMBLE = struct.Struct("<8sII")
_CHUNK_INTS = ("start", "n", "k", "off", "plen", "vlen", "praw", "vraw")
_CHUNK_INT_MAX = MAX_ELEMENTS * 16
_POSITIONS = frozenset(_p.CODINGS + (_c.CLASSES,))


class TensorKind(str, enum.Enum):
    DELTA = "delta"
    FULL = "full"
    REMOVED = "removed"


_KINDS = {k.value: k for k in TensorKind}


def _fail(why: str) -> NoReturn:
    raise DeltaFormatError(f"malformed header: {why}")


def _need(cond, why: str) -> None:
    if not cond:
        _fail(why)


def _ints(vs: list, hi: int) -> bool:
    """Every item of ``vs`` an int in [0, ``hi``] (a loop: no generator per call)."""
    for v in vs:
        if type(v) is not int or not 0 <= v <= hi:
            return False
    return True


def _int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _built(cls, fields: dict):
    """An instance of the frozen dataclass ``cls`` holding ``fields``: every one of its fields,
    checked by the caller. The dataclass's own ``__init__`` sets each field through
    ``object.__setattr__`` (frozen), 2.9 us for a chunk's 17 against 0.4 here; the parse makes one
    per chunk and one per tensor of every delta a receiver opens, on the GIL before anything is
    applied (a delta of 4096 small tensors: ~15 ms of the ~100 its header's parse took;
    docs/results.md). ``tests/test_header.py`` holds the parse's entries to the constructor's."""
    o = object.__new__(cls)
    o.__dict__.update(fields)
    return o


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk: the region's flat range ``[start, start + n)`` with ``k`` changes (docs/format.md)."""

    start: int
    n: int
    k: int
    enc: str
    pos: str
    off: int
    plen: int
    vlen: int
    praw: int
    vraw: int
    pz: bool
    vz: bool
    crc: int
    pre: str
    post: str
    # the classes table: rows of 6 ints (classes coding only), checked where the entry is made
    # (``parse``; ``EncodedChunk.entry``: the encoder's own), so a decoder need not check it again
    cls: tuple | None = None
    # what ``pre``/``post`` are made with (``state.digest.values_digest``): the delta's format
    # version says, not the entry (codec/versions.py)
    values_algo: str = _c.VALUES_ALGO

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def payload_len(self) -> int:
        return self.plen + self.vlen

    @classmethod
    def parse(cls, c, where: str, *, w: int, dtype: torch.dtype, kind: TensorKind, numel: int,
              chunk_elems: int, payload_end: int, values_algo: str) -> ChunkEntry:
        # every check of this runs for every chunk of every apply, on the GIL: the messages are
        # made only for what fails (_need's f-strings were a third of the parse)
        if not isinstance(c, dict):
            _fail(f"{where}: chunk entry is not an object")
        for key in _CHUNK_INTS:
            v = c.get(key)
            if type(v) is not int or not 0 <= v <= _CHUNK_INT_MAX:
                _fail(f"{where}: chunk {key}")
        v = c.get("crc")
        if type(v) is not int or not 0 <= v <= _U32:
            _fail(f"{where}: chunk crc")
        start, n, k = c["start"], c["n"], c["k"]
        if not (0 < k <= n and start + n <= numel):
            _fail(f"{where}: chunk range")
        if n > chunk_elems:
            _fail(f"{where}: chunk of {n} elements, more than the header's chunk_elems {chunk_elems}")
        enc, pos = c.get("enc"), c.get("pos")
        if not (enc in _c.ENCODINGS and isinstance(pos, str) and pos in _POSITIONS):
            _fail(f"{where}: chunk coding")
        if (enc == _c.CLASSES) != (pos == _c.CLASSES):
            _fail(f"{where}: classes chunk coding")
        if type(c.get("pz")) is not bool or type(c.get("vz")) is not bool:
            _fail(f"{where}: chunk flags")
        if not (isinstance(c.get("pre"), str) and isinstance(c.get("post"), str)):
            _fail(f"{where}: chunk digests")
        if not (c["off"] >= PREAMBLE.size and c["off"] + c["plen"] + c["vlen"] <= payload_end):
            _fail(f"{where}: chunk payload outside the file")
        rows = None
        if enc == _c.CLASSES:
            if not (isinstance(c.get("cls"), list) and kind == TensorKind.DELTA):
                _fail(f"{where}: classes table")
            if not (_cl.applicable(dtype) and len(c["cls"]) <= MAX_CLASS_ROWS):
                _fail(f"{where}: classes table")
            if not (not c["pz"] and not c["vz"] and c["praw"] == c["plen"] and c["vraw"] == c["vlen"]):
                _fail(f"{where}: classes streams are stored raw")
            try:
                _cl._check_table(c["cls"], w, _cl.MANTISSA[dtype], k)
            except DeltaFormatError as e:
                _fail(f"{where}: {e}")
            rows = tuple(tuple(r) for r in c["cls"])
        else:
            # the raw sizes are what a decoder allocates: bound them by k and n, never trust them
            _need(c["vraw"] == k * w, f"{where}: value stream of {c['vraw']} raw bytes for {k} x {w}")
            praw_max = {_p.DENSE: 0, _p.BITMAP: (n + 7) // 8}.get(pos, 10 * k)
            _need(c["praw"] <= praw_max if pos == _p.GAPS else c["praw"] == praw_max,
                  f"{where}: position stream of {c['praw']} raw bytes for {pos} positions")
            _need(c["pz"] or c["plen"] == c["praw"], f"{where}: stored position stream length")
            _need(c["vz"] or c["vlen"] == c["vraw"], f"{where}: stored value stream length")
        return _built(cls, {"start": start, "n": n, "k": k, "enc": enc, "pos": pos, "off": c["off"],
                            "plen": c["plen"], "vlen": c["vlen"], "praw": c["praw"], "vraw": c["vraw"],
                            "pz": c["pz"], "vz": c["vz"], "crc": c["crc"], "pre": c["pre"], "post": c["post"],
                            "cls": rows, "values_algo": values_algo})


def _check_algo(digest, where: str) -> None:
    """A tensor digest in an algorithm this build does not know cannot be checked: refused with
    the header, before anything is planned or written (``state.digest.algo_of``)."""
    if isinstance(digest, str) and digest:
        try:
            algo_of(digest)
        except ValueError as e:
            _need(False, f"{where}: {e}")


def _region(t: dict, name: str) -> tuple[list, ShardSpec]:
    """An entry's global ``shape`` and its ``region`` in it, checked."""
    shape = t.get("shape")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and _ints(shape, MAX_ELEMENTS)):
        _fail(f"{name}: shape")
    r = t.get("region")
    if not isinstance(r, dict):
        _fail(f"{name}: region")
    for key in ("offsets", "shape"):
        v = r.get(key)
        if not (isinstance(v, list) and len(v) == len(shape) and _ints(v, MAX_ELEMENTS)):
            _fail(f"{name}: region {key}")
    for o, n, g in zip(r["offsets"], r["shape"], shape):
        if o + n > g:
            _fail(f"{name}: region outside tensor")
    if math.prod(shape) > MAX_ELEMENTS:
        _fail(f"{name}: more than {MAX_ELEMENTS} elements")
    return shape, ShardSpec(tuple(shape), tuple(r["offsets"]), tuple(r["shape"]))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the delta: its canonical name, dtype, global shape and the region sent."""

    name: str
    kind: TensorKind
    dtype: str | None = None  # None for a removed tensor
    shape: tuple | None = None  # global shape (None for a removed tensor)
    region: ShardSpec | None = None
    base_digest: str | None = None
    target_digest: str | None = None
    chunks: tuple = ()
    #: a removed tensor's region its base digest is of, where the sender held part of it (version
    #: 4; None: the whole tensor). Apart from ``region``, which a removed entry never has
    base_region: ShardSpec | None = None

    @property
    def removed(self) -> bool:
        return self.kind == TensorKind.REMOVED

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None:
            raise ValueError(f"{self.name}: a removed tensor has no dtype")
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        """Elements of the region sent (0 for a removed tensor)."""
        return self.region.numel if self.region is not None else 0

    @classmethod
    def parse(cls, t, *, chunk_elems: int, payload_end: int, version: Version) -> TensorEntry:
        # (as ChunkEntry.parse: once per tensor piece of every apply; messages only on failure)
        if not (isinstance(t, dict) and isinstance(t.get("name"), str)):
            _fail("tensor entry")
        name = t["name"]
        kind = t.get("kind")
        kind = _KINDS.get(kind) if isinstance(kind, str) else None
        if kind is None:
            _fail(f"{name}: kind")
        bd = t.get("base_digest")
        if not (bd is None or isinstance(bd, str)):
            _fail(f"{name}: base_digest")
        _check_algo(bd, f"{name}: base_digest")
        if kind == TensorKind.REMOVED:
            return cls(name=name, kind=kind, base_digest=bd or None,
                       base_region=_region(t, name)[1] if "region" in t else None)
        if not (isinstance(t.get("dtype"), str) and t["dtype"] in DTYPES):
            _fail(f"{name}: dtype")
        if not isinstance(t.get("target_digest"), str):
            _fail(f"{name}: target_digest")
        _check_algo(t["target_digest"], f"{name}: target_digest")
        if kind == TensorKind.DELTA and not isinstance(bd, str):
            _fail(f"{name}: base_digest")
        shape, region = _region(t, name)
        dtype = DTYPES[t["dtype"]]
        w = dtype.itemsize
        if not isinstance(t.get("chunks"), list):
            _fail(f"{name}: chunks")
        chunks, end, numel, full = [], 0, region.numel, kind == TensorKind.FULL
        for c in t["chunks"]:
            ch = ChunkEntry.parse(c, name, w=w, dtype=dtype, kind=kind, numel=numel,
                                  chunk_elems=chunk_elems, payload_end=payload_end,
                                  values_algo=version.values_digest)
            if full and not (ch.start == end and ch.k == ch.n):
                _fail(f"{name}: full tensor chunks must be dense and contiguous")
            if ch.start < end:
                _fail(f"{name}: chunk range")
            end = ch.start + ch.n
            chunks.append(ch)
        if full and not (end == numel and all(c.enc == _c.OVERWRITE for c in chunks)):
            _fail(f"{name}: full tensor not covered")
        return _built(cls, {"name": name, "kind": kind, "dtype": t["dtype"], "shape": tuple(shape),
                            "region": region, "base_digest": bd, "target_digest": t["target_digest"],
                            "chunks": tuple(chunks), "base_region": None})


@dataclass(frozen=True)
class DeltaHeader:
    """The parsed header of one delta (docs/format.md, "Header")."""

    format: int
    tensors: tuple
    tool: str | None = None
    created: float | None = None
    encoding: str | None = None
    level: int | None = None
    chunk_elems: int | None = None
    base_digest: str | None = None
    target_digest: str | None = None
    meta: dict = field(default_factory=dict)  # free-form (the file layer's layout lives here)

    def entry(self, name: str) -> TensorEntry | None:
        return next((t for t in self.tensors if t.name == name), None)

    @property
    def names(self) -> list:
        return [t.name for t in self.tensors]


def parse_header(h, payload_end: int, version: Version = VERSIONS[FORMAT_VERSION]) -> DeltaHeader:
    """Type- and range-check the JSON header of a delta of format ``version`` (the container's)
    and return it typed; ``DeltaFormatError`` otherwise."""
    _need(isinstance(h, dict), "not an object")
    _need(h.get("format") == version.number and not isinstance(h.get("format"), bool),
          f"format field (the container says version {version.number})")
    _need(isinstance(h.get("tensors"), list), "tensors is not a list")
    ce = h.get("chunk_elems", MAX_CHUNK_ELEMS)
    _need(_int(ce, 1, MAX_CHUNK_ELEMS), f"chunk_elems must be an integer in [1, {MAX_CHUNK_ELEMS}]")
    for key, typ in (("tool", str), ("encoding", str), ("base_digest", str), ("target_digest", str),
                     ("meta", dict)):
        _need(h.get(key) is None or isinstance(h[key], typ), f"{key}")
    _need(h.get("level") is None or _int(h["level"], -(1 << 31), 1 << 31), "level")
    _need(h.get("created") is None or (isinstance(h["created"], (int, float)) and not isinstance(h["created"], bool)),
          "created")
    tensors, seen = [], set()
    for t in h["tensors"]:
        e = TensorEntry.parse(t, chunk_elems=ce, payload_end=payload_end, version=version)
        _need(e.name not in seen, f"duplicate tensor {e.name!r}")
        seen.add(e.name)
        tensors.append(e)
    return DeltaHeader(format=h["format"], tensors=tuple(tensors), tool=h.get("tool"), created=h.get("created"),
                       encoding=h.get("encoding"), level=h.get("level"), chunk_elems=h.get("chunk_elems"),
                       base_digest=h.get("base_digest"), target_digest=h.get("target_digest"),
                       meta=h.get("meta") or {})
