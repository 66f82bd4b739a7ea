"""DeltaPublishTrainerCallback in a real Hugging Face ``Trainer`` (CPU) on a tiny Llama: one
publish per optimizer step (gradient accumulation included), every version reconstructed
bit-exactly by a Follower, metrics in the trainer's logs, a failed publish raised by
``train()``, and resume from a Trainer checkpoint continuing the version chain."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dcr_testing import FailingStore, assert_state, zeros_like  # noqa: E402
from nemo_dcr.errors import DeltaPublishError  # noqa: E402
from nemo_dcr.integrations import DeltaPublishTrainerCallback, module_snapshot  # noqa: E402
from nemo_dcr.stores import LocalStore  # noqa: E402
from nemo_dcr.sync.follower import Follower  # noqa: E402
from nemo_dcr.sync.versions import read_head, read_manifest, walk  # noqa: E402

VOCAB = 64


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)  # fp32 master weights


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=12):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, VOCAB, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(transformers.TrainerCallback):
    """The trainer-side truth: the weights (bf16, as published) after every optimizer step."""

    def __init__(self):
        self.snaps = {}

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.snaps[state.global_step] = module_snapshot(model, dtype="bfloat16")[0]

    def on_step_end(self, args, state, control, model=None, **kw):
        self.snaps[state.global_step] = module_snapshot(model, dtype="bfloat16")[0]


def make_trainer(tmp_path, callbacks, max_steps, model=None, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, save_strategy=kw.pop("save_strategy", "no"), **kw)
    return transformers.Trainer(model=model or tiny_llama(), args=args, train_dataset=Tokens(), callbacks=callbacks)


def manifests(store):
    return sorted(walk(store, read_head(store)[0]), key=lambda m: m.version)


def test_every_optimizer_step_is_published_bit_exactly_with_metrics_in_the_logs(tmp_path):
    store = LocalStore(tmp_path / "store")
    cb = DeltaPublishTrainerCallback(store, dtype="bfloat16", publish_initial=True)
    rec = Recorder()
    t = make_trainer(tmp_path, [cb, rec], max_steps=4, gradient_accumulation_steps=2)
    t.train()
    ms = manifests(store)
    assert [m.version for m in ms] == [0, 1, 2, 3, 4]
    assert [m.step for m in ms] == [0, 1, 2, 3, 4]  # the initial weights, then one per optimizer step
    assert ms[0].meta.get("initial") is True
    recv = zeros_like(rec.snaps[0])
    f = Follower(store, recv)
    for v in range(5):
        f.sync(v)
        assert_state(recv, rec.snaps[v])  # bf16 of the fp32 master weights, bit for bit
    assert rec.snaps[4]["model.embed_tokens.weight"].dtype == torch.bfloat16
    # every publish in the trainer's log history, under its own step
    dcr = [e for e in t.state.log_history if "dcr/version" in e]
    assert [(e["step"], e["dcr/version"]) for e in dcr] == [(s, float(s)) for s in range(5)]
    assert all(e["dcr/bytes"] > 0 and e["dcr/ratio"] > 0 and "dcr/stall_s" in e for e in dcr)
    assert dcr[0]["dcr/keyframe"] == 1.0 and all(0 < e["dcr/change_rate"] <= 1 for e in dcr[1:])
    assert not cb.loop.uploading  # stopped at the end of training


def test_a_failed_publish_fails_train_with_a_clear_error(tmp_path):
    store = FailingStore(tmp_path / "store", ok=2)  # version 0: a keyframe; version 1: a delta
    cb = DeltaPublishTrainerCallback(store)
    rec = Recorder()
    with pytest.raises(DeltaPublishError) as ei:
        make_trainer(tmp_path, [cb, rec], max_steps=8).train()
    assert "step 3" in str(ei.value) and "injected upload failure" in str(ei.value)
    assert read_head(store.inner)[0].version == 1  # nothing half-published
    assert max(rec.snaps) < 8  # raised in the training loop, not at the end
    assert not cb.loop.uploading


@pytest.mark.parametrize("restore", [False, True], ids=["record", "restore_callback_states"])
def test_resume_from_a_trainer_checkpoint_continues_the_chain(tmp_path, restore):
    # restore_callback_states_from_checkpoint=True: the Trainer rebuilds the callback from its
    # exported args and sets its attributes; otherwise the callback reads its record itself
    store = LocalStore(tmp_path / "store")
    rec = Recorder()
    t = make_trainer(tmp_path, [DeltaPublishTrainerCallback(store, dtype="bf16"), rec], max_steps=3,
                     save_strategy="steps", save_steps=3)
    t.train()
    ckpt = os.path.join(t.args.output_dir, "checkpoint-3")
    with open(os.path.join(ckpt, "trainer_state.json")) as fh:
        record = json.load(fh)["stateful_callbacks"]["DeltaPublishTrainerCallback"]
    assert record["attributes"]["resume_record"]["version"] == 2 and record["attributes"]["resume_record"]["step"] == 3
    assert record["args"]["every_n_steps"] == 1
    head1 = read_head(store)[0]
    recv = zeros_like(rec.snaps[3])
    f = Follower(store, recv)
    f.sync()
    assert_state(recv, rec.snaps[3])

    rec2 = Recorder()
    t2 = make_trainer(tmp_path, [DeltaPublishTrainerCallback(store, dtype="bf16"), rec2], max_steps=6,
                      restore_callback_states_from_checkpoint=restore)
    t2.train(resume_from_checkpoint=ckpt)
    ms = manifests(store)
    assert [m.version for m in ms] == [0, 1, 2, 3, 4, 5]
    assert [m.step for m in ms] == [1, 2, 3, 4, 5, 6]
    m3 = ms[3]
    assert m3.parts and not m3.keyframe_parts  # a delta after the checkpoint's version, not a new chain
    assert m3.base_manifest == head1.manifest
    assert m3.base_digest == read_manifest(store, head1.manifest).target_digest
    assert f.sync().steps == [("delta", 3), ("delta", 4), ("delta", 5)]
    assert_state(recv, rec2.snaps[6])


def test_resume_into_a_store_without_the_checkpoints_version_starts_a_keyframe(tmp_path):
    rec = Recorder()
    cb = DeltaPublishTrainerCallback(LocalStore(tmp_path / "a"), dtype="bf16", background=False)
    t = make_trainer(tmp_path, [cb, rec], max_steps=2, save_strategy="steps", save_steps=2)
    t.train()
    other = LocalStore(tmp_path / "b")  # a store that never saw this run
    rec2 = Recorder()
    t2 = make_trainer(tmp_path, [DeltaPublishTrainerCallback(other, dtype="bf16", background=False), rec2], max_steps=3)
    t2.train(resume_from_checkpoint=os.path.join(t.args.output_dir, "checkpoint-2"))
    m = read_manifest(other, read_head(other)[0].manifest)
    assert m.version == 0 and m.keyframe_parts  # a new chain, from a keyframe
    recv = zeros_like(rec2.snaps[3])
    Follower(other, recv).sync()
    assert_state(recv, rec2.snaps[3])


def test_ddp_over_two_processes_rank0_publishes_the_replicated_model(tmp_path):
    from dcr_testing import mp_hf
    from dcr_testing.procs import launch
    refs, out = tmp_path / "refs", tmp_path / "out"
    refs.mkdir()
    out.mkdir()
    spec = {"store": str(tmp_path / "store"), "refs": str(refs)}
    res, codes, hung = launch(mp_hf.main, 2, lambda r, port: (r, 2, port, spec, str(out)), out, 180.0,
                              preload=("transformers", "accelerate"))
    assert not hung and all(res[r]["ok"] for r in (0, 1)), {r: res[r].get("traceback") for r in res} or codes
    assert res[0]["world"] == 2 and not res[0]["joint"]
    assert res[0]["publishes"] and not res[1]["publishes"]  # a replicated model: rank 0 alone
    assert res[0]["published"]["version"] == 2 and res[1]["published"]["version"] is None
    store = LocalStore(spec["store"])
    recv = zeros_like(torch.load(refs / "r0-s1.pt"))
    f = Follower(store, recv)
    for v in range(3):
        f.sync(v)
        for r in (0, 1):  # DDP kept the replicas equal: either rank's weights are the version
            assert_state(recv, torch.load(refs / f"r{r}-s{v + 1}.pt"))
