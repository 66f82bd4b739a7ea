"""The device path wired in (nemo_dcr/device/trainer.py, receive.py), its kernels run on CPU
tensors under TRITON_INTERPRET=1: a delta from the device snapshot and the compact change stream
is byte-identical to the reference's (every payload byte and header field but the creation
time), a Publisher(device="on") publishes the versions a reference publisher does, a failed
publish leaves the device snapshot the base, and the device apply rebuilds the live state with
pre-images checked before the first write and the state digest updated from the changes alone."""
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from dcr_testing import assert_state  # noqa: E402
from dcr_testing.deltas import same_delta  # noqa: E402
from dcr_testing.device_cases import make_pair  # noqa: E402
from nemo_dcr.codec.format import DeltaReader  # noqa: E402
from nemo_dcr.delta import diff  # noqa: E402
from nemo_dcr.device import kernels  # noqa: E402
from nemo_dcr.device.receive import apply_delta_  # noqa: E402
from nemo_dcr.device.trainer import DeviceSnapshot, choose  # noqa: E402
from nemo_dcr.errors import BaseMismatchError, DcrError, PublishError  # noqa: E402
from nemo_dcr.state.statedigest import ChangeDigest, state_contrib  # noqa: E402
from nemo_dcr.stores import LocalStore  # noqa: E402
from nemo_dcr.sync.follower import Follower  # noqa: E402
from nemo_dcr.sync.publisher import Publisher  # noqa: E402

if not kernels.interpreted():
    pytest.skip("nemo_dcr.device.kernels was imported without TRITON_INTERPRET=1", allow_module_level=True)

CHUNK = 500


def _states():
    """(v0, v1): bf16 over 3 chunks, fp32 2-D, int32, bool, fp64, float8; v1 also adds a
    tensor, drops one, re-types one and holds one non-contiguous (the reference takes those)."""
    pairs = {"w": make_pair(torch.bfloat16, 1300, 0.05, 1), "x": make_pair(torch.float32, 700, 0.3, 2),
             "i": make_pair(torch.int32, 300, 0.1, 3), "b": make_pair(torch.bool, 200, 0.1, 4),
             "d": make_pair(torch.float64, 100, 0.1, 5), "f8": make_pair(torch.float8_e5m2, 600, 0.05, 6),
             "nc": make_pair(torch.float16, 64, 0.2, 7)}
    v0 = {k: a for k, (a, _) in pairs.items()}
    v0["x"] = v0["x"].view(7, 100)
    v0["gone"] = torch.ones(3)
    v0["retyped"] = torch.ones(4)
    v1 = {k: b for k, (_, b) in pairs.items() if k != "nc"}
    v1["x"] = v1["x"].view(7, 100)
    v1["nc"] = pairs["nc"][1].view(8, 8).t()  # not contiguous: the reference encodes it
    v1["new"] = torch.arange(5.0)
    v1["retyped"] = torch.ones(4, dtype=torch.float16)
    return v0, v1


@pytest.mark.parametrize("encoding", ["auto", "classes", "portable"])
def test_delta_bytes_equal_the_reference(encoding):
    v0, v1 = _states()
    dev = DeviceSnapshot()
    dev.reset(v0)
    ref_change, dev_change = ChangeDigest(), ChangeDigest()
    ref = diff(v0, v1, encoding=encoding, chunk_elems=CHUNK, on_change=ref_change, progress=False)
    got = diff(*dev.views(v1), encoding=encoding, chunk_elems=CHUNK, on_change=dev_change, progress=False,
               chunker=dev.chunker)
    same_delta(got, ref)
    assert dev_change.total == ref_change.total
    assert set(dev._pending) == {"w", "x", "i", "b", "d", "f8"}  # the device pass took these, not the rest
    dev.commit(v1)
    assert_state(dev.tensors, {k: v.contiguous() for k, v in v1.items()})


def test_publisher_on_the_device_publishes_the_reference_versions(tmp_path, caplog):
    v0, v1 = _states()
    v2 = {k: v.clone() for k, v in v1.items()}
    v2["w"][::7] = v0["w"][::7]
    live = {k: v.clone() for k, v in v0.items()}
    ref = Publisher(LocalStore(tmp_path / "ref"), chunk_elems=CHUNK, keyframe_every=2)
    dev = Publisher(LocalStore(tmp_path / "dev"), chunk_elems=CHUNK, keyframe_every=2, device="on")
    with caplog.at_level("INFO", logger="nemo_dcr.device"):
        for state in (v0, v1, v2):
            live.clear()
            live.update({k: v.clone() for k, v in state.items()})
            a, b = ref.publish(live), dev.publish(live)
            assert a.manifest.target_digest == b.manifest.target_digest
            assert a.changed == b.changed
            for pa, pb in zip(a.manifest.parts + a.manifest.keyframe_parts,
                              b.manifest.parts + b.manifest.keyframe_parts, strict=True):
                same_delta(ref.store.get(pa.key), dev.store.get(pb.key))
    assert "device path (Triton kernels, interpreted)" in caplog.text
    assert_state(dev.published[0], {k: v.contiguous() for k, v in v2.items()})
    recv = {k: torch.zeros_like(v) for k, v in v0.items()}
    Follower(LocalStore(tmp_path / "dev"), recv).sync()
    assert_state(recv, {k: v.contiguous() for k, v in v2.items()})


class _FailingStore(LocalStore):
    fail = False

    def put(self, key, data):
        if self.fail and key.endswith(".dcr"):
            raise OSError("injected: upload failed")
        return super().put(key, data)


def test_a_failed_publish_leaves_the_device_snapshot_the_base(tmp_path):
    v0, v1 = _states()
    store = _FailingStore(tmp_path / "s")
    pub = Publisher(store, chunk_elems=CHUNK, device="on")
    pub.publish(v0)
    before = {k: v.clone() for k, v in pub.published[0].items()}
    store.fail = True
    with pytest.raises(PublishError):
        pub.publish(v1)
    assert_state(pub.published[0], before)  # nothing of v1 was written into the snapshot
    store.fail = False
    pub.publish(v1)
    recv = {k: torch.zeros_like(v) for k, v in v0.items()}
    Follower(LocalStore(tmp_path / "s"), recv).sync()
    assert_state(recv, {k: v.contiguous() for k, v in v1.items()})


@pytest.mark.parametrize("fv", [4, 5])
def test_device_apply_rebuilds_the_state_and_updates_the_digest(fv):
    """... under the definition the delta's version sums with (2 from version 5)."""
    v0, v1 = _states()  # a tensor added, one removed, one re-typed: sent whole or dropped
    blob = diff(v0, v1, chunk_elems=CHUNK, progress=False, format_version=fv)
    recv = {k: v.clone() for k, v in v0.items()}
    d = apply_delta_(recv, blob)
    assert_state(recv, {k: v.contiguous() for k, v in v1.items()})
    definition = 2 if fv == 5 else 1
    assert d.definition == definition
    assert state_contrib(v0, definition=definition) + d == state_contrib(v1, definition=definition)


def test_device_apply_checks_every_chunk_before_the_first_write():
    v0, v1 = _states()
    keep = ("w", "x", "i")
    v0, v1 = {k: v0[k] for k in keep}, {k: v1[k] for k in keep}
    blob = diff(v0, v1, chunk_elems=CHUNK, progress=False)
    recv = {k: v.clone() for k, v in v0.items()}
    recv["i"].copy_(torch.where(v0["i"] != v1["i"], recv["i"] ^ 4, recv["i"]))  # the last tensor: not its base
    held = {k: v.clone() for k, v in recv.items()}
    with pytest.raises(BaseMismatchError, match="i: chunk at element 0"):
        apply_delta_(recv, blob)
    assert_state(recv, held)  # "w" and "x" come first and were not written either
    with pytest.raises(DcrError, match="whole tensors"):
        apply_delta_({"w": v0["w"][:10].clone(), "x": v0["x"], "i": v0["i"]}, blob)


@pytest.mark.parametrize("how", ["classes moved", "one class emptied"])
def test_device_apply_locates_classes_changes_against_the_held_base(how):
    """A ``classes`` chunk's streams are decoded on the host and its positions located against the
    base where it is held: a base whose classes differ (unchanged elements moved to another
    exponent, or a class emptied so that ranks run past it) is refused, nothing written."""
    v0, v1 = _states()
    keep = ("w", "x", "i")
    v0, v1 = {k: v0[k] for k in keep}, {k: v1[k] for k in keep}
    blob = diff(v0, v1, chunk_elems=CHUNK, encoding="classes", progress=False)
    assert {c.enc for e in DeltaReader.open(blob).header.tensors if e.name == "w" for c in e.chunks} == {"classes"}
    recv = {k: v.clone() for k, v in v0.items()}
    d = apply_delta_(recv, blob)  # the held base: every chunk located and applied
    assert_state(recv, {k: v.contiguous() for k, v in v1.items()})
    assert state_contrib(v0, definition=d.definition) + d == state_contrib(v1, definition=d.definition)
    recv = {k: v.clone() for k, v in v0.items()}
    wb = recv["w"].view(torch.int16)
    same = torch.nonzero(v0["w"].view(torch.int16) == v1["w"].view(torch.int16)).squeeze(1)
    if how == "classes moved":
        wb[same[::7]] ^= 0x0080  # the lowest exponent bit of unchanged elements
    else:
        wb.copy_(torch.where(wb != v1["w"].view(torch.int16), wb, torch.zeros_like(wb)))  # only the changed stay
    held = {k: v.clone() for k, v in recv.items()}
    with pytest.raises(BaseMismatchError, match="w: chunk at element"):
        apply_delta_(recv, blob)
    assert_state(recv, held)


def test_choosing_the_path():
    with pytest.raises(DcrError, match="'off', 'on' or 'auto'"):
        choose("gpu", {})
    nc = {"a": torch.zeros(4, 4).t()}
    assert choose("auto", nc) is False  # nothing the kernels can take: the reference, logged
    with pytest.raises(DcrError, match="cannot run"):
        choose("on", nc)
    with pytest.raises(DcrError, match="keep"):
        DeviceSnapshot("disk")


def test_host_view_answers_membership_without_copying_to_the_host():
    """``name in view`` (diff asks it of each tensor) must not copy the tensor to the host, as
    Mapping's own ``__contains__`` did by looking it up (a meta tensor cannot be copied: it raised)."""
    from nemo_dcr.device.trainer import HostView
    view = HostView({"a": torch.empty(8, device="meta")})
    assert "a" in view and "b" not in view
