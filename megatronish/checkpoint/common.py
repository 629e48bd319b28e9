"""Names and the run-wide (non-tensor) state of a checkpoint, shared by training saves and the offline API.

Entries of one iteration directory:

* ``model.<global name>`` — a model tensor, global shape (padded vocabulary for the word embedding and the
  output layer); ``<global name>`` uses the global layer number: ``decoder.layers.7.mlp.linear_fc1.weight``.
* ``optimizer.<global name>.<state>`` — ``exp_avg`` / ``exp_avg_sq`` (Adam), ``momentum_buffer`` (SGD),
  ``main_param`` (fp32 master copy of a 16-bit model), global shape like the parameter.
* ``fp8.<layer>.<role>.amax_history`` / ``.scale`` — FP8 delayed-scaling state, when FP8 is on.
* ``common_state`` — JSON (see :func:`common_state`): format, iteration, consumed samples, config, code
  version, layout, scheduler, optimizer scalars.
* ``rng_state.<global rank>`` — JSON: python / numpy / torch / device generators and the TP tracker streams
  of that rank.
"""
from __future__ import annotations

import json
import os
import subprocess

import torch

from .. import __version__
from ..config import config_dict
from .dcp_io import CheckpointError

FORMAT = "megatronish-torch_dist"
FORMAT_VERSION = 1
COMMON = "common_state"
MODEL = "model."
OPTIMIZER = "optimizer."
FP8 = "fp8."
RNG = "rng_state."

# ModelConfig fields that decide parameter shapes or meaning, with the flag a user changes.
SHAPE_FIELDS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
    "kv_channels": "--kv-channels", "vocab_size": "the tokenizer vocabulary size (--vocab-size/--tokenizer-type)",
    "position_embedding_type": "--position-embedding-type", "normalization": "--normalization",
    "swiglu": "--swiglu", "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "add_bias_linear": "--disable-bias-linear", "add_qkv_bias": "--add-qkv-bias",
    "num_experts": "--num-experts", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_layer_freq": "--moe-layer-freq",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_shared_expert_gate": "--moe-shared-expert-gate",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "qk_layernorm": "--qk-layernorm",
    "apply_layernorm_1p": "--apply-layernorm-1p",
    "multi_latent_attention": "--multi-latent-attention", "q_lora_rank": "--q-lora-rank",
    "kv_lora_rank": "--kv-lora-rank", "qk_head_dim": "--qk-head-dim", "qk_pos_emb_head_dim": "--qk-pos-emb-head-dim",
    "v_head_dim": "--v-head-dim",
}


def rng_key(rank: int) -> str:
    return f"{RNG}{rank}"


def jsonable(obj):
    """Plain JSON types for a (nested) dataclass config; a model config as its flat Megatron names
    (:meth:`~megatronish.config.ModelConfig.flat`), the layout every checkpoint stores."""
    return json.loads(json.dumps(config_dict(obj), default=str))


def normalize_config(config) -> dict:
    """A run config as a dict with a ``"model"`` section: accepts a ``RunConfig``, a ``ModelConfig``, a dict
    with a ``"model"`` key, or a flat dict of ``ModelConfig`` fields."""
    cfg = jsonable(config)
    if not isinstance(cfg, dict):
        raise TypeError(f"config must be a dict or a dataclass, got {type(config).__name__}")
    if "model" not in cfg:
        cfg = {"model": cfg}
    return cfg


_CODE_VERSION: dict | None = None


def code_version() -> dict:
    """Package version, git commit of the source tree (when it is a checkout) and torch version."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        commit = None
        if os.path.exists(os.path.join(root, ".git")):
            try:
                out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                     timeout=5)
                commit = out.stdout.strip() or None
            except (OSError, subprocess.SubprocessError):
                commit = None
        _CODE_VERSION = {"megatronish": __version__, "git_commit": commit, "torch": torch.__version__}
    return dict(_CODE_VERSION)


def common_state(iteration: int, config: dict, *, consumed_train_samples: int = 0,
                 consumed_valid_samples: int = 0, layout: dict | None = None, scheduler: dict | None = None,
                 optimizer: dict | None = None, has_rng: bool = False, fp8: dict | None = None,
                 release: bool = False) -> dict:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "iteration": iteration, "release": release,
            "consumed_train_samples": consumed_train_samples, "consumed_valid_samples": consumed_valid_samples,
            "config": config, "code_version": code_version(), "layout": layout, "scheduler": scheduler,
            "optimizer": optimizer, "has_rng": has_rng, "fp8": fp8}


def check_model_config(saved: dict, model_cfg, iter_dir: str) -> None:
    """Raise a :class:`CheckpointError` naming the first model-shape field that differs."""
    saved_model = (saved or {}).get("model") or {}
    current = jsonable(model_cfg)
    for name, flag in SHAPE_FIELDS.items():
        if name not in saved_model or name not in current:
            continue
        a, b = saved_model[name], current[name]
        if a != b:
            raise CheckpointError(f"{flag}: checkpoint {iter_dir} has {name}={a!r}, this run has {b!r}; the "
                                  "checkpoint is from a different model shape (match the flag or pass "
                                  "--use-checkpoint-args)")
    if current.get("position_embedding_type") == "learned_absolute" and "max_position_embeddings" in saved_model \
            and saved_model["max_position_embeddings"] != current.get("max_position_embeddings"):
        raise CheckpointError(f"--max-position-embeddings: checkpoint {iter_dir} has "
                              f"{saved_model['max_position_embeddings']}, this run has "
                              f"{current.get('max_position_embeddings')}; the checkpoint is from a different "
                              "model shape")
