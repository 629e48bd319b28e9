"""The one name map between Hugging Face tensors and our global tensors, with the layout rules.

Each :class:`Entry` ties one of our global tensors to the HF tensor(s) it is made of and carries the two
pure data movements between them (no arithmetic, so round trips are bitwise). Both directions, every loader
and every saver go through :func:`build_entries`; docs/convert.md documents the rules:

* fused QKV: ours is ``num_query_groups`` blocks of ``[q heads of the group; k; v]`` (``kv_channels`` rows
  each) — HF Llama keeps separate ``q_proj``/``k_proj``/``v_proj``; HF GPT-2 one ``c_attn`` ``[q | k | v]``;
* SwiGLU ``linear_fc1`` is ``[gate; up]``;
* RoPE is rotate-half on both sides: no permutation of q/k rows;
* GPT-2's ``Conv1D`` stores ``[in, out]``: transposed to our ``[out, in]``;
* vocabulary rows: HF has the true vocabulary; ours is padded with zero rows to a multiple of
  ``make_vocab_size_divisible_by * TP`` (added on import, dropped on export);
* tied embeddings: no ``output_layer.weight`` and no ``lm_head.weight``;
* experts (Mixtral / Qwen-MoE): ours stacks all experts, ``experts.linear_fc1.weight`` ``[E, 2F, h]`` (each
  expert's rows ``[gate; up]``) and ``experts.linear_fc2.weight`` ``[E, h, F]``. HF files hold them either per
  expert (:data:`PER_EXPERT`, published checkpoints and what ``save_pretrained`` writes: Mixtral
  ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen ``mlp.experts.{e}.gate_proj/up_proj/down_proj``) or fused
  (:data:`FUSED`, transformers 5's in-memory modules: ``mlp.experts.gate_up_proj`` ``[E, 2F, h]`` and
  ``mlp.experts.down_proj`` ``[E, h, F]``, our layout exactly).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model.moe.layer import is_moe_layer
from .hf_config import FAMILIES, GPT2, MIXTRAL, QWEN2_MOE, ConvertError
from .hf_deepseek import DEEPSEEK_V3, mtp_hf_prefix, mtp_layer_is_moe

WORD = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
VOCAB_TENSORS = (WORD, OUTPUT)
# HF tensors that are buffers, not weights (older GPT-2 files store the causal mask): skipped on import.
IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
# How a HF MoE file stores its experts (see the module docstring).
PER_EXPERT, FUSED = "per_expert", "fused"
_FUSED_SUFFIX = ".experts.gate_up_proj"


def expert_layout(names) -> str:
    """:data:`FUSED` when HF tensor ``names`` hold transformers 5's fused expert tensors, else :data:`PER_EXPERT`."""
    return FUSED if any(n.endswith(_FUSED_SUFFIX) for n in names) else PER_EXPERT


@dataclass(frozen=True)
class Entry:
    ours: str
    hf: tuple[str, ...]
    to_ours: Callable[..., torch.Tensor]  # HF tensors (in ``hf`` order) -> our global tensor
    to_hf: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # our global tensor -> HF tensors


# ---- layout rules -------------------------------------------------------------------------------------------

def qkv_to_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Separate q ``[heads*d, ...]``, k/v ``[groups*d, ...]`` -> fused ``[groups * (heads/groups + 2) * d, ...]``:
    group ``g`` holds query heads ``g*heads/groups ...`` then key head ``g`` then value head ``g``."""
    rest = q.shape[1:]
    qg = q.reshape(groups, -1, *rest)
    kg = k.reshape(groups, -1, *rest)
    vg = v.reshape(groups, -1, *rest)
    return torch.cat((qg, kg, vg), dim=1).reshape(-1, *rest)


def qkv_from_ours(t: torch.Tensor, heads: int, groups: int, d: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`qkv_to_ours`: fused -> (q, k, v)."""
    rest = t.shape[1:]
    g = t.reshape(groups, (heads // groups + 2) * d, *rest)
    q, k, v = g.split([heads // groups * d, d, d], dim=1)
    return tuple(x.reshape(-1, *rest).contiguous() for x in (q, k, v))


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


def pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows``."""
    if t.size(0) == rows:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.size(0)] = t
    return out


def _vocab_entry(ours: str, hf: str, true_vocab: int, padded: int) -> Entry:
    def to_ours(x):
        if x.size(0) < true_vocab:
            raise ConvertError(f"{hf} has {x.size(0)} rows, fewer than the vocabulary size {true_vocab}")
        return pad_vocab(x[:true_vocab], padded)

    def to_hf(x):
        if x.size(0) < true_vocab:
            raise ConvertError(f"vocabulary size {true_vocab} is larger than the padded vocabulary of {ours} "
                               f"({x.size(0)} rows); pass --true-vocab-size <= {x.size(0)}")
        return (x[:true_vocab].contiguous(),)

    return Entry(ours, (hf,), to_ours, to_hf)


def _same(ours: str, hf: str) -> Entry:
    return Entry(ours, (hf,), lambda x: x, lambda x: (x,))


def _transposed(ours: str, hf: str) -> Entry:
    return Entry(ours, (hf,), _t, lambda x: (_t(x),))


def _gpt2_qkv(ours: str, hf: str, kind: str, heads: int, groups: int, d: int) -> Entry:
    """GPT-2 ``c_attn``: Conv1D weight ``[h, 3h]`` (bias ``[3h]``), columns ``[q heads | k heads | v heads]``."""
    def to_ours(x):
        q, k, v = (x.t() if kind == "weight" else x).chunk(3, dim=0)
        return qkv_to_ours(q, k, v, groups)

    def to_hf(x):
        fused = torch.cat(qkv_from_ours(x, heads, groups, d), dim=0)
        return (_t(fused) if kind == "weight" else fused,)

    return Entry(ours, (hf,), to_ours, to_hf)


def _gate_up(ours: str, gate: str, up: str, kind: str = "weight") -> Entry:
    """SwiGLU ``linear_fc1`` = ``[gate_proj; up_proj]`` along rows."""
    return Entry(ours, (f"{gate}.{kind}", f"{up}.{kind}"), lambda g, u: torch.cat((g, u), dim=0),
                 lambda x: tuple(c.contiguous() for c in x.chunk(2, dim=0)))


def _stacked_experts(ours: str, names: list[tuple[str, ...]]) -> Entry:
    """Our ``[E, rows, cols]`` expert tensor from per-expert HF tensors: ``names[e]`` are expert ``e``'s pieces,
    concatenated along rows (``(gate, up)`` for fc1, ``(down,)`` for fc2)."""
    per = len(names[0])

    def to_ours(*ts):
        return torch.stack([torch.cat(ts[e * per:(e + 1) * per], dim=0) for e in range(len(names))])

    def to_hf(x):
        return tuple(c.contiguous() for expert in x.unbind(0) for c in expert.chunk(per, dim=0))

    return Entry(ours, tuple(n for group in names for n in group), to_ours, to_hf)


def _moe_entries(cfg: ModelConfig, arch: str, o: str, h: str, layout: str) -> list[Entry]:
    """One MoE layer: router, experts (in ``layout``) and, for Qwen2-MoE, the gated shared expert."""
    mixtral_files = arch == MIXTRAL and layout == PER_EXPERT
    m = f"{h}block_sparse_moe." if mixtral_files else f"{h}mlp."
    out = [_same(f"{o}mlp.router.weight", f"{m}gate.weight")]
    if layout == FUSED:
        out += [_same(f"{o}mlp.experts.linear_fc1.weight", f"{m}experts.gate_up_proj"),
                _same(f"{o}mlp.experts.linear_fc2.weight", f"{m}experts.down_proj")]
    else:
        gate, up, down = ("w1", "w3", "w2") if arch == MIXTRAL else ("gate_proj", "up_proj", "down_proj")
        experts = range(cfg.moe.num_experts)
        out += [_stacked_experts(f"{o}mlp.experts.linear_fc1.weight",
                                 [(f"{m}experts.{e}.{gate}.weight", f"{m}experts.{e}.{up}.weight") for e in experts]),
                _stacked_experts(f"{o}mlp.experts.linear_fc2.weight",
                                 [(f"{m}experts.{e}.{down}.weight",) for e in experts])]
    if arch == DEEPSEEK_V3:
        s = f"{m}shared_experts."
        out.append(_same(f"{o}mlp.router.expert_bias", f"{m}gate.e_score_correction_bias"))
        if cfg.moe.moe_shared_expert_intermediate_size:
            out += [_gate_up(f"{o}mlp.shared_experts.linear_fc1.weight", f"{s}gate_proj", f"{s}up_proj"),
                    _same(f"{o}mlp.shared_experts.linear_fc2.weight", f"{s}down_proj.weight")]
    if arch == QWEN2_MOE:
        s = f"{m}shared_expert."
        out += [_gate_up(f"{o}mlp.shared_experts.linear_fc1.weight", f"{s}gate_proj", f"{s}up_proj"),
                _same(f"{o}mlp.shared_experts.linear_fc2.weight", f"{s}down_proj.weight"),
                _same(f"{o}mlp.shared_experts.gate_weight", f"{m}shared_expert_gate.weight")]
    return out


def _mla_entries(cfg: ModelConfig, o: str, h: str) -> list[Entry]:
    """DeepSeek-V3's multi-latent attention: the same tensors under transformers' names (RoPE rows in DeepSeek's
    interleaved pair order both sides, ``rope_interleave`` true)."""
    names = [("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"), ("linear_q_up_proj", "q_b_proj")] \
        if cfg.attention.q_lora_rank is not None else [("linear_q_proj", "q_proj")]
    names += [("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
              ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj")]
    return [_same(f"{o}{ours}.weight", f"{h}{theirs}.weight") for ours, theirs in names]


def _mla_shapes(cfg: ModelConfig, o: str) -> dict[str, tuple[int, ...]]:
    a, h, n = cfg.attention, cfg.hidden_size, cfg.num_attention_heads
    q_head = a.qk_head_dim + a.qk_pos_emb_head_dim
    out = {f"{o}linear_kv_down_proj.weight": (a.kv_lora_rank + a.qk_pos_emb_head_dim, h),
           f"{o}linear_kv_up_proj.weight": (n * (a.qk_head_dim + a.v_head_dim), a.kv_lora_rank),
           f"{o}linear_proj.weight": (h, n * a.v_head_dim)}
    if a.q_lora_rank is None:
        out[f"{o}linear_q_proj.weight"] = (n * q_head, h)
    else:
        out.update({f"{o}linear_q_down_proj.weight": (a.q_lora_rank, h),
                    f"{o}linear_q_up_proj.weight": (n * q_head, a.q_lora_rank)})
    if a.qk_layernorm:
        out[f"{o}kv_layernorm.weight"] = (a.kv_lora_rank,)
        if a.q_lora_rank is not None:
            out[f"{o}q_layernorm.weight"] = (a.q_lora_rank,)
    return out


# ---- the map ------------------------------------------------------------------------------------------------

def build_entries(cfg: ModelConfig, arch: str, padded_vocab: int, prefix: str | None = None,
                  experts: str = PER_EXPERT) -> list[Entry]:
    """Every tensor of the model in file order (embedding, layers 0.., final norm, output layer).

    ``padded_vocab``: rows of our word embedding / output layer. ``prefix``: HF GPT-2 name prefix
    (``"transformer."``, or ``""`` for old files without it); Llama-family names are fixed. ``experts``: the HF
    expert layout of MoE models, :data:`PER_EXPERT` or :data:`FUSED`."""
    V, heads, groups, d = cfg.vocab_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    out: list[Entry] = []
    if arch == GPT2:
        p = "transformer." if prefix is None else prefix
        out.append(_vocab_entry(WORD, f"{p}wte.weight", V, padded_vocab))
        out.append(_same("embedding.position_embeddings.weight", f"{p}wpe.weight"))
        for i in range(cfg.num_layers):
            o, h = f"decoder.layers.{i}.", f"{p}h.{i}."
            for ln_o, ln_h in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                out += [_same(f"{o}{ln_o}.weight", f"{h}{ln_h}.weight"), _same(f"{o}{ln_o}.bias", f"{h}{ln_h}.bias")]
            for kind in ("weight", "bias"):
                out.append(_gpt2_qkv(f"{o}self_attention.linear_qkv.{kind}", f"{h}attn.c_attn.{kind}", kind,
                                     heads, groups, d))
            out += [_transposed(f"{o}self_attention.linear_proj.weight", f"{h}attn.c_proj.weight"),
                    _same(f"{o}self_attention.linear_proj.bias", f"{h}attn.c_proj.bias"),
                    _transposed(f"{o}mlp.linear_fc1.weight", f"{h}mlp.c_fc.weight"),
                    _same(f"{o}mlp.linear_fc1.bias", f"{h}mlp.c_fc.bias"),
                    _transposed(f"{o}mlp.linear_fc2.weight", f"{h}mlp.c_proj.weight"),
                    _same(f"{o}mlp.linear_fc2.bias", f"{h}mlp.c_proj.bias")]
        out += [_same("decoder.final_layernorm.weight", f"{p}ln_f.weight"),
                _same("decoder.final_layernorm.bias", f"{p}ln_f.bias")]
    elif arch in FAMILIES or arch == DEEPSEEK_V3:  # Llama-flavored families and DeepSeek-V3: one table
        out.append(_vocab_entry(WORD, "model.embed_tokens.weight", V, padded_vocab))
        for i in range(cfg.num_layers):
            out += _llama_layer(cfg, arch, f"decoder.layers.{i}.", f"model.layers.{i}.", is_moe_layer(cfg, i),
                                experts)
        out.append(_same("decoder.final_layernorm.weight", "model.norm.weight"))
    else:
        raise ConvertError(f"unknown architecture {arch!r}")
    if cfg.untie_embeddings_and_output_weights:
        out.append(_vocab_entry(OUTPUT, "lm_head.weight", V, padded_vocab))
    for k in range(cfg.mtp_num_layers or 0):  # DeepSeek-V3's multi-token-prediction layers (hf_deepseek.py)
        if arch != DEEPSEEK_V3:
            raise ConvertError(f"multi-token prediction (--mtp-num-layers) converts only for {DEEPSEEK_V3}, not "
                               f"{arch}")
        o, h = f"mtp.layers.{k}.", mtp_hf_prefix(cfg, k)
        out += [_same(f"{o}{x}.weight", f"{h}{x}.weight") for x in ("enorm", "hnorm", "eh_proj")]
        out += _llama_layer(cfg, arch, f"{o}mtp_model_layer.", h, mtp_layer_is_moe(cfg), experts)
        out.append(_same(f"{o}final_layernorm.weight", f"{h}shared_head.norm.weight"))
    return out


def _llama_layer(cfg: ModelConfig, arch: str, o: str, h: str, moe: bool, experts: str) -> list[Entry]:
    """One transformer layer of the Llama-flavored families and DeepSeek-V3 (ours under ``o``, HF's under
    ``h``)."""
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    out = [_same(f"{o}input_layernorm.weight", f"{h}input_layernorm.weight")]
    if cfg.attention.multi_latent_attention:
        out += _mla_entries(cfg, f"{o}self_attention.", f"{h}self_attn.")
    for kind in (("weight", "bias") if cfg.qkv_bias else ("weight",)) if not cfg.attention.multi_latent_attention \
            else ():
        out.append(Entry(f"{o}self_attention.linear_qkv.{kind}",
                         tuple(f"{h}self_attn.{x}_proj.{kind}" for x in "qkv"),
                         lambda q, k, v: qkv_to_ours(q, k, v, groups),
                         lambda x: qkv_from_ours(x, heads, groups, d)))
    if cfg.attention.qk_layernorm and arch != DEEPSEEK_V3:  # Qwen3 / Qwen3-MoE: per-head q/k RMSNorm
        out += [_same(f"{o}self_attention.{x}_layernorm.weight", f"{h}self_attn.{x}_norm.weight") for x in "qk"]
    for kind in kinds if arch != DEEPSEEK_V3 else ():
        out.append(_same(f"{o}self_attention.linear_proj.{kind}", f"{h}self_attn.o_proj.{kind}"))
    out.append(_same(f"{o}pre_mlp_layernorm.weight", f"{h}post_attention_layernorm.weight"))
    if moe:
        return out + _moe_entries(cfg, arch, o, h, experts)
    out += [_gate_up(f"{o}mlp.linear_fc1.{kind}", f"{h}mlp.gate_proj", f"{h}mlp.up_proj", kind) for kind in kinds]
    return out + [_same(f"{o}mlp.linear_fc2.{kind}", f"{h}mlp.down_proj.{kind}") for kind in kinds]


def expected_global_shapes(cfg: ModelConfig, tp: int = 1) -> dict[str, tuple[int, ...]]:
    """Our global parameter shapes (padded vocabulary at ``tp``); tests check them against the model built
    on the meta device (``GPTModel.named_global_parameters``)."""
    h = cfg.hidden_size
    norm_bias = cfg.normalization == "LayerNorm"
    out = {WORD: (cfg.padded_vocab_size(tp), h)}
    if cfg.attention.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = (cfg.max_position_embeddings, h)
    for i in range(cfg.num_layers):
        out.update(_layer_shapes(cfg, f"decoder.layers.{i}.", is_moe_layer(cfg, i)))
    out["decoder.final_layernorm.weight"] = (h,)
    if norm_bias:
        out["decoder.final_layernorm.bias"] = (h,)
    if cfg.untie_embeddings_and_output_weights:
        out[OUTPUT] = (cfg.padded_vocab_size(tp), h)
    for k in range(cfg.mtp_num_layers or 0):  # model/mtp.py: norms of RMSNorm models (no bias)
        o = f"mtp.layers.{k}."
        out.update({f"{o}enorm.weight": (h,), f"{o}hnorm.weight": (h,), f"{o}eh_proj.weight": (h, 2 * h)})
        out.update(_layer_shapes(cfg, f"{o}mtp_model_layer.", mtp_layer_is_moe(cfg)))
        out[f"{o}final_layernorm.weight"] = (h,)
    return out


def _layer_shapes(cfg: ModelConfig, o: str, moe: bool) -> dict[str, tuple[int, ...]]:
    """One transformer layer's parameters (under ``o`` = ``decoder.layers.{i}.``)."""
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels
    proj_in = cfg.num_attention_heads * cfg.kv_channels
    fc1 = ffn * (2 if cfg.swiglu else 1)
    norm_bias = cfg.normalization == "LayerNorm"
    out = {}
    for ln in ("input_layernorm", "pre_mlp_layernorm"):
        out[f"{o}{ln}.weight"] = (h,)
        if norm_bias:
            out[f"{o}{ln}.bias"] = (h,)
    if cfg.attention.multi_latent_attention:
        out.update(_mla_shapes(cfg, f"{o}self_attention."))
    else:
        out[f"{o}self_attention.linear_qkv.weight"] = (qkv, h)
    if cfg.qkv_bias:
        out[f"{o}self_attention.linear_qkv.bias"] = (qkv,)
    if cfg.attention.qk_layernorm and not cfg.attention.multi_latent_attention:
        for x in "qk":
            out[f"{o}self_attention.{x}_layernorm.weight"] = (cfg.kv_channels,)
            if norm_bias:
                out[f"{o}self_attention.{x}_layernorm.bias"] = (cfg.kv_channels,)
    out.setdefault(f"{o}self_attention.linear_proj.weight", (h, proj_in))
    if cfg.add_bias_linear:
        out[f"{o}self_attention.linear_proj.bias"] = (h,)
    if moe:
        out.update(_moe_shapes(cfg, f"{o}mlp."))
        return out
    out[f"{o}mlp.linear_fc1.weight"] = (fc1, h)
    out[f"{o}mlp.linear_fc2.weight"] = (h, ffn)
    if cfg.add_bias_linear:
        out[f"{o}mlp.linear_fc1.bias"] = (fc1,)
        out[f"{o}mlp.linear_fc2.bias"] = (h,)
    return out


def _moe_shapes(cfg: ModelConfig, m: str) -> dict[str, tuple[int, ...]]:
    """An MoE layer's parameters (under ``m`` = ``decoder.layers.{i}.mlp.``); expert linears have no biases."""
    h, E, glu = cfg.hidden_size, cfg.moe.num_experts, 2 if cfg.swiglu else 1
    out = {f"{m}router.weight": (E, h), f"{m}experts.linear_fc1.weight": (E, glu * cfg.moe.moe_ffn_hidden_size, h),
           f"{m}experts.linear_fc2.weight": (E, h, cfg.moe.moe_ffn_hidden_size)}
    if cfg.moe.moe_router_enable_expert_bias:
        out[f"{m}router.expert_bias"] = (E,)
    shared = cfg.moe.moe_shared_expert_intermediate_size
    if shared:
        out[f"{m}shared_experts.linear_fc1.weight"] = (glu * shared, h)
        out[f"{m}shared_experts.linear_fc2.weight"] = (h, shared)
        if cfg.moe.moe_shared_expert_gate:
            out[f"{m}shared_experts.gate_weight"] = (1, h)
    return out


def hf_shapes(entries: list[Entry], our_shapes: dict[str, tuple[int, ...]],
              dtypes: dict[str, torch.dtype] | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF name -> (shape, dtype), by running each entry's ``to_hf`` on a meta tensor of our shape."""
    out = {}
    for e in entries:
        dtype = (dtypes or {}).get(e.ours, torch.float32)
        for name, t in zip(e.hf, e.to_hf(torch.empty(our_shapes[e.ours], dtype=dtype, device="meta"))):
            out[name] = (tuple(t.shape), t.dtype)
    return out
