"""transformers' ``DeepseekV3ForCausalLM`` ``config.json`` <-> :class:`ModelConfig`, and what its published files
carry beyond the model: FP8 block-scaled weights and the multi-token-prediction layers.

Config (docs/convert.md, "DeepSeek-V3"): multi-latent attention (``q_lora_rank`` None or a rank,
``kv_lora_rank``, ``qk_nope_head_dim`` -> ``--qk-head-dim``, ``qk_rope_head_dim`` -> ``--qk-pos-emb-head-dim``,
``v_head_dim``; the latents' RMSNorms are ``--qk-layernorm``), RoPE or YaRN (``rope_parameters`` or the older
``rope_scaling``: ``factor``, ``original_max_position_embeddings``, ``beta_fast``/``beta_slow``, ``mscale``,
``mscale_all_dim``, ``truncate``), the first ``first_k_dense_replace`` layers dense (``--moe-layer-freq``), then
DeepSeek's MoE: ``n_routed_experts``, ``num_experts_per_tok``, sigmoid scores with the expert bias
(``e_score_correction_bias``, ``--moe-router-enable-expert-bias``), group-limited top-k (``n_group``,
``topk_group``), ``routed_scaling_factor``, ``n_shared_experts * moe_intermediate_size`` as the shared expert.

RoPE layout: with ``rope_interleave`` true (transformers' default, DeepSeek's released weights) the rotated pairs
are channels ``(0, 1), (2, 3), ...``, as in our MLA, so the weights copy as they are; ``rope_interleave`` false
(rotate-half pairs) is refused.

FP8: DeepSeek-V3's released weights are ``float8_e4m3fn`` with a ``<name>_scale_inv`` tensor of one float per
``weight_block_size`` block (128 x 128): :func:`dequantize_fp8` multiplies them out into bfloat16 on import;
:func:`fp8_block_reader` does it for a block of rows and columns, reading only the scale blocks covering it.

Multi-token prediction: published files carry ``num_nextn_predict_layers`` layers past the decoder,
``model.layers.<num_hidden_layers + k>.``: ``enorm``, ``hnorm``, ``eh_proj``, a decoder layer (``input_layernorm``,
``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``), ``shared_head.norm`` and two copies of shared tensors,
``embed_tokens`` (the word embedding) and ``shared_head.head`` (the output layer). They map to depth ``k`` of
model/mtp.py, ``mtp.layers.<k>.{enorm,hnorm,eh_proj}``, ``.mtp_model_layer.*`` and ``.final_layernorm``
(:func:`mtp_hf_prefix`, name_map's table); the copies are not ours (our depths use the model's embedding and
output layer) and are written from those on export (:func:`mtp_copies`).
"""
from __future__ import annotations

import re

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..model.moe.layer import is_moe_layer

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConvertError(f"{where}: {msg}")


def _rope(hf: dict, where: str) -> dict:
    """Our RoPE/YaRN fields from ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta``."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    _require(float(theta).is_integer(), where, f"rope_theta {theta} is not an integer (--rotary-base is)")
    out = dict(rotary_base=int(theta))
    if kind == "default":
        return dict(out, rope_type="rope")
    _require(kind == "yarn", where, f"RoPE scaling {kind!r} is not supported for {DEEPSEEK_V3} (default or yarn)")
    _require(params.get("attention_factor") is None, where,
             "an explicit YaRN attention_factor is not supported (ours is derived from factor, mscale and "
             "mscale_all_dim); remove it from config.json")
    original = int(params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096))
    factor = params.get("factor") or int(hf.get("max_position_embeddings", original)) / original
    # transformers applies mscale/mscale_all_dim's ratio to cos and sin only when both are set: ours with mscale 0
    return dict(out, rope_type="yarn", rotary_scaling_factor=float(factor),
                yarn_original_max_position_embeddings=original,
                yarn_beta_fast=float(params.get("beta_fast") or 32), yarn_beta_slow=float(params.get("beta_slow") or 1),
                mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                yarn_correction_range_round_to_int=bool(params.get("truncate", True)))


def _moe(hf: dict, layers: int, where: str) -> dict:
    dense = int(hf.get("first_k_dense_replace") or 0)
    experts = int(hf.get("n_routed_experts") or 0)
    if dense >= layers or not experts:
        return {}  # every layer dense
    topk = int(hf.get("num_experts_per_tok", 8))
    norm = bool(hf.get("norm_topk_prob", True))
    _require(norm == (topk > 1), where,
             f"norm_topk_prob={norm} with num_experts_per_tok {topk}: our sigmoid router renormalises the chosen "
             "scores exactly when it picks more than one expert")
    scoring = hf.get("scoring_func", "sigmoid")
    _require(scoring == "sigmoid", where, f"scoring_func {scoring!r}: DeepSeek-V3's router is sigmoid")
    method = hf.get("topk_method", "noaux_tc")
    _require(method == "noaux_tc", where, f"topk_method {method!r}: only noaux_tc (the expert bias) is supported")
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    grouped = groups > 1
    _require(not grouped or topk == 2 * group_topk, where,
             f"num_experts_per_tok {topk} with topk_group {group_topk}: a group scores by its best two experts "
             "in transformers and by its best num_experts_per_tok / topk_group here; they agree only when that "
             "is 2")
    shared = int(hf.get("n_shared_experts") or 0) * int(hf["moe_intermediate_size"])
    return dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                moe_layer_freq=[0] * dense + [1] * (layers - dense) if dense else 1,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=groups if grouped else None,
                moe_router_group_topk=group_topk if grouped else None,
                moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                moe_shared_expert_intermediate_size=shared or None, moe_router_dtype="fp32",
                moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=float(hf.get("aux_loss_alpha", 1e-4)))


def deepseek_config_from_hf(hf: dict, common: dict, where: str) -> ModelConfig:
    """Our config for a ``DeepseekV3ForCausalLM`` config.json (``common``: vocabulary and init fields)."""
    act = hf.get("hidden_act", "silu")
    _require(act == "silu", where, f"hidden_act {act!r} is not supported (SwiGLU uses silu)")
    _require(not hf.get("attention_bias", False), where,
             "attention_bias=true is not supported (our multi-latent attention has no biases)")
    _require(hf.get("rope_interleave", True), where,
             "rope_interleave=false (rotate-half RoPE pairs) is not supported; our MLA uses DeepSeek's interleaved "
             "pairs, as transformers' default rope_interleave=true")
    layers, n = int(hf["num_hidden_layers"]), int(hf.get("max_position_embeddings", 4096))
    q_lora = hf.get("q_lora_rank")
    return ModelConfig.from_flat(
        num_layers=layers, hidden_size=int(hf["hidden_size"]), num_attention_heads=int(hf["num_attention_heads"]),
        ffn_hidden_size=int(hf["intermediate_size"]), seq_length=n, max_position_embeddings=n,
        position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        swiglu=True, add_bias_linear=False,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        attention_dropout=float(hf.get("attention_dropout", 0.0)), hidden_dropout=0.0,
        multi_latent_attention=True, q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(hf["kv_lora_rank"]), qk_head_dim=int(hf["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]), qk_layernorm=True,
        **_rope(hf, where), **_moe(hf, layers, where), **common)


def deepseek_fits(cfg: ModelConfig, where: str) -> None:
    """A :class:`ConvertError` naming the first setting of an MLA model that ``DeepseekV3ForCausalLM`` cannot
    express."""
    a, m = cfg.attention, cfg.moe
    checks = [(cfg.normalization == "RMSNorm" and cfg.swiglu, "RMSNorm and --swiglu"),
              (not cfg.add_bias_linear, "no linear biases (--disable-bias-linear)"),
              (a.qk_layernorm, "the latents' norms (--qk-layernorm)"),
              (a.rotary_percent == 1.0, "--rotary-percent 1.0")]
    if m.num_experts:
        flags = [is_moe_layer(cfg, i) for i in range(cfg.num_layers)]
        k = flags.index(True)
        checks += [(all(flags[k:]), "its dense layers first, then experts in every layer (--moe-layer-freq)"),
                   (m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias,
                    "--moe-router-score-function sigmoid with --moe-router-enable-expert-bias"),
                   (not m.moe_router_group_topk or m.moe_router_topk == 2 * m.moe_router_group_topk,
                    "--moe-router-topk = 2 x --moe-router-group-topk (a group scores by its best two experts)"),
                   (not m.moe_shared_expert_gate, "an ungated shared expert (no --moe-shared-expert-gate)"),
                   (not m.moe_shared_expert_intermediate_size
                    or m.moe_shared_expert_intermediate_size % m.moe_ffn_hidden_size == 0,
                    "--moe-shared-expert-intermediate-size a multiple of --moe-ffn-hidden-size (n_shared_experts)"),
                   (m.moe_expert_capacity_factor is None, "no --moe-expert-capacity-factor")]
    for ok, what in checks:
        _require(ok, where, f"{DEEPSEEK_V3} needs {what}")


def deepseek_hf_config(cfg: ModelConfig) -> dict:
    """The ``DeepseekV3ForCausalLM`` keys of our config (the caller adds the common ones)."""
    a, m = cfg.attention, cfg.moe
    rope = {"rope_type": "default", "rope_theta": float(a.rotary_base)}
    if a.yarn:
        rope.update(rope_type="yarn", factor=a.rotary_scaling_factor,
                    original_max_position_embeddings=a.yarn_original_max_position_embeddings or 4096,
                    beta_fast=a.yarn_beta_fast or 32.0, beta_slow=a.yarn_beta_slow or 1.0, mscale=a.mscale,
                    mscale_all_dim=a.mscale_all_dim, truncate=a.yarn_correction_range_round_to_int is not False)
    out = dict(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
               num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
               intermediate_size=cfg.ffn_hidden_size, max_position_embeddings=cfg.max_position_embeddings,
               rms_norm_eps=cfg.norm_epsilon, hidden_act="silu", attention_bias=False,
               attention_dropout=a.attention_dropout, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
               qk_nope_head_dim=a.qk_head_dim, qk_rope_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim,
               qk_head_dim=a.qk_head_dim + a.qk_pos_emb_head_dim, head_dim=a.qk_pos_emb_head_dim,
               rope_interleave=True, rope_theta=float(a.rotary_base), rope_parameters=rope,
               num_nextn_predict_layers=cfg.mtp_num_layers or 0)  # the depths written (mtp_copies)
    if not m.num_experts:
        return dict(out, first_k_dense_replace=cfg.num_layers)
    shared = m.moe_shared_expert_intermediate_size or 0
    return dict(out, first_k_dense_replace=next(i for i in range(cfg.num_layers) if is_moe_layer(cfg, i)),
                n_routed_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                moe_intermediate_size=m.moe_ffn_hidden_size, n_shared_experts=shared // m.moe_ffn_hidden_size,
                n_group=m.moe_router_num_groups or 1, topk_group=m.moe_router_group_topk or 1,
                routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0, norm_topk_prob=m.moe_router_topk > 1,
                scoring_func="sigmoid", topk_method="noaux_tc")


# ---- what published files carry beyond the model ---------------------------------------------------------------

def mtp_layer_names(names, hf: dict, keep: int = 0) -> list[str]:
    """The tensors of the multi-token-prediction layers (``model.layers.<i>`` with ``i >= num_hidden_layers``)
    past the first ``keep`` of them."""
    layers = int(hf.get("num_hidden_layers", 0)) + keep
    return sorted(n for n in names if (m := _LAYER.match(n)) and int(m.group(1)) >= layers)


def mtp_depths(names, hf: dict) -> int:
    """How many multi-token-prediction layers the tensor ``names`` hold (consecutive from
    ``num_hidden_layers``)."""
    layers = int(hf.get("num_hidden_layers", 0))
    present = {int(m.group(1)) for n in names if (m := _LAYER.match(n)) and int(m.group(1)) >= layers}
    return next(k for k in range(len(present) + 1) if layers + k not in present)


def mtp_hf_prefix(cfg: ModelConfig, depth: int) -> str:
    """The HF name prefix of multi-token-prediction depth ``depth`` (0-based)."""
    return f"model.layers.{cfg.num_layers + depth}."


def mtp_layer_is_moe(cfg: ModelConfig) -> bool:
    """A depth's decoder layer is an MoE layer when the decoder's last one is (model/mtp.py)."""
    return bool(cfg.moe.num_experts) and is_moe_layer(cfg, cfg.num_layers - 1)


def mtp_copies(cfg: ModelConfig) -> dict[str, str]:
    """HF copy name -> the HF tensor it copies, for each of ``cfg``'s multi-token-prediction depths."""
    head = "lm_head.weight" if cfg.untie_embeddings_and_output_weights else "model.embed_tokens.weight"
    out = {}
    for k in range(cfg.mtp_num_layers or 0):
        h = mtp_hf_prefix(cfg, k)
        out.update({f"{h}embed_tokens.weight": "model.embed_tokens.weight", f"{h}shared_head.head.weight": head})
    return out


def mtp_copies_of(cfg: ModelConfig, arch: str) -> dict[str, list[str]]:
    """HF tensor -> the names it is written again under (:func:`mtp_copies` turned around; none but for
    DeepSeek-V3)."""
    out: dict[str, list[str]] = {}
    for copy, src in (mtp_copies(cfg) if arch == DEEPSEEK_V3 else {}).items():
        out.setdefault(src, []).append(copy)
    return out


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight`` (FP8) times its per-block ``scale_inv`` ``[ceil(rows / b0), ceil(cols / b1)]``, in ``dtype``."""
    rows, cols = weight.shape
    need = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != need:
        raise ConvertError(f"FP8 weight {list(weight.shape)} needs a {list(need)} block scale, got "
                           f"{list(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def fp8_view(names, get, hf: dict):
    """``(names, get)`` of a file set with FP8 weights seen dequantized: the ``*_scale_inv`` tensors are folded
    into their weights (``weight_block_size`` of config.json's ``quantization_config``, default 128 x 128)."""
    names = set(names)
    scales = {n for n in names if n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in names}
    if not scales:
        return names, get
    block = tuple((hf.get("quantization_config") or {}).get("weight_block_size") or (128, 128))

    def dequantized(name: str) -> torch.Tensor:
        t = get(name)
        scale = name + SCALE_SUFFIX
        if t.dtype in FP8_DTYPES and scale in scales:
            return dequantize_fp8(t, get(scale), block)
        return t

    return names - scales, dequantized


def fp8_block_reader(read, shape_of, names, hf: dict):
    """``read(name, index)`` (one slice per leading dimension) with FP8 block-scaled weights dequantized to
    bfloat16 block by block: a block of rows ``r0:r1`` and columns ``c0:c1`` reads its FP8 bytes and only the
    ``<name>_scale_inv`` blocks covering it, ``[r0 // b0 : ceil(r1 / b0), c0 // b1 : ceil(c1 / b1)]``."""
    names = set(names)
    scaled = {n.removesuffix(SCALE_SUFFIX) for n in names if n.endswith(SCALE_SUFFIX)} & names
    if not scaled:
        return read
    b0, b1 = tuple((hf.get("quantization_config") or {}).get("weight_block_size") or (128, 128))

    def reader(name: str, index: tuple[slice, ...]) -> torch.Tensor:
        t = read(name, index)
        if name not in scaled or t.dtype not in FP8_DTYPES:
            return t
        rows_total, cols_total = shape_of(name)
        rows = index[0].indices(rows_total)[:2]
        cols = index[1].indices(cols_total)[:2] if len(index) > 1 else (0, cols_total)
        scale = read(name + SCALE_SUFFIX, (slice(rows[0] // b0, -(-rows[1] // b0)),
                                           slice(cols[0] // b1, -(-cols[1] // b1))))
        scale = scale.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        scale = scale[rows[0] % b0:rows[0] % b0 + t.size(0), cols[0] % b1:cols[0] % b1 + t.size(1)]
        return (t.float() * scale).to(torch.bfloat16)

    return reader
