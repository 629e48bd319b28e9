"""Hugging Face ``config.json`` <-> :class:`ModelConfig`, for ``GPT2LMHeadModel`` and ``LlamaForCausalLM``.

A GPT-2 config becomes our GPT-2 flavor (LayerNorm, learned absolute positions, biases, GELU — the tanh
approximation ``--openai-gelu`` for HF's ``gelu_new``); a Llama config our Llama flavor (RMSNorm, rotate-half
RoPE, SwiGLU, grouped-query attention). Settings either side cannot express are a :class:`ConvertError`.
"""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..errors import ConvertError

GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"
ARCHITECTURES = (GPT2, LLAMA)
_MODEL_TYPE = {GPT2: "gpt2", LLAMA: "llama"}
_ARCH_OF_TYPE = {v: k for k, v in _MODEL_TYPE.items()}
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def architecture(hf: dict, where: str = "config.json") -> str:
    """``GPT2LMHeadModel`` or ``LlamaForCausalLM`` from a config dict (``architectures`` or ``model_type``)."""
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
        cfg = ModelConfig(num_layers=int(hf["n_layer"]), hidden_size=h, num_attention_heads=int(hf["n_head"]),
                          ffn_hidden_size=int(hf.get("n_inner") or 4 * h), seq_length=n, max_position_embeddings=n,
                          position_embedding_type="learned_absolute", normalization="LayerNorm",
                          norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)), swiglu=False,
                          openai_gelu=act in _TANH_GELU,
                          untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                          add_bias_linear=True, attention_dropout=float(hf.get("attn_pdrop", 0.1)),
                          hidden_dropout=float(hf.get("resid_pdrop", 0.1)), **common)
        return cfg, arch
    act = hf.get("hidden_act", "silu")
    _require(act == "silu", where, f"hidden_act {act!r} is not supported (SwiGLU uses silu)")
    _require(int(hf.get("pretraining_tp", 1)) == 1, where, "pretraining_tp > 1 is not supported")
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    _require(attn_bias == mlp_bias, where,
             f"attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported (--disable-bias-linear "
             "switches all linear biases together)")
    h, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n = int(hf.get("max_position_embeddings", 2048))
    cfg = ModelConfig(num_layers=int(hf["num_hidden_layers"]), hidden_size=h, num_attention_heads=heads,
                      num_query_groups=int(hf.get("num_key_value_heads") or heads),
                      kv_channels=int(hf.get("head_dim") or h // heads), ffn_hidden_size=int(hf["intermediate_size"]),
                      seq_length=n, max_position_embeddings=n, position_embedding_type="rope",
                      rotary_base=_rope_theta(hf, where), normalization="RMSNorm",
                      norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), swiglu=True,
                      untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                      add_bias_linear=attn_bias, attention_dropout=float(hf.get("attention_dropout", 0.0)),
                      hidden_dropout=0.0, **common)
    return cfg, arch


def architecture_of(cfg: ModelConfig, where: str = "checkpoint") -> str:
    """Which HF architecture expresses our model config (or a :class:`ConvertError` naming the setting)."""
    gpt2_like = (cfg.normalization == "LayerNorm" and cfg.position_embedding_type == "learned_absolute"
                 and not cfg.swiglu)
    llama_like = cfg.normalization == "RMSNorm" and cfg.position_embedding_type == "rope" and cfg.swiglu
    if gpt2_like:
        _require(cfg.add_bias_linear, where, "GPT-2 needs linear biases (the checkpoint has --disable-bias-linear)")
        _require(cfg.num_query_groups == cfg.num_attention_heads, where,
                 "GPT-2 has no grouped-query attention (--num-query-groups must equal --num-attention-heads)")
        _require(cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size, where,
                 "GPT-2 needs --kv-channels = --hidden-size / --num-attention-heads")
        return GPT2
    if llama_like:
        _require(cfg.rotary_percent == 1.0, where, "Llama rotates whole heads (--rotary-percent must be 1.0)")
        _require(not (cfg.add_qkv_bias and not cfg.add_bias_linear), where,
                 "--add-qkv-bias without the other linear biases has no Llama equivalent")
        return LLAMA
    raise ConvertError(f"{where}: unknown architecture: normalization={cfg.normalization}, "
                       f"position_embedding_type={cfg.position_embedding_type}, swiglu={cfg.swiglu} is neither "
                       f"GPT-2 (LayerNorm, learned_absolute, GELU) nor Llama (RMSNorm, rope, SwiGLU)")


def hf_config_from_model(cfg: ModelConfig, dtype: str = "float32", *, base: dict | None = None) -> dict:
    """``config.json`` for our model config. ``base``: the config.json the model came from (token ids and
    other keys that do not decide the weights are kept from it)."""
    arch = architecture_of(cfg)
    out = {k: v for k, v in (base or {}).items() if architecture_of_safe(base) == arch}
    out.update(architectures=[arch], model_type=_MODEL_TYPE[arch], vocab_size=cfg.vocab_size,
               initializer_range=cfg.init_method_std, torch_dtype=dtype,
               tie_word_embeddings=not cfg.untie_embeddings_and_output_weights)
    out.pop("dtype", None)
    if arch == GPT2:
        out.update(n_layer=cfg.num_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
                   n_inner=cfg.ffn_hidden_size, n_positions=cfg.max_position_embeddings,
                   activation_function="gelu_new" if cfg.openai_gelu else "gelu",
                   layer_norm_epsilon=cfg.norm_epsilon, attn_pdrop=cfg.attention_dropout,
                   resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, scale_attn_weights=True,
                   scale_attn_by_inverse_layer_idx=False)
        out.setdefault("bos_token_id", cfg.vocab_size - 1)
        out.setdefault("eos_token_id", cfg.vocab_size - 1)
    else:
        out.pop("rope_scaling", None)
        out.update(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                   num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
                   head_dim=cfg.kv_channels, intermediate_size=cfg.ffn_hidden_size,
                   max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_epsilon,
                   rope_theta=float(cfg.rotary_base),
                   rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
                   hidden_act="silu", attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
                   attention_dropout=cfg.attention_dropout, pretraining_tp=1)
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
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})
