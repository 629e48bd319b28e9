"""Megatron-LM's checkpoint formats: read megatron-core ``torch_dist`` and the legacy ``mp_rank_XX`` files, write
``torch_dist`` (:mod:`.megatron_write`). Dense GPT models (GPT-2 and Llama style, with or without
multi-latent attention); see docs/megatron.md.

**torch_dist** (``--ckpt-format torch_dist``, Megatron-LM's default): an iteration directory holding a DCP index
(``.metadata``), ``__<rank>_<i>.distcp`` data files, ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``)
and ``common.pt`` (``torch.save`` of the non-tensor state: ``args``, ``iteration``, ``checkpoint_version``, the
optimizer's scalars, ``opt_param_scheduler``). Tensor keys carry no layer number: the transformer layers of one
kind are one global tensor with the layer as a prepended axis (``decoder.layers.self_attention.linear_qkv.weight``
is ``[num_layers, qkv, h]``; layer ``i`` is ``[i]``). Each layer's ``_extra_state`` is a ``ShardedObject``
(``<key>._extra_state/shard_<i>_<num_layers>``, pickled; never read here). Norms use the names of Transformer
Engine's fused layers in both of megatron-core's layer specs (:data:`LAYER_KEYS`).

**legacy** (``--ckpt-format torch``): ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` per TP rank ``TT`` and
PP stage ``PPP``, each a ``torch.save`` of ``{"model": local state dict, "args": argparse.Namespace, "iteration",
"checkpoint_version", "optimizer", "opt_param_scheduler", "rng_state"}``; layer numbers are local to the stage.

Both are read without running pickled code: ``torch.load(weights_only=True)`` with an allow-list
(:func:`safe_load`).

**Layouts.** megatron-core's fused ``linear_qkv`` rows are ``num_query_groups`` blocks ``[q_0..q_{r-1}, k, v]``
(``r = heads / groups``, ``kv_channels`` rows each), and ``linear_fc1`` with SwiGLU is ``[gate; up]`` (in
``torch_dist`` globally; each legacy TP file holds its ``[gate_t; up_t]``). Both are exactly our global layouts
(megatronish/model/attention.py, mlp.py), so tensors move without permutation.

**Multi-latent attention** (``multi_latent_attention`` in the args; megatronish/model/mla.py, whose names are
megatron-core's): the projections keep their module names (``self_attention.linear_q_down_proj.weight``, ...) and
layouts in both specs; the up-projections are split by heads over TP. The norms differ by spec, as neither MLA spec
maps names: the local spec stores ``input_layernorm``, ``pre_mlp_layernorm``, ``self_attention.q_layernorm`` and
``self_attention.kv_layernorm`` under their module names; the Transformer Engine spec stores ``input_layernorm``
alike and fuses the others into the following linear (``mlp.linear_fc1.layer_norm_weight``,
``self_attention.linear_q_up_proj.layer_norm_weight``, ``self_attention.linear_kv_up_proj.layer_norm_weight``).
Both are read; the writer stores these three norms under both names, so its output loads into either spec
(megatron-core's loader accepts unused keys by default). The down-projections are split by rows over TP in the
local spec (``ColumnParallelLinear``) and whole on every rank in the Transformer Engine spec
(``parallel_mode="duplicated"``): the same global tensor in ``torch_dist``; a legacy TP file holding the whole
tensor is read as replicated.
"""
from __future__ import annotations

import json
import os
import re

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from . import dcp_io, layout
from .dcp_io import CheckpointError
from .megatron_pickle import safe_load

METADATA_JSON = "metadata.json"
COMMON_PT = "common.pt"
LEGACY_FILE = "model_optim_rng.pt"

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
}
# norms stored under their module names (a layer spec with a separate norm module; legacy files)
_ALT_KEYS = {"input_layernorm.weight": "input_layernorm.weight", "input_layernorm.bias": "input_layernorm.bias",
             "pre_mlp_layernorm.weight": "pre_mlp_layernorm.weight",
             "pre_mlp_layernorm.bias": "pre_mlp_layernorm.bias",
             **{f"self_attention.{n}_layernorm.{k}": f"self_attention.{n}_layernorm.{k}"
                for n in ("q", "kv") for k in ("weight", "bias")}}
# norms of a multi-latent-attention layer stored under both names by the writer (the module docstring)
_MLA_BOTH = ("pre_mlp_layernorm", "self_attention.q_layernorm", "self_attention.kv_layernorm")
# MLA's down-projections: (their suffix, the stored args that give their rows)
_MLA_DOWN = {"self_attention.linear_q_down_proj.weight": ("q_lora_rank",),
             "self_attention.linear_kv_down_proj.weight": ("kv_lora_rank", "qk_pos_emb_head_dim")}
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
    suffix = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (0, 1)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                  "self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight",
                  "self_attention.linear_kv_up_proj.weight") or suffix in _MLA_DOWN:
        return (0, 1)  # (MLA's down-projections as the local spec splits them)
    if suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        return (0, 2 if swiglu else 1)
    if suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return (1, 1)
    return None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def split_layer(name: str) -> tuple[int | None, str]:
    """``decoder.layers.7.mlp.linear_fc1.weight`` -> ``(7, "mlp.linear_fc1.weight")``; others ``(None, name)``."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def torch_dist_keys(name: str, mla: bool = False) -> tuple[tuple[str, ...], int | None]:
    """Our global name -> (the megatron-core keys the writer stores it under, layer index in their prepended axis
    or None); ``mla``: a multi-latent-attention model (its norms' names, the module docstring)."""
    layer, suffix = split_layer(name)
    if layer is None:
        return (name,), None
    module = suffix.rsplit(".", 1)[0]
    if mla and module == "input_layernorm":
        keys = (suffix,)
    elif mla and module in _MLA_BOTH:
        keys = (LAYER_KEYS[suffix], suffix)
    elif module in _MLA_BOTH[1:]:
        keys = (suffix,)  # (standard attention's per-head query norm: megatron-core's module name)
    else:
        keys = (LAYER_KEYS.get(suffix, suffix),)
    return tuple("decoder.layers." + k for k in keys), layer


# ---------------------------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------------------------
def legacy_files(iter_dir: str) -> dict[tuple[int, int], str]:
    """``{(tp rank, pp stage): path}`` of a legacy iteration directory (empty when it is not one)."""
    out = {}
    if not os.path.isdir(iter_dir):
        return out
    for d in os.listdir(iter_dir):
        m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?", d)
        if m:
            out[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(iter_dir, d, LEGACY_FILE)
    return out


def detect(iter_dir: str) -> str | None:
    """``"torch_dist"``, ``"legacy"``, or None for a directory that is not Megatron's. A Megatron format this
    reader does not read is an error naming it."""
    meta = os.path.join(iter_dir, METADATA_JSON)
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{meta} is not valid JSON ({e})") from None
        if backend == "torch_dist":
            return "torch_dist"
        raise CheckpointError(f"{iter_dir}: Megatron checkpoint format {backend!r} ({meta}) cannot be read; "
                              "re-save it with --ckpt-format torch_dist (or torch)")
    if legacy_files(iter_dir):
        return "legacy"
    if os.path.isfile(os.path.join(iter_dir, COMMON_PT)):
        raise CheckpointError(f"{iter_dir} has {COMMON_PT} but no {METADATA_JSON}: not a complete Megatron "
                              "torch_dist checkpoint")
    return None


def resolve(path: str) -> tuple[str, int | None]:
    """The iteration directory of a Megatron ``--load`` path (the tracker is followed) and its iteration."""
    found = layout.resolve(path)
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}: no {layout.TRACKER} there and it is not an iter_XXXXXXX "
                              "directory")
    return found


def stored_arg(args, name, default=None):
    """A stored arg (``args``: Megatron's ``argparse.Namespace``, or a dict of it)."""
    if isinstance(args, dict):
        return args.get(name, default)
    return getattr(args, name, default) if args is not None else default


# Megatron args that this reader cannot represent: (arg, the value that is fine)
_UNSUPPORTED = (("num_experts", None), ("qk_layernorm", False), ("apply_layernorm_1p", False),
                ("squared_relu", False), ("rotary_interleaved", False), ("use_rope_scaling", False),
                ("apply_residual_connection_post_layernorm", False))
# multi-latent attention's args (Megatron's names, ours alike) and its RoPE/YaRN settings
_MLA_ARGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
             "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
             "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int")


def model_fields(args, where: str) -> dict:
    """Our ``ModelConfig`` fields (all but ``vocab_size``) from Megatron's ``args``."""
    if args is None:
        raise CheckpointError(f"{where} stores no args; the model shape is unknown")
    mla = bool(stored_arg(args, "multi_latent_attention", False))
    for name, fine in _UNSUPPORTED:
        value = stored_arg(args, name)
        if mla and name == "qk_layernorm":
            continue  # multi-latent attention's latent norms (Qwen3-style per-head norms are not read)
        if value is not None and value != fine:
            raise CheckpointError(f"{where}: --{name.replace('_', '-')} {value!r} is not supported when reading "
                                  "Megatron checkpoints (dense GPT-2/Llama-style models, with or without "
                                  "--multi-latent-attention)")
    heads = stored_arg(args, "num_attention_heads")
    groups = stored_arg(args, "num_query_groups") if stored_arg(args, "group_query_attention") else heads
    fields = {
        "num_layers": stored_arg(args, "num_layers"), "hidden_size": stored_arg(args, "hidden_size"),
        "num_attention_heads": heads, "num_query_groups": groups or heads,
        "ffn_hidden_size": stored_arg(args, "ffn_hidden_size"), "kv_channels": stored_arg(args, "kv_channels"),
        "seq_length": stored_arg(args, "seq_length") or stored_arg(args, "max_position_embeddings") or 1024,
        "max_position_embeddings": stored_arg(args, "max_position_embeddings"),
        "position_embedding_type": stored_arg(args, "position_embedding_type", "learned_absolute"),
        "rotary_base": int(stored_arg(args, "rotary_base", 10000) or 10000),
        "rotary_percent": float(stored_arg(args, "rotary_percent", 1.0) or 1.0),
        "normalization": stored_arg(args, "normalization", "LayerNorm"),
        "norm_epsilon": float(stored_arg(args, "norm_epsilon", 1e-5)),
        "swiglu": bool(stored_arg(args, "swiglu", False)), "openai_gelu": bool(stored_arg(args, "openai_gelu", False)),
        "untie_embeddings_and_output_weights": bool(stored_arg(args, "untie_embeddings_and_output_weights", False)),
        "add_bias_linear": bool(stored_arg(args, "add_bias_linear", True)),
        "add_qkv_bias": bool(stored_arg(args, "add_qkv_bias", False)),
        "make_vocab_size_divisible_by": int(stored_arg(args, "make_vocab_size_divisible_by", 128) or 128),
        "init_method_std": float(stored_arg(args, "init_method_std", 0.02) or 0.02),
    }
    fields.update(multi_latent_attention=mla, qk_layernorm=mla and bool(stored_arg(args, "qk_layernorm", False)))
    if mla:
        fields.update({k: stored_arg(args, k) for k in _MLA_ARGS})
        fields["q_lora_rank"] = stored_arg(args, "q_lora_rank")  # None: a full-rank query projection
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if fields[k] is None]
    if missing:
        raise CheckpointError(f"{where}: the stored args have no {missing[0]}; the model shape is unknown")
    if fields["position_embedding_type"] not in ("learned_absolute", "rope", "none"):
        raise CheckpointError(f"{where}: --position-embedding-type {fields['position_embedding_type']!r} is not "
                              "supported (learned_absolute, rope or none)")
    return {k: v for k, v in fields.items() if v is not None or k == "q_lora_rank"}


def true_vocab_size(args) -> int | None:
    """The tokenizer's vocabulary when the args tell it (NullTokenizer: ``--vocab-size`` + 1 for its eod)."""
    vs = stored_arg(args, "vocab_size")
    if vs is None:
        return None
    return int(vs) + 1 if stored_arg(args, "tokenizer_type") == "NullTokenizer" else int(vs)


# ---------------------------------------------------------------------------------------------------------------
# torch_dist
# ---------------------------------------------------------------------------------------------------------------
class TorchDist:
    """A megatron-core ``torch_dist`` iteration directory: its index, ``common.pt`` and args, and our global tensors
    read one at a time (each read touches only the chunks of that layer)."""

    def __init__(self, iter_dir: str):
        self.iter_dir = iter_dir
        self.md = dcp_io.read_index(iter_dir)
        dcp_io.check_files(iter_dir, self.md)
        path = os.path.join(iter_dir, COMMON_PT)
        if not os.path.isfile(path):
            raise CheckpointError(f"{iter_dir}: no {COMMON_PT}; the Megatron checkpoint is incomplete")
        self.common = safe_load(path, path)
        if not isinstance(self.common, dict):
            raise CheckpointError(f"{path} does not hold a dict")
        self.args = self.common.get("args")
        self.where = path
        keys = self.md.state_dict_metadata
        self.tensor_keys = {k: v for k, v in keys.items() if hasattr(v, "size")}
        for k in self.tensor_keys:
            if ".experts." in k or ".router." in k:
                raise CheckpointError(f"{iter_dir} holds Mixture-of-Experts tensor {k!r}; only dense models are read")
        self.layer_key = {}
        self.aliases = set()  # a norm's second name where both are stored (our writer's MLA norms)
        for ours, key in LAYER_KEYS.items():
            found = [c for c in dict.fromkeys(("decoder.layers." + key, "decoder.layers." + _ALT_KEYS.get(ours, key)))
                     if c in self.tensor_keys]
            if found:
                self.layer_key[ours] = found[0]
                self.aliases.update(found[1:])

    @property
    def iteration(self) -> int:
        it = self.common.get("iteration")
        return int(it) if it is not None else 0

    def key_of(self, name: str) -> tuple[str, int | None]:
        layer, suffix = split_layer(name)
        if layer is None:
            return name, None
        return self.layer_key.get(suffix, "decoder.layers." + LAYER_KEYS.get(suffix, suffix)), layer

    def model_keys(self) -> list[str]:
        """Tensor keys of the model (not optimizer, not RNG)."""
        return sorted(k for k in self.tensor_keys if not k.startswith(("optimizer.", "rng_state"))
                      and k not in self.aliases)

    def shape(self, name: str) -> tuple[int, ...] | None:
        key, layer = self.key_of(name)
        tmd = self.tensor_keys.get(key)
        if tmd is None:
            return None
        size = tuple(tmd.size)
        return size[1:] if layer is not None else size

    def dtype(self, name: str) -> torch.dtype:
        return self.tensor_keys[self.key_of(name)[0]].properties.dtype

    def read(self, name: str, prefix: str = "") -> torch.Tensor:
        """Our global tensor ``name`` (``prefix``: e.g. ``optimizer.state.exp_avg.``)."""
        key, layer = self.key_of(name)
        key = prefix + key
        tmd = self.tensor_keys.get(key)
        if tmd is None:
            raise CheckpointError(f"{self.iter_dir}: no tensor {key!r} (needed for {name})")
        size = tuple(tmd.size)
        if layer is None:
            return read_region(self.iter_dir, self.md, key, (0,) * len(size), size)
        if layer >= size[0]:
            raise CheckpointError(f"{self.iter_dir}: {key!r} has {size[0]} layers, layer {layer} was asked for")
        return read_region(self.iter_dir, self.md, key, (layer,) + (0,) * (len(size) - 1), (1, *size[1:]))[0]


def read_region(iter_dir: str, md, key: str, offsets, sizes) -> torch.Tensor:
    """The block ``[offsets, offsets + sizes)`` of stored tensor ``key``, from the chunks that overlap it."""
    tmd = md.state_dict_metadata[key]
    out = torch.empty(tuple(sizes), dtype=tmd.properties.dtype)
    filled = 0
    for chunk in tmd.chunks:
        lo = [max(a, b) for a, b in zip(offsets, chunk.offsets)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        info = md.storage_data[MetadataIndex(key, chunk.offsets)]
        if info.transform_descriptors:
            raise CheckpointError(f"{key!r} in {iter_dir} uses storage transforms {info.transform_descriptors}, "
                                  "which this reader does not support")
        raw, path = dcp_io.read_range(iter_dir, info, key)
        part = dcp_io.load_item(raw, path, dcp_io.item_name(MetadataIndex(key, chunk.offsets)))
        lengths = [h - low for low, h in zip(lo, hi)]
        src = dcp_io.narrow(part.reshape(tuple(chunk.sizes)), [a - b for a, b in zip(lo, chunk.offsets)], lengths)
        dcp_io.narrow(out, [a - b for a, b in zip(lo, offsets)], lengths).copy_(src)
        filled += src.numel()
    if filled != out.numel():
        raise CheckpointError(f"{iter_dir}: the stored chunks of {key!r} do not cover the block {list(offsets)} + "
                              f"{list(sizes)}; the checkpoint is incomplete")
    return out


# ---------------------------------------------------------------------------------------------------------------
# legacy
# ---------------------------------------------------------------------------------------------------------------
class Legacy:
    """A legacy iteration directory: TP files merged, PP stages' local layer numbers made global. Files are opened
    memory-mapped one pipeline stage at a time."""

    def __init__(self, iter_dir: str):
        self.iter_dir = iter_dir
        self.files = legacy_files(iter_dir)
        first = self.files[min(self.files)]
        if not os.path.isfile(first):
            raise CheckpointError(f"missing checkpoint file {first}")
        self._stage, self._sds = None, None
        head = self._load(first)
        self.args = head.get("args")
        self.where = first
        self.common = {k: v for k, v in head.items() if not k.startswith("model")}
        self.tp = int(stored_arg(self.args, "tensor_model_parallel_size", 1) or 1)
        self.pp = int(stored_arg(self.args, "pipeline_model_parallel_size", 1) or 1)
        if "model" not in head:
            chunks = sorted(k for k in head if k.startswith("model"))
            raise CheckpointError(f"{first} holds model chunks {chunks} (virtual pipeline stages); convert it to "
                                  "torch_dist or save without --num-layers-per-virtual-pipeline-stage")
        for t in range(self.tp):
            for p in range(self.pp):
                path = self.files.get((t, p))
                if path is None or not os.path.isfile(path):
                    expect = os.path.join(iter_dir, f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else ""),
                                          LEGACY_FILE)
                    raise CheckpointError(f"missing checkpoint file {expect} (the args say TP {self.tp} x PP "
                                          f"{self.pp})")
        layers = int(stored_arg(self.args, "num_layers"))
        if any(stored_arg(self.args, f"decoder_{end}_pipeline_num_layers") for end in ("first", "last")):
            raise CheckpointError(f"{first}: uneven pipeline stages (--decoder-first/last-pipeline-num-layers) are "
                                  "not supported by the legacy reader")
        if layers % self.pp:
            raise CheckpointError(f"{first}: {layers} layers do not split evenly over {self.pp} pipeline stages")
        self.per_stage = layers // self.pp
        self.swiglu = bool(stored_arg(self.args, "swiglu", False))

    def _load(self, path: str) -> dict:
        if not os.path.isfile(path):
            raise CheckpointError(f"missing checkpoint file {path}")
        obj = safe_load(path, path)
        if not isinstance(obj, dict):
            raise CheckpointError(f"{path} does not hold a dict")
        return obj

    @property
    def iteration(self) -> int:
        return int(self.common.get("iteration") or 0)

    def _stage_sds(self, stage: int) -> list[dict]:
        if self._stage != stage:
            self._sds = None
            self._sds = [self._load(self.files[(t, stage)])["model"] for t in range(self.tp)]
            self._stage = stage
        return self._sds

    def _local(self, name: str) -> tuple[int, list[str]]:
        """(stage, candidate local names) of our global ``name``."""
        layer, suffix = split_layer(name)
        if layer is not None:
            stage, local = divmod(layer, self.per_stage)
            cands = [f"decoder.layers.{local}.{s}" for s in dict.fromkeys((suffix, _ALT_KEYS.get(suffix, suffix),
                                                                          LAYER_KEYS[suffix]))]
            return stage, cands
        if name.startswith("embedding."):
            return 0, [name]
        return self.pp - 1, [name]

    def names(self) -> list[str]:
        """Our global names of every model tensor in the files (extra states dropped)."""
        out = []
        inverse = {}
        for ours, key in LAYER_KEYS.items():
            inverse[key] = ours
            inverse[_ALT_KEYS.get(ours, ours)] = ours
        for stage in range(self.pp):
            for k, v in self._stage_sds(stage)[0].items():
                if k.endswith("_extra_state") or not isinstance(v, torch.Tensor):
                    continue
                layer, suffix = split_layer(k)
                if k == "output_layer.weight" and not stored_arg(self.args, "untie_embeddings_and_output_weights"):
                    continue  # the last stage's copy of the tied word embedding
                if layer is None:
                    if k not in out:
                        out.append(k)
                    continue
                if suffix not in inverse:
                    raise CheckpointError(f"{self.files[(0, stage)]}: unexpected tensor {k!r}")
                out.append(f"decoder.layers.{stage * self.per_stage + layer}.{inverse[suffix]}")
        return out

    def shape(self, name: str) -> tuple[int, ...] | None:
        try:
            parts = self._parts(name)
        except CheckpointError:
            return None
        shape = list(parts[0].shape)
        split = self._split(name, parts[0])
        if split is not None:
            shape[split[0]] *= self.tp
        return tuple(shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._parts(name)[0].dtype

    def _parts(self, name: str) -> list[torch.Tensor]:
        """The TP ranks' local tensors of our global ``name`` (memory-mapped)."""
        stage, cands = self._local(name)
        sds = self._stage_sds(stage)
        key = next((c for c in cands if c in sds[0]), None)
        if key is None:
            raise CheckpointError(f"{self.files[(0, stage)]}: no tensor {cands[0]!r} (needed for {name})")
        parts = []
        for t, sd in enumerate(sds):
            if not isinstance(sd.get(key), torch.Tensor):
                raise CheckpointError(f"{self.files[(t, stage)]}: no tensor {key!r} (needed for {name})")
            parts.append(sd[key])
        return parts

    def _split(self, name: str, part: torch.Tensor) -> tuple[int, int] | None:
        """:func:`tp_split` of ``name`` in these files; None for an MLA down-projection each file holds whole (the
        Transformer Engine spec's, duplicated over TP)."""
        rows = _MLA_DOWN.get(split_layer(name)[1])
        if rows is not None and part.size(0) == sum(int(stored_arg(self.args, a) or 0) for a in rows):
            return None
        return tp_split(name, self.swiglu)

    def read(self, name: str) -> torch.Tensor:
        parts = self._parts(name)
        split = self._split(name, parts[0])
        if split is None or self.tp == 1:
            return parts[0].clone()
        dim, stride = split
        blocks = [p.chunk(stride, dim) for p in parts]
        return torch.cat([blocks[t][k] for k in range(stride) for t in range(self.tp)], dim)


def open_checkpoint(path: str) -> TorchDist | Legacy:
    """The Megatron checkpoint at ``path`` (a save directory with a tracker, or an iteration directory)."""
    iter_dir, _ = resolve(path)
    kind = detect(iter_dir)
    if kind == "torch_dist":
        return TorchDist(iter_dir)
    if kind == "legacy":
        return Legacy(iter_dir)
    raise CheckpointError(f"{iter_dir} is not a Megatron checkpoint (no {METADATA_JSON} of a torch_dist "
                          f"checkpoint, no mp_rank_XX/{LEGACY_FILE})")


def is_megatron(path: str) -> bool:
    """Whether ``path`` (a save or iteration directory) resolves to a Megatron checkpoint."""
    try:
        found = layout.resolve(path)
    except CheckpointError:
        return False
    return found is not None and detect(found[0]) is not None


__all__ = ["CheckpointError", "Legacy", "TorchDist", "detect", "is_megatron", "model_fields", "open_checkpoint",
           "read_region"]
