"""RolloutLoader and the vLLM worker extension on CPU: a small Hugging Face causal LM (built
from a config, random init, no downloads) is trained a few steps; a second copy of it follows
the published versions in place, bit-exactly, and generates exactly what the trainer's BF16
copy generates. vLLM itself is not installed here: the extension is exercised on a fake worker
holding a real module, and vLLM's fused/TP layouts on modules shaped like vLLM's layers.
A two-process gloo group checks a sharded receiver with replicated tensors."""
import json
import os
import threading
import time

import pytest
import torch

from dcr_testing import assert_bits_equal
from dcr_testing.procs import launch
from nemo_dcr.errors import BaseMismatchError, DcrError
from nemo_dcr.integrations import RolloutLoader, module_snapshot, module_tensors
from nemo_dcr.state.index_map import ShardSpec
from nemo_dcr.sync.publisher import Publisher

CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


def llama(seed=0, dtype=torch.float32, **over):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**{**CFG, **over})
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    m.generation_config.pad_token_id = 0
    return m.eval()


def trainer_steps(model, n, seed=0):
    """``n`` AdamW steps on random tokens, yielding after each."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for i in range(n):
        ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        yield i


PROMPT = torch.tensor([[1, 17, 42, 99, 3]])


def generate(model):
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=6, do_sample=False)


def bf16_copy(trainer_model, **over):
    ref = llama(123, torch.bfloat16, **over)
    ref.load_state_dict(module_snapshot(trainer_model, dtype="bfloat16")[0])
    return ref


def assert_same_bits(model, state):
    live = module_tensors(model)
    assert sorted(live) == sorted(state)
    for k, v in state.items():
        assert_bits_equal(live[k], v, k)


# ----------------------------------------------------------------------------- HF models

def test_hf_model_follows_in_place_and_generates_like_the_trainer(tmp_path):
    store = str(tmp_path / "store")
    trainer = llama(0)
    recv = llama(7, torch.bfloat16)  # different weights until the first update
    params = {n: (p, p.data_ptr()) for n, p in recv.named_parameters()}
    pub = Publisher(store)
    loader = RolloutLoader(store, recv)
    assert loader.update() is None  # nothing published yet
    for i in trainer_steps(trainer, 3):
        state = module_snapshot(trainer, dtype="bfloat16")[0]
        pub.publish(state, step=i)
        assert loader.update() == i
        assert loader.last_result.steps == [("keyframe" if i == 0 else "delta", i)]
        assert_same_bits(recv, state)
        assert torch.equal(generate(recv), generate(bf16_copy(trainer)))
    for n, p in recv.named_parameters():  # the live parameters were written, not replaced
        assert p is params[n][0] and p.data_ptr() == params[n][1]
    assert loader() == 2 and loader.last_result.steps == [("delta", 2)]  # nothing new: no work
    loader.check()


def test_lightning_trainer_publishes_and_the_loader_follows_every_version(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from nemo_dcr.integrations import DeltaPublishCallback

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = llama(0)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    store = str(tmp_path / "store")
    lm = LM()
    recv = bf16_copy(lm.model)  # the rollout engine loaded the same initial checkpoint, in bf16
    seen = []

    class Rollout(pl.Callback):  # the rollout side, in lock step with the trainer (after the publish)
        loader = None

        def on_train_start(self, trainer, pl_module):
            self.loader = RolloutLoader(store, recv, version=0)  # publish_initial: version 0 = these weights

        def on_train_batch_end(self, trainer, pl_module, *args):
            v = self.loader.update()
            if v != (seen[-1] if seen else 0):
                seen.append(v)
                assert_same_bits(recv, module_snapshot(pl_module.model, dtype="bfloat16")[0])
                assert torch.equal(generate(recv), generate(bf16_copy(pl_module.model)))
                assert self.loader.last_result.steps == [("delta", v)]

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 256, (16, 12), generator=g))
    cb = DeltaPublishCallback(store, every_n_steps=2, dtype="bfloat16", submodule="model", publish_initial=True,
                              background=False)
    t = pl.Trainer(accelerator="cpu", max_steps=6, accumulate_grad_batches=2, callbacks=[cb, Rollout()],
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    t.fit(lm, torch.utils.data.DataLoader(data, batch_size=2))
    assert seen == [1, 2, 3]  # steps 2, 4, 6 after the initial version 0


@pytest.mark.parametrize("kind", ["callable", "dict"])
def test_name_map(tmp_path, kind):
    """The trainer publishes a wrapper's names (``model.`` prefix); the receiver is the bare model."""
    store = str(tmp_path / "store")
    trainer = llama(0)
    wrapper = torch.nn.Module()
    wrapper.model = trainer
    recv = llama(5, torch.bfloat16)
    published = module_snapshot(wrapper, dtype="bfloat16")[0]
    assert all(k.startswith("model.") for k in published)
    if kind == "callable":
        name_map = lambda n: n[len("model."):]  # noqa: E731
    else:
        name_map = {k: k[len("model."):] for k in published}
    pub = Publisher(store)
    loader = RolloutLoader(store, recv, name_map=name_map)
    for i in trainer_steps(trainer, 2):
        pub.publish(module_snapshot(wrapper, dtype="bfloat16")[0])
        assert loader.update() == i
        assert_same_bits(recv, module_snapshot(trainer, dtype="bfloat16")[0])
    loader.check()
    if kind == "dict":  # a dict map also works for a receiver that already holds a version
        other = bf16_copy(trainer)
        assert RolloutLoader(store, other, name_map=name_map, version=1).version == 1


def test_tied_embeddings_are_published_once(tmp_path):
    store = str(tmp_path / "store")
    trainer = llama(0, tie_word_embeddings=True)
    recv = llama(3, torch.bfloat16, tie_word_embeddings=True)
    state = module_snapshot(trainer, dtype="bfloat16")[0]
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    Publisher(store).publish(state)
    RolloutLoader(store, recv).update()
    assert recv.lm_head.weight.data_ptr() == recv.model.embed_tokens.weight.data_ptr()
    assert_bits_equal(recv.lm_head.weight, state["model.embed_tokens.weight"])


def test_receiver_that_does_not_fit_is_refused_clearly(tmp_path):
    store = str(tmp_path / "store")
    Publisher(store).publish(module_snapshot(llama(0), dtype="bfloat16")[0])
    with pytest.raises(DcrError, match="does not fit the receiver"):
        RolloutLoader(store, llama(0)).update()  # float32 receiver, bfloat16 published


# ----------------------------------------------------------------------------- the loader itself

def small_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=g).bfloat16(), "frozen": torch.randn(8, generator=g),
            "n": torch.tensor(0)}


def step_state(s, i):
    s["w"].view(torch.int16)[i % 32] += 1
    s["n"] += 1


def test_sampling_blocks_updates_and_update_inside_sampling_is_refused(tmp_path):
    store = str(tmp_path / "store")
    s = small_state()
    pub = Publisher(store)
    pub.publish(s)
    recv = {k: torch.zeros_like(v) for k, v in s.items()}
    loader = RolloutLoader(store, recv)
    loader.update()
    step_state(s, 1)
    pub.publish(s)
    inside, release, done = threading.Event(), threading.Event(), threading.Event()

    def sampler():
        with loader.sampling():
            inside.set()
            release.wait(10)
            assert int(recv["n"]) == 0  # never changes under a sampler

    th = threading.Thread(target=sampler)
    th.start()
    inside.wait(10)
    result = {}
    up = threading.Thread(target=lambda: (result.setdefault("v", loader.update()), done.set()))
    up.start()
    deadline = time.monotonic() + 10  # wait until the update is queued on the lock (a state, not a delay)
    while loader._lock._writers_waiting == 0 and not done.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert loader._lock._writers_waiting == 1 and not done.is_set()  # the update waits for the sampler
    release.set()
    th.join(10)
    up.join(10)
    assert result["v"] == 1 and int(recv["n"]) == 1
    with loader.sampling():
        with pytest.raises(DcrError, match="inside sampling"):
            loader.update()


def test_check_every_repairs_a_scribbled_receiver(tmp_path):
    store = str(tmp_path / "store")
    s = small_state()
    pub = Publisher(store)
    pub.publish(s)
    recv = {k: torch.zeros_like(v) for k, v in s.items()}
    loader = RolloutLoader(store, recv, check_every=1)
    loader.update()
    recv["frozen"][3] = 1e6  # something else writes into the weights; no delta touches "frozen"
    step_state(s, 2)
    pub.publish(s)
    assert loader.update() == 1
    assert ("keyframe", 0) in loader.last_result.steps  # rebuilt, then brought to version 1
    for k in s:
        assert_bits_equal(recv[k], s[k], k)


def test_staging_copy_writes_only_changed_tensors_to_the_live_ones(tmp_path):
    """staging=True is what a GPU receiver uses (the codec applies on CPU); forced on CPU here."""
    store = str(tmp_path / "store")
    s = small_state()
    pub = Publisher(store)
    pub.publish(s)
    live = {k: torch.zeros_like(v) for k, v in s.items()}
    loader = RolloutLoader(store, live, staging=True)
    assert all(loader.recv[k] is not live[k] for k in live)
    loader.update()
    for k in s:
        assert_bits_equal(live[k], s[k], k)
    step_state(s, 5)  # changes "w" and "n", not "frozen"
    pub.publish(s)
    copied = []

    class Spy(dict):
        def __getitem__(self, k):
            copied.append(k)
            return dict.__getitem__(self, k)

    loader.live = Spy(loader.live)
    loader.update()
    assert sorted(copied) == ["n", "w"]
    for k in s:
        assert_bits_equal(live[k], s[k], k)
    live["frozen"][0] = -1.0  # a scribble on the engine's copy is what check() looks at
    with pytest.raises(BaseMismatchError):
        loader.check()
    assert loader.update() == 1 and loader.last_result.steps[0] == ("keyframe", 0)
    for k in s:
        assert_bits_equal(live[k], s[k], k)


# ----------------------------------------------------------------------------- a sharded receiver group

def _group_state(v):
    g = torch.Generator().manual_seed(11)
    s = {"W": torch.randn(8, 6, generator=g).bfloat16(), "norm": torch.randn(6, generator=g)}
    for i in range(1, v + 1):
        s["W"].view(torch.int16)[i % 8, i % 6] += 3
        s["norm"][i % 6] += 0.5
    return s


def _as_rank(rank, world, port, out, body):
    """Run ``body(res)`` as rank ``rank`` of a gloo group; ``res`` (with ``ok`` or ``error``) goes
    to ``out/<rank>.json``."""
    import datetime

    import torch.distributed as dist
    res = {"ok": False}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        body(res)
        res["ok"] = True
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)


def _group_rank(rank, world, port, store, out):
    """A TP=2 receiver: W split by rows, norm replicated on both ranks."""
    def body(res):
        rows = 8 // world
        recv = {"W": torch.zeros(rows, 6, dtype=torch.bfloat16), "norm": torch.zeros(6)}
        loader = RolloutLoader(store, recv, shards={"W": ShardSpec.of((8, 6), (rank * rows, 0), (rows, 6))},
                               group=None)
        res["hidden"] = sorted(loader.tensors.hidden)
        res["versions"], res["exact"], res["norm_marked"] = [], [], []
        for v in range(3):
            before = recv["norm"]._version
            res["versions"].append(loader.update(v))
            res["norm_marked"].append(recv["norm"]._version != before)  # what a watcher of changes reads
            want = _group_state(v)
            res["exact"].append(bool(torch.equal(recv["W"].view(torch.int16),
                                                 want["W"][rank * rows:(rank + 1) * rows].view(torch.int16))
                                     and torch.equal(recv["norm"].view(torch.int32), want["norm"].view(torch.int32))))
        loader.check()
    _as_rank(rank, world, port, out, body)


def _run_group(tmp_path, state, rank_fn, world: int) -> list:
    """Versions 0-2 of ``state`` published, then ``rank_fn`` run by ``world`` gloo ranks; their
    results, each checked to have ended well."""
    store = str(tmp_path / "store")
    pub = Publisher(store)
    for v in range(3):
        pub.publish(state(v))
    out = tmp_path / "out"
    out.mkdir()
    found, codes, hung = launch(rank_fn, world, lambda r, port: (r, world, port, store, str(out)), out, 30 * world + 30)
    assert not hung and sorted(found) == list(range(world)), f"ranks hung {hung}, exit codes {codes}"
    for r in range(world):
        assert found[r]["ok"], found[r].get("error")
    return [found[r] for r in range(world)]


def test_sharded_receiver_group_with_a_replicated_tensor(tmp_path):
    res = _run_group(tmp_path, _group_state, _group_rank, 2)
    for r in range(2):
        assert res[r]["versions"] == [0, 1, 2] and all(res[r]["exact"])
    assert res[0]["hidden"] == [] and res[1]["hidden"] == ["norm"]  # rank 0 applies it, rank 1 receives it
    # the received copy is marked changed like the applied one (the vLLM worker rebuilds a replicated
    # layer, an MoE router, on every rank from this; a broadcast alone left rank 1's version as it was)
    assert res[0]["norm_marked"] == res[1]["norm_marked"] == [True, True, True]



def _kv_state(v):
    s = _group_state(v)
    g = torch.Generator().manual_seed(12)
    s["K"] = torch.randn(2, 6, generator=g).bfloat16()  # two kv heads
    for i in range(1, v + 1):
        s["K"].view(torch.int16)[i % 2, i % 6] -= 5
    return s


def _kv_rank(rank, world, port, store, out):
    """A TP=4 receiver of a model with 2 kv heads: W split by rows over the 4 ranks, each kv head
    held by two ranks (0 and 1 hold head 0, 2 and 3 head 1), norm on every rank."""
    def body(res):
        rows, head = 8 // world, rank * 2 // world
        recv = {"W": torch.zeros(rows, 6, dtype=torch.bfloat16), "K": torch.zeros(1, 6, dtype=torch.bfloat16),
                "norm": torch.zeros(6)}
        loader = RolloutLoader(store, recv, shards={"W": ShardSpec.of((8, 6), (rank * rows, 0), (rows, 6)),
                                                    "K": ShardSpec.of((2, 6), (head, 0), (1, 6))}, group=None)
        res["hidden"] = sorted(loader.tensors.hidden)
        res["exact"] = []
        for v in range(3):
            loader.update(v)
            want = _kv_state(v)
            res["exact"].append(all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in (
                (recv["W"], want["W"][rank * rows:(rank + 1) * rows]), (recv["K"], want["K"][head:head + 1]),
                (recv["norm"].view(torch.int16), want["norm"].view(torch.int16)))))
        loader.check()
    _as_rank(rank, world, port, out, body)


def test_receiver_group_with_kv_heads_each_held_by_two_of_four_ranks(tmp_path):
    """Replicas held by different sets of ranks (kv heads at TP above their count): each set's
    lowest rank applies and sends to its set only. Before, every rank broadcast from its own
    set's owner in one collective over the whole group: ranks 0-1 and 2-3 disagreed on the
    source."""
    res = _run_group(tmp_path, _kv_state, _kv_rank, 4)
    assert all(r["exact"] == [True, True, True] for r in res)
    assert [r["hidden"] for r in res] == [[], ["K", "norm"], ["norm"], ["K", "norm"]]


def test_rollout_yaml_configures_the_loader(tmp_path):
    yaml = pytest.importorskip("yaml")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = yaml.safe_load(open(os.path.join(root, "recipes", "rollout.yaml")))
    assert cfg["vllm"]["worker_extension_cls"] == "nemo_dcr.callbacks.vllm_worker.DcrWorkerExtension"
    from nemo_dcr.integrations.vllm_worker import DcrWorkerExtension  # the path resolves
    assert callable(DcrWorkerExtension.dcr_update)
    s = small_state()
    store = str(tmp_path / "store")
    Publisher(store).publish(s)
    loader = RolloutLoader(model_or_tensors={k: v.clone() for k, v in s.items()},
                           **{**cfg["loader"], "store": store})
    assert loader.version == cfg["loader"]["version"] == 0 and loader.check_every == cfg["loader"]["check_every"]
