"""``apply_checkpoint``'s tensors prepared side by side (read, base checked, delta applied, target
checked) while the ones before them are written: the same files, the same report, and the same
refusals, nothing written, as one tensor at a time. Each tensor is read from its file once, and
hashed once."""
from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from nemo_dcr.checkpoint.files import apply_checkpoint, diff_checkpoints
from nemo_dcr.checkpoint.safetensors_io import Checkpoint, save_sharded
from nemo_dcr.errors import BaseMismatchError

files_mod = sys.modules["nemo_dcr.checkpoint.files"]


@pytest.fixture
def ckpts(tmp_path):
    """Six one-chunk tensors in two shards (BF16 and FP32), a tenth of the elements changed in
    four of them, and the delta."""
    g = torch.Generator().manual_seed(5)
    base = {f"t{i}": torch.randn(4000, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(6)}
    target = {n: v.clone() for n, v in base.items()}
    for n in ("t0", "t1", "t3", "t4"):
        target[n][::10] = target[n][::10] * 1.5 + 1
    save_sharded(base, str(tmp_path / "base"), shards=2)
    save_sharded(target, str(tmp_path / "target"), shards=2)
    diff_checkpoints(str(tmp_path / "base"), str(tmp_path / "target"), str(tmp_path / "d.dcr"), progress=False)
    return tmp_path


def files_of(d):
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


def test_tensors_are_prepared_side_by_side_into_the_same_files(ckpts, monkeypatch):
    """Two tensors' base checks meet at a barrier, which one tensor at a time never reaches; the
    result is the target's files byte for byte, and the report is the one-at-a-time apply's."""
    monkeypatch.setattr(files_mod, "AHEAD_JOBS", 1)
    alone = apply_checkpoint(str(ckpts / "base"), str(ckpts / "d.dcr"), str(ckpts / "alone"), progress=False)
    monkeypatch.setattr(files_mod, "AHEAD_JOBS", 4)
    met, real = threading.Barrier(2, timeout=30), files_mod.plan_entry

    def plan(e, *a, **k):
        if e.name in ("t0", "t1"):
            met.wait()  # BrokenBarrierError after 30 s if t1 is not prepared while t0 is
        return real(e, *a, **k)

    monkeypatch.setattr(files_mod, "plan_entry", plan)
    both = apply_checkpoint(str(ckpts / "base"), str(ckpts / "d.dcr"), str(ckpts / "both"), progress=False)
    assert files_of(ckpts / "both") == files_of(ckpts / "alone") == files_of(ckpts / "target")
    assert both.report == alone.report
    assert (both.report.tensors_changed, both.report.tensors_skipped) == (4, 2)


@pytest.mark.parametrize("wrong,says", [("t4", "not the base"), ("t3", "holds the delta's target")])
def test_a_wrong_base_tensor_late_in_the_order_is_refused_with_nothing_written(ckpts, wrong, says):
    """A base tensor that is not the delta's base (or is its target already) is refused while
    tensors before it were prepared and written to temporaries: the output never appears."""
    from safetensors.torch import load_file, save_file
    for name in os.listdir(ckpts / "base"):
        if name.endswith(".safetensors"):
            state = load_file(ckpts / "base" / name)
            if wrong in state:
                state[wrong] = load_file(next((ckpts / "target").glob(name)))[wrong] if says.startswith("holds") \
                    else state[wrong] + 1
                save_file(state, ckpts / "base" / name)
    with pytest.raises(BaseMismatchError, match=f"{wrong}: .*{says}"):
        apply_checkpoint(str(ckpts / "base"), str(ckpts / "d.dcr"), str(ckpts / "out"), progress=False)
    assert not (ckpts / "out").exists()


def test_each_tensor_is_read_by_a_digest_once(ckpts, monkeypatch):
    """The base's digest is the only whole-tensor pass: the target's sum digest follows the
    changes, and an unchanged tensor (its target is its base) is not hashed a second time."""
    digest_mod, apply_mod = sys.modules["nemo_dcr.state.digest"], sys.modules["nemo_dcr.delta.apply"]
    hashed, real = [], digest_mod.tensor_digest
    monkeypatch.setattr(digest_mod, "tensor_digest", lambda t, *a, **k: hashed.append(t.numel()) or real(t, *a, **k))
    monkeypatch.setattr(apply_mod, "RunningDigest", None)  # a target hashed as it is written: TypeError
    r = apply_checkpoint(str(ckpts / "base"), str(ckpts / "d.dcr"), str(ckpts / "out"), progress=False)
    assert hashed == [4000] * 6
    assert files_of(ckpts / "out") == files_of(ckpts / "target") and r.report.tensors_skipped == 2


def test_each_tensor_is_read_from_its_file_once(ckpts, monkeypatch):
    """``name in checkpoint`` answers from the header (Mapping's own read the tensor): a diff
    reads each base and target tensor once, an apply each base tensor once."""
    reads, real = [], Checkpoint.__getitem__
    monkeypatch.setattr(Checkpoint, "__getitem__", lambda self, n: reads.append((self.path, n)) or real(self, n))
    diff_checkpoints(str(ckpts / "base"), str(ckpts / "target"), str(ckpts / "again.dcr"), progress=False)
    assert sorted(reads) == sorted((str(ckpts / d), f"t{i}") for d in ("base", "target") for i in range(6))
    reads.clear()
    apply_checkpoint(str(ckpts / "base"), str(ckpts / "again.dcr"), str(ckpts / "out"), progress=False)
    assert sorted(reads) == [(str(ckpts / "base"), f"t{i}") for i in range(6)]
    assert "t0" in Checkpoint(str(ckpts / "base")) and "t9" not in Checkpoint(str(ckpts / "base"))
