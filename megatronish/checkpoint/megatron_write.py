"""Writing Megatron-LM's ``torch_dist`` format (megatronish/checkpoint/megatron_format.py describes it): the
model's tensors streamed into megatron-core's keys and TP blocks, ``common.pt`` with Megatron's args, and
``metadata.json``."""
from __future__ import annotations

import argparse
import io
import json
import os
import re
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from . import dcp_io
from .dcp_io import CheckpointError
from .megatron_format import COMMON_PT, METADATA_JSON, MOE_ARGS, MTP_ARGS
from .megatron_names import MTP_LAYER_NAMES, extra_state_modules, per_layer_keys, torch_dist_keys, tp_split


def args_to_namespace(cfg, *, tp: int, pp: int, padded_vocab: int, iteration: int = 0) -> argparse.Namespace:
    """Megatron's args for a checkpoint we write (the model-shape flags, the layout, the format)."""
    gqa = cfg.num_query_groups != cfg.num_attention_heads
    a = cfg.attention
    mla = {}
    if a.multi_latent_attention:  # Megatron's names (megatron_format._MLA_ARGS reads them back)
        mla = {k: getattr(a, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                          "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale",
                                          "mscale_all_dim", "yarn_original_max_position_embeddings", "yarn_beta_fast",
                                          "yarn_beta_slow", "yarn_correction_range_round_to_int")}
    moe = {"num_experts": None}
    if cfg.moe.num_experts:  # Megatron's names (megatron_format.MOE_ARGS reads them back)
        moe = {k: getattr(cfg.moe, k) for k in MOE_ARGS}
    return argparse.Namespace(
        multi_latent_attention=a.multi_latent_attention, qk_layernorm=a.qk_layernorm, **mla, **moe,
        **{k: getattr(cfg, k) for k in MTP_ARGS},
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=gqa,
        num_query_groups=cfg.num_query_groups if gqa else 1, kv_channels=cfg.kv_channels,
        seq_length=cfg.seq_length, max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type=cfg.attention.position_embedding_type, rotary_base=cfg.attention.rotary_base,
        rotary_percent=cfg.attention.rotary_percent, normalization=cfg.normalization, norm_epsilon=cfg.norm_epsilon,
        swiglu=cfg.swiglu, openai_gelu=cfg.openai_gelu,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.attention.add_qkv_bias,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by, init_method_std=cfg.init_method_std,
        padded_vocab_size=padded_vocab, vocab_size=None, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, ckpt_format="torch_dist", iteration=iteration,
        consumed_train_samples=0, consumed_valid_samples=0)


def _blocks(shape: tuple[int, ...], split: tuple[int, int] | None, tp: int) -> list[tuple[tuple, tuple]]:
    """(offsets, sizes) of the chunks TP ranks hold of a tensor of ``shape``."""
    if split is None or tp == 1 or shape[split[0]] % (split[1] * tp):
        return [((0,) * len(shape), tuple(shape))]  # (a size TP does not divide: one chunk, read by any rank)
    dim, stride = split
    block = shape[dim] // stride
    part = block // tp
    out = []
    for k in range(stride):
        for t in range(tp):
            off = [0] * len(shape)
            size = list(shape)
            off[dim], size[dim] = k * block + t * part, part
            out.append((tuple(off), tuple(size)))
    return out


def extra_state_bytes() -> bytes:
    """What megatron-core stores as a local linear layer's ``_extra_state`` (a list of its one ``None``)."""
    buf = io.BytesIO()
    torch.save([None], buf)
    return buf.getvalue()


def _is_moe_layer(moe, i: int) -> bool:
    """Whether layer ``i`` (0-based) is a mixture-of-experts layer under ``--moe-layer-freq``."""
    if not moe.num_experts:
        return False
    freq = moe.moe_layer_freq
    return bool(freq[i]) if isinstance(freq, (list, tuple)) else i % freq == 0


def extra_state_keys(cfg, per_layer: bool) -> list[str]:
    """The ``ShardedObject`` keys of megatron-core's ``_extra_state`` entries: one per layer and linear layer
    (``<key>/shard_<layer>_<layers>``; ``/shard_0_1`` when layers are stored one key each), and one per expert for
    the experts' (``shard_<layer>.<expert>_<layers>.<experts>``, or ``shard_<expert>_<experts>``)."""
    L, E = cfg.num_layers, cfg.moe.num_experts
    modules = extra_state_modules(cfg.attention.multi_latent_attention, cfg.attention.q_lora_rank is not None)
    out = []
    # the decoder's layers, then each MTP depth's (one key each, under both names; an MoE layer when the
    # decoder's last layer is one, megatronish/model/mtp.py): (prefix, layer axis position or None, MoE layer)
    layers = [(f"decoder.layers.{i}." if per_layer else "decoder.layers.", None if per_layer else i,
               _is_moe_layer(cfg.moe, i)) for i in range(L)]
    for k in range(cfg.mtp_num_layers or 0):
        out.append(f"mtp.layers.{k}.eh_proj._extra_state/shard_0_1")
        layers += [(f"mtp.layers.{k}.{n}.", None, _is_moe_layer(cfg.moe, L - 1)) for n in MTP_LAYER_NAMES]
    for prefix, i, moe in layers:
        at, of = ("0", "1") if i is None else (str(i), str(L))
        if not moe:
            out += [f"{prefix}{m}._extra_state/shard_{at}_{of}" for m in modules]
            continue
        mods = [m for m in modules if not m.startswith("mlp.")]
        if cfg.moe.moe_shared_expert_intermediate_size:
            mods += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
        out += [f"{prefix}{m}._extra_state/shard_{at}_{of}" for m in mods]
        for e in range(E):
            where = f"shard_{e}_{E}" if i is None else f"shard_{i}.{e}_{L}.{E}"
            out += [f"{prefix}mlp.experts.experts.{fc}._extra_state/{where}" for fc in ("linear_fc1", "linear_fc2")]
    return out


def write_torch_dist(iter_dir: str, cfg, specs, tensors: Iterator, *, tp: int, pp: int, padded_vocab: int,
                     iteration: int = 0) -> None:
    """Write our global tensors (``specs``: ``(name, shape, dtype)`` in the order ``tensors`` yields
    ``(name, tensor)``; vocabulary rows already padded to ``padded_vocab``) as a megatron-core ``torch_dist``
    checkpoint in ``iter_dir``: stacked layer keys, each chunk as the TP rank of a TP x PP run holds it, one
    ``_extra_state`` object per layer and linear layer, ``common.pt`` and ``metadata.json``."""
    L = cfg.num_layers
    mla = cfg.attention.multi_latent_attention
    moe = bool(cfg.moe.num_experts)
    per_layer = moe and per_layer_keys(cfg.moe.moe_layer_freq)
    state: dict = {}
    makers: dict[tuple, tuple] = {}
    order = []
    for name, shape, dtype in specs:
        keys, layer = torch_dist_keys(name, mla, moe, per_layer)
        gshape = tuple(shape) if layer is None else (L, *shape)
        for key in keys:
            entry = state.get(key)
            if entry is None:
                entry = state[key] = dcp_io.Sharded(gshape, [])
            for off, size in _blocks(tuple(shape), tp_split(name, cfg.swiglu), tp):
                full_off = off if layer is None else (layer, *off)
                full_size = size if layer is None else (1, *size)
                entry.pieces.append(dcp_io.Piece(torch.empty(full_size, dtype=dtype, device="meta"), full_off))
                makers[(key, full_off)] = (name, off, size, layer is not None)
            order.append(key)
    for key in extra_state_keys(cfg, per_layer):
        state[key] = _RawBytes(extra_state_bytes())

    source = iter(tensors)
    held: dict[str, torch.Tensor] = {}  # tensors produced and not yet written in full
    left = {}  # pieces still to write, per tensor
    for name, *_ in makers.values():
        left[name] = left.get(name, 0) + 1

    def produce(key, offsets):
        name, off, size, stacked = makers[(key, tuple(offsets))]
        while name not in held:
            try:
                got, t = next(source)
            except StopIteration:
                raise CheckpointError(f"the model tensors ended before {name!r}") from None
            if got not in left:
                raise CheckpointError(f"unexpected tensor {got!r} for this model")
            held[got] = t.detach().cpu()
        block = dcp_io.narrow(held[name], off, size).contiguous()
        left[name] -= 1
        if not left[name]:
            del held[name]
        return block.unsqueeze(0) if stacked else block

    from .offline import _save_streaming

    _save_streaming(state, iter_dir, _LazyPlanner(produce, order=order))
    torch.save({"args": args_to_namespace(cfg, tp=tp, pp=pp, padded_vocab=padded_vocab, iteration=iteration),
                "checkpoint_version": 3.0, "iteration": iteration}, os.path.join(iter_dir, COMMON_PT))
    with open(os.path.join(iter_dir, METADATA_JSON), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)


_MTP_ORDER = 1 << 30  # (the write order of MTP depth k: after every decoder layer)


class _RawBytes:
    """A byte entry written as it is (megatron-core's pickled ``ShardedObject`` payload)."""

    def __init__(self, data: bytes):
        self.data = data


class _LazyPlanner(dcp_io.SavePlanner):
    """Plans from meta-tensor pieces; each piece is produced when DCP writes it, in our tensors' order."""

    def __init__(self, produce, order):
        super().__init__()
        self._produce = produce
        self._rank = {k: i for i, k in enumerate(dict.fromkeys(order))}
        self.failure: BaseException | None = None

    def create_local_plan(self):
        items = []
        for key, entry in self.state_dict.items():
            if isinstance(entry, _RawBytes):
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        everything = self.state_dict
        self.state_dict = {k: v for k, v in everything.items() if not isinstance(v, _RawBytes)}
        try:
            plan = super().create_local_plan()
        finally:
            self.state_dict = everything
        # the source yields layer by layer: write layer 0's tensors first, then layer 1's, ...
        plan_items = sorted(plan.items, key=lambda w: (self._layer(w), self._rank.get(w.index.fqn, 0)))
        self.plan = SavePlan(items + plan_items)
        return self.plan

    @staticmethod
    def _layer(w) -> int:
        """The layer a write item belongs to (-1: not a layer's; MTP depths after every decoder layer): from its
        key or its offset on the layer axis."""
        m = re.match(r"decoder\.layers\.(\d+)\.", w.index.fqn)
        if m:
            return int(m.group(1))
        m = re.match(r"mtp\.layers\.(\d+)\.", w.index.fqn)
        if m:
            return _MTP_ORDER + int(m.group(1))
        return w.index.offset[0] if w.index.fqn.startswith("decoder.layers.") else -1

    def lookup_object(self, index):
        entry = self.state_dict[index.fqn]
        if isinstance(entry, _RawBytes):
            return entry
        try:
            return self._produce(index.fqn, tuple(index.offset))
        except BaseException as e:
            self.failure = e
            raise

    def transform_object(self, write_item, obj):
        if isinstance(obj, _RawBytes):
            return io.BytesIO(obj.data)
        return super().transform_object(write_item, obj)
