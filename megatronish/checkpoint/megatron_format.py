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

**Mixture of experts** (``num_experts`` in the args; megatronish/model/moe/, whose names are megatron-core's but
for the experts): the router (``mlp.router.weight``, ``mlp.router.expert_bias``) and the shared experts
(``mlp.shared_experts.linear_fc1/linear_fc2.weight``, ``gate_weight``) keep their names. megatron-core's three
expert modules (SequentialMLP, TEGroupedMLP, the legacy GroupedMLP) store the same ``torch_dist`` tensors,
``mlp.experts.experts.linear_fc1.weight`` ``[E, 2F, h]`` (each expert's ``[gate; up]``) and ``linear_fc2.weight``
``[E, h, F]``, global expert numbers along their first axis: our stacked expert tensors
(``mlp.experts.linear_fc1.weight``). A model whose layers differ (``--moe-layer-freq`` other than 1) is stored
one key per layer (``decoder.layers.<i>.<suffix>``, no layer axis; megatron-core's ``non_homogeneous_layers``),
so a layer's tensor is looked up under either form. In legacy files each rank holds its EP rank's local experts
(``mp_rank_TT[_PPP]_EEE``; ``local_experts.<j>.``, TEGroupedMLP's ``linear_fc1.weight<j>`` or GroupedMLP's
``weight1/weight2``), split over expert tensor parallelism (:mod:`.megatron_legacy`). With the Transformer Engine
spec an MoE layer keeps ``pre_mlp_layernorm`` as a module (its dense layers fuse it): both names are read per
layer, and the writer stores it under both.

**Multi-token prediction** (``mtp_num_layers`` in the args; megatronish/model/mtp.py): the depths live on the last
pipeline stage and keep megatron-core's names (``mtp.layers.<k>.enorm``, ``hnorm``, ``eh_proj``,
``final_layernorm``), one key per tensor (no layer axis); ``eh_proj`` is column-parallel (``[h, 2h]`` split along
rows). The depth's transformer layer is ``transformer_layer`` in megatron-core 0.16 and before and
``mtp_model_layer`` (ours) later: either is read, with a decoder layer's suffixes; the writer stores both.
"""
from __future__ import annotations

import json
import os
import re

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from . import dcp_io, layout
from .dcp_io import CheckpointError
from .megatron_legacy import LEGACY_FILE, Legacy, legacy_files
from .megatron_names import ALT_KEYS, LAYER_KEYS, MTP_LAYER_NAMES, split_layer, split_mtp, stored_arg
from .megatron_pickle import safe_load

METADATA_JSON = "metadata.json"
# a stored key of an MTP depth's transformer layer: depth, megatron-core's name for the layer, suffix
_MTP_STORED = re.compile(r"^mtp\.layers\.(\d+)\.(" + "|".join(MTP_LAYER_NAMES) + r")\.(.+)$")
COMMON_PT = "common.pt"

# ---------------------------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------------------------
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


# Megatron args that this reader cannot represent: (arg, the value that is fine)
_UNSUPPORTED = (("qk_layernorm", False), ("apply_layernorm_1p", False),
                ("squared_relu", False), ("rotary_interleaved", False), ("use_rope_scaling", False),
                ("apply_residual_connection_post_layernorm", False))
# multi-latent attention's args (Megatron's names, ours alike) and its RoPE/YaRN settings
_MLA_ARGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
             "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
             "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int")
# mixture of experts' args that shape or route the model (Megatron's names, ours alike)
MOE_ARGS = ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
            "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
            "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
            "moe_shared_expert_gate", "moe_grouped_gemm")

# multi-token prediction's args (Megatron's names, ours alike)
MTP_ARGS = ("mtp_num_layers", "mtp_loss_scaling_factor")


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
                                  "Megatron checkpoints (GPT-2/Llama-style models, with or without "
                                  "--multi-latent-attention or --num-experts)")
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
    fields.update({k: stored_arg(args, k) for k in MTP_ARGS})
    if stored_arg(args, "num_experts"):
        fields.update({k: stored_arg(args, k) for k in MOE_ARGS})
        if isinstance(fields["moe_layer_freq"], tuple):
            fields["moe_layer_freq"] = list(fields["moe_layer_freq"])
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
            if re.search(r"\.experts\.\d+\.", k):
                raise CheckpointError(f"{iter_dir} stores experts one key each ({k!r}, megatron-core's "
                                      "singleton_local_shards); re-save it without that option")
        # (slot, megatron-core suffix) -> (key, index in its layer axis or None); slot: a decoder layer's number
        # (stacked keys and per-layer ones), or (depth, name) of an MTP depth's transformer layer
        self._where: dict[tuple, tuple[str, int | None]] = {}
        for k, tmd in self.tensor_keys.items():
            layer, rest = split_layer(k)
            m = _MTP_STORED.match(k)
            if layer is not None:
                self._where[(layer, rest)] = (k, None)
            elif m:
                self._where[((int(m.group(1)), m.group(2)), m.group(3))] = (k, None)
            elif k.startswith("decoder.layers."):
                for c in tmd.chunks:
                    self._where.update({(i, k[len("decoder.layers."):]): (k, i)
                                        for i in range(c.offsets[0], c.offsets[0] + c.sizes[0])})
        # a tensor's later name where the writer stored two (a norm's second name, an MTP layer under both of
        # megatron-core's names): every place it holds has an earlier one too
        shadowed: dict[str, set] = {}
        places = {("mtp", s[0]) if isinstance(s, tuple) else s: None for s, _ in self._where}
        suffixes = set(LAYER_KEYS) | {rest for _, rest in self._where}
        for place in places:
            for ours in suffixes:
                seen = False
                for hit in (self._where.get(w) for w in self._tries(place, ours)):
                    if hit is not None:
                        shadowed.setdefault(hit[0], set()).add(seen)
                        seen = True
        self.aliases = {k for k, flags in shadowed.items() if all(flags)}

    @staticmethod
    def _tries(place, suffix: str) -> list[tuple]:
        """The ``_where`` entries that may hold our ``suffix`` of ``place`` (a decoder layer's number, or
        ``("mtp", depth)``), in the order they are looked up."""
        cands = dict.fromkeys((LAYER_KEYS.get(suffix, suffix), ALT_KEYS.get(suffix, suffix)))
        slots = [(place[1], n) for n in MTP_LAYER_NAMES] if isinstance(place, tuple) else [place]
        return [(slot, c) for slot in slots for c in cands]

    @property
    def iteration(self) -> int:
        it = self.common.get("iteration")
        return int(it) if it is not None else 0

    def key_of(self, name: str) -> tuple[str, int | None]:
        """The stored key of our global tensor ``name`` and its index in the key's layer axis (None: the key is
        the tensor: a non-layer tensor, or a layer stored under its own key)."""
        layer, suffix = split_layer(name)
        depth, inner = split_mtp(name)
        if depth is not None:
            for at in self._tries(("mtp", depth), inner):
                hit = self._where.get(at)
                if hit is not None:
                    return hit
            return f"mtp.layers.{depth}.{MTP_LAYER_NAMES[0]}.{LAYER_KEYS.get(inner, inner)}", None
        if layer is None:
            return name, None
        for at in self._tries(layer, suffix):
            hit = self._where.get(at)
            if hit is not None:
                return hit
        return "decoder.layers." + LAYER_KEYS.get(suffix, suffix), layer

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
           "read_region", "stored_arg"]
