"""Worker processes for test_megatron.py: real megatron-core GPT models over gloo, on CPU.

Each worker joins a gloo group, runs ``parallel_state.initialize_model_parallel`` for its
layout, builds a small GPTModel (local layer spec: no Transformer Engine), and plays one
scenario: a trainer that publishes versions (``Publisher``) and writes, per version, what each
rank published as a reference file (``ref-<tag>-r<rank>-v<version>.pt``: name -> (tensor,
global shape, offsets, local shape)); or a receiver group that follows them
(``Follower(group=...)``) and compares with the trainer's references. Results go to
``<out>/<rank>.json`` like dcr_testing/mp_workers.py; every collective has a timeout.

CPU shim (test only): megatron-core 0.16 calls CUDA in a few places even on a CPU model:
``torch.cuda.current_device()`` (RoPE moves ``inv_freq`` there; DDP allocates its buffers
there) and the CUDA RNG tracker (``torch.cuda.get_rng_state``/``manual_seed``, forked around
attention dropout). :func:`cpu_shim` points ``current_device`` at the CPU, makes
``synchronize`` a no-op and backs the RNG tracker with the CPU generator (dropout is 0 here,
so no random numbers are drawn inside the tracker). Nothing in callbacks/megatron.py needs it.
"""
from __future__ import annotations

import datetime
import glob
import os
import zlib

import torch

TIMEOUT = datetime.timedelta(seconds=30)
VOCAB, PADDED_VOCAB = 100, 128  # HF's true vocabulary; Megatron's, padded to a multiple of 128
CHUNK = 512  # small delta chunks: several per shard



def cpu_shim():
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda *a, **k: None
    import megatron.core.tensor_parallel.random as R
    R._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    R._set_cuda_rng_state = lambda *a, **k: None


def setup(tp=1, pp=1, ep=1):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(123)


def config(tp=1, pp=1, ep=1, moe=False, dtype=torch.bfloat16, num_layers=4):
    """Llama-like: RMSNorm, SwiGLU, RoPE, no biases, GQA (8 heads in 4 groups), untied."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
              expert_model_parallel_size=ep) if moe else {}
    return TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96,
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype, **kw)


def build(cfg, seed=1, moe=False):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    torch.manual_seed(seed)  # CPU init draws each full weight, then keeps this rank's slice
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts if moe else None, moe_grouped_gemm=False)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=PADDED_VOCAB, max_sequence_length=32,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=10000)


def batch(b=2, s=12, seed=0):
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)  # True = masked
    return ids, pos, mask


def perturb(model, v, metadata=None):
    """A sparse 'optimizer step': flip low mantissa bits of ~5 % of the elements, chosen by a
    function of (name, canonical index, version), so every layout makes the same change."""
    from nemo_dcr.integrations.megatron import megatron_snapshot
    from nemo_dcr.state.dtypes import int_view
    views, shards = megatron_snapshot(model, copy=False, metadata=metadata)
    for n, t in views.items():
        s = shards[n]
        g = torch.Generator().manual_seed(zlib.crc32(n.encode()) + 7919 * v)
        mask = torch.rand(s.global_shape, generator=g) < 0.05
        mask = mask[tuple(slice(o, o + k) for o, k in zip(s.offsets, s.shape))]
        bits = int_view(t)
        bits[mask] ^= 0x3


def dump(out, tag, rank, v, tensors, shards):
    torch.save({n: (t.clone(), s.global_shape, s.offsets, s.shape) for n, t in tensors.items() for s in [shards[n]]},
               os.path.join(out, f"ref-{tag}-r{rank}-v{v}.pt"))


def assemble(out, tag, v):
    """The full tensors of version ``v`` from every rank's reference file; checks that the
    ranks' blocks cover each tensor exactly once."""
    from nemo_dcr.integrations.megatron import check_cover
    from nemo_dcr.state.index_map import ShardSpec
    files = sorted(glob.glob(os.path.join(out, f"ref-{tag}-r*-v{v}.pt")))
    if not files:
        raise FileNotFoundError(f"no reference files for {tag} v{v} in {out}")
    per_rank = [torch.load(f) for f in files]
    check_cover([{n: ShardSpec.of(g, o, s) for n, (t, g, o, s) in d.items()} for d in per_rank])
    full = {}
    for d in per_rank:
        for n, (t, g, o, s) in d.items():
            if n not in full:
                full[n] = torch.zeros(g, dtype=t.dtype)
            full[n][tuple(slice(a, a + k) for a, k in zip(o, s))] = t
    return full


def mismatches(blocks, full):
    """``blocks``: [(name, ShardSpec, tensor)]; the names whose tensor is not, bit for bit, that
    region of ``full[name]``."""
    from nemo_dcr.state.dtypes import int_view
    bad = []
    for n, s, t in blocks:
        if n not in full:
            bad.append(f"{n} (not in the reference)")
            continue
        ref = full[n][tuple(slice(a, a + k) for a, k in zip(s.offsets, s.shape))]
        if t.dtype != ref.dtype or tuple(t.shape) != tuple(ref.shape) or \
                not torch.equal(int_view(t.contiguous()), int_view(ref)):
            bad.append(f"{n}@{s.offsets}")
    return bad


def _names_and_shapes(shards):
    return {n: list(s.global_shape) for n, s in shards.items()}


# ----------------------------------------------------------------------------- scenarios

def _train(rank, world, a, res, out):
    """(a) TP=2 trainer: real forward/backward/Adam steps; publishes Megatron coordinates and,
    through hf_mapping, HF Llama coordinates, each to its own store."""
    import torch.distributed as dist

    from nemo_dcr.integrations.hf_mapping import GPTLayout, megatron_to_hf_shards
    from nemo_dcr.integrations.megatron import megatron_snapshot
    from nemo_dcr.sync.publisher import Publisher
    setup(tp=2)
    cfg = config(tp=2)
    model = build(cfg)
    layout = GPTLayout.from_megatron(cfg, VOCAB)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pm = Publisher(a["store_m"], chunk_elems=CHUNK)
    ph = Publisher(a["store_hf"], chunk_elems=CHUNK)
    res["versions"], res["hf_names"], first = [], None, None
    for v in range(3):
        if v:
            ids, pos, mask = batch(seed=v)
            opt.zero_grad()
            model(ids, pos, mask, labels=ids).float().mean().backward()
            opt.step()
        tensors, shards = megatron_snapshot(model)
        first = first or shards
        res["same_shards_object"] = shards is first
        r = pm.publish(tensors, shards, step=v)
        dump(out, "m", rank, v, tensors, shards)
        ht, hs = megatron_to_hf_shards(tensors, shards, layout)
        rh = ph.publish(ht, hs, step=v)
        dump(out, "hf", rank, v, ht, hs)
        res["versions"].append([r.version, rh.version, r.change_rate])
        res["hf_names"] = sorted(hs)
        res["hf_specs"] = {n: [s.offsets, s.shape] for n, s in hs.items()}
    res["names"] = _names_and_shapes(shards)
    dist.barrier()


def _publish(rank, world, a, res, out):
    """A trainer of layout (tp, pp, ep) publishing versions 0..n-1 with sparse bit changes in
    between; optionally the stacked layout too (or the error it gives)."""
    from nemo_dcr.integrations.megatron import megatron_snapshot
    from nemo_dcr.sync.publisher import Publisher
    tp, pp, ep, moe = a.get("tp", 1), a.get("pp", 1), a.get("ep", 1), a.get("moe", False)
    setup(tp, pp, ep)
    model = build(config(tp, pp, ep, moe=moe), moe=moe)
    pub = Publisher(a["store"], chunk_elems=CHUNK)
    stacked = Publisher(a["store_stacked"], chunk_elems=CHUNK) if a.get("store_stacked") else None
    res["versions"], first = [], None
    for v in range(a.get("versions", 3)):
        if v:
            perturb(model, v)
        tensors, shards = megatron_snapshot(model)
        first = first or shards
        res["same_shards_object"] = shards is first  # also when another layout is snapshot in between
        res["versions"].append(pub.publish(tensors, shards).version)
        dump(out, "m", rank, v, tensors, shards)
        if stacked is not None:
            st, ss = megatron_snapshot(model, metadata={"singleton_local_shards": False})
            stacked.publish(st, ss)
            dump(out, "stacked", rank, v, st, ss)
            res["stacked_names"] = _names_and_shapes(ss)
    if stacked is not None:
        try:  # tiled blocks are copies: no in-place views of them
            megatron_snapshot(model, metadata={"singleton_local_shards": False}, copy=False)
            res["stacked_views_error"] = None
        except Exception as e:
            res["stacked_views_error"] = f"{type(e).__name__}: {e}"
    res["names"] = _names_and_shapes(shards)
    res["held"] = len(tensors)
    if a.get("try_stacked"):
        try:
            megatron_snapshot(model, metadata={"singleton_local_shards": False})
            res["stacked_error"] = None
        except Exception as e:
            res["stacked_error"] = f"{type(e).__name__}: {e}"


def _follow(rank, world, a, res, out):
    """A TP=a['tp'] receiver group: applies every version into views of its own (differently
    initialised) model's parameters, refreshes the TP-replicated layer norms, compares."""
    import torch.distributed as dist

    from nemo_dcr.integrations.megatron import check_cover, megatron_snapshot, sync_replicas
    from nemo_dcr.sync.follower import Follower
    tp = a["tp"]
    setup(tp)
    model = build(config(tp), seed=99)
    views, shards = megatron_snapshot(model, copy=False)
    everyone = [None] * world
    dist.all_gather_object(everyone, shards)
    check_cover(everyone)
    f = Follower(a["store"], views, shards)
    res["steps"], res["bad"] = [], {}
    for v in range(a["versions"]):
        s = f.sync(v)
        res["steps"].append([list(x) for x in s.steps])
        sync_replicas(model)
        full = assemble(a["ref_dir"], "m", v)
        bad = mismatches([(n, shards[n], views[n]) for n in views], full)
        # every block this rank holds, other replicas too, straight from the live parameters
        bad += [f"replica:{n}" for n in mismatches(_all_blocks(model), full)]
        if bad:
            res["bad"][v] = bad
    f.check()
    res["held"] = len(views)


def _all_blocks(model):
    from nemo_dcr.integrations.megatron import DEFAULT_METADATA, _model_of, _pieces, model_chunks
    ps = _pieces([_model_of(c) for c in model_chunks(model)], DEFAULT_METADATA, main_only=False)
    return [(p.name, p.spec, p.tensor) for p in ps]


def _dp2(rank, world, a, res, out):
    """DP=2 with Megatron's DDP and the distributed optimizer, overlap_param_gather=True: an
    emulated optimizer step (each rank changes only its own slice of the parameter buffer,
    as DistributedOptimizer does) leaves the other slice stale until force_param_sync. Then
    (rank 0) a TP=1 float32 model's full snapshot and logits for the HF comparison."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from nemo_dcr.integrations.megatron import force_param_sync, is_megatron_module, megatron_snapshot
    from nemo_dcr.state.dtypes import int_view
    setup()
    cfg = config()
    model = build(cfg)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True, bucket_size=4000), model)

    class Lightningish(torch.nn.Module):  # a wrapper holding the chunks the way NeMo does
        def __init__(self, chunks):
            super().__init__()
            self.module = torch.nn.ModuleList(chunks)

    wrapped = Lightningish([ddp])
    res["is_megatron"] = [is_megatron_module(wrapped), is_megatron_module(torch.nn.Linear(2, 2))]
    before, _ = megatron_snapshot(wrapped)
    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    with torch.no_grad():
        for bg in ddp.bucket_groups:
            for b in bg.buckets:
                int_view(shard_buffer(b.param_data, dp)[dpr]).__ixor__(0x1)  # "my slice was updated"

    def flat():
        return torch.cat([int_view(p.detach()).flatten().to(torch.int32) for p in model.parameters()])

    def same_across_dp():
        x = flat()
        allx = [torch.zeros_like(x) for _ in range(world)]
        dist.all_gather(allx, x)
        return all(torch.equal(allx[0], y) for y in allx)

    res["equal_before_sync"] = same_across_dp()
    stale, _ = megatron_snapshot(wrapped)
    res["synced_chunks"] = force_param_sync(wrapped)
    res["equal_after_sync"] = same_across_dp()
    after, shards = megatron_snapshot(wrapped)

    def changed(x, y):
        return sum(int((int_view(x[n]) != int_view(y[n])).sum()) for n in x)

    total = sum(t.numel() for t in after.values())
    res["changed_stale"], res["changed_after"], res["total"] = changed(before, stale), changed(before, after), total
    res["published_tensors"] = len(after)
    res["force_param_sync_plain"] = force_param_sync(model)  # no DDP: nothing to do
    if rank == 0:  # a float32 TP=1 model and its logits, for the HF Llama comparison
        cfg32 = config(dtype=torch.float32, num_layers=2)
        m32 = build(cfg32, seed=5)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():  # O(1) weights and non-trivial norms, so a wrong mapping shows in the logits
            for p in m32.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 1 else 0.15) + (p.dim() == 1))
        ids, pos, mask = batch(b=2, s=12, seed=3)
        with torch.no_grad():
            logits = m32(ids, pos, mask)
        full, fs = megatron_snapshot(m32)
        assert all(s.is_full for s in fs.values())
        torch.save({"state": full, "logits": logits, "ids": ids}, os.path.join(out, "fp32.pt"))
        res["logits_shape"] = list(logits.shape)


SCENARIOS = {"train": _train, "publish": _publish, "follow": _follow, "dp2": _dp2}


def main(rank: int, world: int, port: int, scenario: str, args: dict, out: str) -> None:
    import warnings

    from dcr_testing.procs import run_rank
    warnings.filterwarnings("ignore")
    run_rank(rank, world, port, out, lambda res: SCENARIOS[scenario](rank, world, args, res, out), TIMEOUT,
             prepare=cpu_shim)
