"""megatron-core's names for our tensors (the name map of :mod:`.megatron_format`, whose docstring describes the
formats): our per-layer suffix -> the ``torch_dist`` key suffix, the TP splits of Megatron's model, the keys the
writer stores each tensor under, and the ``_extra_state`` modules."""
from __future__ import annotations

import re

# our per-layer suffix -> the megatron-core torch_dist key suffix (after "decoder.layers.")
LAYER_KEYS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias": "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias": "self_attention.linear_proj.bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias": "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
    # multi-latent attention (the norms as the Transformer Engine spec fuses them)
    "self_attention.linear_q_proj.weight": "self_attention.linear_q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_q_up_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.q_layernorm.bias": "self_attention.linear_q_up_proj.layer_norm_bias",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.bias": "self_attention.linear_kv_up_proj.layer_norm_bias",
    # mixture of experts (the router and shared experts keep their names)
    "mlp.experts.linear_fc1.weight": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.linear_fc2.weight": "mlp.experts.experts.linear_fc2.weight",
}
# norms stored under their module names (a layer spec with a separate norm module; legacy files)
ALT_KEYS = {"input_layernorm.weight": "input_layernorm.weight", "input_layernorm.bias": "input_layernorm.bias",
             "pre_mlp_layernorm.weight": "pre_mlp_layernorm.weight",
             "pre_mlp_layernorm.bias": "pre_mlp_layernorm.bias",
             **{f"self_attention.{n}_layernorm.{k}": f"self_attention.{n}_layernorm.{k}"
                for n in ("q", "kv") for k in ("weight", "bias")}}
# norms of a multi-latent-attention layer stored under both names by the writer (the module docstring)
_MLA_BOTH = ("pre_mlp_layernorm", "self_attention.q_layernorm", "self_attention.kv_layernorm")
# MLA's down-projections: (their suffix, the stored args that give their rows)
MLA_DOWN = {"self_attention.linear_q_down_proj.weight": ("q_lora_rank",),
             "self_attention.linear_kv_down_proj.weight": ("kv_lora_rank", "qk_pos_emb_head_dim")}
# an expert weight's split over expert tensor parallelism, per expert: (dim, stride; SwiGLU's 2 set by the caller)
EXPERT_SPLIT = {"mlp.experts.linear_fc1.weight": 0, "mlp.experts.linear_fc2.weight": 1}
# linear layers that have an ``_extra_state`` in megatron-core's model
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def extra_state_modules(mla: bool, q_lora: bool) -> tuple[str, ...]:
    """The linear layers of one transformer layer that have an ``_extra_state`` (``mla``: multi-latent attention,
    ``q_lora``: with its query down-projection)."""
    if not mla:
        return EXTRA_STATE_MODULES
    q = ("linear_q_down_proj", "linear_q_up_proj") if q_lora else ("linear_q_proj",)
    attn = tuple(f"self_attention.{m}" for m in (*q, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"))
    return attn + EXTRA_STATE_MODULES[2:]



def tp_split(name: str, swiglu: bool) -> tuple[int, int] | None:
    """How Megatron's model splits our global tensor ``name`` over TP ranks: ``(dim, stride)`` (stride 2: each rank
    holds its block of both halves, SwiGLU's ``[gate_t; up_t]``), or None when it is replicated."""
    suffix = layer_suffix(name)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") or _MTP_EH.match(name):
        return (0, 1)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                  "self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight",
                  "self_attention.linear_kv_up_proj.weight") or suffix in MLA_DOWN:
        return (0, 1)  # (MLA's down-projections as the local spec splits them)
    if suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.shared_experts.linear_fc1.weight"):
        return (0, 2 if swiglu else 1)
    if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight"):
        return (1, 1)
    return None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# a multi-token-prediction depth's transformer layer: ours ``mtp.layers.<k>.mtp_model_layer.<suffix>``
# (megatronish/model/mtp.py); megatron-core names it ``transformer_layer`` (0.16 and before) or ``mtp_model_layer``
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.mtp_model_layer\.(.+)$")
_MTP_EH = re.compile(r"^mtp\.layers\.\d+\.eh_proj\.weight$")  # column-parallel [h, 2h]: split along rows
MTP_LAYER_NAMES = ("transformer_layer", "mtp_model_layer")


def split_layer(name: str) -> tuple[int | None, str]:
    """``decoder.layers.7.mlp.linear_fc1.weight`` -> ``(7, "mlp.linear_fc1.weight")``; others ``(None, name)``."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def split_mtp(name: str) -> tuple[int | None, str]:
    """``mtp.layers.0.mtp_model_layer.mlp.router.weight`` -> ``(0, "mlp.router.weight")``; others
    ``(None, name)``."""
    m = _MTP_LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def layer_suffix(name: str) -> str:
    """The suffix of ``name`` inside its transformer layer (a decoder layer's or an MTP depth's), else ``name``."""
    layer, suffix = split_layer(name)
    return suffix if layer is not None else split_mtp(name)[1]


def torch_dist_keys(name: str, mla: bool = False, moe: bool = False,
                    per_layer: bool = False) -> tuple[tuple[str, ...], int | None]:
    """Our global name -> (the megatron-core keys the writer stores it under, layer index in their prepended axis
    or None); ``mla``: a multi-latent-attention model (its norms' names, the module docstring); ``moe``: a model
    with mixture-of-experts layers (the pre-MLP norm under both names); ``per_layer``: one key per layer."""
    layer, suffix = split_layer(name)
    depth, inner = split_mtp(name)
    if depth is not None:  # one key per tensor, under each of megatron-core's names for the layer
        keys, _ = torch_dist_keys(f"decoder.layers.0.{inner}", mla, moe, per_layer=True)
        return tuple(f"mtp.layers.{depth}.{n}.{k[len('decoder.layers.0.'):]}" for n in MTP_LAYER_NAMES
                     for k in keys), None
    if layer is None:
        return (name,), None
    module = suffix.rsplit(".", 1)[0]
    if per_layer:
        keys, _ = torch_dist_keys(name, mla, moe)
        return tuple(f"decoder.layers.{layer}." + k[len("decoder.layers."):] for k in keys), None
    if moe and module == "pre_mlp_layernorm":
        keys = (LAYER_KEYS[suffix], suffix)
    elif mla and module == "input_layernorm":
        keys = (suffix,)
    elif mla and module in _MLA_BOTH:
        keys = (LAYER_KEYS[suffix], suffix)
    elif module in _MLA_BOTH[1:]:
        keys = (suffix,)  # (standard attention's per-head query norm: megatron-core's module name)
    else:
        keys = (LAYER_KEYS.get(suffix, suffix),)
    return tuple("decoder.layers." + k for k in keys), layer


def stored_arg(args, name, default=None):
    """A stored arg (``args``: Megatron's ``argparse.Namespace``, or a dict of it)."""
    if isinstance(args, dict):
        return args.get(name, default)
    return getattr(args, name, default) if args is not None else default


def per_layer_keys(moe_layer_freq) -> bool:
    """Whether megatron-core stores the layers one key each (its ``non_homogeneous_layers``): MoE layers
    interleaved with dense ones (``--moe-layer-freq`` a list or an int above 1)."""
    return isinstance(moe_layer_freq, (list, tuple)) or (moe_layer_freq or 1) > 1
