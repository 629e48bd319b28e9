"""``--use-checkpoint-args``: take the model-shape flags from the ``--load`` checkpoint's config (Megatron's
``load_args_from_checkpoint``). Flags Megatron fills only when unset on the command line stay as given;
the architecture switches are always taken from the checkpoint.

The ``--load`` path is resolved once (:func:`resolve_load`, the tracker followed); ``configs_from_args`` keeps
that ``(iteration directory, iteration)`` on ``CheckpointConfig.load_resolved``, so the flags and the loaded
weights come from the same iteration and the loader does not resolve the path again."""
from __future__ import annotations

from . import layout, megatron_format
from .dcp_io import CheckpointError
from .offline import read_checkpoint_meta


def _megatron_meta(path: str) -> dict:
    """The config part of :func:`read_checkpoint_meta` for a Megatron-LM checkpoint (from its stored args)."""
    ck = megatron_format.open_checkpoint(path)
    model = megatron_format.model_fields(ck.args, ck.where)
    vocab = megatron_format.true_vocab_size(ck.args)
    data = {}
    if vocab is not None and megatron_format.stored_arg(ck.args, "tokenizer_type") == "NullTokenizer":
        data = {"tokenizer_type": "NullTokenizer", "vocab_size_flag": vocab - 1}
    return {"iter_dir": ck.iter_dir, "config": {"model": model, "data": data}}

# ModelConfig fields (each the argparse dest of its flag) filled only when the command line left them unset.
_IF_UNSET = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "seq_length",
             "max_position_embeddings")
# Always taken from the checkpoint (the mixture-of-experts ones as Megatron's load_args_from_checkpoint forces).
_FORCED = ("position_embedding_type", "rotary_percent", "rotary_base", "normalization", "norm_epsilon", "swiglu",
           "openai_gelu", "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
           "make_vocab_size_divisible_by", "apply_layernorm_1p",
           "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
           "moe_grouped_gemm", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
           "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
           "moe_router_num_groups", "moe_router_group_topk",
           "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
           "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
           "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int",
           "mtp_num_layers", "mtp_loss_scaling_factor")
# Not taken: the token dispatcher is the run's choice (it changes no weight; Megatron keeps the command line's).


def resolve_load(load: str) -> tuple[str, int | None]:
    """``(iteration directory, iteration)`` of the ``--load`` checkpoint (its tracker followed), once per run."""
    try:
        found = layout.resolve(load)
    except CheckpointError as e:
        raise CheckpointError(f"--use-checkpoint-args: {e}") from None
    if found is None:
        raise CheckpointError(f"--use-checkpoint-args: no checkpoint at {load}: no {layout.TRACKER} there and it is "
                              "not an iter_XXXXXXX directory")
    return found


def checkpoint_arg_values(args, iter_dir: str) -> dict:
    """The flag values (argparse dests) that the config stored in ``iter_dir`` gives a run with the flags ``args``
    (which are only read)."""
    try:
        meta = _megatron_meta(iter_dir) if megatron_format.is_megatron(iter_dir) else read_checkpoint_meta(iter_dir)
    except CheckpointError as e:
        raise CheckpointError(f"--use-checkpoint-args: {e}") from None
    model = (meta.get("config") or {}).get("model") or {}
    if not model:
        raise CheckpointError(f"--use-checkpoint-args: checkpoint {meta['iter_dir']} stores no model config")
    values = {field: model[field] for field in _IF_UNSET
              if model.get(field) is not None and getattr(args, field, None) is None}
    values.update({field: model[field] for field in _FORCED if field in model and hasattr(args, field)})
    heads, groups = model.get("num_attention_heads"), model.get("num_query_groups")
    if groups is not None:
        values.update(group_query_attention=groups != heads, num_query_groups=groups)
    data = (meta.get("config") or {}).get("data") or {}
    if args.tokenizer_type is None and args.vocab_size is None and args.vocab_file is None:
        if data.get("tokenizer_type"):
            values["tokenizer_type"] = data["tokenizer_type"]
        if data.get("vocab_size_flag") is not None:
            values["vocab_size"] = data["vocab_size_flag"]
        elif model.get("vocab_size") is not None and values.get("tokenizer_type", args.tokenizer_type) in (
                None, "NullTokenizer"):
            values["tokenizer_type"], values["vocab_size"] = "NullTokenizer", model["vocab_size"] - 1
    return values
