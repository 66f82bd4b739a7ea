"""Reference codec for one chunk, in pure PyTorch. It defines the bytes of the format.

A chunk is a contiguous range ``[start, start + n)`` of a region's flat index. Encoding:

1. ``x = old_bits ^ new_bits`` on integer views; the changed positions are ``x != 0``.
2. Positions are coded (``positions.py``); values are the new bits (``overwrite``), ``x`` at
   the changed positions (``xor``), or the difference in the format's monotone order (``add``,
   ``ordered.py``), split into byte planes (``planes.py``).
3. Each stream is zstd-compressed, or stored raw when zstd does not make it smaller.

   Or (``classes``, ``classes.py``): positions and values coded together, modelled on the base
   value's exponent, with Rice codes; no zstd. It needs the whole base chunk to decode.
4. ``pre``/``post`` are digests of the old and new bits at the changed positions (BLAKE3-64 in
   format version 2, BLAKE2b-64 in version 1: ``values_algo``, codec/versions.py). The
   receiver checks the bits it holds against them before touching anything: ``pre`` means
   "apply", ``post`` means "already applied, skip" (so an XOR re-delivered is harmless),
   anything else is a wrong base.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import zstandard

from nemo_dcr.codec import classes, native, ordered, planes, positions
from nemo_dcr.codec.checksum import crc32

# the coding names live in the torch-free names.py (the CLI offers them); re-exported from here
from nemo_dcr.codec.names import ADD, AUTO, CHOICES, CLASSES, ENCODINGS, OVERWRITE, PORTABLE, XOR  # noqa: F401
from nemo_dcr.codec.ordered import to_bits, unsigned
from nemo_dcr.codec.versions import FORMAT_VERSION, VERSIONS
from nemo_dcr.errors import DcrError, DeltaFormatError
from nemo_dcr.state.digest import values_digest

if TYPE_CHECKING:
    from nemo_dcr.codec.header import ChunkEntry

_PREFER = {CLASSES: 0, XOR: 1, ADD: 2, OVERWRITE: 3}  # ties
CLASSES_ENOUGH = 1.0  # auto: a classes chunk at or under this many bytes per change is taken without trying the rest
_ROW_BYTES = 8  # auto: what one classes table row costs in the (zstd-compressed) header, roughly
#: the fewest bytes of a zstd frame of non-empty content as ``pack`` makes them (the magic number,
#: the frame header with its content size, which ``check_frame`` requires, a block header and a
#: byte): no value stream of k changes of w bytes is shorter than min(k * w, MIN_FRAME)
MIN_FRAME = 10
VALUES_ALGO = VERSIONS[FORMAT_VERSION].values_digest  # the pre/post digests a writer makes by default

_tls = threading.local()

#: chunks up to these many elements are ``light``: a delta's chunk (its positions coded, its
#: elements mostly unchanged) and a dense one (every element sent: a keyframe's, a tensor sent
#: whole), whose C work per element is several times a delta's. Dense: 64K. At 16K a keyframe
#: of 4096 tensors of 32K BF16 took 1.88-2.17 s to publish on two workers against 1.33 s with
#: its chunks on the calling thread, and synced in 1.88 s against 1.42; at 64K elements publish
#: 0.95-1.07 s against 1.20-1.22, sync the same; from 128K on two workers tie or win
#: (``bench/tensors.py``; docs/results.md, "Format version 4, fifth turn")
LIGHT_DELTA = 1 << 18
LIGHT_DENSE = 1 << 16


def light(n: int, dense: bool) -> bool:
    """Whether encoding or applying a chunk of ``n`` elements is mostly the Python around its C
    calls (~0.1-0.3 ms), so that a stream of them runs faster on one thread than on two
    (``util.parallel.ordered_map``'s ``light``; measured in docs/results.md, twenty-second turn)."""
    return n <= (LIGHT_DENSE if dense else LIGHT_DELTA)


#: streams of at least this many bytes are made with ``_fast_params`` at level 1, and the byte
#: planes of a chunk's own values each in blocks of their own (``pack``). At 512 bytes the two
#: ways took about the same time (4.5-4.6 against 4.7-5.2 us for BF16 planes, 19 % smaller);
#: smaller streams, and so the golden deltas (streams of at most 72 bytes), keep the bytes earlier
#: builds made of them.
FAST_STREAM = 512
ZSTD_BLOCK = 128 * 1024  # the largest block of a zstd frame (ZSTD_BLOCKSIZE_MAX)


def _fast_params(level: int) -> zstandard.ZstdCompressionParameters:
    """Level 1: zstd's fast strategy with a 64-entry hash table and 7-byte matches. Byte planes of
    weights are nearly all literals (entropy-coded bytes, few repeats), so level 1's 64 KiB match
    table is mostly cache misses for nothing: measured on BF16, FP16 and FP32 keyframe planes
    (2 MiB) these frames are 0-2 % smaller and 1.3-2.3x faster to make (docs/results.md, "Keyframe
    publish"); on the streams of a delta's changes (positions, xor and add planes; 1-100 KiB)
    within 1.5 % of level 1's size (add planes up to 9 % smaller) and up to 2x faster to make
    (docs/results.md, thirtieth turn). Standard frames: any zstd decodes them."""
    return zstandard.ZstdCompressionParameters(compression_level=level, strategy=zstandard.STRATEGY_FAST,
                                               window_log=17, hash_log=6, chain_log=6, search_log=1,
                                               min_match=7, target_length=0, write_content_size=True)


def _compressor(level: int, fast: bool = False) -> zstandard.ZstdCompressor:
    """A per-thread compressor. ``fast``: the stream is at least ``FAST_STREAM`` bytes; at level 1
    (the default) it then gets ``_fast_params``; other levels are zstd's own."""
    cache = getattr(_tls, "c", None)
    if cache is None:
        cache = _tls.c = {}
    key = (level, fast and level == 1)
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(compression_params=_fast_params(level)) if key[1] \
            else zstandard.ZstdCompressor(level=level)
    return cache[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "d", None)
    if d is None:
        d = _tls.d = zstandard.ZstdDecompressor()
    return d


def pack(raw: bytes, level: int, parts: int = 1):
    """(stored bytes, zstd?) -- zstd only when it is smaller. ``parts``: ``raw`` is that many byte
    planes of equal length (``planes.split``), each then compressed in blocks of its own (one
    frame, flushed at each plane's end: ``_in_blocks``) from ``FAST_STREAM`` bytes on, where
    zstd's own blocks would hold two planes' bytes (see below)."""
    if not raw:
        return b"", False
    fast = len(raw) >= FAST_STREAM
    c = _compressor(level, fast)
    # zstd cuts a frame into blocks of ZSTD_BLOCK: planes of a multiple of that (a large tensor's
    # chunks) are apart in its blocks already, and from 8 blocks a plane on at most one block in
    # eight holds two planes' bytes. There one call, which reads its input where it is, made the
    # frame 12-23 % faster than the streaming calls of _in_blocks, for frames under 1 % larger
    # (docs/results.md, thirtieth turn)
    plane = len(raw) // parts
    split = fast and parts > 1 and plane < 8 * ZSTD_BLOCK and plane % ZSTD_BLOCK != 0
    z = _in_blocks(c, raw, parts) if split else c.compress(raw)
    return (z, True) if len(z) < len(raw) else (raw, False)


def _in_blocks(c: zstandard.ZstdCompressor, raw, parts: int) -> bytes:
    """One frame of ``raw``'s ``parts`` equal planes, a block boundary at each plane's end. A
    chunk's own values (a keyframe's, an overwrite chunk's): their exponent bytes and mantissa
    bytes differ in statistics, and in one block zstd codes them with one literal table. Block by
    block the mantissa planes get a literal table of their own and the exponent plane its own:
    BF16 and FP32 planes of 512 bytes to 128 KiB 13-19 % smaller than one level-1 block, decoded
    1.8-4.5x faster, made about as fast or faster; planes of 128 KiB to 1 MiB whose length is not
    a multiple of ``ZSTD_BLOCK`` (one of zstd's blocks then holds the end of one plane and the
    start of the next) 0.7-4 % smaller, decoded 1.07-1.5x faster, made up to 12 % slower
    (docs/results.md, thirtieth turn). The planes of an xor or add of the changes are small
    numbers in every byte; there a block each measured no smaller and a little slower to make, so
    those are not split."""
    m = memoryview(raw).cast("B")
    k = len(m) // parts
    o = c.compressobj(size=len(m))
    out = []
    for p in range(parts):
        out.append(o.compress(m[p * k:(p + 1) * k]))
        out.append(o.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK if p < parts - 1 else zstandard.COMPRESSOBJ_FLUSH_FINISH))
    return b"".join(out)


def check_frame(stored, raw_len: int) -> None:
    """A zstd frame may declare its content size, and zstd allocates what it declares whatever
    ``max_output_size`` says: compare it with the header's before decompressing anything. Every
    frame a writer makes declares it (``ZstdCompressor.compress``), so one that does not is
    refused here too: otherwise only decompressing it would tell that it expands past the header's
    length (a zstd bomb), which is too late for a check made before the first write."""
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        raise DeltaFormatError(f"zstd stream does not decode: {e}") from None
    if declared == -1:
        raise DeltaFormatError(f"zstd frame does not declare its content size (header says {raw_len} bytes)")
    if declared != raw_len:
        raise DeltaFormatError(f"zstd frame declares {declared} bytes, header says {raw_len}")


def unpack(stored, compressed: bool, raw_len: int) -> bytes:
    if not compressed:
        if len(stored) != raw_len:
            raise DeltaFormatError(f"stream is {len(stored)} bytes, header says {raw_len}")
        return bytes(stored)
    check_frame(stored, raw_len)
    try:
        out = _decompressor().decompress(stored, max_output_size=raw_len)
    except (zstandard.ZstdError, MemoryError, OverflowError) as e:
        raise DeltaFormatError(f"zstd stream does not decode: {e}") from None
    if len(out) != raw_len:
        raise DeltaFormatError(f"zstd stream gives {len(out)} bytes, header says {raw_len}")
    return out


@dataclass
class EncodedChunk:
    start: int
    n: int
    k: int
    enc: str
    pos: str
    pos_bytes: bytes
    val_bytes: bytes
    pos_raw: int
    val_raw: int
    pos_z: bool
    val_z: bool
    pre: str
    post: str
    alt_val_len: dict  # stored value bytes of every encoding tried (for inspect/bench)
    changes: tuple | None = None  # (positions, old bits or None, new bits) when asked for
    cls: list | None = None  # the classes table (classes coding only)
    values_algo: str = VALUES_ALGO  # what pre/post are made with (not in the header: the format version says)
    crc: int | None = None  # of the payload; computed with the chunk (on the encoding thread) when None

    def __post_init__(self):
        if self.crc is None:
            self.crc = crc32(self.val_bytes, crc32(self.pos_bytes))

    def entry(self, offset: int) -> ChunkEntry:
        """The typed entry a reader would parse from ``header(offset)``."""
        from nemo_dcr.codec.header import ChunkEntry
        h = self.header(offset)
        h["cls"] = tuple(tuple(r) for r in h["cls"]) if "cls" in h else None
        return ChunkEntry(**h, values_algo=self.values_algo)

    def header(self, offset: int) -> dict:
        extra = {"cls": self.cls} if self.cls is not None else {}
        return {**extra,
            "start": self.start, "n": self.n, "k": self.k, "enc": self.enc, "pos": self.pos,
            "off": offset, "plen": len(self.pos_bytes), "vlen": len(self.val_bytes),
            "praw": self.pos_raw, "vraw": self.val_raw, "pz": self.pos_z, "vz": self.val_z,
            "crc": self.crc,
            "pre": self.pre, "post": self.post,
        }


def encode_chunk(old: torch.Tensor | None, new: torch.Tensor, start: int, encoding: str = AUTO,
                 level: int = 3, keep_changes: bool = False, is_float: bool = True,
                 dtype: torch.dtype | None = None, values_algo: str = VALUES_ALGO,
                 write_base: bool = False) -> EncodedChunk | None:
    """old/new: 1-D integer views of the chunk. ``old=None`` means "no base": every element
    is sent, overwrite. Returns None when nothing changed. ``write_base``: ``old`` (a contiguous
    view of the caller's base) is brought to ``new`` by the changes as they are found (the
    ``classes`` kernel's pass writes them while they are in cache); the codings after it read
    the changes alone, not ``old``. On an error ``old`` is as it was.

    ``auto`` (the default): where the dtype allows it, ``classes`` first; if that costs more than
    ``CLASSES_ENOUGH`` bytes per change, xor, add and overwrite too, and the smallest wins.
    ``portable``: the smallest of xor, add and overwrite. ``dtype`` (the tensor's) enables
    ``classes``; without it only the other codings are used. ``values_algo``: the pre/post
    digests' algorithm, as the delta's format version says (codec/versions.py)."""
    n = new.numel()
    encoding, use_classes = plan_encoding(encoding, old is not None, dtype)
    cls_try = None
    if use_classes:
        assert old is not None and dtype is not None  # plan_encoding tries classes only with both
        k, rows, pbytes, vbytes, idx, prev, newv = classes.encode(old, new, classes.MANTISSA[dtype],
                                                                 with_changes=True, write_base=write_base)
        if k == 0:
            return None
        cls_try = (k, rows, pbytes, vbytes)
    elif old is None:
        # every element is sent (dense positions): the indices only for callers that keep changes
        idx = torch.arange(n, dtype=torch.int64) if keep_changes else None
        newv, prev = new, None
    else:
        x = torch.bitwise_xor(old, new)
        idx = torch.nonzero(x).squeeze(1)
        if idx.numel() == 0:
            return None
        newv, prev = new[idx], old[idx]  # (copies: old may be written below)
        if write_base:
            old.scatter_(0, idx, newv)
    try:
        return encode_changes(idx, prev, newv, n, start, encoding, level, keep_changes, is_float, cls_try,
                              values_algo)
    except BaseException:
        if write_base and old is not None and prev is not None:
            old.scatter_(0, idx, prev)  # nothing stays written
        raise


def plan_encoding(encoding: str, has_base: bool, dtype: torch.dtype | None) -> tuple[str, bool]:
    """-> (the encoding to use, whether to try ``classes``): ``classes`` asked where it does not
    apply becomes the smallest of the rest."""
    use_classes = has_base and dtype is not None and classes.applicable(dtype) and encoding in (AUTO, CLASSES)
    if encoding == CLASSES and not use_classes:
        encoding = AUTO if not has_base else PORTABLE
    return encoding, use_classes


def encode_changes(idx: torch.Tensor | None, prev: torch.Tensor | None, newv: torch.Tensor, n: int, start: int,
                   encoding: str, level: int = 3, keep_changes: bool = False, is_float: bool = True,
                   cls_try: tuple | None = None, values_algo: str = VALUES_ALGO) -> EncodedChunk:
    """The chunk from its changes alone (O(changes)): ``idx`` their positions in the chunk
    (increasing; None: all ``n``, a chunk sent whole), ``prev``/``newv`` their old (None: no
    base, every element sent) and new bits,
    ``cls_try`` the ``classes`` coding of the chunk (k, rows, position bytes, value bytes) where
    ``plan_encoding`` says to try it. What ``encode_chunk`` ends with, and what the device path
    (``nemo_dcr/device``) calls with the compact change stream, so both give the same bytes."""
    if cls_try is not None:
        k, rows, pbytes, vbytes = cls_try
        cost = len(pbytes) + len(vbytes) + _ROW_BYTES * len(rows)
        if encoding == CLASSES or cost <= CLASSES_ENOUGH * k:
            return _classes_chunk(prev, newv, start, n, cls_try, {CLASSES: cost}, keep_changes, idx, values_algo)
    w = newv.element_size()
    k = n if idx is None else idx.numel()
    pos_coding, pos_raw = (positions.DENSE, b"") if idx is None else positions.encode(idx, n)
    pos_bytes, pos_z = pack(pos_raw, level)
    if cls_try is not None and cost <= len(pos_bytes) + min(k * w, MIN_FRAME):
        # no other coding can be smaller: each sends these positions and a value stream of at
        # least min(k * w, MIN_FRAME) bytes (stored raw, or a zstd frame), so ``classes`` wins
        # as it would after trying them (ties go to it). Small chunks' tables cost more per
        # change: at 16K elements 42 % of chunks missed the early-out above, and all of them
        # won with ``classes`` after three more zstd calls (docs/results.md, twenty-third turn)
        return _classes_chunk(prev, newv, start, n, cls_try, {CLASSES: cost}, keep_changes, idx, values_algo)
    xorv = None if prev is None else torch.bitwise_xor(prev, newv)
    tried = {}
    mixed = encoding in (AUTO, PORTABLE)
    if mixed or encoding == OVERWRITE or xorv is None:
        tried[OVERWRITE] = pack(planes.split(newv), level, w)
    add_ok = xorv is not None and w in ordered.WIDTHS
    if xorv is not None and (mixed or encoding == XOR or (encoding == ADD and not add_ok)):
        tried[XOR] = pack(planes.split(xorv), level)
    if add_ok and (mixed or encoding == ADD):
        assert prev is not None  # add_ok: there is a base (xorv is not None)
        tried[ADD] = pack(planes.split(ordered.encode(prev, newv, is_float)), level)
    sizes = {e: len(v[0]) + len(pos_bytes) for e, v in tried.items()}
    if cls_try is not None:
        sizes[CLASSES] = len(cls_try[2]) + len(cls_try[3]) + _ROW_BYTES * len(cls_try[1])
    enc = min(sizes, key=lambda e: (sizes[e], _PREFER[e]))
    if enc == CLASSES:
        return _classes_chunk(prev, newv, start, n, cls_try, sizes, keep_changes, idx, values_algo)
    val_bytes, val_z = tried[enc]
    return EncodedChunk(
        start=start, n=n, k=k, enc=enc, pos=pos_coding, pos_bytes=pos_bytes, val_bytes=val_bytes,
        pos_raw=len(pos_raw), val_raw=k * w, pos_z=pos_z, val_z=val_z,
        pre=values_digest(prev, values_algo) if prev is not None else "", post=values_digest(newv, values_algo),
        alt_val_len={e: len(v[0]) for e, v in tried.items()},
        changes=(idx, prev, newv) if keep_changes else None, values_algo=values_algo,
    )


def _classes_chunk(prev, newv, start, n, cls_try, sizes, keep_changes, idx, values_algo) -> EncodedChunk:
    k, rows, pbytes, vbytes = cls_try
    return EncodedChunk(
        start=start, n=n, k=k, enc=CLASSES, pos=CLASSES, pos_bytes=pbytes, val_bytes=vbytes,
        pos_raw=len(pbytes), val_raw=len(vbytes), pos_z=False, val_z=False,
        pre=values_digest(prev, values_algo), post=values_digest(newv, values_algo), alt_val_len=dict(sizes),
        changes=(idx, prev, newv) if keep_changes else None, cls=rows, values_algo=values_algo,
    )


def _classes_payload_entry(h: ChunkEntry, w: int, dtype: torch.dtype | None) -> None:
    """What a ``classes`` chunk's entry must be for its streams to be read."""
    if h.enc != h.pos or h.pz or h.vz or h.cls is None:
        raise DeltaFormatError("malformed classes chunk entry")
    if dtype is None or not classes.applicable(dtype) or w != dtype.itemsize:
        raise DeltaFormatError(f"a classes chunk for dtype {dtype}")
    if h.plen != h.praw or h.vlen != h.vraw:
        raise DeltaFormatError("classes chunk stream lengths differ from the header")


def _classes_payload(h: ChunkEntry, payload, w: int, dtype: torch.dtype | None) -> tuple[bytes, bytes, int]:
    """A ``classes`` chunk's two streams, checked against its entry -> (positions, values, mantissa bits)."""
    _classes_payload_entry(h, w, dtype)
    assert dtype is not None  # (_classes_payload_entry)
    p = memoryview(payload)
    pos_raw = bytes(p[: h.plen])
    val_raw = bytes(p[h.plen:])
    if len(pos_raw) != h.praw or len(val_raw) != h.vraw:
        raise DeltaFormatError("classes chunk stream lengths differ from the header")
    return pos_raw, val_raw, classes.MANTISSA[dtype]


def decode_chunk(h: ChunkEntry, payload, w: int, base: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None, with_old: bool = False, into: bool = False,
                 checked: bool = False, offset: int = 0):
    """Chunk entry + its payload bytes -> (positions relative to the chunk, plus ``offset``;
    value bits).

    A ``classes`` chunk also needs ``base`` (the receiver's bits of the whole chunk, 1-D integer
    view) and ``dtype``; its values are the new bits, not a difference. ``with_old``: a third
    item, the base bits at the positions where the decode read them (``classes`` chunks), else
    None (the caller gathers them). ``into``: a ``classes`` chunk's new bits are also written
    into ``base`` (``classes.decode``'s ``into``; other codings ignore it: the caller writes).
    ``checked``: the caller checked the payload's checksum already (``DeltaReader.check_payloads``,
    which ``apply`` runs before its first write): it is not computed a second time."""
    if not checked and crc32(payload) != h.crc:
        raise DeltaFormatError("chunk checksum mismatch")
    p = memoryview(payload)
    if h.enc == CLASSES or h.pos == CLASSES:
        pos_raw, val_raw, mant = _classes_payload(h, payload, w, dtype)
        if base is None or base.numel() != h.n:
            raise DeltaFormatError("a classes chunk decodes only against the whole base chunk")
        return classes.decode(base, h.cls, pos_raw, val_raw, h.k, mant, with_old=with_old, into=into,
                              offset=offset, table_checked=True)
    if h.vraw != h.k * w:  # what planes.join would allocate: never more than the header's k allows
        raise DeltaFormatError(f"value stream of {h.vraw} bytes for {h.k} changes of {w} bytes")
    pos_raw = unpack(p[: h.plen], h.pz, h.praw)
    val_raw = unpack(p[h.plen:], h.vz, h.vraw)
    idx = positions.decode(h.pos, pos_raw, h.n, h.k)
    if offset:
        idx += offset  # (a fresh array: in place)
    vals = planes.join(val_raw, h.k, w)
    return (idx, vals, None) if with_old else (idx, vals)


def dense_stream(h: ChunkEntry, payload, w: int, checked: bool = False):
    """The value stream of a chunk whose positions are ``dense`` (every element of its range, in
    order: a keyframe's chunk, a tensor sent whole), checked and decompressed: its byte planes,
    which ``planes.join`` turns into the values, or writes straight into a receiver's range. The
    positions are the range itself (an int64 array of the chunk's length, not made). ``checked``:
    as ``decode_chunk``'s (a keyframe's payload was CRC'd twice: once per object before the first
    write, then again chunk by chunk)."""
    if not checked and crc32(payload) != h.crc:
        raise DeltaFormatError("chunk checksum mismatch")
    if h.pos != positions.DENSE or h.k != h.n or h.plen or h.praw:
        raise DeltaFormatError("dense positions with a non-full chunk or a payload")
    if h.vraw != h.k * w:
        raise DeltaFormatError(f"value stream of {h.vraw} bytes for {h.k} changes of {w} bytes")
    return unpack(memoryview(payload)[h.plen:], h.vz, h.vraw)


def locate_chunk(h: ChunkEntry, payload, base: torch.Tensor, dtype: torch.dtype):
    """A ``classes`` chunk decoded against ``base`` (its whole base chunk, an integer view) held
    anywhere, a GPU included -> (positions relative to the chunk, new bits), both where ``base``
    is. The streams are decoded on the host without the base (``classes.decode_streams``,
    O(changes)); only they cross, and ``classes.locate`` places them against ``base`` there.
    ``classes.RankPastClass`` (a ``DeltaFormatError``): the streams do not fit ``base``. What
    ``decode_chunk`` does with the fused C scan, for a base the C kernel cannot read."""
    w = base.element_size()
    cls, rank, d = (x.to(base.device) for x in chunk_streams(h, payload, w, dtype))
    idx, un = classes.locate(unsigned(base), h.cls, cls, rank, d, w, classes.MANTISSA[dtype])
    return idx, to_bits(un, w).view(base.dtype)


def chunk_streams(h: ChunkEntry, payload, w: int, dtype: torch.dtype):
    """A ``classes`` chunk's streams decoded on the host without its base -> per change (class,
    rank among the base chunk's elements of that class in index order, value difference), int64;
    O(changes). ``locate_chunk`` places them against a base held anywhere; a receiver group whose
    ranks hold the chunk between them places them from the ranks' class counts
    (``sync/chunk_gather.py``)."""
    if crc32(payload) != h.crc:
        raise DeltaFormatError("chunk checksum mismatch")
    pos_raw, val_raw, mant = _classes_payload(h, payload, w, dtype)
    return classes.decode_streams(h.cls, pos_raw, val_raw, h.k, h.n, w, mant, table_checked=True)


class StreamsDoNotDecode(DeltaFormatError):
    """A chunk of ``chunk_streams_many`` that fails its checksum or does not decode; ``call``: which."""

    def __init__(self, message: str, call: int):
        super().__init__(message)
        self.call = call


def chunk_streams_many(bufs: Sequence, chunks: Sequence[tuple[int, ChunkEntry, torch.dtype]],
                       use_native: bool | None = None):
    """``chunk_streams`` of many ``classes`` chunks in one kernel call: chunk ``i`` is
    ``chunks[i] = (b, entry, dtype)``, its payload in the object ``bufs[b]`` (a ``DeltaReader``'s
    buffer: the entry's offsets are in it) -> (class, rank, difference: every chunk's changes one
    after another, int64 numpy arrays; where each chunk's start, and the total last). A receiver
    group decodes a version's chunks held in part this way (thousands from an FSDP trainer's
    shards, where each call cost ~15-30 us of Python around a few of C). ``StreamsDoNotDecode``
    names the first chunk that fails."""
    lib = native.lib() if use_native is not False else None
    if lib is None:
        if use_native:
            raise DcrError(f"C kernels unavailable: {native.build_error}")
        got = []
        for i, (b, h, dtype) in enumerate(chunks):
            try:
                got.append([x.numpy() for x in chunk_streams(h, memoryview(bufs[b])[h.off:h.off + h.payload_len],
                                                             dtype.itemsize, dtype)])
            except DeltaFormatError as e:
                raise StreamsDoNotDecode(str(e), i) from None
        cat = [np.concatenate([np.empty(0, np.int64)] + [g[j] for g in got]) for j in range(3)]
        return (*cat, classes.offsets(np.array([g[0].size for g in got], dtype=np.int64)))
    holders = [native.buffer_address(b) for b in bufs]  # (kept until the call returns)
    for i, (b, h, dtype) in enumerate(chunks):
        try:
            _classes_payload_entry(h, dtype.itemsize, dtype)
        except DeltaFormatError as e:
            raise StreamsDoNotDecode(str(e), i) from None
        if h.off + h.payload_len > holders[b][0].size:
            raise StreamsDoNotDecode("a chunk's payload past the end of its object", i)
    n = np.array([h.n for _, h, _ in chunks], dtype=np.int64)
    w = np.array([d.itemsize for _, _, d in chunks], dtype=np.int32)
    mant = np.array([classes.MANTISSA[d] for _, _, d in chunks], dtype=np.int32)
    # (every entry's table is there: _classes_payload_entry)
    tab_off = classes.offsets(np.array([len(h.cls or ()) for _, h, _ in chunks], dtype=np.int64))
    table = np.array([v for _, h, _ in chunks for row in h.cls or () for v in row] or [0], dtype=np.int64)
    payload = np.array([holders[b][1] + h.off for b, h, _ in chunks], dtype=np.int64)
    plen = np.array([h.plen for _, h, _ in chunks], dtype=np.int64)
    vlen = np.array([h.vlen for _, h, _ in chunks], dtype=np.int64)
    crc = np.array([h.crc for _, h, _ in chunks], dtype=np.uint32)
    k_off = classes.offsets(np.array([h.k for _, h, _ in chunks], dtype=np.int64))
    out = [np.empty(int(k_off[-1]), dtype=np.int64) for _ in range(3)]
    failed = np.zeros(1, dtype=np.int64)
    args: list[np.ndarray] = [n, w, mant, tab_off, table, payload, plen, vlen, crc, k_off, *out, failed]
    rc = lib.dcr_cls_decode_streams_many(len(chunks), *(a.ctypes.data for a in args))
    if rc:
        why = "chunk checksum mismatch" if rc == classes.E_CRC else \
            f"classes chunk does not decode: {classes.error_name(rc)}"
        raise StreamsDoNotDecode(why, int(failed[0]))
    return (*out, k_off)
