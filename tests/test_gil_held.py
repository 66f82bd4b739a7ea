"""The chunk path's short C calls keep the GIL (``native.held``), and a reader whose payloads were
checked before the first write (``DeltaReader.check_payloads``) is not CRC'd a second time chunk
by chunk, while one that was not checked still is. On a busy machine each call that gave the GIL
up waited to take it back (docs/results.md, eighteenth turn)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from dcr_testing import assert_bits_equal, record_held_calls
from nemo_dcr.codec import chunk as chunk_mod
from nemo_dcr.codec import native
from nemo_dcr.codec.format import DeltaReader
from nemo_dcr.delta import ApplyReport, apply, diff, plan_entry, run_plan
from nemo_dcr.errors import BaseMismatchError, DcrError, DeltaFormatError
from nemo_dcr.state import statedigest as sd
from nemo_dcr.stores import LocalStore
from nemo_dcr.sync.follower import Follower
from nemo_dcr.sync.publisher import Publisher

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"no C kernels: {native.build_error}")


def _states(seed: int = 3, n: int = 4, size: int = 1 << 16, changed: int = 600):
    g = torch.Generator().manual_seed(seed)
    v0 = {f"t{i}": (torch.randn(size, generator=g) * 0.02).bfloat16() for i in range(n)}
    v1 = {k: v.clone() for k, v in v0.items()}
    for v in v1.values():
        idx = torch.randperm(size, generator=g)[:changed]
        v[idx] = (v[idx].float() * 1.01 + 1e-4).bfloat16()
    return v0, v1


def test_held_is_the_loaded_library_keeping_the_gil(monkeypatch):
    h = native.held()
    assert isinstance(h, ctypes.PyDLL) and h._name == native.lib()._name
    assert native.held() is h  # made once
    monkeypatch.setattr(native, "lib", lambda: None)  # the kernels off: nothing to call
    assert native.held() is None


@pytest.mark.parametrize("values,numel,out", [
    ([0, 5, 9], 10, False), ([9], 10, False), ([0, 10], 10, True), ([-1, 3], 10, True),
    ([3, 2**40, 7], 2**40 + 1, False), ([3, 2**40 + 1], 2**40 + 1, True), ([-(2**62)], 5, True),
])
def test_the_range_check_in_c_agrees_with_aminmax(monkeypatch, values, numel, out):
    idx = torch.tensor(values, dtype=torch.int64)
    assert sd._out_of_range(idx, numel) is out
    monkeypatch.setattr(native, "lib", lambda: None)  # torch's aminmax
    assert sd._out_of_range(idx, numel) is out


def test_a_state_digest_change_out_of_range_is_refused_before_the_kernel():
    idx = torch.tensor([0, 4, 12], dtype=torch.int64)
    bits = torch.zeros(3, dtype=torch.int16)
    with pytest.raises(DcrError, match="out of range"):
        sd.change_contrib("w", torch.bfloat16, (3, 4), idx, bits, bits + 1)


def test_a_syncs_short_calls_keep_the_gil(tmp_path, monkeypatch):
    """A delta sync's CRCs of its segments and its state digest changes (with their index checks,
    ``dcr_sd_change_acc``) go through the library's GIL-keeping handle; the result is the target,
    bit for bit."""
    called = record_held_calls(monkeypatch)
    v0, v1 = _states()
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store, signer=None)
    pub.publish(v0)
    pub.publish(v1)
    held = {k: v.clone() for k, v in v0.items()}
    assert Follower(store, held, version=0, verify_initial=False, stream=True).sync().version == 1
    for k, v in v1.items():
        assert_bits_equal(held[k], v)
    assert {"dcr_crc32", "dcr_sd_change_acc"} <= set(called), called


def test_checked_payloads_are_not_crcd_again_and_unchecked_ones_are(monkeypatch):
    v0, v1 = _states(n=2)
    blob = diff(v0, v1)
    crcs = []
    real = chunk_mod.crc32

    def counting(data, *a, **k):
        crcs.append(len(data))
        return real(data, *a, **k)
    monkeypatch.setattr(chunk_mod, "crc32", counting)

    # apply checks every payload before its first write (DeltaReader.check_payloads): the
    # chunks' decoders then take them as checked
    held = {k: v.clone() for k, v in v0.items()}
    apply(held, DeltaReader(blob))
    for k, v in v1.items():
        assert_bits_equal(held[k], v)
    assert crcs == []

    # a reader nobody checked (run_plan called directly): each chunk is checked as it decodes,
    # and a damaged one is refused before its write
    bad = bytearray(blob)
    r = DeltaReader(bytes(bad))
    c = r.header.tensors[0].chunks[0]
    bad[c.off + c.payload_len // 2] ^= 0x40
    r = DeltaReader(bytes(bad))
    assert not r.payloads_checked
    e = r.header.tensors[0]
    t = v0[e.name].clone()
    # (a classes chunk that does not decode is reported by the pre-image check after it)
    with pytest.raises((DeltaFormatError, BaseMismatchError)):
        run_plan(r, plan_entry(e, t, None, verify=False), ApplyReport(), workers=1)
    assert_bits_equal(t, v0[e.name])
    assert crcs  # checked here, chunk by chunk
