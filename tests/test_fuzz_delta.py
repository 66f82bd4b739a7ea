"""A fast, deterministic fuzz of the delta decoder that lives on in the suite (issue 13).

Mutated deltas -- bit flips, truncations and splices of the bytes; payload bytes changed with
their checksum fixed (so the decoders, not the crc, see them); header fields replaced by hostile
values with every checksum valid -- are applied with the C kernel and with the reference. Every
outcome must be a ``DcrError`` subclass, or the exact target (a mutation nothing reads), and
never another exception, a hang or a partial write reported as success.
"""
from __future__ import annotations

import copy
import os
import random
import zlib

import pytest
import torch

from dcr_testing import bits, deadline
from dcr_testing.deltas import rewrite
from dcr_testing.fuzz_cases import fuzz_states
from nemo_dcr import DcrError, DeltaReader, apply, diff, inspect
from nemo_dcr.codec import native
from nemo_dcr.codec.format import PREAMBLE

SEED = 20261201
# per family and backend: ~900 mutated deltas in a few seconds; a longer campaign:
# NEMO_DCR_FUZZ_CASES=20000 pytest tests/test_fuzz_delta.py
CASES = int(os.environ.get("NEMO_DCR_FUZZ_CASES", "150"))


BASE, TARGET = fuzz_states()
BLOBS = {
    "auto": diff(BASE, TARGET, chunk_elems=64, workers=1),
    "portable": diff(BASE, TARGET, encoding="portable", chunk_elems=64, workers=1),
    "keyframe": diff({}, TARGET, encoding="overwrite", chunk_elems=64, workers=1),
    "auto-v2": diff(BASE, TARGET, chunk_elems=64, workers=1, format_version=2),
}


def equal(a, b) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                    and torch.equal(bits(a[k]), bits(b[k])) for k in a)


# ----------------------------------------------------------------------------- mutators

def mutate_bytes(rng: random.Random, blob: bytes) -> bytes:
    b = bytearray(blob)
    op = rng.choice(("flip", "flip", "truncate", "splice", "zero"))
    if op == "flip":
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if op == "truncate":
        return bytes(b[:rng.randrange(len(b))])
    if op == "zero":
        i = rng.randrange(len(b))
        b[i:i + rng.randint(1, 16)] = bytes(min(16, len(b) - i))
        return bytes(b)
    other = BLOBS[rng.choice(sorted(BLOBS))]  # a piece of another delta spliced in
    i, j = sorted(rng.randrange(len(b)) for _ in range(2))
    k = rng.randrange(len(other))
    return bytes(b[:i]) + other[k:k + rng.randint(1, 64)] + bytes(b[j:])


def mutate_payload(rng: random.Random, blob: bytes) -> bytes:
    """Change a chunk's payload bytes and fix its crc: the decoders see the damage."""
    r = DeltaReader(blob)
    h = copy.deepcopy(r.raw_header)
    area = bytearray(r.buf[PREAMBLE.size:r.payload_end])
    chunks = [c for t in h["tensors"] for c in t.get("chunks", ())]
    c = rng.choice(chunks)
    lo, n = c["off"] - PREAMBLE.size, c["plen"] + c["vlen"]
    for _ in range(rng.randint(1, 3)):
        if n:
            area[lo + rng.randrange(n)] ^= 1 << rng.randrange(8)
    c["crc"] = zlib.crc32(bytes(area[lo:lo + n]))
    return rewrite(blob, h, bytes(area))


HOSTILE = [0, 1, -1, 2 ** 31, 2 ** 63, 2 ** 64 + 1, 1e308, True, None, "x", [], {}, [1, 2], "classes", "gaps",
           "delta", "full", "removed", "bfloat16", "0" * 16]


def mutate_header(rng: random.Random, blob: bytes) -> bytes:
    """Replace one header field (top level, tensor or chunk) by a hostile value."""
    h = copy.deepcopy(DeltaReader(blob).raw_header)
    t = rng.choice(h["tensors"])
    target = rng.choice([h, t, t, *(t.get("chunks") or [t])])
    key = rng.choice(sorted(target))
    value = rng.choice(HOSTILE)
    if isinstance(target[key], int) and not isinstance(target[key], bool) and rng.random() < 0.5:
        value = target[key] + rng.choice((-1, 1, 7, -(2 ** 40), 2 ** 40))  # near miss
    target[key] = value
    return rewrite(blob, h)


FAMILIES = {"bytes": mutate_bytes, "payload": mutate_payload, "header": mutate_header}


@pytest.fixture(params=["native", "reference"])
def backend(request, monkeypatch):
    if request.param == "native":
        if native.lib() is None:
            pytest.skip(f"C kernel unavailable: {native.build_error}")
    else:
        monkeypatch.setattr(native, "lib", lambda: None)
    return request.param


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mutated_deltas_give_typed_errors_or_the_target(backend, family):
    rng = random.Random(f"{SEED}-{family}-{backend}")
    outcomes = {"error": 0, "target": 0, "other": 0}
    for case in range(CASES):
        name = rng.choice(sorted(BLOBS))
        try:
            bad = FAMILIES[family](rng, BLOBS[name])
        except DcrError:
            continue  # (a mutator re-reading an already damaged delta)
        start = {k: v.clone() for k, v in (BASE if name != "keyframe" else {}).items()}
        recv = {k: v.clone() for k, v in start.items()}
        try:
            with deadline(20):
                inspect(bad)
                apply(recv, bad, workers=1)
        except DcrError:
            outcomes["error"] += 1
            continue
        except Exception as e:  # noqa: BLE001 - the point of the test
            raise AssertionError(f"{family} case {case} on {name!r} ({backend}): "
                                 f"{type(e).__name__}: {e}") from e
        if equal(recv, TARGET):
            outcomes["target"] += 1
        elif family == "header":
            # a forged header with valid checksums may mean something else (a tensor marked
            # removed, say); all that is promised is a typed error or a consistent apply
            outcomes["other"] += 1
        else:
            raise AssertionError(f"{family} case {case} on {name!r} ({backend}) applied without error "
                                 "but the result is not the target")
    assert outcomes["error"] > CASES // 3, outcomes  # the mutations do reach the checks
