"""Host side of the trainer's device path: the delta chunks of one tensor from its compact
change stream alone (O(changes) on the host), byte for byte what the reference
``codec/chunk.encode_chunk`` makes from the whole (base, target) chunks.

    ch = diff_(snapshot, live, chunk_elems=chunk_elems, use_classes=tries_classes(encoding, dtype))
    chunks = encode_changes_chunks(ch, encoding, level)

The two share one implementation of every coding: ``classes.encode_ranked`` takes the classes
and ranks the device pass found, ``chunk.encode_changes`` the changes; only the finding differs.
"""
from __future__ import annotations

import torch

from nemo_dcr.codec import classes
from nemo_dcr.codec.chunk import EncodedChunk, encode_changes, plan_encoding
from nemo_dcr.codec.ordered import unsigned
from nemo_dcr.device.diff import DeviceChanges
from nemo_dcr.errors import DcrError


def tries_classes(encoding: str, dtype: torch.dtype) -> bool:
    """Whether the reference would try the ``classes`` coding for a delta chunk of ``dtype``
    (so the device pass must find classes and ranks)."""
    return plan_encoding(encoding, True, dtype)[1]


def encode_changes_chunks(ch: DeviceChanges, encoding: str, level: int = 3,
                          keep_changes: bool = False) -> list[EncodedChunk]:
    """The chunks with changes, in order (``start`` relative to the tensor, as ``diff`` writes
    them). ``ch`` must come from ``diff_`` with the delta's ``chunk_elems`` and, where
    ``tries_classes``, with classes and ranks."""
    encoding, use_classes = plan_encoding(encoding, True, ch.dtype)
    if use_classes and ch.cls is None:
        raise DcrError(f"encoding {encoding!r} tries classes for {ch.dtype}: diff_ needs use_classes=True")
    ch = ch.cpu()
    out: list[EncodedChunk] = []
    if not ch.k:
        return out
    w = ch.old.element_size()
    chunk = ch.chunk_elems
    ids, counts = torch.unique_consecutive(ch.pos // chunk, return_counts=True)
    a = 0
    for c, kc in zip(ids.tolist(), counts.tolist()):
        s = slice(a, a + kc)
        start = c * chunk
        n = min(chunk, ch.numel - start)
        prev, newv = ch.old[s], ch.new[s]
        cls_try = None
        if use_classes:
            assert ch.cls is not None and ch.rank is not None  # checked above
            cls_try = classes.encode_ranked(ch.cls[s], ch.rank[s], unsigned(prev), unsigned(newv), w,
                                            classes.MANTISSA[ch.dtype])
        out.append(encode_changes(ch.pos[s] - start, prev, newv, n, start, encoding, level, keep_changes,
                                  ch.dtype.is_floating_point, cls_try))
        a += kc
    return out
