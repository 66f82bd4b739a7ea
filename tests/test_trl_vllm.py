"""The RL loop with a real RL library and a real engine (bench/rl_trl_vllm.py): TRL's GRPOTrainer
trains a tiny model; its rollouts come from a stock vLLM engine that nemo-dcr refits after every
optimizer step, and each version the engine serves is read back and compared with the trainer's
BF16 bits. Runs in the TRL venv (``make test-trl``: TRL 1.16 layered on the vLLM venv), skipped
elsewhere."""
import pytest

from dcr_testing import bench

pytest.importorskip("trl", reason="TRL is not installed here: `make test-trl` builds its venv and runs this")
pytest.importorskip("vllm", reason="the real vLLM engine is not installed here: `make test-trl` runs this")


def _bench():
    return bench.load("rl_trl_vllm")


def test_grpo_on_a_refitted_engine_llama(tmp_path):
    """Llama (untied embeddings): the reward rises; every version the engine serves, one per
    optimizer step, is the trainer's BF16 bits; the baseline engine, given the same weights by
    a dense push and a dense reload each step, generates the same greedy tokens."""
    bench = _bench()
    steps = 15
    res = bench.run(steps=steps, kind="llama", size="tiny", workdir=str(tmp_path), baseline=True, lr=5e-3)
    rows = res["versions"]
    assert [r["step"] for r in rows] == list(range(steps + 1))
    assert [r["version"] for r in rows] == list(range(steps + 1))
    assert all(r["bit_exact"] and r["same_tokens"] for r in rows)
    assert all(r["change_rate"] > 0 and 0 < r["delta_bytes"] < r["dense_bytes"] for r in rows[1:])
    assert all(r["publish_s"] > 0 and r["refit_s"] > 0 and r["push_s"] > 0 and r["reload_s"] > 0 for r in rows)
    rewards = res["rewards"]
    assert len(rewards) == steps
    k = steps // 3
    assert sum(rewards[-k:]) / k > sum(rewards[:k]) / k + 0.05, rewards
    table = bench.table(res)
    assert "nemo-dcr" in table and "dense reload" in table


def test_grpo_on_a_refitted_engine_qwen2(tmp_path):
    """Qwen2 (tied embeddings, qkv bias): every version served is the trainer's bits."""
    bench = _bench()
    res = bench.run(steps=4, kind="qwen2", size="tiny", workdir=str(tmp_path), baseline=False, lr=2e-3)
    rows = res["versions"]
    assert [r["version"] for r in rows] == list(range(5))
    assert all(r["bit_exact"] for r in rows)
    assert all(r["change_rate"] > 0 for r in rows[1:])
