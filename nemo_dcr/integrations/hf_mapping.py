"""Megatron GPT names and layouts (Llama-style, MoE layers too) <-> Hugging Face Llama / Mixtral / Qwen-MoE,
as fixed permutations.

Every conversion here moves rows (slices, concatenations); no value is computed, so a BF16
tensor converts bit-exactly and a delta published in HF coordinates rebuilds exactly the HF
tensors a dense conversion would give.

Megatron -> HF, per layer ``i`` (names as ``megatron_snapshot`` gives them, or as a module's
``state_dict`` has them; a leading ``module.`` is ignored):

==============================================================  ================================================
``embedding.word_embeddings.weight``  [Vpad, h]                   ``model.embed_tokens.weight`` [V, h]: rows >= V
                                                                  are Megatron's vocab padding and are dropped
``output_layer.weight``  [Vpad, h]                                ``lm_head.weight`` [V, h] (same)
``decoder.final_layernorm.weight``                                ``model.norm.weight``
``decoder.layers.i.self_attention.linear_qkv.layer_norm_weight``  ``model.layers.i.input_layernorm.weight``
  (TE fused; the local spec's ``input_layernorm.weight`` too)
``decoder.layers.i.self_attention.linear_qkv.weight``             ``...self_attn.{q,k,v}_proj.weight`` (below)
  (and ``.bias``, Qwen2-style)
``decoder.layers.i.self_attention.linear_proj.weight``            ``...self_attn.o_proj.weight``
``decoder.layers.i.self_attention.{q,k}_layernorm.weight``        ``...self_attn.{q,k}_norm.weight``
``decoder.layers.i.mlp.linear_fc1.layer_norm_weight``             ``model.layers.i.post_attention_layernorm.weight``
  (or ``pre_mlp_layernorm.weight``)
``decoder.layers.i.mlp.linear_fc1.weight`` [2f, h]                ``...mlp.gate_proj.weight`` rows [0, f),
                                                                  ``...mlp.up_proj.weight`` rows [f, 2f)
``decoder.layers.i.mlp.linear_fc1.weight_w`` / ``_v`` [f, h]      ``...mlp.gate_proj.weight`` / ``up_proj.weight``
``decoder.layers.i.mlp.linear_fc2.weight``                        ``...mlp.down_proj.weight``
==============================================================  ================================================

Fused QKV: Megatron's ``linear_qkv`` rows are grouped per query group ``g`` (``G`` groups,
``Q = heads / G`` query heads per group, head dim ``d``): ``[q heads gQ..gQ+Q-1 (Q*d rows) |
k_g (d) | v_g (d)]`` for g = 0..G-1. HF's ``q_proj`` rows are the heads in order, ``k_proj`` /
``v_proj`` rows the groups in order.

Shards: :func:`megatron_shard_to_hf` maps one Megatron block (a ``ShardSpec`` region, e.g. TP
rank r's ``linear_qkv`` rows) to HF rectangles, so every trainer rank can publish in HF
coordinates without gathering. A Megatron TP shard is always one rectangle per HF tensor:
TP rank r holds whole query groups [g0, g1) of ``linear_qkv`` -> ``q_proj`` rows
[g0*Q*d, g1*Q*d), ``k_proj``/``v_proj`` rows [g0*d, g1*d), each contiguous in HF (the q rows
are gathered out of the interleaved block: a copy); ``linear_fc1_w``/``_v`` rows are
``gate_proj``/``up_proj`` rows; vocab-parallel embedding rows are rows (clipped to V, a shard
of padding only maps to nothing); row-parallel ``linear_proj``/``linear_fc2`` columns are
columns. In fact any contiguous row range of ``linear_qkv`` (even one that splits query
groups) meets consecutive HF rows of each of q, k and v, so every Megatron block is at most
one rectangle per HF tensor, and no delta-format change is needed. What
:func:`megatron_to_hf_shards` refuses is two Megatron blocks of one rank landing in the same
HF tensor (e.g. both layer-norm spellings present, or two blocks of a stacked key).

MoE layers (``GPTLayout.moe`` picks the Hugging Face family; expert ``E`` is Megatron's global
expert index, which the snapshot's per-expert keys carry, so expert-parallel ranks map their own
experts without a gather):

========================================================  ===========================  ==========================
Megatron (per layer ``i``)                                 ``mixtral``                  ``qwen`` (Qwen2/3-MoE)
========================================================  ===========================  ==========================
``mlp.router.weight`` [E, h]                               ``block_sparse_moe.gate``    ``mlp.gate``
``mlp.experts.experts.E.linear_fc1.weight_w`` / ``_v``     ``...experts.E.w1`` / ``w3``  ``mlp.experts.E.gate_proj``
  (fused ``.weight``: gate rows, then up rows)                                          / ``up_proj``
``mlp.experts.experts.E.linear_fc2.weight``                ``...experts.E.w2``          ``mlp.experts.E.down_proj``
``mlp.shared_experts.linear_fc1.weight_w`` / ``_v``        (none: an error)             ``mlp.shared_expert.gate_proj``
  / ``linear_fc2.weight``                                                               / ``up_proj`` / ``down_proj``
``mlp.shared_experts.gate_weight`` [1, h]                  (none)                       ``mlp.shared_expert_gate``
``pre_mlp_layernorm.weight``                               ``post_attention_layernorm``  (same)
========================================================  ===========================  ==========================

(every HF name under ``model.layers.i.``, ending in ``.weight``). A module's ``state_dict``
spellings of the experts map the same way: SequentialMLP's ``mlp.experts.local_experts.E.`` and
TEGroupedMLP's ``mlp.experts.linear_fc1.weightE``, whose ``E`` is the *local* index (the global one
only without expert parallelism). Router and expert shards are rows/columns like the dense MLP's.

Not covered: stacked layouts (``singleton_local_shards=False``: convert per-layer names), the
legacy GroupedMLP's ``weight1``/``weight2`` (all experts in one tensor), the router's
``expert_bias`` (a buffer, not published), biases other than QKV's.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nemo_dcr.errors import DcrError
from nemo_dcr.state.index_map import ShardSpec


@dataclass(frozen=True)
class GPTLayout:
    """What the permutations depend on."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # the true (HF) vocabulary; Megatron's rows beyond it are padding
    #: the Hugging Face naming of MoE layers: ``mixtral`` (``block_sparse_moe.gate``,
    #: ``block_sparse_moe.experts.E.w1/w3/w2``) or ``qwen`` (Qwen2-MoE / Qwen3-MoE: ``mlp.gate``,
    #: ``mlp.experts.E.gate_proj/up_proj/down_proj``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``)
    moe: str = "mixtral"

    def __post_init__(self):
        if self.moe not in _MOE:
            raise DcrError(f"GPTLayout.moe must be one of {sorted(_MOE)}, not {self.moe!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise DcrError(f"{self.num_attention_heads} heads do not split into {self.num_query_groups} groups")

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_hf(cls, cfg) -> GPTLayout:
        """From a ``transformers`` ``LlamaConfig`` (or any config with the same fields)."""
        heads = cfg.num_attention_heads
        groups = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        moe = "qwen" if str(getattr(cfg, "model_type", "")).startswith("qwen") else "mixtral"
        return cls(heads, groups, head_dim, cfg.vocab_size, moe)

    @classmethod
    def from_megatron(cls, cfg, vocab_size: int, moe: str = "mixtral") -> GPTLayout:
        """From a megatron-core ``TransformerConfig``, the true vocabulary size and the HF MoE naming."""
        heads = cfg.num_attention_heads
        groups = getattr(cfg, "num_query_groups", None) or heads
        head_dim = getattr(cfg, "kv_channels", None) or cfg.hidden_size // heads
        return cls(heads, groups, head_dim, int(vocab_size), moe)


def as_layout(config, vocab_size: int | None = None) -> GPTLayout:
    """A :class:`GPTLayout` from itself, a dict of its fields, an HF config or a Megatron
    ``TransformerConfig`` (which needs ``vocab_size``)."""
    if isinstance(config, GPTLayout):
        return config
    if isinstance(config, Mapping):
        return GPTLayout(**config)
    if hasattr(config, "num_key_value_heads") or hasattr(config, "vocab_size"):
        return GPTLayout.from_hf(config)
    if vocab_size is None:
        raise DcrError("a Megatron TransformerConfig needs the true vocab_size")
    return GPTLayout.from_megatron(config, vocab_size)


# ----------------------------------------------------------------------------- name rules

_L = r"decoder\.layers\.(?P<L>\d+)\."
_HL = "model.layers.{L}."


def _expert(fc: int, suffix: str = "") -> str:
    """One expert's ``linear_fc<fc>.weight<suffix>`` in Megatron's three spellings (the expert
    index as group E, E2 or E3)."""
    w = rf"linear_fc{fc}\.weight{suffix}"
    return (rf"mlp\.experts\.(?:experts\.(?P<E>\d+)\.{w}|local_experts\.(?P<E2>\d+)\.{w}"
            rf"|linear_fc{fc}\.weight(?P<E3>\d+){suffix})")


# (megatron pattern, kind, HF name(s), glu parts); kind: same | vocab | qkv | glu. ``{part}`` in an
# HF name is a qkv/glu part.
_DENSE = [
    (r"embedding\.word_embeddings\.weight", "vocab", "model.embed_tokens.weight"),
    (r"output_layer\.weight", "vocab", "lm_head.weight"),
    (r"decoder\.final_layernorm\.weight", "same", "model.norm.weight"),
    (_L + r"self_attention\.linear_qkv\.layer_norm_weight", "same", _HL + "input_layernorm.weight"),
    (_L + r"input_layernorm\.weight", "same", _HL + "input_layernorm.weight"),
    (_L + r"self_attention\.linear_qkv\.weight", "qkv", _HL + "self_attn.{part}_proj.weight"),
    (_L + r"self_attention\.linear_qkv\.bias", "qkv", _HL + "self_attn.{part}_proj.bias"),
    (_L + r"self_attention\.linear_proj\.weight", "same", _HL + "self_attn.o_proj.weight"),
    (_L + r"self_attention\.q_layernorm\.weight", "same", _HL + "self_attn.q_norm.weight"),
    (_L + r"self_attention\.k_layernorm\.weight", "same", _HL + "self_attn.k_norm.weight"),
    (_L + r"mlp\.linear_fc1\.layer_norm_weight", "same", _HL + "post_attention_layernorm.weight"),
    (_L + r"pre_mlp_layernorm\.weight", "same", _HL + "post_attention_layernorm.weight"),
    (_L + r"mlp\.linear_fc1\.weight", "glu", _HL + "mlp.{part}_proj.weight", ("gate", "up")),
    (_L + r"mlp\.linear_fc1\.weight_w", "same", _HL + "mlp.gate_proj.weight"),
    (_L + r"mlp\.linear_fc1\.weight_v", "same", _HL + "mlp.up_proj.weight"),
    (_L + r"mlp\.linear_fc2\.weight", "same", _HL + "mlp.down_proj.weight"),
]


def _routed(router: str, expert: str, parts: tuple[str, str], down: str) -> list:
    """The router and the experts of an MoE layer, in one family's HF names (``expert`` has
    ``{E}`` and ``{part}``: the gate/up parts, or ``down``)."""
    gate, up = parts
    return [
        (_L + r"mlp\.router\.weight", "same", _HL + router),
        (_L + _expert(1), "glu", _HL + expert, parts),
        (_L + _expert(1, "_w"), "same", _HL + expert.replace("{part}", gate)),
        (_L + _expert(1, "_v"), "same", _HL + expert.replace("{part}", up)),
        (_L + _expert(2), "same", _HL + expert.replace("{part}", down)),
    ]


#: MoE layers, per Hugging Face family (``GPTLayout.moe``): the router, every expert's gated MLP
#: (Megatron's per-expert keys ``mlp.experts.experts.E.linear_fc1.weight_w`` as the snapshot gives
#: them with the global expert index, SequentialMLP's ``mlp.experts.local_experts.E.`` and
#: TEGroupedMLP's ``mlp.experts.linear_fc1.weightE`` as a module's ``state_dict`` has them, where
#: E is the local index: the global one without expert parallelism), and Qwen's shared expert.
_MOE = {
    "mixtral": _routed("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{E}.{part}.weight",
                       ("w1", "w3"), "w2"),
    "qwen": _routed("mlp.gate.weight", "mlp.experts.{E}.{part}_proj.weight", ("gate", "up"), "down") + [
        (_L + r"mlp\.shared_experts\.linear_fc1\.weight", "glu", _HL + "mlp.shared_expert.{part}_proj.weight",
         ("gate", "up")),
        (_L + r"mlp\.shared_experts\.linear_fc1\.weight_w", "same", _HL + "mlp.shared_expert.gate_proj.weight"),
        (_L + r"mlp\.shared_experts\.linear_fc1\.weight_v", "same", _HL + "mlp.shared_expert.up_proj.weight"),
        (_L + r"mlp\.shared_experts\.linear_fc2\.weight", "same", _HL + "mlp.shared_expert.down_proj.weight"),
        (_L + r"mlp\.shared_experts\.gate_weight", "same", _HL + "mlp.shared_expert_gate.weight"),
    ],
}
MOE_FAMILIES = tuple(_MOE)
_COMPILED: dict[str, list] = {}


def _rules(moe: str) -> list:
    if moe not in _COMPILED:
        _COMPILED[moe] = [(re.compile(r[0] + r"\Z"), r[1], r[2],
                           r[3] if len(r) > 3 else ("q", "k", "v") if r[1] == "qkv" else None)
                          for r in _DENSE + _MOE[moe]]
    return _COMPILED[moe]


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _rule(name: str, lay: GPTLayout):
    """(kind, HF name with ``{part}`` left for qkv/glu, the parts) of a Megatron name."""
    n = _strip(name)
    for pat, kind, hf, parts in _rules(lay.moe):
        m = pat.match(n)
        if m:
            g = m.groupdict()
            e = next((g[k] for k in ("E", "E2", "E3") if g.get(k) is not None), None)
            return kind, hf.format(L=g.get("L"), E=e, part="{part}"), parts
    raise DcrError(f"{name}: no Hugging Face counterpart in the {lay.moe!r} naming (stacked-layer, "
                   "shared-expert outside Qwen, or unknown key)")


def _segments(kind: str, hf: str, parts, rows: int, lay: GPTLayout) -> tuple[list[tuple], dict[str, int]]:
    """The row permutation of one Megatron tensor with ``rows`` rows (dim 0):
    ``[(hf_name, megatron_row, hf_row, length)]`` and ``{hf_name: HF rows}``."""
    if kind == "same":
        return [(hf, 0, 0, rows)], {hf: rows}
    if kind == "vocab":
        if rows < lay.vocab_size:
            raise DcrError(f"{hf}: Megatron has {rows} vocabulary rows, "
                           f"fewer than the true vocab_size {lay.vocab_size}")
        return [(hf, 0, 0, lay.vocab_size)], {hf: lay.vocab_size}
    if kind == "glu":
        if rows % 2:
            raise DcrError(f"{hf}: a gated linear_fc1 needs an even number of rows, not {rows}")
        f = rows // 2
        gate, up = (hf.format(part=p) for p in parts)
        return [(gate, 0, 0, f), (up, f, 0, f)], {gate: f, up: f}
    if kind == "qkv":
        G, Q, d = lay.num_query_groups, lay.q_per_group, lay.head_dim
        if rows != G * (Q + 2) * d:
            raise DcrError(f"{hf.format(part='qkv')}: {rows} rows, but {G} query groups of {Q} heads (+k, v) of "
                           f"dim {d} make {G * (Q + 2) * d}")
        q, k, v = (hf.format(part=p) for p in parts)
        seg = []
        for g in range(G):
            base = g * (Q + 2) * d
            seg += [(q, base, g * Q * d, Q * d), (k, base + Q * d, g * d, d), (v, base + (Q + 1) * d, g * d, d)]
        return seg, {q: G * Q * d, k: G * d, v: G * d}
    raise AssertionError(kind)


def hf_names(name: str, global_shape, config) -> dict[str, tuple]:
    """``{hf_name: HF global shape}`` of the HF tensors a Megatron tensor maps to."""
    lay = as_layout(config)
    kind, hf, parts = _rule(name, lay)
    _, rows = _segments(kind, hf, parts, int(global_shape[0]), lay)
    return {h: (r,) + tuple(global_shape[1:]) for h, r in rows.items()}


# ----------------------------------------------------------------------------- shards

def megatron_shard_to_hf(name: str, spec: ShardSpec | None, tensor: torch.Tensor,
                         config) -> list[tuple[str, ShardSpec, torch.Tensor]]:
    """The HF rectangles of one Megatron block: ``[(hf_name, ShardSpec in the HF tensor,
    tensor)]``. ``spec`` None: ``tensor`` is the whole Megatron tensor. A rectangle's tensor is
    a view of ``tensor`` when its rows are contiguous there, else a copy (``torch.cat``). Rows
    of vocabulary padding map to nothing. (Rows that land in one HF tensor are merged into a
    rectangle wherever their HF rows are consecutive, which for the row permutations here is
    always: each HF tensor appears at most once.)"""
    lay = as_layout(config)
    if spec is None:
        spec = ShardSpec.full(tensor.shape)
    if tuple(tensor.shape) != spec.shape:
        raise DcrError(f"{name}: tensor shape {tuple(tensor.shape)} differs from its shard shape {spec.shape}")
    if len(spec.global_shape) == 0:
        raise DcrError(f"{name}: a 0-dim tensor has no Hugging Face counterpart")
    kind, hf, parts = _rule(name, lay)
    segs, hf_rows = _segments(kind, hf, parts, spec.global_shape[0], lay)
    a, n = spec.offsets[0], spec.shape[0]
    pieces: dict[str, list[tuple]] = {}
    for h, ms, hs, ln in segs:
        s, e = max(ms, a), min(ms + ln, a + n)
        if s < e:
            pieces.setdefault(h, []).append((hs + s - ms, s - a, e - s))  # (hf row, local row, rows)
    out = []
    for h in sorted(pieces, key=lambda x: list(hf_rows).index(x)):
        runs: list[list[tuple]] = []
        for p in sorted(pieces[h]):
            if runs and runs[-1][-1][0] + runs[-1][-1][2] == p[0]:
                runs[-1].append(p)
            else:
                runs.append([p])
        for run in runs:
            rows = sum(p[2] for p in run)
            if len(run) == 1:
                t = tensor.narrow(0, run[0][1], rows)
            elif all(q[1] == p[1] + p[2] for p, q in zip(run, run[1:])):
                t = tensor.narrow(0, run[0][1], rows)
            else:
                t = torch.cat([tensor.narrow(0, p[1], p[2]) for p in run], 0)
            hspec = ShardSpec.of((hf_rows[h],) + tuple(spec.global_shape[1:]), (run[0][0],) + tuple(spec.offsets[1:]),
                                 (rows,) + tuple(spec.shape[1:]))
            out.append((h, hspec, t))
    return out


def megatron_to_hf_shards(tensors: Mapping[str, torch.Tensor], shards: Mapping[str, ShardSpec] | None,
                          config) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """One rank's Megatron blocks (e.g. ``megatron_snapshot``'s) as HF ``(tensors, shards)``,
    ready for ``Publisher.publish``. Raises ``DcrError`` if an HF tensor would get two
    rectangles from this rank (one delta entry per tensor and rank) or a name has no HF
    counterpart."""
    shards = shards or {}
    out_t: dict[str, torch.Tensor] = {}
    out_s: dict[str, ShardSpec] = {}
    src: dict[str, str] = {}
    for name in sorted(tensors):
        for h, hspec, t in megatron_shard_to_hf(name, shards.get(name), tensors[name], config):
            if h in out_t:
                raise DcrError(f"{h}: this rank's blocks map to it twice ({src[h]} -> {out_s[h].offsets}+"
                               f"{out_s[h].shape}, {name} -> {hspec.offsets}+{hspec.shape}); a delta has one entry "
                               "per tensor and rank")
            out_t[h], out_s[h], src[h] = t, hspec, name
    return out_t, out_s


def megatron_to_hf(tensors_full: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Whole Megatron tensors -> whole HF tensors (views of the inputs where rows are
    contiguous, copies where QKV rows are regrouped). For tests and single-process use."""
    t, s = megatron_to_hf_shards(tensors_full, None, config)
    for h, spec in s.items():
        if not spec.is_full:
            raise DcrError(f"{h}: only {spec.shape} of {spec.global_shape} is in the input")
    return t


def hf_to_megatron(hf_tensors: Mapping[str, torch.Tensor], config, *, padded_vocab_size: int | None = None,
                   split_fc1: bool = True, te_layernorm_names: bool = True) -> dict[str, torch.Tensor]:
    """The inverse of :func:`megatron_to_hf` for whole tensors (vocab padding rows are zero).
    ``split_fc1``: ``linear_fc1.weight_w``/``_v`` (the snapshot's per-layer names) or the fused
    ``linear_fc1.weight``; ``te_layernorm_names``: ``linear_qkv.layer_norm_weight`` /
    ``linear_fc1.layer_norm_weight`` (canonical) or ``input_layernorm`` / ``pre_mlp_layernorm``.
    MoE layers (HF experts in the layout's ``moe`` naming) get Megatron's per-expert snapshot
    names (``mlp.experts.experts.E.linear_fc1.weight_w``, ...), ``mlp.router.weight``, the shared
    expert's, and ``pre_mlp_layernorm.weight`` (an MoE layer has no ``linear_fc1`` to fuse it into)."""
    lay = as_layout(config)
    pv = padded_vocab_size or lay.vocab_size
    layers = sorted({int(m.group(1)) for k in hf_tensors for m in [re.match(r"model\.layers\.(\d+)\.", k)] if m})
    moe_block = r"block_sparse_moe" if lay.moe == "mixtral" else r"mlp"
    expert_at = r"model\.layers\.(\d+)\." + moe_block + r"\.experts\.(\d+)\."
    experts: dict[int, set] = {}
    for k in hf_tensors:
        m = re.match(expert_at, k)
        if m:
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    fc1 = ["linear_fc1.weight_w", "linear_fc1.weight_v"] if split_fc1 else ["linear_fc1.weight"]
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    for i in layers:
        p = f"decoder.layers.{i}."
        moe = i in experts
        names += [p + ("self_attention.linear_qkv.layer_norm_weight" if te_layernorm_names
                       else "input_layernorm.weight"),
                  p + "self_attention.linear_qkv.weight", p + "self_attention.linear_qkv.bias",
                  p + "self_attention.linear_proj.weight", p + "self_attention.q_layernorm.weight",
                  p + "self_attention.k_layernorm.weight",
                  p + ("mlp.linear_fc1.layer_norm_weight" if te_layernorm_names and not moe
                       else "pre_mlp_layernorm.weight")]
        if moe:
            names.append(p + "mlp.router.weight")
            for e in sorted(experts[i]):
                names += [f"{p}mlp.experts.experts.{e}.{w}" for w in fc1 + ["linear_fc2.weight"]]
            names += [f"{p}mlp.shared_experts.{w}" for w in fc1 + ["linear_fc2.weight", "gate_weight"]]
        else:
            names += [f"{p}mlp.{w}" for w in fc1 + ["linear_fc2.weight"]]
    out, used = {}, set()
    for name in names:
        try:
            kind, hf, names_of = _rule(name, lay)
        except DcrError:
            continue  # (a shared expert in the Mixtral naming: no HF tensor can need it)
        parts = [hf.format(part=x) for x in names_of] if names_of else [hf]
        have = [p in hf_tensors for p in parts]
        if not any(have):
            continue
        if not all(have):
            raise DcrError(f"{name}: needs {parts}, missing {[p for p, h in zip(parts, have) if not h]}")
        ref = hf_tensors[parts[0]]
        rows = pv if kind == "vocab" else sum(hf_tensors[p].shape[0] for p in parts)
        segs, hf_rows = _segments(kind, hf, names_of, rows, lay)
        for p in parts:
            if hf_tensors[p].shape[0] != hf_rows[p]:
                raise DcrError(f"{p}: {hf_tensors[p].shape[0]} rows, expected {hf_rows[p]}")
        t = torch.zeros((rows,) + tuple(ref.shape[1:]), dtype=ref.dtype, device=ref.device)
        for h, ms, hs, ln in segs:
            t[ms:ms + ln] = hf_tensors[h][hs:hs + ln]
        out[name] = t
        used.update(parts)
    left = sorted(set(hf_tensors) - used)
    if left:
        raise DcrError(f"no Megatron counterpart for {left[:5]}{' ...' if len(left) > 5 else ''}")
    return out


__all__ = ["MOE_FAMILIES", "GPTLayout", "as_layout", "hf_names", "megatron_shard_to_hf", "megatron_to_hf_shards",
           "megatron_to_hf", "hf_to_megatron"]
