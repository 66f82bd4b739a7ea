"""Megatron-core models published and followed bit-exactly across layouts (callbacks/megatron.py)
and Megatron GPT -> Hugging Face Llama as fixed permutations (callbacks/hf_mapping.py).

Real megatron-core 0.16 GPTModels (local layer spec, no Transformer Engine) on CPU, in groups
of 2 or 4 processes over gloo (workers in mp_megatron.py, started from a fork server like
test_publish_multirank.py; a group that outlives its deadline is killed and fails the test):

(a) a TP=2 trainer taking real Adam steps publishes; an unsharded receiver rebuilds every
    tensor bit-exactly, and a real HF ``LlamaForCausalLM`` follows the same trainer publishing
    in HF coordinates (each rank maps its own shards, no gather);
(b) a TP=4 trainer -> a TP=2 receiver group applying in place into its own GPTModel;
(c) TP=2 x PP=2: per-layer names and offsets are the same as without pipeline stages;
(d) MoE with expert parallel 2 (SequentialMLP experts), per-expert and stacked layouts;
plus the distributed optimizer's deferred parameter all-gather (force_param_sync) and the HF
model's logits against Megatron's forward.

The workers need a small test-only CPU shim (megatron-core calls torch.cuda.current_device()
and the CUDA RNG tracker even for CPU models): see mp_megatron.cpu_shim. The library code
does not need it.
"""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install '.[megatron]')")

from dcr_testing import assert_bits_equal  # noqa: E402
from dcr_testing import mp_megatron as W  # noqa: E402
from dcr_testing.procs import launch  # noqa: E402
from nemo_dcr.errors import DcrError  # noqa: E402
from nemo_dcr.integrations import hf_mapping as H  # noqa: E402
from nemo_dcr.integrations.megatron import check_cover, is_megatron_module, megatron_snapshot  # noqa: E402
from nemo_dcr.state.index_map import ShardSpec  # noqa: E402
from nemo_dcr.sync.follower import Follower  # noqa: E402

DEADLINE = 90.0
LAYOUT = H.GPTLayout(num_attention_heads=8, num_query_groups=4, head_dim=8, vocab_size=W.VOCAB)


def run_group(world, scenario, args, out, deadline=DEADLINE):
    """Run ``world`` ranks of ``scenario``; -> {rank: result}. Fails on a hang or a rank error."""
    out.mkdir(parents=True, exist_ok=True)
    res, codes, hung = launch(W.main, world, lambda r, port: (r, world, port, scenario, args, str(out)), out, deadline)
    assert not hung, f"ranks {hung} of {scenario!r} still running after {deadline}s; results so far: {res}"
    missing = [r for r in range(world) if r not in res]
    assert not missing, f"ranks {missing} of {scenario!r} wrote no result (exit codes {codes})"
    failed = sorted((r for r in res if not res[r]["ok"]),
                    key=lambda r: "remote" in res[r]["traceback"] or "Connection" in res[r]["traceback"])
    assert not failed, "\n".join(f"rank {r} failed:\n{res[r]['traceback']}" for r in failed)
    return res


def follow_unsharded(store, tag, ref_dir, versions):
    """A single unsharded receiver following every version; compared with the assembled
    references. Returns the final tensors."""
    full0 = W.assemble(ref_dir, tag, 0)
    recv = {n: torch.zeros_like(t) for n, t in full0.items()}
    f = Follower(store, recv)
    for v in range(versions):
        assert f.sync(v).steps == [("keyframe" if v == 0 else "delta", v)]
        ref = full0 if v == 0 else W.assemble(ref_dir, tag, v)
        assert sorted(recv) == sorted(ref)
        for n in ref:
            assert_bits_equal(recv[n], ref[n], f"{tag}:{n}@v{v}")
    f.check()
    return recv


# ----------------------------------------------------------------------------- (a) TP=2, real steps

@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2")
    args = {"store_m": str(d / "store-m"), "store_hf": str(d / "store-hf")}
    res = run_group(2, "train", args, d / "out")
    return {"dir": d / "out", "res": res, **args}


def test_tp2_trainer_unsharded_receiver_bit_exact(tp2):
    res = tp2["res"]
    for r in (0, 1):
        assert [v[:2] for v in res[r]["versions"]] == [[0, 0], [1, 1], [2, 2]]
        assert res[r]["same_shards_object"]  # index maps built once per model
    assert res[0]["versions"][1][2] > 0.05  # Adam changed a good part of the bits
    names = res[0]["names"]
    only0 = set(names) - set(res[1]["names"])  # TP-replicated: owned (published) by TP rank 0 alone
    assert only0 and all("norm" in n for n in only0) and set(res[1]["names"]) < set(names)
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in names  # per layer, global index
    assert names["decoder.layers.0.mlp.linear_fc1.weight_w"] == [96, 64]  # gate half, TP-sharded by rows
    assert names["embedding.word_embeddings.weight"] == [W.PADDED_VOCAB, 64]
    follow_unsharded(tp2["store_m"], "m", tp2["dir"], 3)


def test_tp2_trainer_publishes_hf_coordinates_into_a_real_llama(tp2):
    transformers = pytest.importorskip("transformers")
    res = tp2["res"]
    # each rank's part of each HF tensor is one rectangle: whole query groups, gate/up rows
    s0, s1 = res[0]["hf_specs"], res[1]["hf_specs"]
    assert s0["model.layers.0.self_attn.q_proj.weight"] == [[0, 0], [32, 64]]
    assert s1["model.layers.0.self_attn.q_proj.weight"] == [[32, 0], [32, 64]]
    assert s1["model.layers.0.self_attn.k_proj.weight"] == [[16, 0], [16, 64]]
    assert s1["model.layers.0.mlp.up_proj.weight"] == [[48, 0], [48, 64]]
    assert s1["model.embed_tokens.weight"] == [[64, 0], [36, 64]]  # rows 100..127 were padding
    assert "model.layers.0.input_layernorm.weight" not in s1  # replicated: rank 0's

    hf = transformers.LlamaForCausalLM(_llama_config(transformers, num_layers=4)).to(torch.bfloat16)
    recv = {n: p.detach() for n, p in hf.named_parameters()}  # the live model, updated in place
    assert sorted(recv) == sorted(set(res[0]["hf_names"]) | set(res[1]["hf_names"]))
    f = Follower(tp2["store_hf"], recv)
    for v in range(3):
        f.sync(v)
        exp = H.megatron_to_hf(W.assemble(tp2["dir"], "m", v), LAYOUT)  # gather, then convert
        assert sorted(exp) == sorted(recv)
        for n in exp:
            assert_bits_equal(recv[n], exp[n], f"{n}@v{v}")
    f.check()
    ids = torch.randint(0, W.VOCAB, (1, 8))
    assert torch.isfinite(hf(ids).logits).all()


def _llama_config(transformers, num_layers):
    return transformers.LlamaConfig(
        vocab_size=W.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


# ----------------------------------------------------------------------------- (b) TP=4 -> TP=2 group

def test_tp4_trainer_to_tp2_receiver_group(tmp_path):
    res = run_group(4, "publish", {"tp": 4, "store": str(tmp_path / "store")}, tmp_path / "pub")
    assert all(res[r]["versions"] == [0, 1, 2] for r in range(4))
    assert res[0]["held"] > res[3]["held"] > 0  # rank 0 also owns the replicated layer norms
    rec = run_group(2, "follow", {"tp": 2, "store": str(tmp_path / "store"), "ref_dir": str(tmp_path / "pub"),
                                  "versions": 3}, tmp_path / "recv")
    for r in (0, 1):
        assert rec[r]["bad"] == {}, rec[r]["bad"]
        assert rec[r]["steps"] == [[["keyframe", 0]], [["delta", 1]], [["delta", 2]]]


# ----------------------------------------------------------------------------- (c) PP=2

def test_pp2_names_and_offsets_are_canonical(tmp_path, tp2):
    res = run_group(4, "publish", {"tp": 2, "pp": 2, "store": str(tmp_path / "store"), "try_stacked": True},
                    tmp_path / "pub")
    names = {}
    for r in range(4):
        names.update(res[r]["names"])
    assert names == tp2["res"][0]["names"]  # the same keys and global shapes as with PP=1
    stage0 = set(res[0]["names"])
    assert "embedding.word_embeddings.weight" in stage0 and "output_layer.weight" not in stage0
    assert {n for n in stage0 if n.startswith("decoder.layers.")} == {
        n for n in names if n.startswith(("decoder.layers.0.", "decoder.layers.1."))}
    # the stacked layout cannot put a TP-sharded gated fc1 (gate rows + up rows) in one rectangle
    err = res[0]["stacked_error"]
    assert err and "linear_fc1" in err and "singleton_local_shards" in err
    follow_unsharded(str(tmp_path / "store"), "m", tmp_path / "pub", 3)


# ----------------------------------------------------------------------------- (d) MoE, EP=2

def test_moe_expert_parallel_per_expert_and_stacked(tmp_path):
    args = {"ep": 2, "moe": True, "store": str(tmp_path / "store"), "store_stacked": str(tmp_path / "stacked")}
    res = run_group(2, "publish", args, tmp_path / "pub")
    n0, n1 = res[0]["names"], res[1]["names"]
    assert res[0]["same_shards_object"] and res[1]["same_shards_object"]
    e = "decoder.layers.2.mlp.experts.experts.{}.linear_fc1.weight_w"
    assert e.format(0) in n0 and e.format(1) in n0 and e.format(2) in n1 and e.format(3) in n1
    assert "decoder.layers.2.mlp.router.weight" in n0 and "decoder.layers.2.mlp.router.weight" not in n1
    # stacked: rank r's experts of every layer, both fc1 halves, tile one block of the global tensor
    st = res[0]["stacked_names"]
    assert st["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == [4, 4, 192, 64]
    assert "copy=False needs views" in res[0]["stacked_views_error"]
    follow_unsharded(str(tmp_path / "store"), "m", tmp_path / "pub", 3)
    follow_unsharded(str(tmp_path / "stacked"), "stacked", tmp_path / "pub", 3)
    # the real model's names, both EP ranks' experts (global expert index), in Mixtral's checkpoint
    # names and shapes: exactly what save_pretrained writes for the same architecture
    transformers = pytest.importorskip("transformers")
    cfg = _moe_config(transformers, "mixtral", layers=4)
    lay = H.GPTLayout.from_hf(cfg)
    got = {}
    for names in (n0, n1):
        for n, shape in names.items():
            for h, hshape in H.hf_names(n, shape, lay).items():
                assert got.setdefault(h, hshape) == hshape
    ckpt = _hf_checkpoint(transformers.AutoModelForCausalLM.from_config(cfg), tmp_path / "hf")
    assert got == {k: tuple(v.shape) for k, v in ckpt.items()}


# ----------------------------------------------------------------------------- distributed optimizer

@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp2")
    return {"dir": d, "res": run_group(2, "dp2", {}, d)}


def test_force_param_sync_completes_the_distributed_optimizer_all_gather(dp2):
    res = dp2["res"]
    for r in (0, 1):
        assert res[r]["is_megatron"] == [True, False]
        assert res[r]["equal_before_sync"] is False  # each rank has the other's slice stale
        assert res[r]["equal_after_sync"] is True
        assert res[r]["synced_chunks"] == 1 and res[r]["force_param_sync_plain"] == 0
    r0 = res[0]
    assert r0["total"] > 0 and res[1]["published_tensors"] == 0  # DP rank 1 holds only replicas
    assert 0 < r0["changed_stale"] < r0["total"]  # before the sync: rank 0's own slice only
    assert r0["changed_after"] == r0["total"]  # after: every element


def test_hf_llama_logits_match_megatron_forward(dp2):
    transformers = pytest.importorskip("transformers")
    saved = torch.load(dp2["dir"] / "fp32.pt")
    hf = transformers.LlamaForCausalLM(_llama_config(transformers, num_layers=2)).float().eval()
    hf.load_state_dict(H.megatron_to_hf(saved["state"], LAYOUT), strict=True)
    with torch.no_grad():
        got = hf(saved["ids"]).logits
    ref = saved["logits"][..., :W.VOCAB]
    assert got.shape == ref.shape
    assert ref.std() > 0.5
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


# ----------------------------------------------------------------------------- hf_mapping, no processes

def _megatron_state(lay, layers=2, hidden=64, ffn=96, padded=W.PADDED_VOCAB, split_fc1=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    G, Q, d = lay.num_query_groups, lay.q_per_group, lay.head_dim
    st = {"embedding.word_embeddings.weight": r(padded, hidden), "output_layer.weight": r(padded, hidden),
          "decoder.final_layernorm.weight": r(hidden)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        st[p + "self_attention.linear_qkv.layer_norm_weight"] = r(hidden)
        st[p + "self_attention.linear_qkv.weight"] = r(G * (Q + 2) * d, hidden)
        st[p + "self_attention.linear_proj.weight"] = r(hidden, lay.num_attention_heads * d)
        st[p + "mlp.linear_fc1.layer_norm_weight"] = r(hidden)
        if split_fc1:
            st[p + "mlp.linear_fc1.weight_w"], st[p + "mlp.linear_fc1.weight_v"] = r(ffn, hidden), r(ffn, hidden)
        else:
            st[p + "mlp.linear_fc1.weight"] = r(2 * ffn, hidden)
        st[p + "mlp.linear_fc2.weight"] = r(hidden, ffn)
    return st


def _reference_hf(st, lay):
    """An independent, loop-by-head statement of the Megatron -> HF layout."""
    G, Q, d, V = lay.num_query_groups, lay.q_per_group, lay.head_dim, lay.vocab_size
    out = {"model.embed_tokens.weight": st["embedding.word_embeddings.weight"][:V],
           "lm_head.weight": st["output_layer.weight"][:V], "model.norm.weight": st["decoder.final_layernorm.weight"]}
    layers = sorted({int(k.split(".")[2]) for k in st if k.startswith("decoder.layers.")})
    for i in layers:
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = st[p + "self_attention.linear_qkv.weight"]
        q_rows, k_rows, v_rows = [], [], []
        for head in range(lay.num_attention_heads):  # HF head ``head`` uses kv group head // Q
            g, j = divmod(head, Q)
            q_rows.append(qkv[g * (Q + 2) * d + j * d: g * (Q + 2) * d + (j + 1) * d])
        for g in range(G):
            k_rows.append(qkv[g * (Q + 2) * d + Q * d: g * (Q + 2) * d + (Q + 1) * d])
            v_rows.append(qkv[g * (Q + 2) * d + (Q + 1) * d: (g + 1) * (Q + 2) * d])
        out[h + "self_attn.q_proj.weight"] = torch.cat(q_rows)
        out[h + "self_attn.k_proj.weight"] = torch.cat(k_rows)
        out[h + "self_attn.v_proj.weight"] = torch.cat(v_rows)
        out[h + "self_attn.o_proj.weight"] = st[p + "self_attention.linear_proj.weight"]
        out[h + "input_layernorm.weight"] = st[p + "self_attention.linear_qkv.layer_norm_weight"]
        out[h + "post_attention_layernorm.weight"] = st[p + "mlp.linear_fc1.layer_norm_weight"]
        if p + "mlp.linear_fc1.weight" in st:
            gate, up = st[p + "mlp.linear_fc1.weight"].chunk(2)
        else:
            gate, up = st[p + "mlp.linear_fc1.weight_w"], st[p + "mlp.linear_fc1.weight_v"]
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = st[p + "mlp.linear_fc2.weight"]
    return out


@pytest.mark.parametrize("split_fc1", [True, False])
def test_hf_permutation_is_bit_exact_and_round_trips(split_fc1):
    st = _megatron_state(LAYOUT, split_fc1=split_fc1)
    hf = H.megatron_to_hf(st, LAYOUT)
    ref = _reference_hf(st, LAYOUT)
    assert sorted(hf) == sorted(ref)
    for n in ref:
        assert_bits_equal(hf[n], ref[n], n)
    back = H.hf_to_megatron(hf, LAYOUT, padded_vocab_size=W.PADDED_VOCAB, split_fc1=split_fc1)
    assert sorted(back) == sorted(st)
    for n, t in st.items():
        if "embedding" in n or "output_layer" in n:
            assert_bits_equal(back[n][:W.VOCAB], t[:W.VOCAB], n)
            assert not back[n][W.VOCAB:].any()  # padding comes back as zeros
        else:
            assert_bits_equal(back[n], t, n)
    again = H.megatron_to_hf(back, LAYOUT)
    for n in hf:
        assert_bits_equal(again[n], hf[n], n)
    # local-spec names (input_layernorm / pre_mlp_layernorm) and "module." prefixes map the same
    local = H.hf_to_megatron(hf, LAYOUT, te_layernorm_names=False)
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in local
    hf2 = H.megatron_to_hf({"module." + k: v for k, v in local.items()}, LAYOUT)
    for n in hf:
        assert_bits_equal(hf2[n], hf[n], n)
    with pytest.raises(DcrError, match="no Hugging Face counterpart"):
        H.megatron_to_hf({"decoder.layers.0.mlp.experts.weight1": torch.zeros(64, 4 * 96)}, LAYOUT)  # legacy GroupedMLP
    with pytest.raises(DcrError, match="no Hugging Face counterpart in the 'mixtral' naming"):
        H.megatron_to_hf({"decoder.layers.0.mlp.shared_experts.gate_weight": torch.zeros(1, 64)}, LAYOUT)


def _moe_config(transformers, family, layers=2, experts=4):
    common = dict(vocab_size=W.VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=8, max_position_embeddings=32, tie_word_embeddings=False)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=96, num_local_experts=experts, num_experts_per_tok=2,
                                          **common)
    return transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=96, num_experts=experts,
                                       num_experts_per_tok=2, shared_expert_intermediate_size=80,
                                       decoder_sparse_step=1, mlp_only_layers=[0], qkv_bias=False, **common)


def _moe_megatron_state(family, experts=4, ffn=96, shared=80, hidden=64, seed=1):
    """Two layers in the snapshot's per-expert names, both MoE (Mixtral), or layer 0 dense
    (Qwen's ``mlp_only_layers``) and layer 1 MoE with a shared expert."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    st = _megatron_state(LAYOUT, layers=2, ffn=128 if family == "qwen" else 96, seed=seed)
    for i in (0, 1) if family == "mixtral" else (1,):
        _moe_layer(st, f"decoder.layers.{i}.", family, r, experts, ffn, shared, hidden)
    return st


def _moe_layer(st, p, family, r, experts, ffn, shared, hidden):
    for k in [k for k in st if k.startswith(p + "mlp.") or k == p + "mlp.linear_fc1.layer_norm_weight"]:
        del st[k]
    st[p + "pre_mlp_layernorm.weight"] = r(hidden)
    st[p + "mlp.router.weight"] = r(experts, hidden)
    for e in range(experts):
        st[f"{p}mlp.experts.experts.{e}.linear_fc1.weight_w"] = r(ffn, hidden)
        st[f"{p}mlp.experts.experts.{e}.linear_fc1.weight_v"] = r(ffn, hidden)
        st[f"{p}mlp.experts.experts.{e}.linear_fc2.weight"] = r(hidden, ffn)
    if family == "qwen":
        st[p + "mlp.shared_experts.linear_fc1.weight_w"] = r(shared, hidden)
        st[p + "mlp.shared_experts.linear_fc1.weight_v"] = r(shared, hidden)
        st[p + "mlp.shared_experts.linear_fc2.weight"] = r(hidden, shared)
        st[p + "mlp.shared_experts.gate_weight"] = r(1, hidden)


def _hf_checkpoint(model, path) -> dict:
    """What ``save_pretrained`` writes: the checkpoint names vLLM loads and a trainer publishes
    (transformers 5 fuses experts in memory and splits them again on save)."""
    from safetensors.torch import load_file
    model.save_pretrained(str(path), safe_serialization=True)
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("family", H.MOE_FAMILIES)
def test_hf_moe_names_load_into_the_real_hf_model_and_round_trip(family, tmp_path):
    """Megatron MoE names -> the Hugging Face family's checkpoint (Mixtral; Qwen2-MoE with a
    shared expert and a dense first layer): every key and shape ``save_pretrained`` writes, loaded
    by the real ``transformers`` model without missing or unexpected keys and saved back bit for
    bit; the other Megatron spellings of the experts give the same tensors; and back to Megatron."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file
    cfg = _moe_config(transformers, family)
    lay = H.GPTLayout.from_hf(cfg)
    assert lay.moe == family and lay.num_query_groups == LAYOUT.num_query_groups
    st = _moe_megatron_state(family)
    hf = H.megatron_to_hf(st, lay)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    want = {k: tuple(v.shape) for k, v in _hf_checkpoint(model, tmp_path / "init").items()}
    assert {k: tuple(v.shape) for k, v in hf.items()} == want
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "init" / "model.safetensors"),
              metadata={"format": "pt"})
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "init"), dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    for k, v in _hf_checkpoint(loaded, tmp_path / "again").items():
        assert_bits_equal(v, hf[k], k)
    e = "model.layers.1.block_sparse_moe.experts.2.w3.weight" if family == "mixtral" \
        else "model.layers.1.mlp.experts.2.up_proj.weight"
    assert_bits_equal(hf[e], st["decoder.layers.1.mlp.experts.experts.2.linear_fc1.weight_v"], e)
    # SequentialMLP's and TEGroupedMLP's state_dict spellings (fused fc1: gate rows, then up rows)
    p = "decoder.layers.1.mlp.experts."
    for spell in ("local_experts.{e}.linear_fc{n}.weight", "linear_fc{n}.weight{e}"):
        alt = {k: v for k, v in st.items() if not k.startswith(p)}
        for i in range(4):
            alt[p + spell.format(e=i, n=1)] = torch.cat([st[f"{p}experts.{i}.linear_fc1.weight_w"],
                                                         st[f"{p}experts.{i}.linear_fc1.weight_v"]])
            alt[p + spell.format(e=i, n=2)] = st[f"{p}experts.{i}.linear_fc2.weight"]
        got = H.megatron_to_hf(alt, lay)
        assert sorted(got) == sorted(hf)
        for k in hf:
            assert_bits_equal(got[k], hf[k], k)
    back = H.hf_to_megatron(hf, lay, padded_vocab_size=W.PADDED_VOCAB)
    assert sorted(back) == sorted(st)
    for n, t in st.items():
        rows = W.VOCAB if ("embedding" in n or "output_layer" in n) else t.shape[0]
        assert_bits_equal(back[n][:rows], t[:rows], n)
    # TP=2 shards of the experts (fc1 rows, fc2 columns) map to HF rectangles of the same tensors
    name = "decoder.layers.1.mlp.experts.experts.3.linear_fc2.weight"
    spec, local = _tp_split(name, st[name], 2, 1)
    [(h, hspec, t)] = H.megatron_shard_to_hf(name, spec, local, lay)
    assert hspec.offsets == (0, 48) and hspec.global_shape == tuple(hf[h].shape)
    assert_bits_equal(t, hf[h][:, 48:], h)


def _tp_split(name, t, tp, r):
    """Megatron's TP sharding of a whole per-layer tensor: (ShardSpec, local tensor)."""
    col = ("linear_qkv.weight", "linear_fc1.weight_w", "linear_fc1.weight_v", "word_embeddings", "output_layer")
    row = ("linear_proj.weight", "linear_fc2.weight")
    dim = 0 if any(c in name for c in col) else 1 if any(c in name for c in row) else None
    if dim is None:
        return ShardSpec.full(t.shape), t  # replicated
    n = t.shape[dim] // tp
    offs = [0] * t.dim()
    offs[dim] = r * n
    shape = list(t.shape)
    shape[dim] = n
    return ShardSpec.of(t.shape, offs, shape), t.narrow(dim, r * n, n)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hf_shard_mapping_rebuilds_the_full_conversion(tp):
    lay = H.GPTLayout(8, 4, 8, vocab_size=90)  # with tp=4 the last vocab shard (rows 96..127) is all padding
    st = _megatron_state(lay)
    exp = H.megatron_to_hf(st, lay)
    got = {n: torch.full_like(t, float("nan")) for n, t in exp.items()}
    per_rank = []
    for r in range(tp):
        tensors, shards = {}, {}
        for n, t in st.items():
            if "layer_norm" in n or "final_layernorm" in n:
                if r:
                    continue  # replicated: rank 0 publishes it
            shards[n], tensors[n] = _tp_split(n, t, tp, r)
        ht, hs = H.megatron_to_hf_shards(tensors, shards, lay)  # raises if a tensor got two rectangles
        per_rank.append(hs)
        for n, spec in hs.items():
            assert spec.global_shape == tuple(exp[n].shape)
            got[n][ShardSpec.full(spec.global_shape).slices_of(spec)] = ht[n]
        if tp == 4 and r == 3:
            assert "model.embed_tokens.weight" not in hs
    check_cover(per_rank)
    for n in exp:
        assert_bits_equal(got[n], exp[n], n)


def test_hf_shard_mapping_of_a_region_splitting_query_groups():
    """Any row range of linear_qkv meets consecutive q rows, k rows and v rows in HF: one
    rectangle per HF tensor (gathered out of the interleaved rows: a copy)."""
    st = _megatron_state(LAYOUT)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    t = st[name]
    spec = ShardSpec.of(t.shape, (8, 0), (40, 64))  # rows 8..47: half of group 0's q, k0, v0, group 1's q
    out = H.megatron_shard_to_hf(name, spec, t[8:48], LAYOUT)
    assert [(h.split(".")[-2], s.offsets, s.shape) for h, s, _ in out] == [
        ("q_proj", (8, 0), (24, 64)), ("k_proj", (0, 0), (8, 64)), ("v_proj", (0, 0), (8, 64))]
    full = H.megatron_to_hf(st, LAYOUT)
    for h, s, x in out:
        assert_bits_equal(x, full[h][ShardSpec.full(s.global_shape).slices_of(s)], h)
    # two Megatron names for one HF tensor on one rank (local-spec and TE layer-norm names)
    ln = st["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    with pytest.raises(DcrError, match="map to it twice"):
        H.megatron_to_hf_shards({"decoder.layers.0.input_layernorm.weight": ln,
                                 "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": ln}, None, LAYOUT)


def test_check_cover_and_detection_without_megatron_models():
    g = (8, 4)
    ok = [{"w": ShardSpec.of(g, (0, 0), (4, 4))}, {"w": ShardSpec.of(g, (4, 0), (4, 4))}]
    assert check_cover(ok) == {"w": g}
    with pytest.raises(DcrError, match="both hold"):
        check_cover([ok[0], ok[0], ok[1]])
    with pytest.raises(DcrError, match="hold 16 of its 32"):
        check_cover(ok[:1])
    assert not is_megatron_module(torch.nn.Linear(2, 2))
    assert not is_megatron_module([torch.nn.Linear(2, 2)])
    with pytest.raises(DcrError, match="no Megatron model"):
        megatron_snapshot(torch.nn.Linear(2, 2))


def test_stacked_blocks_tile_into_one_rectangle_or_fail_clearly():
    """A stacked key (leading layer axis) on a pipeline stage holding layers 2-3: its per-layer
    blocks become one rectangle at layer offset 2; gate and up rows of a TP-sharded fc1 cannot."""
    from nemo_dcr.integrations.megatron import _Piece, _tile
    full = torch.randn(4, 6, 3).to(torch.bfloat16)
    blocks = [_Piece("w", ShardSpec.of((4, 6, 3), (r, 0, 0), (1, 6, 3)), full[r:r + 1], True) for r in (3, 2)]
    p = _tile("w", blocks)
    assert (p.spec.offsets, p.spec.shape, p.alias) == ((2, 0, 0), (2, 6, 3), False)
    assert_bits_equal(p.tensor, full[2:4], "w")
    fc1 = torch.randn(8, 3)  # TP rank 0 of 2: gate rows 0..1 and up rows 4..5 of [gate; up]
    halves = [_Piece("fc1", ShardSpec.of((8, 3), (o, 0), (2, 3)), fc1[o:o + 2], True) for o in (0, 4)]
    with pytest.raises(DcrError, match="singleton_local_shards"):
        _tile("fc1", halves)
    with pytest.raises(DcrError, match="do not form one rectangle"):
        _tile("w", blocks + blocks[:1])  # the same block twice
