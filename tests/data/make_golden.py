"""Write the golden inputs and deltas in tests/data/golden/ (checked by tests/test_golden.py).

    python tests/data/make_golden.py --version 5   # the deltas of format version 5 (golden_v5/)
    python tests/data/make_golden.py --version 4   # the deltas of format version 4 (golden_v4/)
    python tests/data/make_golden.py --version 3   # the deltas of format version 3 (golden_v3/)
    python tests/data/make_golden.py --version 2   # the deltas of format version 2 (golden_v2/)
    python tests/data/make_golden.py --version 1   # the inputs and version 1 deltas (golden/)

Run it only for a new format version, once: the point of the files is that the bytes of every
encoding of every version stay what they were. Version 1's deltas are in ``golden/`` with the
inputs; each later version's in ``golden_v<N>/``, encoded from the same inputs (``golden/``). The
inputs are seeded, and the header's ``created`` time is pinned (CREATED), so running this twice on
the same code writes the same bytes.

What is written (a few KB each):

* ``base.safetensors`` / ``target.safetensors``: one state in several dtypes (bf16, fp16, fp32,
  fp8 e4m3 and e5m2, int32, uint8), sparse small changes as in a training step, plus NaNs with
  different payloads, -0.0 and subnormals in both, a tensor only in the base (removed), one only
  in the target (created), one unchanged and one empty.
* ``<encoding>.dcr`` for every encoding choice: ``diff(base, target, encoding=..., chunk_elems=CHUNK)``.
* ``shard<r>.dcr``: ``big`` (bf16) split in two row shards, each encoded alone (``portable``, small
  chunks), as two ranks of a sharded trainer would; ``shard_base.safetensors`` /
  ``shard_target.safetensors`` hold the whole tensor.
* ``cli_diff.dcr``: ``nemo-dcr diff base.safetensors target.safetensors`` (default options).
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from unittest import mock

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "golden")  # the inputs, and the deltas of format version 1
VERSIONS = (1, 2, 3, 4, 5)  # format versions with golden deltas


def deltas_dir(version: int) -> str:
    """Where the golden deltas of format ``version`` are."""
    return OUT if version == 1 else os.path.join(HERE, f"golden_v{version}")
ENCODINGS = ("auto", "portable", "classes", "xor", "add", "overwrite")
CHUNK = 256  # elements per chunk: the bigger tensors span several chunks
SHARD_CHUNK = 64
CREATED = 1_700_000_000.0  # the header's "created", pinned so the files are reproducible
LEVEL = 3  # the zstd level the files were written at (the default then; the default is 1 now)


def _bits(t, int_dtype):
    return t.view(int_dtype)


def special_values(dtype, n, seed):
    """``n`` values of ``dtype`` full of the cases that break value-based codecs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype)
    iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    b = _bits(x, iv)
    if dtype == torch.bfloat16:
        pats = [0x7FC0, 0x7FC1, 0xFFC0, 0x7F81, -0x0, 0x8000, 0x0001, 0x8001, 0x007F, 0x7F80, 0xFF80]
    elif dtype == torch.float16:
        pats = [0x7E00, 0x7E01, 0xFE00, 0x7C01, 0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x7C00, 0xFC00]
    elif dtype == torch.float32:
        pats = [0x7FC00000, 0x7FC00001, -0x00400000, 0x7F800001, 0x0, -0x80000000, 0x1, -0x7FFFFFFF, 0x007FFFFF,
                0x7F800000, -0x00800000]
    elif dtype == torch.float8_e4m3fn:
        pats = [0x7F, 0xFF, 0x00, 0x80, 0x01, 0x81, 0x07, 0x87]  # NaNs, +-0, subnormals
    elif dtype == torch.float8_e5m2:
        pats = [0x7D, 0x7E, 0xFF, 0x00, 0x80, 0x01, 0x83, 0x7C, 0xFC]  # NaNs, +-0, subnormals, infs
    else:
        raise ValueError(dtype)
    idx = torch.randperm(n, generator=g)[:len(pats)]
    for i, p in zip(idx.tolist(), pats):
        if iv == torch.int16 and p > 0x7FFF:
            p -= 0x10000
        if iv == torch.uint8:
            p &= 0xFF
        b[i] = p
    return x


def step(base, seed, rate=0.05, scale=1e-2):
    """A training-like update: a few elements move by a small relative amount."""
    g = torch.Generator().manual_seed(seed)
    t = base.clone()
    if t.numel() == 0:
        return t
    flat = t.view(-1)
    k = max(1, int(rate * flat.numel()))
    idx = torch.randperm(flat.numel(), generator=g)[:k]
    if t.dtype.is_floating_point:
        v = flat[idx].float()
        flat[idx] = (v + scale * torch.randn(k, generator=g) * (v.abs() + 1e-3)).to(t.dtype)
    else:
        flat[idx] = flat[idx] + torch.randint(1, 5, (k,), generator=g).to(t.dtype)
    return t


def special_changes(base, target, seed):
    """Also change some bits between special values: NaN payload -> other payload, 0.0 <-> -0.0,
    a subnormal -> another one (value-wise equal or unordered changes a codec must still carry)."""
    iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[base.element_size()]
    tb, bb = _bits(target.view(-1), iv), _bits(base.view(-1), iv)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(tb.numel(), generator=g)[:6].tolist()
    flips = [1, 1 << (8 * base.element_size() - 1), 2, 1, 1 << (8 * base.element_size() - 1), 3]
    for i, f in zip(idx, flips):
        width = 8 * base.element_size()
        v = (int(bb[i]) & ((1 << width) - 1)) ^ f
        if iv != torch.uint8 and v >= 1 << (width - 1):
            v -= 1 << width  # back to the signed integer view
        tb[i] = v


def states():
    base, target = {}, {}
    for name, dtype, shape, seed in (
        ("layer.w_bf16", torch.bfloat16, (24, 40), 1),
        ("layer.w_fp16", torch.float16, (16, 20), 2),
        ("layer.w_fp32", torch.float32, (300,), 3),
        ("layer.w_fp8_e4m3", torch.float8_e4m3fn, (12, 16), 4),
        ("layer.w_fp8_e5m2", torch.float8_e5m2, (96,), 5),
    ):
        b = special_values(dtype, int(torch.Size(shape).numel()), seed).view(shape)
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t = b.clone()
            g = torch.Generator().manual_seed(seed + 100)
            flat = _bits(t.view(-1), torch.uint8)
            idx = torch.randperm(flat.numel(), generator=g)[:10]
            flat[idx] = flat[idx] ^ torch.randint(1, 4, (10,), generator=g).to(torch.uint8)
        else:
            t = step(b, seed + 100)
        special_changes(b, t, seed + 200)
        base[name], target[name] = b.contiguous(), t.contiguous()
    g = torch.Generator().manual_seed(7)
    base["step_count.int32"] = torch.randint(-1000, 1000, (64,), generator=g, dtype=torch.int32)
    target["step_count.int32"] = step(base["step_count.int32"], 107, rate=0.1)
    base["mask.uint8"] = torch.randint(0, 256, (40,), generator=g, dtype=torch.uint8)
    target["mask.uint8"] = step(base["mask.uint8"], 108, rate=0.1)
    base["frozen.bf16"] = torch.randn(8, 8, generator=g).to(torch.bfloat16)
    target["frozen.bf16"] = base["frozen.bf16"].clone()
    base["empty.fp32"] = torch.zeros(0, 4)
    target["empty.fp32"] = torch.zeros(0, 4)
    base["old_head.fp32"] = torch.randn(10, generator=g)
    target["new_head.bf16"] = torch.randn(6, 5, generator=g).to(torch.bfloat16)
    return base, target


def shard_states():
    """One bf16 matrix for the sharded case (several chunks per shard)."""
    b = special_values(torch.bfloat16, 32 * 20, 11).view(32, 20).contiguous()
    t = step(b, 111)
    special_changes(b, t, 211)
    return {"big": b}, {"big": t.contiguous()}


SHARD_ROWS = ((0, 13), (13, 19))  # uneven: (row offset, rows) of rank 0 and rank 1


@contextmanager
def pinned_clock():
    """``time.time()`` returns CREATED while encoding: the header's ``created`` is reproducible."""
    with mock.patch.object(time, "time", return_value=CREATED):
        yield


def load_inputs(d: str = OUT):
    """The committed inputs: (base, target, shard base, shard target) as dicts of tensors."""
    from safetensors.torch import load_file
    names = ("base", "target", "shard_base", "shard_target")
    return tuple(load_file(os.path.join(d, f"{n}.safetensors")) for n in names)


def encode_all(inputs_dir: str, scratch: str, workers: int | None = 1, version: int = 1) -> dict:
    """Every golden delta of format ``version`` encoded again from the inputs in ``inputs_dir``:
    {file name: bytes}. ``scratch``: a directory for the CLI's output."""
    from nemo_dcr import ShardSpec, diff
    from nemo_dcr.cli import main as cli_main

    base, target, sb, st = load_inputs(inputs_dir)
    out = {}
    with pinned_clock():
        for enc in ENCODINGS:
            out[f"{enc}.dcr"] = diff(base, target, encoding=enc, level=LEVEL, chunk_elems=CHUNK, workers=workers,
                                     format_version=version)
        for r, (off, rows) in enumerate(SHARD_ROWS):
            spec = ShardSpec.of(tuple(sb["big"].shape), (off, 0), (rows, sb["big"].shape[1]))
            out[f"shard{r}.dcr"] = diff({"big": sb["big"][off:off + rows]}, {"big": st["big"][off:off + rows]},
                                        encoding="portable", level=LEVEL, chunk_elems=SHARD_CHUNK, shards={"big": spec},
                                        workers=workers, format_version=version)
        cli_out = os.path.join(scratch, "cli_diff.dcr")
        argv = ["diff", os.path.join(inputs_dir, "base.safetensors"), os.path.join(inputs_dir, "target.safetensors"),
                "-o", cli_out, "--level", str(LEVEL), "--format-version", str(version)]
        if cli_main(argv + (["--workers", str(workers)] if workers else [])) != 0:
            raise RuntimeError("nemo-dcr diff failed")
        with open(cli_out, "rb") as f:
            out["cli_diff.dcr"] = f.read()
    return out


def main(version: int) -> None:
    out = deltas_dir(version)
    os.makedirs(out, exist_ok=True)
    if version == 1:  # the inputs go with the first version; later ones reuse them
        base, target = states()
        save_file(base, os.path.join(OUT, "base.safetensors"))
        save_file(target, os.path.join(OUT, "target.safetensors"))
        sb, st = shard_states()
        save_file(sb, os.path.join(OUT, "shard_base.safetensors"))
        save_file(st, os.path.join(OUT, "shard_target.safetensors"))
    for name, blob in encode_all(OUT, out, version=version).items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(blob)
    for name in sorted(os.listdir(out)):
        print(f"{os.path.getsize(os.path.join(out, name)):>7} {name}")


if __name__ == "__main__":
    import argparse
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root, when run as a script
    ap = argparse.ArgumentParser(description="write the golden deltas of one format version")
    ap.add_argument("--version", type=int, choices=VERSIONS, required=True)
    main(ap.parse_args().version)
