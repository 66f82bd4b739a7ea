"""DeltaPublishCallback in a real Lightning Trainer (CPU): one publish per optimizer step
(gradient accumulation included), every published version reconstructed bit-exactly by a
Follower, metrics in the CSV log, background failures raised by fit(), resume from a Lightning
checkpoint continuing the version chain, skipped steps, and the YAML recipes."""
import csv
import os
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from dcr_testing import FailingStore, assert_bits_equal, assert_state, zeros_like  # noqa: E402
from nemo_dcr.errors import DcrError  # noqa: E402
from nemo_dcr.integrations import DeltaPublishCallback, DeltaPublishError, module_snapshot  # noqa: E402
from nemo_dcr.stores import LocalStore  # noqa: E402
from nemo_dcr.sync.follower import Follower  # noqa: E402
from nemo_dcr.sync.versions import read_head, read_manifest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Tiny(pl.LightningModule):
    def __init__(self, skip_steps=(), lr=1e-2):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.skip_steps, self.lr = set(skip_steps), lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += 1
        return torch.nn.functional.mse_loss(self.net(x), y)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if self.trainer.global_step + 1 in self.skip_steps:  # e.g. inf/NaN gradients: no update
            optimizer_closure()
            for cb in self.trainer.callbacks:
                if isinstance(cb, DeltaPublishCallback):
                    cb.mark_skipped()
            return
        optimizer.step(closure=optimizer_closure)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


class Recorder(pl.Callback):
    """The trainer-side truth: a snapshot after every optimizer step, and the batches seen."""

    def __init__(self):
        self.snaps, self.batches, self._last = {}, 0, None

    def on_train_start(self, trainer, pl_module):
        self._last = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            self.snaps[trainer.global_step] = module_snapshot(pl_module)[0]


def trainer(tmp_path, callbacks, max_steps, name="run", **kw):
    from lightning.pytorch.loggers import CSVLogger
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks,
                      logger=CSVLogger(str(tmp_path), name=name), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def manifests(store):
    head, _ = read_head(store)
    out, m = [], read_manifest(store, head.manifest)
    while True:
        out.append(m)
        if m.base_manifest is None:
            break
        m = read_manifest(store, m.base_manifest)
    return out[::-1]




def test_publishes_once_per_optimizer_step_and_every_version_is_bit_exact(store, tmp_path):
    """accumulate_grad_batches=2: 12 batches, 6 optimizer steps, every_n_steps=2: 3 versions."""
    cb = DeltaPublishCallback(store, every_n_steps=2, keyframe_every=2, max_pending=1)
    rec = Recorder()
    t = trainer(tmp_path, [cb, rec], max_steps=6, accumulate_grad_batches=2, log_every_n_steps=1)
    t.fit(Tiny())
    assert rec.batches == 12 and sorted(rec.snaps) == [1, 2, 3, 4, 5, 6]
    ms = manifests(store)
    assert [m.version for m in ms] == [0, 1, 2]
    assert [m.step for m in ms] == [2, 4, 6]
    assert [m.is_keyframe for m in ms] == [True, False, True]
    assert cb.last_published["version"] == 2 and cb.last_published["step"] == 6
    for m in ms:  # every version, as a receiver that starts there would rebuild it
        recv = zeros_like(rec.snaps[m.step])
        Follower(store, recv).sync(m.version)
        assert_state(recv, rec.snaps[m.step])
    recv = zeros_like(rec.snaps[2])
    f = Follower(store, recv)
    for m in ms:  # and one receiver following the chain
        f.sync(m.version)
        assert_state(recv, rec.snaps[m.step])
    assert 0 < ms[1].meta["global_step"] == 4

    rows = list(csv.DictReader(open(os.path.join(t.logger.log_dir, "metrics.csv"))))
    dcr = [r for r in rows if r.get("dcr/version")]
    assert [int(r["step"]) for r in dcr] == [2, 4, 6]
    for r in dcr:
        for k in ("dcr/change_rate", "dcr/bytes", "dcr/ratio", "dcr/publish_s"):
            assert r[k] != "", k
        assert float(r["dcr/bytes"]) > 0 and float(r["dcr/ratio"]) > 0
    assert float(dcr[0]["dcr/keyframe"]) == 1.0  # the first version: a keyframe, no delta
    assert all(0 < float(r["dcr/change_rate"]) <= 1 for r in dcr[1:])


def test_metrics_reach_callback_metrics_and_the_progress_bar(tmp_path):
    """Through ``pl_module.log`` (issue 22): other callbacks (early stopping, checkpoint
    monitors) and the progress bar see the dcr/* values during training, and the last
    version's after it."""
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((dict(trainer.callback_metrics), dict(trainer.progress_bar_metrics)))

    cb = DeltaPublishCallback(str(tmp_path / "store"), every_n_steps=1, background=False, publish_initial=True)
    t = trainer(tmp_path, [cb, Watch()], max_steps=4)
    t.fit(Tiny())  # (version 0 at on_train_start, where pl_module.log may not log on a step)
    cm, bar = seen[-1]
    assert float(cm["dcr/version"]) == 4 and 0 < float(cm["dcr/change_rate"]) <= 1
    assert {"dcr/bytes", "dcr/ratio", "dcr/publish_s", "dcr/keyframe", "dcr/stall_s"} <= set(cm)
    assert float(bar["dcr/version"]) == 4 and "dcr/change_rate" in bar
    assert float(seen[0][0]["dcr/version"]) == 1  # from the first step on
    bg = DeltaPublishCallback(str(tmp_path / "store2"), every_n_steps=1, max_pending=1)
    t = trainer(tmp_path, [bg], max_steps=3, name="bg")
    t.fit(Tiny())
    assert float(t.callback_metrics["dcr/version"]) == 2  # the background's last, after training


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_publish_fails_the_fit_with_a_clear_error(tmp_path, background):
    store = FailingStore(tmp_path / "store", ok=2)  # version 0: delta-less keyframe; version 1: delta
    cb = DeltaPublishCallback(store, background=background)
    rec = Recorder()
    t = trainer(tmp_path, [cb, rec], max_steps=8)
    with pytest.raises(DeltaPublishError) as ei:
        t.fit(Tiny())
    msg = str(ei.value)
    assert "step 3" in msg and "injected upload failure" in msg and "OSError" in msg
    assert read_head(store.inner)[0].version == 1  # nothing half-published
    assert max(rec.snaps) < 8  # raised in the training loop, not at the end
    assert not cb.loop.uploading  # the upload thread was stopped


def test_the_callback_copies_and_pickles_as_its_configuration(tmp_path):
    # NeMo's Trainer deep-copies its callbacks to record its configuration; the upload thread's
    # lock made that fail ("cannot pickle '_thread.lock' object")
    import copy
    import pickle
    cb = DeltaPublishCallback(str(tmp_path / "store"), every_n_steps=3, dtype="bfloat16", background=False)
    t = trainer(tmp_path, [cb], max_steps=3)
    t.fit(Tiny())
    for c in (copy.deepcopy(cb), pickle.loads(pickle.dumps(cb))):
        assert (c.store, c.every_n_steps, c.dtype, c.background) == (cb.store, 3, "bfloat16", False)
        assert c.last_published == cb.last_published and c.last_published["version"] == 0
        assert c.publisher is None and not c.loop.started  # a copy has not started: it publishes on its own


def test_resume_from_a_lightning_checkpoint_continues_the_chain(tmp_path):
    store = LocalStore(tmp_path / "store")
    ckpt = str(tmp_path / "run1.ckpt")
    cb = DeltaPublishCallback(store, every_n_steps=1)
    rec = Recorder()
    t = trainer(tmp_path, [cb, rec], max_steps=3)
    t.fit(Tiny())
    t.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["callbacks"][cb.state_key]
    assert state["version"] == 2 and state["step"] == 3
    head1 = read_head(store)[0]
    recv = zeros_like(rec.snaps[3])
    f = Follower(store, recv)
    f.sync()

    cb2 = DeltaPublishCallback(store, every_n_steps=1)
    rec2 = Recorder()
    t2 = trainer(tmp_path, [cb2, rec2], max_steps=6)
    t2.fit(Tiny(), ckpt_path=ckpt)
    ms = manifests(store)
    assert [m.version for m in ms] == [0, 1, 2, 3, 4, 5]
    assert [m.step for m in ms] == [1, 2, 3, 4, 5, 6]
    m3 = ms[3]
    assert m3.parts and not m3.keyframe_parts  # a delta, not a new chain
    assert m3.base_manifest == head1.manifest
    assert m3.base_digest == read_manifest(store, head1.manifest).target_digest
    assert f.sync().steps == [("delta", 3), ("delta", 4), ("delta", 5)]
    assert_state(recv, rec2.snaps[6])


def test_resume_whose_base_is_lost_publishes_a_keyframe(tmp_path):
    store = LocalStore(tmp_path / "store")
    ckpt = str(tmp_path / "run1.ckpt")
    cb = DeltaPublishCallback(store, background=False)
    t = trainer(tmp_path, [cb], max_steps=2)
    t.fit(Tiny())
    t.save_checkpoint(ckpt)
    head = read_head(store)[0]
    for p in read_manifest(store, head.manifest).parts:  # the newest delta is damaged
        store.put(p.key, b"garbage")
    cb2 = DeltaPublishCallback(store, background=False)
    rec = Recorder()
    with pytest.warns(UserWarning, match="publishing a keyframe"):
        trainer(tmp_path, [cb2, rec], max_steps=3).fit(Tiny(), ckpt_path=ckpt)
    m = read_manifest(store, read_head(store)[0].manifest)
    assert m.version == 2 and m.keyframe_parts and not m.parts  # a keyframe alone
    recv = zeros_like(rec.snaps[3])
    assert Follower(store, recv).sync().steps == [("keyframe", 2)]
    assert_state(recv, rec.snaps[3])


def test_resume_into_a_store_that_lacks_the_checkpoints_version_starts_from_a_keyframe(tmp_path):
    ckpt = str(tmp_path / "run1.ckpt")
    cb = DeltaPublishCallback(LocalStore(tmp_path / "a"), every_n_steps=1, background=False)
    t = trainer(tmp_path, [cb], max_steps=3)
    t.fit(Tiny())
    t.save_checkpoint(ckpt)
    other = LocalStore(tmp_path / "b")  # another run's store, behind this checkpoint's version 2
    from nemo_dcr.sync.publisher import Publisher
    Publisher(other).publish(module_snapshot(Tiny())[0])
    cb2 = DeltaPublishCallback(other, background=False)  # its state_key names store b: load a's state by hand
    cb2.load_state_dict(torch.load(ckpt, weights_only=False)["callbacks"][cb.state_key])
    rec = Recorder()
    with pytest.warns(UserWarning, match="behind the checkpoint"):
        trainer(tmp_path, [cb2, rec], max_steps=4).fit(Tiny(), ckpt_path=ckpt)
    m = read_manifest(other, read_head(other)[0].manifest)
    assert m.version == 1 and m.keyframe_parts and m.step == 4
    recv = zeros_like(rec.snaps[4])
    Follower(other, recv).sync()
    assert_state(recv, rec.snaps[4])


@pytest.mark.parametrize("mode", ["skip", "empty"])
def test_skipped_optimizer_steps(tmp_path, mode):
    store = LocalStore(tmp_path / "store")
    cb = DeltaPublishCallback(store, on_skipped_step=mode, background=False)
    rec = Recorder()
    trainer(tmp_path, [cb, rec], max_steps=4).fit(Tiny(skip_steps={2}))
    ms = manifests(store)
    if mode == "skip":
        assert [m.step for m in ms] == [1, 3, 4]
    else:
        assert [m.step for m in ms] == [1, 2, 3, 4]
        assert ms[1].meta["skipped_step"] == 2
        assert sum(p.changed for p in ms[1].parts) == 0  # the same weights: an empty delta
    assert_bits_equal(rec.snaps[1]["net.0.weight"], rec.snaps[2]["net.0.weight"])  # step 2 did not update
    recv = zeros_like(rec.snaps[4])
    Follower(store, recv).sync()
    assert_state(recv, rec.snaps[4])


def test_dtype_submodule_and_initial_version(tmp_path):
    """Publish the inner module in bfloat16, from step 0 (publish_initial)."""
    store = LocalStore(tmp_path / "store")
    cb = DeltaPublishCallback(store, dtype="bfloat16", submodule="net", publish_initial=True, every_n_steps=2)
    rec = Recorder()
    model = Tiny()
    initial = module_snapshot(model.net, dtype="bfloat16")[0]
    trainer(tmp_path, [cb, rec], max_steps=4).fit(model)
    ms = manifests(store)
    assert [m.step for m in ms] == [0, 2, 4] and ms[0].meta.get("initial")
    recv = {k: v.clone() for k, v in initial.items()}
    assert sorted(recv) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    f = Follower(store, recv, version=0)  # the receiver already holds version 0: deltas only
    assert f.sync().steps == [("delta", 1), ("delta", 2)]
    final = {k[len("net."):]: v.to(torch.bfloat16) for k, v in rec.snaps[4].items() if k.startswith("net.")}
    assert_state(recv, final)


@pytest.mark.parametrize("checksum, fmt, algo", [(None, 5, "blake3"), ("sha256", 3, "sha256")])
def test_the_object_checksum_reaches_the_publisher(tmp_path, checksum, fmt, algo):
    """``object_checksum="sha256"``: format-3 manifests (delta version 4), which receivers of the
    release before format 4 read; the default, BLAKE3 (format 5)."""
    store = LocalStore(tmp_path / "store")
    cb = DeltaPublishCallback(store, object_checksum=checksum, background=False)
    rec = Recorder()
    trainer(tmp_path, [cb, rec], max_steps=2).fit(Tiny())
    ms = manifests(store)
    assert [m.step for m in ms] == [1, 2] and cb.object_checksum == checksum
    assert read_head(store)[0].format == fmt and all(m.format == fmt for m in ms)
    assert {p.algo for m in ms for p in m.parts + m.keyframe_parts} == {algo}
    recv = zeros_like(rec.snaps[2])
    Follower(store, recv).sync()
    assert_state(recv, rec.snaps[2])


def test_bad_arguments_are_refused():
    for kw in ({"every_n_steps": 0}, {"on_skipped_step": "maybe"}, {"max_pending": 0}, {"encoding": "gzip"},
               {"dtype": "int8"}, {"object_checksum": "md5"}, {"format_version": 2, "object_checksum": "blake3"}):
        # a bad dtype is the codec's DcrError, the callback's own checks raise ValueError
        with pytest.raises((ValueError, DcrError)):
            DeltaPublishCallback("x", **kw)


# ----------------------------------------------------------------------------- recipes

def test_train_publish_yaml_instantiates_the_callback_with_lightning_cli(tmp_path):
    pytest.importorskip("jsonargparse")
    import yaml
    from lightning.pytorch.cli import LightningCLI

    cfg = yaml.safe_load(open(os.path.join(ROOT, "recipes", "train_publish.yaml")))
    cbs = cfg["trainer"]["callbacks"]
    dcr = [c for c in cbs if c["class_path"].endswith("DeltaPublishCallback")]
    assert len(dcr) == 1
    dcr[0]["init_args"]["store"] = str(tmp_path / "store")
    cfg["trainer"].pop("logger", None)
    cfg["trainer"]["default_root_dir"] = str(tmp_path)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = LightningCLI(Tiny, run=False, args=["--config", str(path)], save_config_callback=None)
    got = [c for c in cli.trainer.callbacks if isinstance(c, DeltaPublishCallback)]
    assert len(got) == 1
    c = got[0]
    want = dcr[0]["init_args"]
    for k, v in want.items():
        assert getattr(c, k) == v, k
    assert cli.trainer.accumulate_grad_batches == cfg["trainer"].get("accumulate_grad_batches", 1)


def test_nemo_recipe_helper():
    import importlib.util
    spec = importlib.util.spec_from_file_location("dcr_nemo_recipe", os.path.join(ROOT, "recipes", "nemo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Config:  # the shape of nemo_run.Config: a target and its keyword arguments
        def __init__(self, fn, **kw):
            self.fn, self.kw = fn, kw

    class Recipe:
        class trainer:
            callbacks = None

    r = mod.add_dcr_callback(Recipe, store="s3://b/run", every_n_steps=4, config_cls=Config)
    (c,) = r.trainer.callbacks
    assert c.fn is DeltaPublishCallback and c.kw == {"store": "s3://b/run", "every_n_steps": 4}
    cb = c.fn(**c.kw)
    assert cb.every_n_steps == 4
    with pytest.raises(TypeError):
        mod.add_dcr_callback(Recipe, every_n_steps=4, config_cls=Config)  # store is required


def test_nemo_recipe_helper_with_nemo_run():
    run = pytest.importorskip("nemo_run")
    import importlib.util
    spec = importlib.util.spec_from_file_location("dcr_nemo_recipe", os.path.join(ROOT, "recipes", "nemo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    trainer_cfg = run.Config(pl.Trainer, callbacks=[])

    class Recipe:
        trainer = trainer_cfg

    mod.add_dcr_callback(Recipe, store="s3://b/run", every_n_steps=2, dtype="bfloat16")
    import fiddle as fdl  # what nemo_run builds its configs with
    trainer = fdl.build(Recipe.trainer)
    cbs = [c for c in trainer.callbacks if isinstance(c, DeltaPublishCallback)]
    assert len(cbs) == 1 and cbs[0].store == "s3://b/run" and cbs[0].every_n_steps == 2


# ----------------------------------------------------------------------------- distributed (2 CPU ranks, DDP)

def _half_snapshot(module):
    """A snapshot_fn: every rank publishes every other tensor (whole), as a sharded model would."""
    import torch.distributed as dist
    r, w = dist.get_rank(), dist.get_world_size()
    tensors = module_snapshot(module)[0]
    return {k: v for i, (k, v) in enumerate(sorted(tensors.items())) if i % w == r}, {}


def _ddp_rank(rank, world, port, root, out):
    import json
    import time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    res = {}
    for mode in ("replicated", "joint"):  # one process group, two runs
        r = res[mode] = {"ok": False}
        try:
            t0 = time.perf_counter()
            cb = DeltaPublishCallback(os.path.join(root, mode), every_n_steps=1,
                                      snapshot_fn=_half_snapshot if mode == "joint" else None)
            rec = Recorder()
            t = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=3, callbacks=[cb, rec],
                           logger=False, enable_checkpointing=False, enable_progress_bar=False,
                           enable_model_summary=False)
            t.fit(Tiny())
            r.update(ok=True, publishes=cb.loop.publishes, joint=cb.loop.joint, seconds=time.perf_counter() - t0)
            torch.save(rec.snaps, os.path.join(out, f"snaps-{mode}-{rank}.pt"))
        except Exception as e:  # noqa: BLE001
            import traceback
            r["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)


def test_ddp_ranks_publish_over_their_own_gloo_group(tmp_path):
    """DDP on 2 CPU ranks: a replicated module is published by rank 0 alone; with a
    snapshot_fn every rank publishes its part and the parts are committed jointly."""
    from dcr_testing.procs import launch

    root = str(tmp_path / "stores")
    out = tmp_path / "out"
    out.mkdir()
    # the fork server imports these once (Lightning alone takes seconds) and every rank forks from
    # it; the first test module to start the server sets the list (test_publish_multirank's too)
    found, codes, hung = launch(_ddp_rank, 2, lambda r, port: (r, 2, port, root, str(out)), out, 120)
    assert not hung and sorted(found) == [0, 1], f"ranks hung {hung}, exit codes {codes}"
    res = [found[r] for r in range(2)]
    for mode in ("replicated", "joint"):
        for r in range(2):
            assert res[r][mode]["ok"], res[r][mode].get("error")
        assert [x[mode]["publishes"] for x in res] == ([True, False] if mode == "replicated" else [True, True])
        assert [x[mode]["joint"] for x in res] == [mode == "joint"] * 2
        store = LocalStore(os.path.join(root, mode))
        ms = manifests(store)
        assert [m.step for m in ms] == [1, 2, 3]
        assert all(m.world_size == (2 if mode == "joint" else 1) for m in ms)
        snaps = torch.load(out / f"snaps-{mode}-0.pt")
        for m in ms:
            recv = zeros_like(snaps[m.step])
            Follower(store, recv).sync(m.version)
            assert_state(recv, snaps[m.step])
