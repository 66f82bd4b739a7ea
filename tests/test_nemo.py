"""The Lightning callback under NeMo 2's own stack (``nemo.lightning.Trainer``,
``MegatronStrategy`` TP=2 over gloo, ``llm.GPTModel``, ``MegatronParallel``), as far as CPU
allows: the initial weights published jointly by both TP ranks, each its own shards in
canonical coordinates, pulled by a plain receiver bit for bit (workers: dcr_testing/mp_nemo.py).
Runs in the NeMo environment (``make test-nemo``, part of ``make test``); skipped elsewhere.
The optimizer steps and a resume under NeMo need a GPU: tests/gpu/run_nemo.py."""

import pytest
import torch

pytest.importorskip("nemo.lightning")
pytest.importorskip("nemo.collections.llm")

from dcr_testing import assert_bits_equal  # noqa: E402
from dcr_testing import mp_nemo as W  # noqa: E402
from dcr_testing.procs import launch  # noqa: E402
from nemo_dcr.stores import LocalStore  # noqa: E402
from nemo_dcr.sync.follower import Follower  # noqa: E402
from nemo_dcr.sync.versions import read_head, read_manifest  # noqa: E402

DEADLINE = 300.0  # NeMo's imports alone take ~50 s on 2 busy cores (once, in the fork server)


def test_callback_under_nemo_megatron_strategy_publishes_tp_shards_jointly(tmp_path):
    refs = tmp_path / "refs"
    refs.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    spec = {"store": str(tmp_path / "store"), "refs": str(refs)}
    results, codes, hung = launch(W.main, 2, lambda r, port: (r, 2, port, spec, "initial", str(out)), out, DEADLINE,
                                  preload=("nemo.lightning", "nemo.collections.llm"))
    assert not hung, f"ranks {hung} still running after {DEADLINE}s; exit codes {codes}"
    failed = {r: res.get("traceback") for r, res in results.items() if not res["ok"]}
    assert len(results) == 2 and not failed, failed or codes
    for r in (0, 1):
        # NeMo's wrapper around the pipeline, Megatron's DDP (which NeMo's init_ddp put) around the GPTModel
        assert results[r]["megatron_parallel"] == "MegatronParallel" and results[r]["module"] == "DDP"
        assert results[r]["joint"] is True  # a Megatron model: every rank publishes its own shards
        assert results[r]["published"]["version"] == 0 and results[r]["global_step"] == 0

    store = LocalStore(spec["store"])
    m = read_manifest(store, read_head(store)[0].manifest)
    assert m.world_size == 2 and {p.rank for p in m.keyframe_parts} == {0, 1}
    # the whole model, assembled from each rank's megatron_snapshot blocks, cast as published
    shards = [torch.load(refs / f"rank{r}.pt", weights_only=False) for r in (0, 1)]  # our own files (ShardSpecs)
    whole = {}
    for part in shards:
        for name, (t, spec_) in part.items():
            g = spec_.global_shape if spec_ is not None else tuple(t.shape)
            full = whole.setdefault(name, torch.zeros(g, dtype=torch.bfloat16))
            sl = tuple(slice(o, o + s) for o, s in zip(spec_.offsets, spec_.shape)) if spec_ is not None else ...
            full[sl] = t.to(torch.bfloat16)
    assert any(s is not None and not s.is_full for part in shards for _, s in part.values())  # TP-sharded
    recv = {n: torch.zeros_like(t) for n, t in whole.items()}
    Follower(store, recv).sync()
    for n in whole:
        assert_bits_equal(recv[n], whole[n], n)
