"""The ``classes`` coding (issue #5): the C kernel and the PyTorch reference give the same bytes,
both decode bit-exactly for every float dtype and special value, malformed streams are refused,
and the delta-level rules hold (auto picks it where it pays, re-delivery, wrong base, receivers
that hold only part of a chunk)."""
from __future__ import annotations

import sys

import pytest
import torch

from dcr_testing import assert_bits_equal
from nemo_dcr import BaseMismatchError, DcrError, DeltaFormatError, DeltaReader, PartialApplyError, apply, diff
from nemo_dcr.codec import classes, native
from nemo_dcr.codec.ordered import to_bits, unsigned
from nemo_dcr.state.dtypes import INT_VIEW
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.state.statedigest import ChangeDigest, state_contrib

DTYPES = list(classes.MANTISSA)
needs_native = pytest.mark.skipif(native.lib() is None, reason=f"C kernels unavailable: {native.build_error}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.element_size()]).reshape(-1)


def _pair(dtype, n, p, seed, big=0.1, scale=0.02):
    """A base like trained weights and a target moved by a step or two in the monotone order at a
    rate that falls with the magnitude (as under Adam), some by many steps."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, generator=g) * scale).to(dtype)
    old = _bits(base).clone()
    mag = base.float().abs().clamp(min=1e-8)
    rate = (p * scale / mag).clamp(max=1.0) if n else mag
    idx = torch.nonzero(torch.rand(n, generator=g) < rate).squeeze(1)
    steps = torch.randint(0, 2, (idx.numel(),), generator=g) * 2 - 1
    far = torch.rand(idx.numel(), generator=g) < big
    steps = torch.where(far, torch.randint(2, 300, (idx.numel(),), generator=g) * steps, steps)
    w = old.element_size()
    u = old.to(torch.int64) & ((1 << 8 * w) - 1)
    sign = 1 << (8 * w - 1)
    key = torch.where(u >= sign, (1 << 8 * w) - 1 - u, u | sign)
    key[idx] = (key[idx] + steps) % (1 << 8 * w)
    newu = torch.where(key >= sign, key - sign, (1 << 8 * w) - 1 - key)
    new = torch.where(newu >= sign, newu - (1 << 8 * w), newu) if w > 1 else newu
    return old, new.to(old.dtype)


def _check(old, new, mant, native_too=True):
    ref = classes.encode_reference(old, new, mant)
    if native_too and native.lib() is not None:
        assert classes.encode(old, new, mant, use_native=True) == ref  # same bytes, same table
        placed = classes.place(old, new, mant)  # the device path's host coder: the changes alone
        if placed is not None:
            idx, c, r = placed
            uo, un = unsigned(old[idx]), unsigned(new[idx])
            assert classes.encode_ranked(c, r, uo, un, old.element_size(), mant, use_native=True) == ref
    k, rows, pos, val = ref
    want = torch.nonzero(old != new).squeeze(1)
    assert k == want.numel()
    w, uses = old.element_size(), ([False, True] if native_too and native.lib() is not None else [False])
    for use in uses:
        idx, vals = classes.decode(old, rows, pos, val, k, mant, use_native=use)
        assert torch.equal(idx, want)
        assert torch.equal(vals, new[want])
        # the device receiver's split: the streams without the base, then located against it
        cls, rank, d = classes.decode_streams(rows, pos, val, k, old.numel(), w, mant, use_native=use)
        assert cls.dtype == rank.dtype == d.dtype == torch.int64 and cls.numel() == rank.numel() == d.numel() == k
        lidx, lnew = classes.locate(unsigned(old), rows, cls, rank, d, w, mant)
        assert torch.equal(lidx, want) and torch.equal(lnew, unsigned(new[want]))
    return ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,p", [(0, 0.1), (1, 1.0), (7, 0.5), (1000, 0.01), (20000, 0.03), (4096, 1.0)])
def test_native_equals_reference_and_round_trips(dtype, n, p):
    old, new = _pair(dtype, n, p, seed=n + int(p * 100))
    _check(old, new, classes.MANTISSA[dtype])


@pytest.mark.skipif(native.lib() is None, reason="the C kernels' out-arguments")
def test_encodes_on_several_threads_each_get_their_own_results():
    """The encoder's out-arguments are made once per thread (``classes._EncodeOut``): chunks
    encoded on four threads at once give what each gives alone, changes included."""
    from concurrent.futures import ThreadPoolExecutor
    pairs = [_pair(torch.bfloat16, 20000, 0.01 * (i + 1), seed=i) for i in range(16)]
    alone = [classes.encode(o, n, 7, with_changes=True) for o, n in pairs]
    with ThreadPoolExecutor(4) as ex:
        together = list(ex.map(lambda p: classes.encode(p[0], p[1], 7, with_changes=True), pairs * 4))
    for i, got in enumerate(together):
        want = alone[i % len(pairs)]
        assert got[:4] == want[:4]
        assert all(torch.equal(a, b) for a, b in zip(got[4:], want[4:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bit_pattern_as_base(dtype):
    """Every pattern of the dtype (all of them for 8 and 16 bits, a sample for 32) as a base
    value: NaN payloads, infinities, -0.0, subnormals; each moved by +-1, +-2 and far (wrapping
    round the order), and a target that is every pattern too."""
    w = torch.empty((), dtype=dtype).element_size()
    if w == 4:
        g = torch.Generator().manual_seed(5)
        u = torch.cat([torch.randint(0, 1 << 32, (3000,), generator=g),
                       torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00001, 0x7F800000, 0xFF800000, 0, 0x80000000, 1,
                                     0x807FFFFF, 0xFFFFFFFF, 0x7FFFFFFF])])
    elif w == 2:  # every exponent and sign with a spread of mantissas, and the specials, all of them
        special = [0x7FC0, 0x7F81, 0x7FFF, 0xFFC0, 0xFF81, 0x7F80, 0xFF80, 0x7E00, 0x7C01, 0xFE00, 0x7C00, 0xFC00,
                   0x0000, 0x8000, 0x0001, 0x007F, 0x8001, 0x03FF, 0xFFFF, 0x7FFF, 0x8000]
        u = torch.cat([torch.arange(0, 1 << 16, 41), torch.tensor(special)])
    else:
        u = torch.arange(1 << (8 * w))
    for step in (1, -1, 2, -2, 1000, -(1 << (8 * w - 1)), (1 << (8 * w - 1)) - 1):
        old = (u - (1 << 8 * w) * (u >= (1 << (8 * w - 1))) * (w > 1)).to(INT_VIEW[w])
        newu = (u + step) % (1 << 8 * w)
        new = (newu - (1 << 8 * w) * (newu >= (1 << (8 * w - 1))) * (w > 1)).to(INT_VIEW[w])
        _check(old, new, classes.MANTISSA[dtype])
    _check(old, old.flip(0), classes.MANTISSA[dtype])


def test_escape_codes_for_outlying_gaps():
    """One class with many small gaps and one enormous one: the Rice parameter fits the small
    ones, the big gap goes through the escape (32 zero bits + 48 bits)."""
    n = 300000
    old = torch.full((n,), 0x3C00, dtype=torch.int16)  # all in one class
    new = old.clone()
    new[:200] += 1
    new[-1] += 1
    new[100] -= 2  # |d| 1 and a big one
    k, rows, pos, val = _check(old, new, classes.MANTISSA[torch.bfloat16])
    (row,) = rows
    assert ((n - 201) >> row[2]) >= classes.QMAX


def _mutations(blob: bytes, seed: int, count: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        b = bytearray(blob)
        if not b:
            return
        kind = int(torch.randint(0, 3, (1,), generator=g))
        at = int(torch.randint(0, len(b), (1,), generator=g))
        if kind == 0:
            b[at] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
        elif kind == 1:
            del b[at:]
        else:
            b.insert(at, int(torch.randint(0, 256, (1,), generator=g)))
        yield bytes(b)


def _outcome(fn):
    try:
        idx, vals = fn()
        return ("ok", idx.tolist(), vals.tolist())
    except DeltaFormatError:
        return ("error",)


def _located(old, rows, pos, val, k, mant, use_native):
    w = old.element_size()
    cls, rank, d = classes.decode_streams(rows, pos, val, k, old.numel(), w, mant, use_native=use_native)
    idx, un = classes.locate(unsigned(old), rows, cls, rank, d, w, mant)
    return idx, to_bits(un, w).view(old.dtype)


@needs_native
def test_malformed_streams_are_refused_the_same_way():
    """Flipped, truncated and inserted bytes in either stream, and bad table rows: the kernel and
    the reference agree on every outcome (same decode, or both refuse), and nothing crashes."""
    old, new = _pair(torch.bfloat16, 5000, 0.03, seed=3)
    mant = classes.MANTISSA[torch.bfloat16]
    k, rows, pos, val = classes.encode_reference(old, new, mant)
    refused = 0
    for which in ("pos", "val"):
        for bad in _mutations(pos if which == "pos" else val, seed=len(which), count=60):
            p, v = (bad, val) if which == "pos" else (pos, bad)
            a = _outcome(lambda p=p, v=v: classes.decode(old, rows, p, v, k, mant, use_native=True))
            b = _outcome(lambda p=p, v=v: classes.decode(old, rows, p, v, k, mant, use_native=False))
            assert a == b
            refused += a[0] == "error"
            # the base-free stream decode: the kernel and the reference agree too, and what the
            # whole decode refuses it refuses or the locate does (a rank past its class)
            s1 = _outcome(lambda p=p, v=v: _located(old, rows, p, v, k, mant, True))
            s2 = _outcome(lambda p=p, v=v: _located(old, rows, p, v, k, mant, False))
            assert s1 == s2 == a
    assert refused > 60
    bad_tables = [rows[::-1], [r[:5] for r in rows], [[r[0], r[1] + 1] + r[2:] for r in rows],
                  [[999] + r[1:] for r in rows], [[r[0], r[1], 40] + r[3:] for r in rows], rows[:-1]]
    for t in bad_tables:
        for use in (True, False):
            with pytest.raises(DeltaFormatError):
                classes.decode(old, t, pos, val, k, mant, use_native=use)
            with pytest.raises(DeltaFormatError):
                _located(old, t, pos, val, k, mant, use)
        # a parsed entry's table is not checked again in Python (``table_checked``): the kernel
        # alone refuses it, and never reads past it
        before = old.clone()
        for into in (False, True):
            with pytest.raises(DeltaFormatError):
                classes.decode(old, t, pos, val, k, mant, use_native=True, into=into, table_checked=True)
            assert torch.equal(old, before)


@needs_native
def test_the_bytewise_bit_reader_decodes_the_same(tmp_path):
    """The kernel's bit reader takes each window in one 8-byte load on a little-endian host and
    byte by byte elsewhere (and near a stream's end). A build that reads every window byte by
    byte (``-DDCR_READ_BYTEWISE``, the path a big-endian host takes) decodes and refuses as the
    reference does: round trips of every dtype, escape codes, malformed streams."""
    import os
    import subprocess
    from pathlib import Path
    here = Path(__file__).resolve().parent
    code = ("import test_classes as t; from nemo_dcr.codec import native; "
            "[t.test_native_equals_reference_and_round_trips(d, n, p) for d in t.DTYPES "
            "for n, p in ((1, 1.0), (7, 0.5), (20000, 0.03), (4096, 1.0))]; "
            "t.test_escape_codes_for_outlying_gaps(); t.test_malformed_streams_are_refused_the_same_way(); "
            "print(native.origin)")
    env = {**os.environ, "NEMO_DCR_NATIVE_CFLAGS": "-DDCR_READ_BYTEWISE", "NEMO_DCR_CACHE": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                       cwd=here.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["variant", "build"], r.stdout


# ----------------------------------------------------------------------------- through diff/apply

def _model(seed=0, p=0.02):
    ts = {}
    for i, (dtype, shape) in enumerate([(torch.bfloat16, (64, 300)), (torch.float16, (5000,)),
                                       (torch.float32, (40, 50)), (torch.float8_e4m3fn, (3000,)),
                                       (torch.float8_e5m2, (2, 1500))]):
        old, new = _pair(dtype, int(torch.tensor(shape).prod()), p, seed=seed + i, big=0.02)
        ts[f"t{i}"] = (old.view(dtype).reshape(shape), new.view(dtype).reshape(shape))
    return {k: v[0] for k, v in ts.items()}, {k: v[1] for k, v in ts.items()}


@pytest.fixture(params=["scan", "located"])
def decode_route(request, monkeypatch):
    """Both ways ``apply`` decodes a chunk: on the host with the fused C scan (tensors in host
    memory), and as on a GPU, the payload decoded without the base and the changes located
    where the tensor is (``delta/apply._decode``). Here the second is chosen for CPU tensors
    too: the same code that runs for a tensor on a device, on tensors a test can read."""
    if request.param == "scan":
        yield request.param
        return
    monkeypatch.setattr(sys.modules["nemo_dcr.delta.apply"], "on_host", lambda t: False)
    calls = []
    real = classes.locate
    monkeypatch.setattr(classes, "locate", lambda *a: calls.append(1) or real(*a))
    yield request.param
    assert calls, "no classes chunk went through classes.locate"


@pytest.mark.usefixtures("decode_route")
def test_auto_picks_classes_where_it_pays_and_round_trips():
    base, target = _model()
    blob = diff(base, target, chunk_elems=4096, workers=2)
    encs = {c["enc"] for t in DeltaReader(blob).raw_header["tensors"] for c in t["chunks"]}
    assert "classes" in encs
    assert len(blob) < len(diff(base, target, encoding="portable", chunk_elems=4096))
    recv = {k: v.clone() for k, v in base.items()}
    rep = apply(recv, blob)
    for k in target:
        assert_bits_equal(recv[k], target[k])
    # re-delivery: every tensor is at its target, nothing is written
    again = apply(recv, blob)
    assert again.chunks_applied == 0 and again.tensors_skipped == len(target)
    assert rep.elements_changed == sum(int((_bits(base[k]) != _bits(target[k])).sum()) for k in base)
    # the follower's O(changes) digest update sees the same changes either way
    recv = {k: v.clone() for k, v in base.items()}
    change = ChangeDigest()
    apply(recv, blob, verify=False, on_change=change)
    assert state_contrib(base) + change.total == state_contrib(target)


def test_auto_falls_back_when_classes_does_not_pay():
    """Random bits (a re-initialised tensor): every change is far, the modelled coding costs more
    than raw values, and the chunk goes out as overwrite."""
    g = torch.Generator().manual_seed(0)
    base = {"x": torch.randn(20000, generator=g).to(torch.bfloat16)}
    target = {"x": torch.randn(20000, generator=g).to(torch.bfloat16)}
    h = DeltaReader(diff(base, target)).raw_header
    assert {c["enc"] for c in h["tensors"][0]["chunks"]} == {"overwrite"}
    forced = diff(base, target, encoding="classes")
    recv = {"x": base["x"].clone()}
    apply(recv, forced)
    assert_bits_equal(recv["x"], target["x"])


@pytest.mark.usefixtures("decode_route")
def test_wrong_base_is_refused_untouched():
    base, target = _model(seed=1)
    blob = diff(base, target, encoding="classes", chunk_elems=4096)
    other, _ = _model(seed=2)
    recv = {k: v.clone() for k, v in other.items()}
    with pytest.raises(BaseMismatchError):
        apply(recv, blob)
    for k in other:
        assert_bits_equal(recv[k], other[k])
    # without the base digests (a follower's apply): each chunk is decoded against what is held
    # and refused by its pre-image, or, located, by a rank past its class; apply says it may have
    # written (the entry was reached), and nothing was
    with pytest.raises(PartialApplyError) as e:
        apply(recv, blob, verify=False, workers=1)
    assert isinstance(e.value.__cause__, BaseMismatchError)
    for k in other:
        assert_bits_equal(recv[k], other[k])


@pytest.mark.usefixtures("decode_route")
def test_resume_after_a_partial_apply():
    """Half the chunks of a tensor applied: a retry with the journal of the first attempt
    finishes it; a classes chunk that was applied is recognised by its post-image when none of
    its changes moved to another exponent, and otherwise reported (never applied twice)."""
    base, target = _model(seed=3)
    name = "t0"
    blob = diff({name: base[name]}, {name: target[name]}, encoding="classes", chunk_elems=2048)
    chunks = DeltaReader(blob).raw_header["tensors"][0]["chunks"]
    assert len(chunks) > 4 and all(c["enc"] == "classes" for c in chunks)
    half = chunks[len(chunks) // 2]["start"]
    recv = base[name].clone()
    flat = _bits(recv)
    flat[:half] = _bits(target[name])[:half]  # chunks before `half` applied, the rest not
    journal = {(name, c["start"]) for c in chunks if c["start"] < half}
    r = {name: recv}
    apply(r, blob, resume=True, journal=set(journal))
    assert_bits_equal(r[name], target[name])
    # without the journal: applied chunks are either recognised or refused, never re-applied
    recv2 = base[name].clone()
    _bits(recv2)[:half] = _bits(target[name])[:half]
    snapshot = recv2.clone()
    try:
        apply({name: recv2}, blob, resume=True)
        assert_bits_equal(recv2, target[name])
    except DcrError as e:
        assert "journal" in str(e)
        changed = _bits(recv2) != _bits(snapshot)
        assert torch.equal(_bits(recv2)[changed], _bits(target[name])[changed])  # only real target bits written


def test_the_c_kernels_never_get_a_device_pointer():
    """A tensor off the host (here a meta tensor; a CUDA one alike) is refused by the kernels'
    wrappers with a clear error, never dereferenced on the host."""
    old, new = _pair(torch.bfloat16, 1000, 0.05, seed=9)
    mant = classes.MANTISSA[torch.bfloat16]
    k, rows, pos, val = classes.encode_reference(old, new, mant)
    if native.lib() is None:
        pytest.skip("no C kernels here")
    meta = old.to("meta")
    with pytest.raises(DcrError, match="host memory"):
        classes.decode(meta, rows, pos, val, k, mant, use_native=True)
    with pytest.raises(DcrError, match="host memory"):
        classes.encode(meta, new.to("meta"), mant, use_native=True)


def test_receiver_holding_part_of_a_chunk_gets_a_clear_error():
    """A classes chunk decodes only against the whole base chunk: a receiver sharded differently
    is told to use 'portable', which it can apply."""
    base, target = _model(seed=4)
    b, t = base["t0"], target["t0"]  # (64, 300)
    half = ShardSpec.of(b.shape, [0, 0], [32, 300])
    blob = diff({"t0": b}, {"t0": t}, encoding="classes", chunk_elems=1 << 20)
    with pytest.raises(DcrError, match="portable"):
        apply({"t0": b[:32].clone()}, blob, shards={"t0": half}, verify=False)
    portable = diff({"t0": b}, {"t0": t}, encoding="portable")
    part = b[:32].clone()
    apply({"t0": part}, portable, shards={"t0": half})
    assert_bits_equal(part, t[:32])


def test_reference_decoder_is_used_without_the_kernel(monkeypatch):
    """With the kernels off, diff/apply go through the reference and give the same bytes."""
    base, target = _model(seed=5)
    with_native = DeltaReader(diff(base, target, encoding="classes")).raw_header
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", True)
    blob = diff(base, target, encoding="classes")
    ref = DeltaReader(blob).raw_header
    for a, b in zip(with_native["tensors"], ref["tensors"]):
        assert [(c["cls"], c["crc"], c["plen"], c["vlen"]) for c in a["chunks"]] == \
            [(c["cls"], c["crc"], c["plen"], c["vlen"]) for c in b["chunks"]]
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, blob)
    for k in target:
        assert_bits_equal(recv[k], target[k])


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_vector_and_scalar_scans_agree(dtype):
    """The kernel's vector scans (2-byte dtypes: AVX-512 where the CPU has it, and AVX2, which
    ``dcr_set_simd(2)`` forces there; ``dcr_set_simd(3)``: AVX2 whose decoder selects a block's
    bit without pdep, what a core with a slow pdep runs) and its scalar scans give the same bytes
    and the same decode, including the base bits at the changes, chunk tails that are not a whole
    block, chunks over several of the decoder's 4096-element segments, changes at a segment's
    first and last element, a change at every bit of a block whose elements are all one class,
    and more active classes than the vector path takes."""
    lib = native.lib()
    mant = classes.MANTISSA[dtype]
    cases = [_pair(dtype, n, p, seed=n) for n, p in [(1, 1.0), (63, 0.2), (64, 0.2), (65, 0.2), (1000, 0.05),
                                                     (70001, 0.01), (5000, 1.0)]]
    g = torch.Generator().manual_seed(9)
    wild = torch.randint(-32768, 32768, (20000,), generator=g).to(torch.int16)  # ~all exponents active
    cases.append((wild, wild ^ (torch.rand(20000, generator=g) < 0.3).to(torch.int16)))
    old, new = _pair(dtype, 3 * 4096 + 77, 0.02, seed=4)
    edge = torch.tensor([0, 4095, 4096, 8191, 8192, 3 * 4096 + 76])  # segment ends, the last element
    new[edge] = old[edge] ^ 1
    cases.append((old, new))
    # one class throughout (mantissas differ, the exponent not): the r-th member of a block is
    # bit r, every r from 0 to 63 selected once, each byte of the block's mask in turn
    one = (torch.arange(2 * 4096 + 64) % 128 + (15 << mant)).to(torch.int16)
    nudged = one.clone()
    at = torch.arange(64) * 64 + torch.arange(64)  # block b's bit b
    nudged[at] ^= 1
    cases.append((one, nudged))
    try:
        for old, new in cases:
            out = []
            for simd in (1, 2, 3, 0):
                lib.dcr_set_simd(simd)
                k, rows, pos, val, idx, eold, enew = classes.encode(old, new, mant, with_changes=True)
                assert torch.equal(idx, torch.nonzero(old != new).squeeze(1))
                assert torch.equal(eold, old[idx]) and torch.equal(enew, new[idx])  # gathered by the scan
                didx, dval, dold = classes.decode(old, rows, pos, val, k, mant, with_old=True)
                assert torch.equal(didx, idx) and torch.equal(dval, new[idx]) and torch.equal(dold, old[idx])
                out.append((k, rows, pos, val, idx.tolist(), didx.tolist(), dval.tolist(), dold.tolist()))
            assert all(o == out[0] for o in out)
            assert out[0][:4] == classes.encode_reference(old, new, mant)
    finally:
        lib.dcr_set_simd(1)


@needs_native
def test_the_version_line_names_how_a_block_bit_is_selected():
    """``describe()`` (``nemo-dcr --version``) says whether the AVX2 scans select a block's bit by
    pdep (cores where it is fast) or without it; ``dcr_set_simd(3)`` and the scalar scans do not
    use it."""
    lib = native.lib()
    try:
        lib.dcr_set_simd(3)
        assert lib.dcr_simd_pdep() == 0 and "pdep" not in native.describe()
        lib.dcr_set_simd(0)
        assert lib.dcr_simd_pdep() == 0 and native.describe().startswith("native, scalar scans")
        lib.dcr_set_simd(2)
        if native.simd_level() == 1:
            assert ("AVX2 + pdep scans" in native.describe()) == bool(lib.dcr_simd_pdep())
    finally:
        lib.dcr_set_simd(1)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_into_the_base_writes_the_changes_or_nothing(dtype):
    """A chunk decoded into the receiver's own bits (``into``: each change written as the scan
    passes it) leaves exactly the target there, its version counter moved as a scatter_ moves
    it; one that turns out not to decode (a base with
    too few members in a class, found after the first half's changes were written) leaves the
    base as it was, on the vector scans and the scalar one."""
    lib = native.lib()
    mant = classes.MANTISSA[dtype]
    old, new = _pair(dtype, 3 * 4096 + 77, 0.02, seed=11)
    k, rows, pos, val = classes.encode(old, new, mant)
    n = old.numel()
    short = old.clone()
    short[n // 2:] = old[0]  # every later element in one class: the others run out of members
    try:
        for simd in (1, 2, 3, 0):
            lib.dcr_set_simd(simd)
            b = old.clone()
            seen = b._version
            idx, nv, held = classes.decode(b, rows, pos, val, k, mant, into=True)
            assert torch.equal(b, new) and torch.equal(held, old[idx]) and torch.equal(nv, new[idx])
            assert b._version > seen  # as after a scatter_: those that watch the tensor see it changed
            b = short.clone()
            with pytest.raises(DeltaFormatError, match="does not decode"):
                classes.decode(b, rows, pos, val, k, mant, into=True)
            assert torch.equal(b, short)
    finally:
        lib.dcr_set_simd(1)
    b = old.clone()  # the reference, without the kernel: the same outcome
    idx, nv, held = classes.decode(b, rows, pos, val, k, mant, into=True, use_native=False)
    assert torch.equal(b, new) and torch.equal(held, old[idx]) and torch.equal(nv, new[idx])
    b = short.clone()
    with pytest.raises(DeltaFormatError):
        classes.decode(b, rows, pos, val, k, mant, into=True, use_native=False)
    assert torch.equal(b, short)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_encode_that_writes_its_base_leaves_the_target_there_and_the_same_bytes(dtype):
    """``write_base`` (``diff(write_base=...)``: the publisher's snapshot brought to the target by
    the encoder's rank pass): on the vector passes and the scalar one, and without the kernel, the
    base ends equal to the target, its version counter moved as a scatter_ would, with the bytes
    and changes of an encode that writes nothing; chunk tails, segment ends, more active classes
    than the vector pass takes, and a chunk without a change (nothing written)."""
    lib = native.lib()
    mant = classes.MANTISSA[dtype]
    w = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(21)
    cases = [_pair(dtype, n, p, seed=n) for n, p in [(1, 1.0), (65, 0.2), (3 * 4096 + 77, 0.02), (5000, 1.0)]]
    wild = torch.randint(-(1 << 8 * w - 1), 1 << 8 * w - 1, (20000,), generator=g).to(INT_VIEW[w])
    cases.append((wild, wild ^ (torch.rand(20000, generator=g) < 0.3).to(INT_VIEW[w])))  # ~all classes
    cases.append((cases[2][0], cases[2][0].clone()))
    routes = [(True, simd) for simd in ((1, 2, 3, 0) if lib is not None else ())] + [(False, None)]
    try:
        for old, new in cases:
            want = classes.encode(old, new, mant, with_changes=True, use_native=False)
            for use, simd in routes:
                if simd is not None:
                    lib.dcr_set_simd(simd)
                b = old.clone()
                seen = b._version
                got = classes.encode(b, new, mant, with_changes=True, write_base=True, use_native=use)
                assert got[:4] == want[:4] and all(torch.equal(x, y) for x, y in zip(got[4:], want[4:]))
                assert torch.equal(b, new)
                assert (b._version > seen) == bool(got[0])
    finally:
        if lib is not None:
            lib.dcr_set_simd(1)
    with pytest.raises(DcrError, match="contiguous"):
        old, new = cases[2]
        classes.encode(old.clone()[::2], new[::2], mant, write_base=True)


def _blocks_with(old: torch.Tensor, start: int, count: int, per_block: int, g) -> None:
    """In ``count`` blocks of 64 from ``start``: exactly ``per_block`` elements changed each, at
    random places; some in the lowest mantissa bit (their class kept), some in the exponent."""
    for b in range(count):
        at = start + 64 * b + torch.randperm(64, generator=g)[:per_block]
        flip = torch.where(torch.rand(per_block, generator=g) < 0.8, 1, 1 << 8)
        old[at] ^= flip.to(old.dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_change_finder_takes_any_mix_of_sparse_and_dense_blocks(dtype):
    """The vector change finder writes a block's first 2, 4 or 8 changes to fixed places (as many
    as a block of the segment before held) and loops for the rest: segments of 4096 elements that
    are sparse, then dense, all changed, unchanged, then blocks with exactly one more change than
    each setting writes (3 after a sparse segment, 9 after a dense one, 5 after a middling one),
    and a tail that is not a whole block. Encoded by every scan and by the reference, with and
    without the base written (the finder writes a block's changes into it), and a chunk whose one
    class has an escaped gap on every scan (the Rice parameters' costs, vector and scalar)."""
    lib = native.lib()
    mant = classes.MANTISSA[dtype]
    g = torch.Generator().manual_seed(31)
    seg = 4096
    old, _ = _pair(dtype, 9 * seg + 77, 0.0, seed=8)
    new = old.clone()
    new[:seg][torch.rand(seg, generator=g) < 0.005] ^= 1            # 0: sparse (2 places next)
    _blocks_with(new, 1 * seg, 64, 3, g)                            # 1: 3 a block, looped (8 next)
    _blocks_with(new, 2 * seg, 64, 9, g)                            # 2: 9 a block, looped (8 next)
    new[3 * seg:4 * seg] ^= 1                                       # 3: every element
    _blocks_with(new, 5 * seg, 64, 3, g)                            # 4 unchanged (2 next); 5: 3, looped
    for b in range(64):                                             # 6: 1 or 2 a block (4 next)
        _blocks_with(new, 6 * seg + 64 * b, 1, 1 + b % 2, g)
    _blocks_with(new, 7 * seg, 64, 5, g)                            # 7: 5 a block, looped
    new[-77:][torch.rand(77, generator=g) < 0.3] ^= 1                # the tail
    one = torch.full((300000,), 0x3C00, dtype=torch.int16)  # one class, an escaped gap
    bumped = one.clone()
    bumped[:200] += 1
    bumped[-1] += 1
    try:
        for a, b in [(old, new), (one, bumped)]:
            want = classes.encode(a, b, mant, with_changes=True, use_native=False)
            assert want[0] == int((a != b).sum())
            for simd in (1, 2, 3, 0):
                lib.dcr_set_simd(simd)
                for write_base in (False, True):
                    held = a.clone()
                    got = classes.encode(held, b, mant, with_changes=True, write_base=write_base)
                    assert got[:4] == want[:4] and all(torch.equal(x, y) for x, y in zip(got[4:], want[4:]))
                    assert torch.equal(held, b if write_base else a)
    finally:
        lib.dcr_set_simd(1)


def test_a_chunk_encode_that_fails_after_writing_its_base_writes_it_back(monkeypatch):
    """``encode_chunk(write_base=True)``: the base is written as the changes are found; when the
    codings after that fail, the base is as it was (``classes`` and the others alike)."""
    from nemo_dcr.codec import chunk
    old, new = _pair(torch.bfloat16, 3000, 0.05, seed=5)

    def broken(*a, **k):
        raise RuntimeError("injected: coding failed")
    monkeypatch.setattr(chunk, "encode_changes", broken)
    for encoding in ("auto", "portable"):
        b = old.clone()
        with pytest.raises(RuntimeError, match="injected"):
            chunk.encode_chunk(b, new, 0, encoding, dtype=torch.bfloat16, write_base=True)
        assert torch.equal(b, old)
    monkeypatch.undo()
    for encoding in ("auto", "portable", "xor"):
        b = old.clone()
        c = chunk.encode_chunk(b, new, 0, encoding, dtype=torch.bfloat16, write_base=True, keep_changes=True)
        assert torch.equal(b, new) and c.changes is not None


def test_positions_come_back_with_the_chunks_start_added():
    """``offset`` (a chunk's start in its tensor) is added to the positions a decode returns, by
    the kernel on each scan and by the reference; the bits it writes into the base go to the
    chunk's own positions, and a decode that fails still leaves the base as it was."""
    lib = native.lib()
    dtype = torch.bfloat16
    mant = classes.MANTISSA[dtype]
    old, new = _pair(dtype, 3 * 4096 + 77, 0.02, seed=12)
    k, rows, pos, val = classes.encode(old, new, mant)
    changed = torch.nonzero(old != new).squeeze(1)
    start = (1 << 33) + 5  # past 32 bits: a position in a large tensor
    short = old.clone()
    short[old.numel() // 2:] = old[0]
    routes = [dict(use_native=True, simd=s) for s in (1, 2, 3, 0)] + [dict(use_native=False, simd=None)]
    try:
        for r in routes:
            if r["simd"] is not None:
                lib.dcr_set_simd(r["simd"])
            idx, nv = classes.decode(old, rows, pos, val, k, mant, use_native=r["use_native"], offset=start)
            assert torch.equal(idx, changed + start) and torch.equal(nv, new[changed])
            b = old.clone()
            idx, nv, held = classes.decode(b, rows, pos, val, k, mant, use_native=r["use_native"], into=True,
                                           offset=start)
            assert torch.equal(idx, changed + start) and torch.equal(b, new) and torch.equal(held, old[changed])
            b = short.clone()
            with pytest.raises(DeltaFormatError):
                classes.decode(b, rows, pos, val, k, mant, use_native=r["use_native"], into=True, offset=start)
            assert torch.equal(b, short)
    finally:
        lib.dcr_set_simd(1)


def test_a_chunk_decoded_into_a_wrong_base_is_written_back():
    """A follower's apply (no base digests) decodes a classes chunk into the tensor, then checks
    the bits it replaced against the chunk's pre-image: a base one mantissa bit off at one changed
    position decodes (the classes are the same) and is refused by that check, and the tensor
    holds what it held before, bit for bit."""
    base, target = _model(seed=6)
    name = "t0"
    blob = diff({name: base[name]}, {name: target[name]}, encoding="classes")
    changed = torch.nonzero(_bits(base[name]) != _bits(target[name])).squeeze(1)
    wrong = base[name].clone()
    _bits(wrong)[changed[len(changed) // 2]] ^= 1
    held = wrong.clone()
    with pytest.raises(PartialApplyError) as e:
        apply({name: held}, blob, verify=False, workers=1)
    assert isinstance(e.value.__cause__, BaseMismatchError)
    assert_bits_equal(held, wrong)


@pytest.mark.parametrize("receiver", ["whole", "rows 8-47", "rows 16-31", "rows 24-63"])
def test_a_row_shard_is_applied_in_place_where_its_receiver_holds_it_as_one_run(receiver, monkeypatch):
    """A trainer rank's row shard (rows 16-31 of a (64, 300) tensor: one run of the canonical
    tensor) decodes into a receiver that holds it as one run -- the tensor whole, or a row shard
    that contains it -- as a whole tensor's chunks do (``apply._shift``), with no per-element index
    maps. A receiver whose shard only overlaps it ("rows 24-63") is refused with the classes
    error, as before. The target's bits land at the shard's rows and nowhere else, and a base one
    bit off at a changed position is refused with the receiver's bits as they were."""
    import importlib
    apply_mod = importlib.import_module("nemo_dcr.delta.apply")
    base, target = _model(seed=8)
    b, t = base["t0"], target["t0"]  # (64, 300) BF16
    region = ShardSpec.of(b.shape, [16, 0], [16, 300])
    blob = diff({"t0": b[16:32].clone()}, {"t0": t[16:32].clone()}, shards={"t0": region}, encoding="classes",
                chunk_elems=1000)
    lo, hi = {"whole": (0, 64), "rows 8-47": (8, 48), "rows 16-31": (16, 32), "rows 24-63": (24, 64)}[receiver]
    spec = ShardSpec.of(b.shape, [lo, 0], [hi - lo, 300])
    if receiver == "rows 24-63":
        with pytest.raises(DcrError, match="portable"):
            apply({"t0": b[lo:hi].clone()}, blob, shards={"t0": spec}, verify=False)
        return
    want = b[lo:hi].clone()
    want[16 - lo:32 - lo] = t[16:32]
    maps = []
    real = apply_mod.IndexMap.to_local
    monkeypatch.setattr(apply_mod.IndexMap, "to_local", lambda self, g: maps.append(1) or real(self, g))
    held = b[lo:hi].clone()
    apply({"t0": held}, blob, shards={"t0": spec})
    assert_bits_equal(held, want)
    assert not maps  # no chunk mapped its elements one by one
    one = diff({"t0": b[16:32].clone()}, {"t0": t[16:32].clone()}, shards={"t0": region}, encoding="classes")
    changed = torch.nonzero(_bits(b[16:32]) != _bits(t[16:32])).squeeze(1)
    wrong = b[lo:hi].clone()
    _bits(wrong[16 - lo:32 - lo])[changed[len(changed) // 2]] ^= 1
    held = wrong.clone()
    with pytest.raises(PartialApplyError) as e:  # (one chunk: nothing else was written before it)
        apply({"t0": held}, one, shards={"t0": spec}, verify=False, workers=1)
    assert isinstance(e.value.__cause__, BaseMismatchError)
    assert_bits_equal(held, wrong)


def _column_shard(seed: int):
    """A tensor-parallel trainer rank's column shard, columns 100-199 of a (64, 300) BF16 tensor,
    and its delta in chunks of 1000 -> (the apply module, the tensor's base and target, the
    shard's spec, its base and target, the delta)."""
    import importlib
    base, target = _model(seed=seed)
    b, t = base["t0"], target["t0"]
    region = ShardSpec.of(b.shape, [0, 100], [64, 100])
    shard_b, shard_t = b[:, 100:200].clone(), t[:, 100:200].clone()
    blob = diff({"t0": shard_b}, {"t0": shard_t}, shards={"t0": region}, encoding="classes", chunk_elems=1000)
    return importlib.import_module("nemo_dcr.delta.apply"), b, t, region, shard_b, shard_t, blob


@pytest.mark.parametrize("receiver", ["the same columns", "as an index shape", "columns 150-299"])
def test_a_column_shard_is_applied_in_place_where_its_receiver_holds_exactly_it(receiver, monkeypatch):
    """A tensor-parallel trainer rank's column shard (columns 100-199 of a (64, 300) tensor: a
    run per row) into a receiver holding exactly those elements -- the same box, or the same
    elements as a box of an index shape -- decodes in place as a whole tensor's chunks do (both
    number the elements in canonical order: ``apply._shift`` is 0), with no per-element index
    maps; a delta and then a keyframe of it land bit for bit, and a base one bit off is refused
    with the receiver's bits as they were. A receiver holding only some of the shard's columns
    ("columns 150-299") is refused with the classes error, as before."""
    apply_mod, b, t, region, shard_b, shard_t, blob = _column_shard(seed=9)
    if receiver == "columns 150-299":
        spec = ShardSpec.of(b.shape, [0, 150], [64, 150])
        with pytest.raises(DcrError, match="portable"):
            apply({"t0": b[:, 150:].clone()}, blob, shards={"t0": spec}, verify=False)
        return
    spec, mine_b, mine_t = region, shard_b, shard_t
    if receiver == "as an index shape":  # the held tensor has the box's shape there
        spec = ShardSpec.of(b.shape, [0, 1, 0], [64, 1, 100], index_shape=(64, 3, 100))
        mine_b, mine_t = shard_b.view(64, 1, 100), shard_t.view(64, 1, 100)
    maps = []
    real = apply_mod.IndexMap.to_local
    monkeypatch.setattr(apply_mod.IndexMap, "to_local", lambda self, g: maps.append(1) or real(self, g))
    held = mine_b.clone()
    apply({"t0": held}, blob, shards={"t0": spec})
    assert_bits_equal(held, mine_t)
    key = diff({}, {"t0": shard_t}, shards={"t0": region})  # a keyframe of it: its chunks dense, written as ranges
    held = torch.zeros_like(mine_b)
    apply({"t0": held}, key, shards={"t0": spec})
    assert_bits_equal(held, mine_t)
    assert not maps  # no chunk mapped its elements one by one
    one = diff({"t0": shard_b}, {"t0": shard_t}, shards={"t0": region}, encoding="classes")
    changed = torch.nonzero(_bits(shard_b) != _bits(shard_t)).squeeze(1)
    wrong = mine_b.clone()
    _bits(wrong)[changed[len(changed) // 2]] ^= 1
    held = wrong.clone()
    with pytest.raises(PartialApplyError) as e:  # (one chunk: nothing else was written before it)
        apply({"t0": held}, one, shards={"t0": spec}, verify=False, workers=1)
    assert isinstance(e.value.__cause__, BaseMismatchError)
    assert_bits_equal(held, wrong)


@pytest.mark.parametrize("receiver", ["whole", "whole, staged", "rows 8-63"])
def test_a_column_shard_into_a_receiver_holding_more_is_gathered_by_runs(receiver, monkeypatch):
    """A tensor-parallel trainer rank's column shard (columns 100-199 of a (64, 300) tensor: a run
    per row) into a receiver holding the tensor whole: each chunk's base bits gathered run by
    run (``_held_chunk``), not mapped element by element, and the index maps asked about the
    changes and the runs' starts alone; the delta lands bit for bit at the shard's columns and
    nowhere else, and a base one bit off is refused with nothing written. "staged": chunks this
    small are decoded into their gathered copy and written back run by run (``_apply_staged``),
    no change scattered; "whole": the threshold at 0, so each change is mapped and scattered. A
    receiver holding only part of each chunk ("rows 8-63") is refused with the classes error,
    as before."""
    apply_mod, b, t, region, shard_b, shard_t, blob = _column_shard(seed=10)
    staged = receiver == "whole, staged"
    if not staged:
        monkeypatch.setattr(apply_mod, "STAGE_ELEMS", 0)
        monkeypatch.setattr(apply_mod, "STAGE_PER_CHANGE", 0)
    scatters = []
    real_scatter = apply_mod.FlatAccess.scatter
    monkeypatch.setattr(apply_mod.FlatAccess, "scatter",
                        lambda self, i, v: scatters.append(i.numel()) or real_scatter(self, i, v))
    if receiver == "rows 8-63":  # holds only some of each chunk's positions
        with pytest.raises(DcrError, match="portable"):
            apply({"t0": b[8:].clone()}, blob, shards={"t0": ShardSpec.of(b.shape, [8, 0], [56, 300])}, verify=False)
        return
    sizes = []
    for name in ("to_global", "to_local"):
        real = getattr(apply_mod.IndexMap, name)
        monkeypatch.setattr(apply_mod.IndexMap, name,
                            lambda self, g, real=real: sizes.append(g.numel()) or real(self, g))
    held = b.clone()
    apply({"t0": held}, blob)
    want = b.clone()
    want[:, 100:200] = t[:, 100:200]
    assert_bits_equal(held, want)
    changed = torch.nonzero(_bits(shard_b) != _bits(shard_t)).squeeze(1)
    assert max(sizes, default=0) < 1000  # changes and run starts, never a chunk's 1000 elements
    assert (not scatters) if staged else (sizes and sum(scatters) == changed.numel())
    told = []  # those told of the changes (a follower's state digest) get canonical indices, old and new bits
    held = b.clone()
    apply({"t0": held}, blob, on_change=lambda name, dtype, shape, glob, old, new: told.append((glob, old, new)))
    assert_bits_equal(held, want)
    glob, old, new = (torch.cat([x[i] for x in told]) for i in range(3))
    order = torch.argsort(glob)  # (chunks run on the workers in any order)
    glob, old, new = glob[order], old[order], new[order]
    assert torch.equal(glob, (changed // 100) * 300 + 100 + changed % 100)
    assert torch.equal(old, _bits(b).view(-1)[glob]) and torch.equal(new, _bits(t).view(-1)[glob])
    one = diff({"t0": shard_b}, {"t0": shard_t}, shards={"t0": region}, encoding="classes")
    wrong = b.clone()
    at = int(changed[len(changed) // 2])
    wrong.view(torch.int16)[at // 100, 100 + at % 100] ^= 1  # (a changed position of the shard)
    held = wrong.clone()
    with pytest.raises(PartialApplyError) as e:  # (one chunk: nothing else was written before it)
        apply({"t0": held}, one, verify=False, workers=1)
    assert isinstance(e.value.__cause__, BaseMismatchError)
    assert_bits_equal(held, wrong)


def test_deltas_with_the_older_blake2b_digests_still_verify(monkeypatch):
    """Deltas written before the SHA-256 tensor digests carry bare BLAKE2b ones: a reader checks
    each with the algorithm it names, and still refuses a wrong base."""
    import importlib
    delta_mod = importlib.import_module("nemo_dcr.delta.diff")  # the module (nemo_dcr.delta.diff is the function)
    from nemo_dcr.state import digest
    base, target = _model(seed=6)
    monkeypatch.setattr(delta_mod, "tensor_digest", lambda t, *a, **k: digest.tensor_digest(t, "blake2b"))
    old_blob = diff(base, target, format_version=1)
    monkeypatch.undo()
    entries = DeltaReader(old_blob).raw_header["tensors"]
    assert all(":" not in e["target_digest"] for e in entries)  # bare BLAKE2b, in a version 1 delta
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, old_blob)
    for k in target:
        assert_bits_equal(recv[k], target[k])
    other, _ = _model(seed=7)
    with pytest.raises(BaseMismatchError):
        apply({k: v.clone() for k, v in other.items()}, old_blob)
    new_entries = DeltaReader(diff(base, target, format_version=2)).raw_header["tensors"]
    assert all(e["target_digest"].startswith("blake3:") for e in new_entries)
    new_entries = DeltaReader(diff(base, target, format_version=3)).raw_header["tensors"]
    assert all(e["target_digest"].startswith("sd:") for e in new_entries)
    new_entries = DeltaReader(diff(base, target, format_version=4)).raw_header["tensors"]
    assert all(e["target_digest"].startswith("sdn:") for e in new_entries)
    new_entries = DeltaReader(diff(base, target)).raw_header["tensors"]  # the default: version 5
    assert all(e["target_digest"].startswith("sdb:") for e in new_entries)


@pytest.mark.parametrize("use_native", [False, True] if native.lib() is not None else [False])
def test_rare_extreme_exponents_share_the_end_classes(use_native):
    """A change at an exponent with few changes below the busy range goes into the lowest busy
    class (and above it into the highest); positions still decode exactly."""
    g = torch.Generator().manual_seed(11)
    mant = classes.MANTISSA[torch.bfloat16]
    exps = torch.tensor([118, 119, 120])[torch.randint(0, 3, (20000,), generator=g)]
    old = ((exps << mant) | torch.randint(0, 128, (20000,), generator=g)).to(torch.int16)
    old[:50] = (100 << mant) + torch.arange(50)  # a rare low exponent
    old[-50:] = (130 << mant) + torch.arange(50)  # a rare high one
    new = old.clone()
    hit = torch.rand(20000, generator=g) < 0.05
    hit[:50] = hit[-50:] = False
    hit[[3, 7, 19990]] = True  # two changes at exponent 100, one at 130
    new[hit] += 1
    k, rows, pos, val = classes.encode(old, new, mant, use_native=use_native)
    assert [r[0] for r in rows] == [118, 119, 120]  # 100 and 130 merged into the ends
    idx, vals = classes.decode(old, rows, pos, val, k, mant, use_native=use_native)
    want = torch.nonzero(old != new).squeeze(1)
    assert torch.equal(idx, want) and torch.equal(vals, new[want])
