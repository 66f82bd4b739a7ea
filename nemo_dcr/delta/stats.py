"""What is inside a delta: sizes by stream and by encoding, change rate, bytes per change."""
from __future__ import annotations

import math
from collections import Counter

from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.state.dtypes import dtype_from_name, itemsize


def inspect(delta, *, check: bool = True) -> dict:
    """Sizes and rates of a delta. ``check=False`` skips the chunk checksums (for a delta this
    process has just written, where reading every payload again is wasted work)."""
    r = DeltaReader.open(delta)
    if check:
        r.check_payloads()
    h = r.header
    elements = changed = dense = 0
    by_stream: Counter[str] = Counter()
    by_encoding: Counter[str] = Counter()
    by_position: Counter[str] = Counter()
    chunks_by_encoding: Counter[str] = Counter()
    tensors = []
    for t in h.tensors:
        if t.removed:
            tensors.append({"name": t.name, "kind": t.kind.value})
            continue
        w = itemsize(t.torch_dtype)
        n = t.numel
        k = sum(c.k for c in t.chunks)
        b = sum(c.payload_len for c in t.chunks)
        elements += n
        changed += k
        dense += n * w
        for c in t.chunks:
            by_stream["positions"] += c.plen
            by_stream["values"] += c.vlen
            by_encoding[c.enc] += c.payload_len
            by_position[c.pos] += c.plen
            chunks_by_encoding[c.enc] += 1
        tensors.append({"name": t.name, "kind": t.kind.value, "dtype": t.dtype, "elements": n,
                        "changed": k, "bytes": b, "chunks": len(t.chunks)})
    total = r.size
    by_stream["header"] = total - by_stream["positions"] - by_stream["values"]
    return {
        "format": h.format,
        "tool": h.tool,
        "encoding": h.encoding,
        "level": h.level,
        "bytes": total,
        "tensors": len([t for t in tensors if t["kind"] != "removed"]),
        "elements": elements,
        "changed": changed,
        "change_rate": changed / elements if elements else 0.0,
        "dense_bytes": dense,
        "ratio_to_dense": dense / total if total else 0.0,
        "bytes_per_changed": total / changed if changed else None,
        "bytes_by_stream": dict(by_stream),
        "bytes_by_encoding": dict(by_encoding),
        "chunks_by_encoding": dict(chunks_by_encoding),
        "position_bytes_by_coding": dict(by_position),
        "base_digest": h.base_digest,
        "target_digest": h.target_digest,
        "per_tensor": tensors,
    }


def totals(header: dict) -> tuple[int, int, int]:
    """``(elements, changed, dense_bytes)`` of the delta whose header ``diff(..., out=f)``
    returned: what :func:`inspect` counts, for a delta streamed away and not read back."""
    elements = changed = dense = 0
    for t in header["tensors"]:
        if t["kind"] != "removed":
            n = math.prod(t["region"]["shape"])
            elements += n
            changed += sum(c["k"] for c in t["chunks"])
            dense += n * itemsize(dtype_from_name(t["dtype"]))
    return elements, changed, dense


def format_text(s: dict) -> str:
    def mib(b):
        return f"{b / 2**20:.3f} MiB" if b >= 2**20 else f"{b} B"

    lines = [
        f"format            v{s['format']} ({s['tool']}), encoding {s['encoding']}, zstd level {s['level']}",
        f"tensors           {s['tensors']}",
        f"elements          {s['elements']:,} ({s['changed']:,} changed, {100 * s['change_rate']:.4f} %)",
        f"delta size        {mib(s['bytes'])}  (dense {mib(s['dense_bytes'])}, ratio {s['ratio_to_dense']:.2f}x)",
        "bytes per change  " + (f"{s['bytes_per_changed']:.4f}" if s["bytes_per_changed"] is not None else "n/a"),
        "by stream         " + ", ".join(f"{k} {mib(v)}" for k, v in s["bytes_by_stream"].items()),
        "by encoding       " + (", ".join(f"{k} {mib(v)} ({s['chunks_by_encoding'][k]} chunks)"
                                          for k, v in s["bytes_by_encoding"].items()) or "none"),
        "positions coded   " + (", ".join(f"{k} {mib(v)}" for k, v in s["position_bytes_by_coding"].items()) or "none"),
        f"base digest       {s['base_digest']}",
        f"target digest     {s['target_digest']}",
    ]
    return "\n".join(lines)
