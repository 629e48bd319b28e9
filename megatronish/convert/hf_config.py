"""Hugging Face ``config.json`` <-> :class:`ModelConfig`, for ``GPT2LMHeadModel`` and the Llama-flavored
families: the dense ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and
the mixture-of-experts ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``.

A GPT-2 config becomes our GPT-2 flavor (LayerNorm, learned absolute positions, biases, GELU — the tanh
approximation ``--openai-gelu`` for HF's ``gelu_new``); every other family our Llama flavor (RMSNorm, rotate-half
RoPE, SwiGLU, grouped-query attention). The Llama-flavored families differ only in the switches of
:data:`FAMILIES` (one row each): q/k/v biases (``--add-qkv-bias``; Qwen2 always, Qwen2-MoE by ``qkv_bias``),
per-head q/k RMSNorm (``--qk-layernorm``; Qwen3), how config.json turns on sliding-window attention (rejected
when the window is shorter than the sequence) and the MoE router style (docs/convert.md, "Mixture of experts":
Mixtral's renormalised top-k is ours without ``--moe-router-pre-softmax``; Qwen's ``norm_topk_prob=false`` is
ours with it; Qwen2-MoE adds the sigmoid-gated shared expert). ``DeepseekV3ForCausalLM`` (multi-latent
attention, YaRN, DeepSeek's MoE) has its own mapping, :mod:`.hf_deepseek`. ``head_dim`` (``--kv-channels``) and tied
embeddings are read from config.json for every family. Settings either side cannot express are a
:class:`ConvertError`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import ConvertError
from ..model.moe.layer import is_moe_layer
from .hf_deepseek import DEEPSEEK_V3, deepseek_config_from_hf, deepseek_fits, deepseek_hf_config

GPT2, LLAMA, MISTRAL = "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM"
QWEN2, QWEN3 = "Qwen2ForCausalLM", "Qwen3ForCausalLM"
MIXTRAL, QWEN2_MOE, QWEN3_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"


@dataclass(frozen=True)
class Family:
    """What sets one Llama-flavored family apart; everything else (RMSNorm, RoPE, SwiGLU, GQA, ``head_dim``,
    tied embeddings, the tensor names) is shared."""
    model_type: str
    qkv_bias: bool | str = False  # q/k/v biases: never, always, or the config.json key that switches them
    qk_norm: bool = False  # per-head q/k RMSNorm (``q_norm``/``k_norm``; ours --qk-layernorm)
    window_switch: str | None = None  # key that must be true for ``sliding_window`` to apply (Qwen); None: none
    linear_bias: bool = False  # ``attention_bias``/``mlp_bias`` switch every linear bias (Llama only)
    moe: str | None = None  # None: dense MLPs; "mixtral" / "qwen": the MoE config style (experts, router)


FAMILIES = {  # first match wins on export when no source config.json says which (Llama before Mistral)
    LLAMA: Family("llama", linear_bias=True),
    MISTRAL: Family("mistral"),
    QWEN2: Family("qwen2", qkv_bias=True, window_switch="use_sliding_window"),
    QWEN3: Family("qwen3", qk_norm=True, window_switch="use_sliding_window"),
    MIXTRAL: Family("mixtral", moe="mixtral"),
    QWEN2_MOE: Family("qwen2_moe", qkv_bias="qkv_bias", window_switch="use_sliding_window", moe="qwen"),
    QWEN3_MOE: Family("qwen3_moe", qk_norm=True, window_switch="use_sliding_window", moe="qwen"),
}
MOE_ARCHITECTURES = tuple(a for a, f in FAMILIES.items() if f.moe)
ARCHITECTURES = (GPT2, *FAMILIES, DEEPSEEK_V3)  # DeepSeek-V3: multi-latent attention (hf_deepseek.py)
_MODEL_TYPE = {GPT2: "gpt2", **{a: f.model_type for a, f in FAMILIES.items()}, DEEPSEEK_V3: "deepseek_v3"}
_ARCH_OF_TYPE = {v: k for k, v in _MODEL_TYPE.items()}
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def architecture(hf: dict, where: str = "config.json") -> str:
    """One of :data:`ARCHITECTURES` from a config dict (``architectures`` or ``model_type``)."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return a
    if not archs and hf.get("model_type") in _ARCH_OF_TYPE:
        return _ARCH_OF_TYPE[hf["model_type"]]
    found = archs or hf.get("model_type")
    raise ConvertError(f"{where}: unknown architecture {found!r} (model_type {hf.get('model_type')!r}); "
                       f"this converter handles {', '.join(ARCHITECTURES)}")


def _require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ConvertError(f"{where}: {msg}")


def _rope_theta(hf: dict, where: str) -> int:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kinds = {params.get("rope_type"), scaling.get("rope_type") or scaling.get("type")} - {None, "default"}
    kind = next(iter(sorted(kinds)), "default")
    _require(not kinds, where, f"RoPE scaling {kind!r} is not supported (only plain RoPE); "
                                       "convert a model without rope_scaling")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    _require(float(theta).is_integer(), where, f"rope_theta {theta} is not an integer (--rotary-base is)")
    return int(theta)


def model_config_from_hf(hf: dict, *, true_vocab_size: int | None = None, make_vocab_size_divisible_by: int = 128,
                         where: str = "config.json") -> tuple[ModelConfig, str]:
    """Our model config and the HF architecture for a HF ``config.json`` dict."""
    arch = architecture(hf, where)
    vocab = int(hf["vocab_size"])
    if true_vocab_size is not None:
        _require(true_vocab_size <= vocab, where,
                 f"--true-vocab-size {true_vocab_size} is larger than the checkpoint's vocabulary ({vocab} rows); "
                 f"pass at most {vocab}")
        vocab = true_vocab_size
    common = dict(vocab_size=vocab, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                  init_method_std=float(hf.get("initializer_range", 0.02)))
    if arch == GPT2:
        act = hf.get("activation_function", "gelu_new")
        _require(act in _TANH_GELU + ("gelu",), where,
                 f"activation_function {act!r} is not supported (gelu_new / gelu_pytorch_tanh = --openai-gelu, "
                 "or gelu)")
        _require(hf.get("scale_attn_weights", True), where, "scale_attn_weights=false is not supported")
        _require(not hf.get("scale_attn_by_inverse_layer_idx", False), where,
                 "scale_attn_by_inverse_layer_idx=true is not supported")
        _require(not hf.get("add_cross_attention", False), where, "cross attention is not supported")
        h, n = int(hf["n_embd"]), int(hf["n_positions"])
        cfg = ModelConfig.from_flat(num_layers=int(hf["n_layer"]), hidden_size=h, num_attention_heads=int(hf["n_head"]),
                          ffn_hidden_size=int(hf.get("n_inner") or 4 * h), seq_length=n, max_position_embeddings=n,
                          position_embedding_type="learned_absolute", normalization="LayerNorm",
                          norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)), swiglu=False,
                          openai_gelu=act in _TANH_GELU,
                          untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                          add_bias_linear=True, attention_dropout=float(hf.get("attn_pdrop", 0.1)),
                          hidden_dropout=float(hf.get("resid_pdrop", 0.1)), **common)
        return cfg, arch
    if arch == DEEPSEEK_V3:
        return deepseek_config_from_hf(hf, common, where), arch
    act = hf.get("hidden_act", "silu")
    _require(act == "silu", where, f"hidden_act {act!r} is not supported (SwiGLU uses silu)")
    _require(int(hf.get("pretraining_tp", 1)) == 1, where, "pretraining_tp > 1 is not supported")
    h, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    layers = int(hf["num_hidden_layers"])
    n = int(hf.get("max_position_embeddings", 2048))
    fam = FAMILIES[arch]
    _check_window(hf, arch, fam, n, where)
    if fam.linear_bias:
        attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        _require(attn_bias == mlp_bias, where,
                 f"attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported (--disable-bias-linear "
                 "switches all linear biases together)")
    else:  # Qwen3's attention_bias would bias o_proj too, without MLP biases: no flag of ours does that
        attn_bias = False
        _require(not hf.get("attention_bias", False), where,
                 f"attention_bias=true is not supported for {arch} (an o_proj bias without MLP biases has no "
                 "equivalent here); convert a model with attention_bias false")
    qkv_bias = hf.get(fam.qkv_bias, True) if isinstance(fam.qkv_bias, str) else fam.qkv_bias  # absent: true
    specific = dict(add_bias_linear=attn_bias, add_qkv_bias=bool(qkv_bias) and not attn_bias,
                    qk_layernorm=fam.qk_norm, ffn_hidden_size=int(hf["intermediate_size"]))
    if fam.moe:
        specific.update(_moe_from_hf(hf, arch, layers, where))
    cfg = ModelConfig.from_flat(num_layers=layers, hidden_size=h, num_attention_heads=heads,
                      num_query_groups=int(hf.get("num_key_value_heads") or heads),
                      kv_channels=int(hf.get("head_dim") or h // heads),
                      seq_length=n, max_position_embeddings=n, position_embedding_type="rope",
                      rotary_base=_rope_theta(hf, where), normalization="RMSNorm",
                      norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), swiglu=True,
                      untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                      attention_dropout=float(hf.get("attention_dropout", 0.0)),
                      hidden_dropout=0.0, **specific, **common)
    return cfg, arch


def _check_window(hf: dict, arch: str, fam: Family, seq: int, where: str) -> None:
    """Sliding-window attention is not built here: a window shorter than the sequence (``max_position_embeddings``,
    the length we train at) is an error; a window that covers the sequence is full causal attention. Qwen
    families apply ``sliding_window`` only under ``use_sliding_window: true`` (whatever ``max_window_layers``)."""
    window = hf.get("sliding_window")
    if fam.window_switch is not None and not hf.get(fam.window_switch, False):
        window = None
    if window is None or int(window) >= seq:
        return
    on = f"{fam.window_switch}=true with " if fam.window_switch else ""
    raise ConvertError(f"{where}: {on}sliding_window {window} is shorter than the sequence length {seq} "
                       f"(max_position_embeddings): {arch} with sliding-window attention is not supported (full "
                       f"causal attention only); set \"sliding_window\": null"
                       + (f" (or \"{fam.window_switch}\": false)" if fam.window_switch else "")
                       + f" in config.json for full attention, or max_position_embeddings <= {window}")


def _moe_from_hf(hf: dict, arch: str, layers: int, where: str) -> dict:
    """Our MoE settings of a Mixtral / Qwen2-MoE / Qwen3-MoE ``config.json``."""
    if FAMILIES[arch].moe == "mixtral":
        experts = hf.get("num_local_experts", hf.get("num_experts"))
        jitter = float(hf.get("router_jitter_noise") or 0.0)
        _require(jitter == 0.0, where, f"router_jitter_noise {jitter} is not supported (our router adds no input "
                                       "jitter); set it to 0")
        ffn = moe_ffn = int(hf["intermediate_size"])
        renormalise, moe_layers = True, [1] * layers
    else:
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        ffn, moe_ffn = int(hf["intermediate_size"]), int(hf["moe_intermediate_size"])
        renormalise = bool(hf.get("norm_topk_prob", False))
        step, dense = int(hf.get("decoder_sparse_step", 1) or 1), set(hf.get("mlp_only_layers") or [])
        moe_layers = [int((i + 1) % step == 0 and i not in dense) for i in range(layers)]  # HF's rule
    _require(experts is not None and int(experts) >= 1, where, f"num_experts {experts!r}: an MoE model needs >= 1")
    _require(any(moe_layers), where, "no layer is a mixture of experts (decoder_sparse_step / mlp_only_layers); "
                                     "convert it as a dense model")
    out = dict(num_experts=int(experts), moe_router_topk=int(hf.get("num_experts_per_tok", 2)),
               moe_router_score_function="softmax", moe_router_pre_softmax=not renormalise,
               moe_layer_freq=1 if all(moe_layers) else moe_layers, ffn_hidden_size=ffn, moe_ffn_hidden_size=moe_ffn,
               moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
    if arch == QWEN2_MOE:
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        _require(shared >= 1, where, f"shared_expert_intermediate_size {shared}: Qwen2-MoE needs a shared expert")
        out.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return out


def architecture_of(cfg: ModelConfig, where: str = "checkpoint", *, base: dict | None = None) -> str:
    """Which HF architecture expresses our model config (or a :class:`ConvertError` naming the setting).
    ``base``: the config.json the model came from; its family is chosen when it fits (a Mistral stays a
    Mistral, though a Llama expresses the same model)."""
    _require(not getattr(cfg, "apply_layernorm_1p", False), where,
             "--apply-layernorm-1p (zero-centered norm weights) has no HF equivalent in this converter")
    if cfg.attention.multi_latent_attention:
        deepseek_fits(cfg, where)
        return DEEPSEEK_V3
    gpt2_like = (cfg.normalization == "LayerNorm" and cfg.attention.position_embedding_type == "learned_absolute"
                 and not cfg.swiglu)
    llama_like = cfg.normalization == "RMSNorm" and cfg.attention.position_embedding_type == "rope" and cfg.swiglu
    if gpt2_like:
        _require(not cfg.moe.num_experts, where,
                 "a GPT-2-flavored mixture of experts has no Hugging Face equivalent here")
        _require(not cfg.attention.qk_layernorm, where, "GPT-2 has no query/key layer norm (--qk-layernorm)")
        _require(cfg.add_bias_linear, where, "GPT-2 needs linear biases (the checkpoint has --disable-bias-linear)")
        _require(cfg.num_query_groups == cfg.num_attention_heads, where,
                 "GPT-2 has no grouped-query attention (--num-query-groups must equal --num-attention-heads)")
        _require(cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size, where,
                 "GPT-2 needs --kv-channels = --hidden-size / --num-attention-heads")
        return GPT2
    if llama_like:
        _require(cfg.attention.rotary_percent == 1.0, where, "Llama rotates whole heads (--rotary-percent must be 1.0)")
        if cfg.moe.num_experts:
            return _moe_architecture(cfg, where)
        return _dense_architecture(cfg, where, architecture_of_safe(base))
    raise ConvertError(f"{where}: unknown architecture: normalization={cfg.normalization}, "
                       f"position_embedding_type={cfg.attention.position_embedding_type}, swiglu={cfg.swiglu} is "
                       "neither "
                       f"GPT-2 (LayerNorm, learned_absolute, GELU) nor Llama (RMSNorm, rope, SwiGLU)")


def _dense_architecture(cfg: ModelConfig, where: str, prefer: str | None) -> str:
    """The dense family of :data:`FAMILIES` whose switches are the config's: ``prefer`` when it fits, else the
    first that does."""
    qkv_only = cfg.attention.add_qkv_bias and not cfg.add_bias_linear

    def fits(f: Family) -> bool:
        return (not f.moe and f.qk_norm == cfg.attention.qk_layernorm and (f.linear_bias or not cfg.add_bias_linear)
                and qkv_only == bool(f.qkv_bias))

    found = [a for a, f in FAMILIES.items() if fits(f)]
    _require(bool(found), where,
             f"--qk-layernorm={cfg.attention.qk_layernorm} with q/k/v-only biases={qkv_only} (--add-qkv-bias) and "
             f"all linear biases={cfg.add_bias_linear} (--disable-bias-linear off) has no dense Hugging Face "
             "equivalent here "
             "(Llama: no biases or all; Mistral: none; Qwen2: q/k/v biases only; Qwen3: --qk-layernorm, no biases)")
    return prefer if prefer in found else found[0]


def _moe_architecture(cfg: ModelConfig, where: str) -> str:
    """Qwen3-MoE (``--qk-layernorm``), Qwen2-MoE (a gated shared expert) or Mixtral (neither)."""
    c = cfg
    _require(c.moe.moe_router_score_function == "softmax", where,
             "Hugging Face's Mixtral/Qwen MoE routers use softmax scores (--moe-router-score-function softmax)")
    for on, flag in ((c.moe.moe_router_group_topk, "--moe-router-group-topk"),
                     (c.moe.moe_router_topk_scaling_factor, "--moe-router-topk-scaling-factor"),
                     (c.moe.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
                     (c.moe.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor")):
        _require(not on, where, f"{flag} has no equivalent in Hugging Face's Mixtral/Qwen MoE models")
    _require(isinstance(c.moe.moe_aux_loss_coeff, (int, float)) or len(c.moe.moe_aux_loss_coeff) == 1, where,
             "one --moe-aux-loss-coeff (router_aux_loss_coef) only")
    if c.attention.qk_layernorm:
        _require(not c.moe.moe_shared_expert_intermediate_size, where,
                 "Qwen3-MoE (--qk-layernorm) has no shared expert (--moe-shared-expert-intermediate-size)")
        _require(not c.attention.add_qkv_bias, where, "Qwen3-MoE (--qk-layernorm) has no q/k/v biases (--add-qkv-bias)")
        return QWEN3_MOE
    if c.moe.moe_shared_expert_intermediate_size:
        _require(c.moe.moe_shared_expert_gate, where,
                 "Qwen2-MoE's shared expert is gated: it needs --moe-shared-expert-gate")
        return QWEN2_MOE
    _require(not c.moe.moe_router_pre_softmax, where,
             "Mixtral renormalises the top-k probabilities: --moe-router-pre-softmax has no Mixtral equivalent "
             "(a shared expert or --qk-layernorm would make it Qwen-MoE)")
    _require(all(is_moe_layer(c, i) for i in range(c.num_layers)), where,
             "Mixtral has experts in every layer (--moe-layer-freq must be 1)")
    _require(not c.attention.add_qkv_bias, where, "Mixtral has no q/k/v biases (--add-qkv-bias)")
    return MIXTRAL


def hf_config_from_model(cfg: ModelConfig, dtype: str = "float32", *, base: dict | None = None) -> dict:
    """``config.json`` for our model config. ``base``: the config.json the model came from (token ids and
    other keys that do not decide the weights are kept from it)."""
    arch = architecture_of(cfg, base=base)
    out = {k: v for k, v in (base or {}).items() if architecture_of_safe(base) == arch}
    out.update(architectures=[arch], model_type=_MODEL_TYPE[arch], vocab_size=cfg.vocab_size,
               initializer_range=cfg.init_method_std, torch_dtype=dtype,
               tie_word_embeddings=not cfg.untie_embeddings_and_output_weights)
    out.pop("dtype", None)
    if arch == GPT2:
        out.update(n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
                   n_inner=cfg.ffn_hidden_size, n_positions=cfg.max_position_embeddings,
                   activation_function="gelu_new" if cfg.openai_gelu else "gelu",
                   layer_norm_epsilon=cfg.norm_epsilon, attn_pdrop=cfg.attention.attention_dropout,
                   resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, scale_attn_weights=True,
                   scale_attn_by_inverse_layer_idx=False)
        out.setdefault("bos_token_id", cfg.vocab_size - 1)
        out.setdefault("eos_token_id", cfg.vocab_size - 1)
    elif arch == DEEPSEEK_V3:
        for key in ("rope_scaling", "quantization_config", "num_mtp_layers"):
            out.pop(key, None)
        out.update(deepseek_hf_config(cfg))
    else:
        for key in ("rope_scaling", "num_experts", "num_local_experts"):
            out.pop(key, None)
        out.update(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                   num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
                   head_dim=cfg.kv_channels, intermediate_size=cfg.ffn_hidden_size,
                   max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_epsilon,
                   rope_theta=float(cfg.attention.rotary_base),
                   rope_parameters={"rope_type": "default", "rope_theta": float(cfg.attention.rotary_base)},
                   hidden_act="silu", attention_dropout=cfg.attention.attention_dropout)
        fam = FAMILIES[arch]
        if fam.linear_bias:
            out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear, pretraining_tp=1)
        elif fam.qk_norm:  # Qwen3's switch of q/k/v/o biases
            out.update(attention_bias=False)
        if isinstance(fam.qkv_bias, str):
            out[fam.qkv_bias] = cfg.attention.add_qkv_bias
        if fam.window_switch:  # full causal attention
            out[fam.window_switch] = False
        else:
            out.update(sliding_window=None)
        out.pop("layer_types", None)  # transformers derives it (every layer full attention)
        if fam.moe:
            out.update(_moe_to_hf(cfg, arch))
    return out


def _moe_to_hf(cfg: ModelConfig, arch: str) -> dict:
    coeff = cfg.moe.moe_aux_loss_coeff
    coeff = float(coeff if isinstance(coeff, (int, float)) else coeff[0])
    common = dict(num_experts_per_tok=cfg.moe.moe_router_topk, router_aux_loss_coef=coeff, output_router_logits=False)
    if FAMILIES[arch].moe == "mixtral":
        return dict(common, num_local_experts=cfg.moe.num_experts, intermediate_size=cfg.moe.moe_ffn_hidden_size,
                    router_jitter_noise=0.0)
    dense = [i for i in range(cfg.num_layers) if not is_moe_layer(cfg, i)]
    out = dict(common, num_experts=cfg.moe.num_experts, moe_intermediate_size=cfg.moe.moe_ffn_hidden_size,
               norm_topk_prob=not cfg.moe.moe_router_pre_softmax, decoder_sparse_step=1, mlp_only_layers=dense)
    if arch == QWEN2_MOE:
        out.update(shared_expert_intermediate_size=cfg.moe.moe_shared_expert_intermediate_size)
    return out


def architecture_of_safe(hf: dict | None) -> str | None:
    try:
        return architecture(hf or {})
    except ConvertError:
        return None


def model_config_from_dict(d: dict, where: str) -> ModelConfig:
    """A :class:`ModelConfig` from the ``"model"`` section stored in one of our checkpoints."""
    if not d:
        raise ConvertError(f"{where}: the checkpoint stores no model config")
    names = ModelConfig.flat_names()
    return ModelConfig.from_flat({k: v for k, v in d.items() if k in names})
