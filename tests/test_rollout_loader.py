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
import types

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


# ----------------------------------------------------------------------------- vLLM

class FakeWorker:
    """What vLLM mixes the extension into: a worker with ``model_runner.model``."""

    def __init__(self, model):
        self.model_runner = types.SimpleNamespace(model=model)
        self.device = torch.device("cpu")


def worker_with(model):
    from nemo_dcr.integrations.vllm_worker import DcrWorkerExtension
    return type("Worker", (FakeWorker, DcrWorkerExtension), {})(model)


def test_worker_extension_on_an_hf_module(tmp_path):
    from nemo_dcr.integrations.vllm_worker import refit
    from nemo_dcr.state.digest import tensor_digest

    store = str(tmp_path / "store")
    trainer = llama(0)
    worker = worker_with(llama(9, torch.bfloat16))
    pub = Publisher(store)
    resets = []

    class FakeLLM:  # the driver side: collective_rpc over the one worker (the real engine: test_vllm_engine*.py)
        llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(call_utility=lambda *a: None))

        def collective_rpc(self, method, args=()):
            return [getattr(worker, method)(*args)]

        def reset_prefix_cache(self, reset_running_requests=False):
            resets.append(reset_running_requests)
            return True

    llm = FakeLLM()
    for i in trainer_steps(trainer, 2):
        state = module_snapshot(trainer, dtype="bfloat16")[0]
        pub.publish(state)
        assert refit(llm, store) == i
        fp = worker.dcr_fingerprint()
        assert fp == {k: tensor_digest(v) for k, v in sorted(state.items())}
        assert torch.equal(generate(worker.model_runner.model), generate(bf16_copy(trainer)))
    assert refit(llm, store) == 1 and len(resets) == 2  # nothing new: the prefix cache is kept
    assert worker.dcr_check() == 1


# modules shaped like vLLM's parallel layers (the extension recognises them by class name)

class QKVParallelLinear(torch.nn.Module):
    def __init__(self, weight, nq, nkv, hs, tq, tkv, tp_rank, tp_size):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.num_heads, self.num_kv_heads, self.head_size = nq, nkv, hs
        self.total_num_heads, self.total_num_kv_heads = tq, tkv
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_kv_head_replicas = max(1, tp_size // tkv)


class MergedColumnParallelLinear(torch.nn.Module):
    def __init__(self, weight, output_sizes, tp_rank, tp_size):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.output_sizes, self.tp_rank, self.tp_size = output_sizes, tp_rank, tp_size


class RowParallelLinear(torch.nn.Module):
    def __init__(self, weight, tp_rank, tp_size):
        super().__init__()
        self.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight, False)
        self.tp_rank, self.tp_size = tp_rank, tp_size


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, weight, org_vocab, start, end):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.org_vocab_size = org_vocab
        self.shard_indices = types.SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=end)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class Holder(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight


def vllm_like(hf, tp_rank=0, tp_size=1, pad_to=64):
    """A module laid out as vLLM's Llama on TP rank ``tp_rank`` of ``tp_size``. With tp_size=1
    the HF model's weights become views of the fused parameters (so the HF model computes with
    whatever is written into the vLLM-shaped ones)."""
    cfg = hf.config
    hs = cfg.head_dim
    tq, tkv = cfg.num_attention_heads, cfg.num_key_value_heads
    nq = tq // tp_size
    nkv = max(1, tkv // tp_size)
    kv_shard = tp_rank // max(1, tp_size // tkv)
    inter = cfg.intermediate_size // tp_size
    alias = tp_size == 1

    def rows(t, i, n):
        return t.data[i * n:(i + 1) * n]

    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList()
    for L in hf.model.layers:
        a, m = L.self_attn, L.mlp
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        parts = [rows(a.q_proj.weight, tp_rank, nq * hs), rows(a.k_proj.weight, kv_shard, nkv * hs),
                 rows(a.v_proj.weight, kv_shard, nkv * hs)]
        qkv = QKVParallelLinear(torch.cat(parts).clone(), nq, nkv, hs, tq, tkv, tp_rank, tp_size)
        layer.self_attn.qkv_proj = qkv
        gate_up = MergedColumnParallelLinear(torch.cat([rows(m.gate_proj.weight, tp_rank, inter),
                                                        rows(m.up_proj.weight, tp_rank, inter)]).clone(),
                                             [cfg.intermediate_size] * 2, tp_rank, tp_size)
        layer.mlp.gate_up_proj = gate_up
        cols = lambda w: w.data[:, tp_rank * (w.shape[1] // tp_size):(tp_rank + 1) * (w.shape[1] // tp_size)]  # noqa
        if alias:
            o = 0
            for lin, n in ((a.q_proj, nq * hs), (a.k_proj, nkv * hs), (a.v_proj, nkv * hs)):
                lin.weight = torch.nn.Parameter(qkv.weight.data[o:o + n], requires_grad=False)
                o += n
            m.gate_proj.weight = torch.nn.Parameter(gate_up.weight.data[:inter], requires_grad=False)
            m.up_proj.weight = torch.nn.Parameter(gate_up.weight.data[inter:], requires_grad=False)
            layer.self_attn.o_proj = RowParallelLinear(a.o_proj.weight, 0, 1)
            layer.mlp.down_proj = RowParallelLinear(m.down_proj.weight, 0, 1)
            layer.input_layernorm = Holder(L.input_layernorm.weight)
            layer.post_attention_layernorm = Holder(L.post_attention_layernorm.weight)
        else:
            layer.self_attn.o_proj = RowParallelLinear(cols(a.o_proj.weight).clone(), tp_rank, tp_size)
            layer.mlp.down_proj = RowParallelLinear(cols(m.down_proj.weight).clone(), tp_rank, tp_size)
            layer.input_layernorm = Holder(torch.nn.Parameter(L.input_layernorm.weight.data.clone()))
            layer.post_attention_layernorm = Holder(torch.nn.Parameter(L.post_attention_layernorm.weight.data.clone()))
        root.model.layers.append(layer)

    def vocab(w):
        v, h = w.shape
        padded = -(-v // (pad_to * tp_size)) * pad_to * tp_size
        per = padded // tp_size
        start, end = tp_rank * per, min(v, (tp_rank + 1) * per)
        local = torch.zeros(per, h, dtype=w.dtype)
        local[:end - start] = w.data[start:end]
        mod = VocabParallelEmbedding(local, v, start, end)
        if alias:
            return mod, torch.nn.Parameter(mod.weight.data[:v], requires_grad=False)
        return mod, None

    root.model.embed_tokens, emb = vocab(hf.model.embed_tokens.weight)
    head, lm = vocab(hf.lm_head.weight)
    root.lm_head = ParallelLMHead(head.weight.data, head.org_vocab_size, head.shard_indices.org_vocab_start_index,
                                  head.shard_indices.org_vocab_end_index)
    root.model.norm = Holder(hf.model.norm.weight if alias else torch.nn.Parameter(hf.model.norm.weight.data.clone()))
    if alias:
        hf.model.embed_tokens.weight = emb
        hf.lm_head.weight = torch.nn.Parameter(root.lm_head.weight.data[:hf.lm_head.weight.shape[0]],
                                               requires_grad=False)
    return root


def test_vllm_fused_layout_follows_hf_names_bit_exactly(tmp_path):
    """TP=1: vLLM's qkv_proj/gate_up_proj rows and padded vocabulary, written from HF names."""
    store = str(tmp_path / "store")
    trainer = llama(0, vocab_size=250)
    engine_hf = llama(4, torch.bfloat16, vocab_size=250)  # computes with views of the vLLM-shaped weights
    engine = vllm_like(engine_hf)
    assert engine.model.embed_tokens.weight.shape[0] == 256  # padded like vLLM
    worker = worker_with(engine)
    pub = Publisher(store)
    for i in trainer_steps(trainer, 2):
        state = module_snapshot(trainer, dtype="bfloat16")[0]
        pub.publish(state)
        assert worker.dcr_update(store) == i
        assert_same_bits(engine_hf, state)
        assert torch.equal(generate(engine_hf), generate(bf16_copy(trainer, vocab_size=250)))
    assert not engine.model.embed_tokens.weight.data[250:].any()  # padding rows left alone


@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_tp_layouts_place_every_published_element(tp):
    """Every TP rank's views, placed by their ShardSpecs, rebuild every HF tensor (tp=4 with 2 kv
    heads: kv heads replicated over pairs of ranks)."""
    from nemo_dcr.integrations.vllm_worker import vllm_tensors

    hf = llama(0, torch.bfloat16, vocab_size=250)
    want = module_snapshot(hf)[0]
    built = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    for r in range(tp):
        tensors, shards = vllm_tensors(vllm_like(hf, r, tp))
        assert sorted(tensors) == sorted(want)
        for k, t in tensors.items():
            spec = shards.get(k, ShardSpec.full(t.shape))
            sl = tuple(slice(o, o + s) for o, s in zip(spec.offsets, spec.shape))
            assert spec.global_shape == tuple(want[k].shape), k
            built[k][sl] = t
    for k in want:
        assert_bits_equal(built[k], want[k], k)


# ----------------------------------------------------------------------------- a sharded receiver group

def _group_state(v):
    g = torch.Generator().manual_seed(11)
    s = {"W": torch.randn(8, 6, generator=g).bfloat16(), "norm": torch.randn(6, generator=g)}
    for i in range(1, v + 1):
        s["W"].view(torch.int16)[i % 8, i % 6] += 3
        s["norm"][i % 6] += 0.5
    return s


def _group_rank(rank, world, port, store, out):
    """A TP=2 receiver: W split by rows, norm replicated on both ranks."""
    import datetime

    import torch.distributed as dist
    res = {"ok": False}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
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
        res["ok"] = True
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)


def test_sharded_receiver_group_with_a_replicated_tensor(tmp_path):
    store = str(tmp_path / "store")
    pub = Publisher(store)
    for v in range(3):
        pub.publish(_group_state(v))
    out = tmp_path / "out"
    out.mkdir()
    found, codes, hung = launch(_group_rank, 2, lambda r, port: (r, 2, port, store, str(out)), out, 90)
    assert not hung and sorted(found) == [0, 1], f"ranks hung {hung}, exit codes {codes}"
    res = [found[r] for r in range(2)]
    for r in range(2):
        assert res[r]["ok"], res[r].get("error")
        assert res[r]["versions"] == [0, 1, 2] and all(res[r]["exact"])
    assert res[0]["hidden"] == [] and res[1]["hidden"] == ["norm"]  # rank 0 applies it, rank 1 receives it
    # the received copy is marked changed like the applied one (the vLLM worker rebuilds a replicated
    # layer, an MoE router, on every rank from this; a broadcast alone left rank 1's version as it was)
    assert res[0]["norm_marked"] == res[1]["norm_marked"] == [True, True, True]



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
