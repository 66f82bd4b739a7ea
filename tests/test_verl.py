"""The verl checkpoint engine (nemo_dcr/integrations/verl_engine.py) against verl's own classes:
found through verl's plugin hook (``import_external_libs`` + ``CheckpointEngineRegistry``), wired
the way ``CheckpointEngineManager`` wires engines (``prepare`` on every worker, the class's
``build_topology``, ``init_process_group`` with its per-rank arguments), actor ranks sending a
real Hugging Face model's ``(name, tensor)`` stream while rollout workers receive concurrently;
each rollout worker's model equals the trainer's bit for bit after every step, and a step that
changed a few tensors hands the server only those. Runs in the verl environment
(``make test-verl``); skipped where verl is not installed."""
import asyncio

import pytest
import torch

pytest.importorskip("verl.checkpoint_engine.base")
transformers = pytest.importorskip("transformers")

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl.workers.rollout.utils import ensure_async_iterator  # noqa: E402

from dcr_testing import assert_state  # noqa: E402
from nemo_dcr.errors import DcrError  # noqa: E402

ACTORS, ROLLOUTS = 2, 2


def tiny_llama(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def wire(store, **kw):
    """Engines for ACTORS actor workers and ROLLOUTS rollout workers, set up as verl's manager does."""
    import_external_libs("nemo_dcr.integrations.verl_engine")  # checkpoint_engine.custom_backend_module
    cls = CheckpointEngineRegistry.get("dcr")
    assert issubclass(cls, CheckpointEngine)
    actors = [CheckpointEngineRegistry.new("dcr", bucket_size=1 << 20, store=store, **kw) for _ in range(ACTORS)]
    rollouts = [CheckpointEngineRegistry.new("dcr", bucket_size=1 << 20, store=store, **kw) for _ in range(ROLLOUTS)]
    metadata = [e.prepare() for e in actors + rollouts]
    akw, rkw = cls.build_topology(ACTORS, ROLLOUTS, metadata)
    for engines, kwargs in ((actors, akw), (rollouts, rkw)):
        for i, e in enumerate(engines):
            e.init_process_group(**{k: v[i] for k, v in kwargs.items()})
    return actors, rollouts


async def update(actors, rollouts, model, step, servers):
    """One CheckpointEngineManager.update_weights: senders and receivers at once; each server
    loads what its worker yields. -> (the senders' metrics, the names each server loaded)."""
    async def serve(engine, server):
        names = []
        async for name, t in ensure_async_iterator(engine.receive_weights(global_steps=step)):
            server[name] = t.clone()  # a server copies into its own weights
            names.append(name)
        return names

    def stream():
        yield from model.state_dict().items()

    out = await asyncio.gather(*[a.send_weights(stream(), global_steps=step) for a in actors],
                               *[serve(r, s) for r, s in zip(rollouts, servers)])
    for e in actors + rollouts:
        e.finalize()
    return out[:len(actors)], out[len(actors):]


def trainer_state(model):
    return {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}


def test_verl_engines_refit_every_rollout_worker_bit_for_bit(tmp_path):
    actors, rollouts = wire(str(tmp_path / "store"), dtype="bfloat16")
    model = tiny_llama()
    servers = [{} for _ in rollouts]
    metrics, loaded = asyncio.run(update(actors, rollouts, model, 1, servers))
    assert metrics[0]["dcr/version"] == 0.0 and metrics[1] == {}  # actor rank 0 publishes, rank 1 only iterates
    want = trainer_state(model)
    for server, names in zip(servers, loaded):
        assert sorted(names) == sorted(want)  # the first update: every tensor
        assert_state(server, want)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (2, 3):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        metrics, loaded = asyncio.run(update(actors, rollouts, model, step, servers))
        assert metrics[0]["dcr/version"] == step - 1 and metrics[0]["dcr/bytes"] > 0
        want = trainer_state(model)
        for server in servers:
            assert_state(server, want)

    with torch.no_grad():  # a step that changed one tensor: the servers load only that one
        model.lm_head.weight[0, 0] += 1.0
    metrics, loaded = asyncio.run(update(actors, rollouts, model, 4, servers))
    assert loaded == [["lm_head.weight"]] * ROLLOUTS
    for server in servers:
        assert_state(server, trainer_state(model))


def test_a_rollout_worker_waits_for_its_step_and_says_when_it_never_comes(tmp_path):
    actors, rollouts = wire(str(tmp_path / "store"), timeout_s=0.5)
    model = tiny_llama()
    asyncio.run(update(actors, rollouts, model, 1, [{} for _ in rollouts]))

    async def receive():
        return [n async for n, _ in rollouts[0].receive_weights(global_steps=7)]
    with pytest.raises(DcrError, match="no version for step 7"):
        asyncio.run(receive())
    with pytest.raises(DcrError, match="needs a store"):
        CheckpointEngineRegistry.new("dcr", bucket_size=1)
