"""Format version 2's digests (BLAKE3), checked against the ``blake3`` package directly rather
than against our own hashing code: the tensor digest over exactly the bytes docs/format.md names,
for every dtype, non-contiguous and empty tensors, whatever the ranges and threads; the chunk
digests; and every check still firing with them (a wrong base, a wrong target, an unknown
algorithm refused before the first write, in versions 2 and 3), next to version 1 deltas that
still verify."""
from __future__ import annotations

import copy

import blake3
import pytest
import torch

from dcr_testing import assert_state
from dcr_testing.deltas import rewrite
from nemo_dcr import BaseMismatchError, DeltaReader, PartialApplyError, TargetMismatchError, apply, diff
from nemo_dcr.codec.versions import FORMAT_VERSION
from nemo_dcr.errors import DcrError, DeltaFormatError
from nemo_dcr.state import digest
from nemo_dcr.state.digest import RunningDigest, algo_of, tensor_digest, tensor_digest_like, values_digest
from nemo_dcr.state.dtypes import DTYPES


def _random(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bit patterns (NaN payloads, -0.0, subnormals included) of ``dtype``."""
    n = int(torch.Size(shape).numel())
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1  # a bool byte is 0 or 1
    return raw.view(dtype).reshape(shape)


def _reference(t: torch.Tensor) -> str:
    """docs/format.md: "blake3:" + the first 32 hex digits of BLAKE3 over "<dtype>|[d0, d1, ...]|"
    and the tensor's little-endian row-major bytes, in one call of the blake3 package."""
    framing = f"{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode()
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return "blake3:" + blake3.blake3(framing + data).hexdigest()[:32]


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_tensor_digest_is_blake3_of_the_framed_bytes(name):
    dtype = DTYPES[name]
    t = _random(dtype, (37, 24), seed=len(name))
    cases = [t, t.t(), t[::3, 1::2], t[5], t[:0], t[:, :0], t[2, 3], t.reshape(-1)[:1]]
    for v in cases:
        assert tensor_digest(v) == _reference(v), (name, tuple(v.shape), v.stride())
        assert tensor_digest_like(v, "blake3:" + "0" * 32) == _reference(v)
    assert len({tensor_digest(v) for v in cases}) == len(cases)  # shape and dtype are in the digest


def test_ranges_and_threads_do_not_change_the_digest(monkeypatch):
    """Hashed in ranges of HASH_RANGE elements, on 1 or 2 BLAKE3 threads (above THREADED_MIN):
    the same digest as one call over all the bytes, contiguous or not."""
    t = _random(torch.bfloat16, (1 << 11, 1 << 11), seed=3)  # 8 MiB: threaded by default
    assert t.numel() * t.element_size() >= digest.THREADED_MIN
    want = {v: _reference(v) for v in (t, t.t())}
    for threads in (1, 2, 4):
        for rng in (1 << 22, 1 << 17, 12345):
            monkeypatch.setattr(digest, "HASH_RANGE", rng)
            for v, d in want.items():
                assert RunningDigest(v, threads=threads).hexdigest() == d
    r = RunningDigest(t)  # fed front to back in uneven steps, as apply does
    for end in (0, 1, 1000, 1000, 2_000_001, t.numel() + 5):
        r.advance(end)
    assert r.hexdigest() == want[t]


def test_values_digest_is_64_bits_of_blake3():
    for dtype in (torch.int16, torch.uint8, torch.int32, torch.int64):
        bits = _random(dtype, (1001,), seed=9)
        data = bits.numpy().tobytes()
        assert values_digest(bits) == blake3.blake3(data).hexdigest()[:16]
        assert values_digest(bits, "blake3") == blake3.blake3(data).hexdigest(length=8)
        assert values_digest(bits[:0]) == blake3.blake3(b"").hexdigest()[:16]
    with pytest.raises(ValueError, match="unknown values digest"):
        values_digest(bits, "md5")


def test_algorithms_are_named_by_the_digest():
    t = _random(torch.float32, (10, 3), seed=1)
    for algo, prefix in (("blake3", "blake3:"), ("sha256", "sha256:"), ("blake2b", "")):
        d = tensor_digest(t, algo)
        assert d.startswith(prefix) and len(d) == len(prefix) + 32
        assert algo_of(d) == algo and tensor_digest_like(t, d) == d
    for bad in ("md5:" + "0" * 32, "BLAKE3:" + "0" * 32, "sha512:ab", ":"):
        with pytest.raises(ValueError, match="unknown tensor digest algorithm"):
            algo_of(bad)
    with pytest.raises(ValueError, match="unknown tensor digest algorithm"):
        tensor_digest(t, "md5")


def _states(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = {"a.bf16": torch.randn(64, 50, generator=g).to(torch.bfloat16),
            "b.fp32": torch.randn(300, generator=g),
            "c.i64": torch.randint(-(1 << 40), 1 << 40, (7, 9), generator=g),
            "e.empty": torch.zeros(0, 3, dtype=torch.float16)}
    target = {k: v.clone() for k, v in base.items()}
    target["a.bf16"].view(-1)[::37] = torch.randn(87, generator=g).to(torch.bfloat16)
    target["b.fp32"][[3, 200]] = torch.tensor([-0.0, float("nan")])
    target["c.i64"][2, 2] += 1
    target["z.new"] = torch.arange(6, dtype=torch.uint8)
    return base, target


@pytest.mark.parametrize("fv, tensor_prefix, values_algo", [(3, "sd:", "blake3"), (2, "blake3:", "blake3"),
                                                           (1, "sha256:", "blake2b")])
def test_each_version_writes_its_digests(fv, tensor_prefix, values_algo):
    base, target = _states()
    r = DeltaReader.open(diff(base, target, chunk_elems=512, format_version=fv))
    assert r.version == fv and r.raw_header["format"] == fv
    chunks = 0
    for e in r.header.tensors:
        assert e.target_digest.startswith(tensor_prefix)
        assert e.target_digest == tensor_digest(target[e.name], {3: "sd", 2: "blake3", 1: "sha256"}[fv])
        for c in e.chunks:
            chunks += 1
            assert c.values_algo == values_algo
            idx = torch.arange(c.start, c.end)  # every chunk here is small: compare the post image
            new = target[e.name].reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                                   8: torch.int64}[target[e.name].element_size()])[idx]
            if e.kind.value == "full":
                assert c.post == values_digest(new, values_algo)
    assert chunks > 3
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, r)
    assert_state(recv, target)


def test_the_default_format_version_is_5():
    base, target = _states()
    assert FORMAT_VERSION == 5 and DeltaReader.open(diff(base, target)).version == 5


def test_a_format_version_is_checked():
    base, target = _states()
    with pytest.raises(DcrError, match="format version 6"):
        diff(base, target, format_version=6)


def test_known_base_digests_of_another_algorithm_are_hashed():
    """A publisher's cached base digests reused only in their own algorithm: a version 1 delta
    never carries a "blake3:" digest its readers cannot check, nor a version 2 one a stale one."""
    base, target = _states()
    known = {e.name: e.target_digest for e in DeltaReader.open(diff({}, base, format_version=2)).header.tensors}
    assert all(d.startswith("blake3:") for d in known.values())
    v1 = DeltaReader.open(diff(base, target, base_digests=known, format_version=1)).header
    assert all(e.base_digest.startswith("sha256:") for e in v1.tensors if e.base_digest)
    v2 = DeltaReader.open(diff(base, target, base_digests=known, format_version=2)).header
    assert {e.name: e.base_digest for e in v2.tensors if e.base_digest} == \
        {k: d for k, d in known.items() if k in target}
    v3 = DeltaReader.open(diff(base, target, base_digests=known, format_version=3)).header
    assert {e.name: e.base_digest for e in v3.tensors if e.base_digest} == \
        {k: tensor_digest(base[k], "sd") for k in known if k in target}


def _rebuild(blob: bytes, mutate) -> bytes:
    h = copy.deepcopy(DeltaReader(blob).raw_header)
    mutate(h)
    return rewrite(blob, h)


def _entry(h, name):
    return next(t for t in h["tensors"] if t["name"] == name)


@pytest.mark.parametrize("fv", [2, 3])
def test_a_wrong_target_is_caught_by_the_tensor_digest(fv):
    base, target = _states()
    blob = diff(base, target, format_version=fv)

    def flip(h):  # the last hex digit of one target digest
        e = _entry(h, "a.bf16")
        e["target_digest"] = e["target_digest"][:-1] + ("0" if e["target_digest"][-1] != "0" else "1")
    recv = {k: v.clone() for k, v in base.items()}
    with pytest.raises(PartialApplyError) as e:  # (found after the writes, so partly applied)
        apply(recv, _rebuild(blob, flip))
    assert isinstance(e.value.__cause__, TargetMismatchError) and "a.bf16" in str(e.value.__cause__)


@pytest.mark.parametrize("fv", [2, 3])
def test_a_wrong_base_is_caught_by_the_tensor_and_chunk_digests(fv):
    base, target = _states()
    blob = diff(base, target, format_version=fv)
    wrong = {k: v.clone() for k, v in base.items()}
    wrong["a.bf16"].view(-1)[37] = 1.5  # a changed position: the chunk's pre-image differs
    snap = {k: v.clone() for k, v in wrong.items()}
    with pytest.raises(BaseMismatchError):  # the tensor digest, before the first write
        apply(wrong, blob)
    assert_state(wrong, snap)
    with pytest.raises(PartialApplyError) as e:  # the chunk's BLAKE3-64 pre-image (checked per chunk)
        apply(wrong, blob, verify=False)
    assert isinstance(e.value.__cause__, BaseMismatchError) and "at element 0 " in str(e.value.__cause__)


@pytest.mark.parametrize("field", ["target_digest", "base_digest"])
@pytest.mark.parametrize("fv", [2, 3])
def test_an_unknown_digest_algorithm_is_refused_before_the_first_write(field, fv):
    """Tensors are applied in name order; the last one names an algorithm this build does not
    know: the delta is refused when it is opened, with every tensor as it was."""
    base, target = _states()
    name = "c.i64"
    blob = _rebuild(diff(base, target, format_version=fv),
                    lambda h: _entry(h, name).update({field: "blake9:" + "0" * 32}))
    recv = {k: v.clone() for k, v in base.items()}
    with pytest.raises(DeltaFormatError, match="unknown tensor digest algorithm 'blake9'"):
        apply(recv, blob)
    assert_state(recv, base)


def test_version_1_deltas_still_apply_and_verify():
    """SHA-256 tensor digests with BLAKE2b-64 chunk digests (version 1): applied, and a wrong
    base still refused by either check."""
    base, target = _states()
    blob = diff(base, target, format_version=1)
    recv = {k: v.clone() for k, v in base.items()}
    apply(recv, blob)
    assert_state(recv, target)
    apply(recv, blob)  # re-delivered: recognised by the target digests
    assert_state(recv, target)
    wrong = {k: v.clone() for k, v in base.items()}
    wrong["a.bf16"].view(-1)[0] = 2.0
    with pytest.raises(BaseMismatchError):
        apply(wrong, blob)
    with pytest.raises(PartialApplyError) as e:
        apply(wrong, blob, verify=False)
    assert isinstance(e.value.__cause__, BaseMismatchError)


def test_a_publisher_can_write_version_1_for_older_receivers(tmp_path):
    """``Publisher(format_version=1)``: every part (keyframe and delta) is a version 1 delta, and
    a follower applies the chain bit-exactly."""
    from dcr_testing import zeros_like
    from nemo_dcr import Follower, Publisher
    from nemo_dcr.stores.local import LocalStore
    base, target = _states()
    target.pop("z.new")  # (the same tensor set: the follower holds it)
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store, chunk_elems=512, format_version=1)
    recv = zeros_like(base)
    fol = Follower(store, recv)
    for s in (base, target):
        r = pub.publish(s)
        for p in r.manifest.parts + r.manifest.keyframe_parts:
            assert DeltaReader.open(store.get(p.key)).version == 1
        fol.sync()
        assert_state(recv, s)
    with pytest.raises(DcrError, match="format version 0"):
        Publisher(store, format_version=0)


def test_the_lightning_callback_takes_a_format_version(tmp_path):
    pytest.importorskip("lightning")
    from nemo_dcr.integrations import DeltaPublishCallback
    assert DeltaPublishCallback(str(tmp_path), format_version=1).format_version == 1
    assert DeltaPublishCallback(str(tmp_path)).format_version == FORMAT_VERSION == 5
    # SHA-256 parts named alone: the newest version their receivers read (manifest format 3)
    assert DeltaPublishCallback(str(tmp_path), object_checksum="sha256").format_version == 4
    with pytest.raises(DcrError, match="format version 7"):
        DeltaPublishCallback(str(tmp_path), format_version=7)
