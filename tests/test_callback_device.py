"""The Lightning callback's device path (issue 24; integrations/device_snapshot.py,
device/capture.py), its kernels run on CPU tensors under TRITON_INTERPRET=1: a real Trainer
publishing with ``device="on"`` writes the very versions a host-path callback writes for the same
training run (every part byte for byte, but creation time and publish id; deltas, keyframes, an
empty version), with the last published version kept in device or pinned memory; each capture
between keyframes moves only its change streams and digests to the host (counted: O(changes));
a Follower rebuilds every version bit-exactly."""
import copy
import os
import warnings

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
pl = pytest.importorskip("lightning.pytorch")

from dcr_testing import assert_state  # noqa: E402
from dcr_testing.deltas import same_delta  # noqa: E402
from nemo_dcr.device import kernels  # noqa: E402
from nemo_dcr.device.capture import Captured, DeviceCapture  # noqa: E402
from nemo_dcr.integrations import DeltaPublishCallback, module_snapshot  # noqa: E402
from nemo_dcr.stores import LocalStore  # noqa: E402
from nemo_dcr.sync.follower import Follower  # noqa: E402
from nemo_dcr.sync.versions import read_head, read_manifest  # noqa: E402

if not kernels.interpreted():
    pytest.skip("nemo_dcr.device.kernels was imported without TRITON_INTERPRET=1", allow_module_level=True)
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


class Skipper(pl.Callback):
    """Marks one step skipped (an empty version: the callback's ``on_skipped_step="empty"``)."""

    def __init__(self, step):
        self.step, self.truth = step, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            for cb in trainer.callbacks:
                if isinstance(cb, DeltaPublishCallback):
                    cb.mark_skipped()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.truth[trainer.global_step] = module_snapshot(pl_module, "bfloat16")[0]


def run(tmp_path, name, captures=None, **kw):
    store = LocalStore(str(tmp_path / name))
    cb = DeltaPublishCallback(store, keyframe_every=3, dtype="bfloat16", chunk_elems=256, publish_initial=True,
                              on_skipped_step="empty", **kw)
    if captures is not None:  # record what each capture moved to the host (the capture itself runs as it is)
        dc = cb.device.capture
        take = dc.capture

        def recorded(live, full=False):
            job = take(live, full)
            captures.append(job)
            return job
        dc.capture = recorded
    skipper = Skipper(step=4)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[cb, skipper], logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(Tiny())
    return store, cb, skipper.truth


def chain(store):
    head, _ = read_head(store)
    out, m = [], read_manifest(store, head.manifest)
    while True:
        out.append(m)
        if m.base_manifest is None:
            return out[::-1]
        m = read_manifest(store, m.base_manifest)


@pytest.mark.parametrize("keep, fv", [("device", 3), ("pinned", 3), ("device", 2)])
def test_device_callback_publishes_the_host_paths_versions(tmp_path, keep, fv):
    ref, ref_cb, truth = run(tmp_path, "host", device="off", format_version=fv)
    captures: list[Captured] = []
    dev, cb, truth_dev = run(tmp_path, "dev", captures, device="on", keep=keep, format_version=fv)
    assert cb.device.active and not ref_cb.device.active
    # the device hashes each captured tensor for version 2 (BLAKE3); version 3 sums the changes
    assert all(bool(c.digests) == (fv == 2) for c in captures if c.streams)
    a, b = chain(ref), chain(dev)
    assert [m.version for m in a] == [m.version for m in b] == list(range(7))  # initial + 6 steps (one empty)
    assert [m.is_keyframe for m in b] == [True, False, False, True, False, False, True]
    for ma, mb in zip(a, b, strict=True):
        assert ma.target_digest == mb.target_digest and ma.changed == mb.changed
        for pa, pb in zip(ma.parts + ma.keyframe_parts, mb.parts + mb.keyframe_parts, strict=True):
            same_delta(ref.get(pa.key), dev.get(pb.key))
    # every version rebuilt bit-exactly from the device path's store
    state = {k: torch.zeros_like(v) for k, v in truth_dev[6].items()}
    Follower(dev, state).sync()
    assert_state(state, truth_dev[6])
    assert_state(state, truth[6])
    # what crossed to the host: a whole copy for the first capture and the keyframes' (versions 3, 6),
    # the change streams alone for the others (positions 8 B, old and new bits 2 + 2, class and rank 8 + 8)
    assert [c.full for c in captures] == [True, False, False, True, False, True]  # the empty version: no capture
    dense = sum(t.numel() * t.element_size() for t in truth_dev[6].values())
    for c in captures:
        k = sum(s.k for s in c.streams.values())
        if c.full:
            assert c.d2h_bytes >= dense
        else:
            assert c.d2h_bytes == sum(s.nbytes() for s in c.streams.values()) <= 28 * k
            assert c.d2h_bytes < dense
    kept = cb.device.capture.kept
    assert all((t.device.type == "cpu") for t in kept.values())  # (CPU tensors here; on a GPU: where `keep` says)
    assert cb.device.capture.kept_bytes() == dense
    # a copy (NeMo's Trainer deep-copies its callbacks) keeps the modes, none of the captured state
    c = copy.deepcopy(cb)
    assert c.device is not cb.device and (c.device.device, c.device.capture.keep) == ("on", keep)
    assert not c.device.capture.kept and c.device.active is None


def test_capture_refuses_a_keyframe_it_cannot_make_and_a_moved_store():
    """A job without the full state cannot become a keyframe; clear errors, nothing half done."""
    from nemo_dcr.errors import DcrError
    cap = DeviceCapture(chunk_elems=64)
    live = {"w": torch.arange(200, dtype=torch.float32).to(torch.bfloat16)}
    first = cap.capture(live)
    live["w"][::7] += 1
    second = cap.capture(live)
    assert first.host and not second.host and second.streams["w"].k == 29
    with pytest.raises(DcrError, match="needs the full state"):
        cap.base.host_view(second)["w"]
    cap.base.reset({"w": torch.zeros(200, dtype=torch.bfloat16)}, like=second)  # rebuilt from a store
    with pytest.raises(DcrError, match="store moved on"):
        cap.base.views(second)


def test_the_hugging_face_callback_takes_the_device_path_too(tmp_path):
    """DeltaPublishTrainerCallback drives the same PublishLoop: with ``device="on"`` its versions
    are the host path's, part for part, from a real ``transformers.Trainer``."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from nemo_dcr.integrations import DeltaPublishTrainerCallback

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(3, 64, (32, 12), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def train(name, device):
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        store = LocalStore(str(tmp_path / name))
        cb = DeltaPublishTrainerCallback(store, keyframe_every=3, dtype="bfloat16", chunk_elems=256,
                                         publish_initial=True, device=device, encoding="portable")  # (the
        # interpreted class/rank kernel takes most of a capture's time: the Lightning test runs it)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / f"out-{name}"), max_steps=4,
                                              per_device_train_batch_size=2, learning_rate=1e-3, report_to="none",
                                              use_cpu=True, disable_tqdm=True, seed=0, save_strategy="no",
                                              dataloader_num_workers=0)
        transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
        return store, cb, module_snapshot(model, "bfloat16")[0]

    ref, ref_cb, _ = train("host", "off")
    dev, cb, last = train("dev", "on")
    assert cb.device.active and not ref_cb.device.active
    assert cb.state()["args"]["device"] == "on"  # what a Trainer checkpoint records of it
    a, b = chain(ref), chain(dev)
    assert [m.version for m in b] == list(range(5)) and [m.is_keyframe for m in b] == [True, False, False, True, False]
    for ma, mb in zip(a, b, strict=True):
        assert ma.target_digest == mb.target_digest
        for pa, pb in zip(ma.parts + ma.keyframe_parts, mb.parts + mb.keyframe_parts, strict=True):
            same_delta(ref.get(pa.key), dev.get(pb.key))
    state = {k: torch.zeros_like(v) for k, v in last.items()}
    Follower(dev, state).sync()
    assert_state(state, last)
