"""Loaders and savers of ``tools/checkpoint/convert.py``: small plugins over the one name map.

A loader turns ``--load-dir`` into a :class:`Source` — our model config, the HF architecture, the list of our
global tensors with shapes and dtypes, and an iterator that produces them one at a time. A saver consumes a
:class:`Source`. ``LOADERS``/``SAVERS`` map the ``--loader``/``--saver`` names to them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ConfigError
from ..parallel_config import parallel_dims, validate_model
from .core import hf_to_ours, ours_to_hf
from .hf_config import (
    GPT2,
    ConvertError,
    architecture_of,
    hf_config_from_model,
    model_config_from_dict,
    model_config_from_hf,
)
from .hf_deepseek import DEEPSEEK_V3, FP8_DTYPES, fp8_view, mtp_copies, mtp_copies_of, mtp_depths
from .hf_io import HFReader, HFWriter, parse_size
from .name_map import IGNORED_HF_SUFFIXES, VOCAB_TENSORS, build_entries, expected_global_shapes, expert_layout


@dataclass
class Source:
    cfg: ModelConfig
    arch: str
    specs: list[tuple[str, tuple[int, ...], torch.dtype]]  # our global tensors, in the order tensors() yields
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    hf_config: dict | None = None  # the HF config.json the weights came from, when known
    origin: str = ""


# ---- loaders ------------------------------------------------------------------------------------------------

def check_names(names: set[str], entries, cfg: ModelConfig, arch: str, where: str) -> None:
    """The HF tensor ``names`` are exactly those the name map ``entries`` needs (a tied ``lm_head.weight`` and
    buffers aside): one error line naming the first unexpected or missing tensor otherwise."""
    known = {n for e in entries for n in e.hf}
    if not cfg.untie_embeddings_and_output_weights:
        known.add("lm_head.weight")  # a copy of the tied word embedding, when present
    extra = sorted(n for n in names - known if not n.endswith(IGNORED_HF_SUFFIXES))
    if extra:
        raise ConvertError(f"{where}: unexpected tensor {extra[0]!r}" + (f" (and {len(extra) - 1} more)" if
                                                                          len(extra) > 1 else "")
                           + f" for the {arch} described by config.json; config and weights do not match")
    missing = [n for e in entries for n in e.hf if n not in names]
    if missing:
        owner = next(e.ours for e in entries if missing[0] in e.hf)
        raise ConvertError(f"{where}: missing tensor {missing[0]!r} (needed for {owner})"
                           + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                           + f"; the directory does not hold a complete {arch}")


def _checked_copies(cfg: ModelConfig, names: set[str], get, where: str) -> set[str]:
    """The multi-token-prediction layers' copies of the embedding and the output layer present in ``names``,
    each checked equal to the tensor it copies (our depths share the model's)."""
    out = set()
    for copy, src in mtp_copies(cfg).items():
        if copy in names:
            if src in names and not torch.equal(get(copy), get(src)):
                raise ConvertError(f"{where}: {copy} differs from {src}; the multi-token-prediction layers share "
                                   "the model's embedding and output layer here, so the copy must equal it")
            out.add(copy)
    return out


def _with_copies(items, copies_of: dict[str, list[str]]):
    """HF ``(name, tensor)`` items with each multi-token-prediction copy right after the tensor it copies."""
    for name, t in items:
        yield name, t
        for copy in copies_of.get(name, ()):
            yield copy, t


def load_hf(args) -> Source:
    r = HFReader(args.load_dir)
    where = f"--load-dir {args.load_dir}"
    cfg, arch = model_config_from_hf(r.config, true_vocab_size=args.true_vocab_size,
                                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                     where=f"{args.load_dir}/config.json")
    names, get = fp8_view(r.names(), r.get, r.config)  # FP8 block-scaled weights: dequantized to bfloat16
    depths = mtp_depths(names, r.config) if arch == DEEPSEEK_V3 else 0
    if depths:  # the multi-token-prediction layers present become --mtp-num-layers depths
        cfg = cfg.replace(mtp_num_layers=depths)
        names -= _checked_copies(cfg, names, get, where)
    prefix = None
    if arch == GPT2 and "transformer.wte.weight" not in names and "wte.weight" in names:
        prefix = ""  # old GPT-2 files without the "transformer." prefix
    padded = cfg.padded_vocab_size(args.target_tensor_parallel_size)
    experts = expert_layout(names)  # MoE: per-expert tensors (published files) or transformers 5's fused ones
    entries = build_entries(cfg, arch, padded, prefix, experts)
    check_names(names, entries, cfg, arch, where)
    shapes = expected_global_shapes(cfg, args.target_tensor_parallel_size)
    specs = [(e.ours, shapes[e.ours], torch.bfloat16 if r.dtype(e.hf[0]) in FP8_DTYPES else r.dtype(e.hf[0]))
             for e in entries]

    def tensors():
        try:
            yield from hf_to_ours(get, cfg, arch, padded, prefix=prefix, experts=experts, where=where)
        finally:
            r.close()

    return Source(cfg, arch, specs, tensors, hf_config=r.config, origin=f"hf:{args.load_dir}")


def load_megatronish(args) -> Source:
    from ..checkpoint.offline import CheckpointError, iter_model_tensors, read_checkpoint_meta

    try:
        meta = read_checkpoint_meta(args.load_dir)
    except CheckpointError as e:
        raise ConvertError(f"--load-dir {args.load_dir}: {e}") from None
    where = meta["iter_dir"]
    conf = meta.get("config") or {}
    cfg = model_config_from_dict(conf.get("model") or {}, where)
    stored = meta["tensors"]
    rows = stored.get("embedding.word_embeddings.weight", {}).get("shape", (0,))[0]
    if args.true_vocab_size is not None:
        if args.true_vocab_size > rows:
            raise ConvertError(f"--true-vocab-size {args.true_vocab_size} is larger than the padded vocabulary "
                               f"of {where} ({rows} rows); pass at most {rows}")
        cfg = dataclasses.replace(cfg, vocab_size=args.true_vocab_size)
    elif cfg.vocab_size > rows:
        raise ConvertError(f"{where}: vocabulary size {cfg.vocab_size} in the config is larger than the padded "
                           f"vocabulary ({rows} rows); pass --true-vocab-size <= {rows}")
    hf_config = (conf.get("convert") or {}).get("hf_config")
    arch = architecture_of(cfg, where, base=hf_config)  # the source's family when it fits (Mistral stays one)
    expect = expected_global_shapes(cfg)
    for name, shape in expect.items():
        if name not in stored:
            raise ConvertError(f"{where}: missing tensor {name!r}; the checkpoint does not hold a complete model "
                               "of its config")
        got = tuple(stored[name]["shape"])
        vocab = name in VOCAB_TENSORS
        if (got[1:] != shape[1:] or got[0] < cfg.vocab_size) if vocab else got != shape:
            raise ConvertError(f"{where}: tensor {name!r} has shape {list(got)}, the config needs {list(shape)}")
    extra = sorted(set(stored) - set(expect))
    if extra:
        raise ConvertError(f"{where}: unexpected tensor {extra[0]!r} for its config")
    order = [e.ours for e in build_entries(cfg, arch, rows)]
    specs = [(n, tuple(stored[n]["shape"]), stored[n]["dtype"]) for n in order]
    return Source(cfg, arch, specs, lambda: iter_model_tensors(args.load_dir, order), hf_config=hf_config,
                  origin=f"megatronish:{where}")


# ---- savers -------------------------------------------------------------------------------------------------

def save_hf(args, src: Source) -> None:
    entries = {e.ours: e for e in build_entries(src.cfg, src.arch, src.cfg.padded_vocab_size())}
    copies = mtp_copies_of(src.cfg, src.arch)
    plan, dtypes = [], set()
    for name, shape, dtype in src.specs:
        metas = entries[name].to_hf(torch.empty(shape, dtype=dtype, device="meta"))
        for hname, t in _with_copies(zip(entries[name].hf, metas), copies):
            plan.append((hname, tuple(t.shape), t.dtype))
            dtypes.add(t.dtype)
    dtype = str(max(dtypes, key=lambda d: d.itemsize)).removeprefix("torch.") if dtypes else "float32"
    config = hf_config_from_model(src.cfg, dtype, base=src.hf_config)
    w = HFWriter(args.save_dir, plan, parse_size(args.max_shard_size))
    for hname, t in _with_copies(ours_to_hf(src.tensors(), src.cfg, src.arch, where=src.origin), copies):
        w.write(hname, t)
    w.close(config)


def check_target_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ConvertError("--target-tensor-parallel-size and --target-pipeline-parallel-size must be >= 1")
    derived_kv = cfg.kv_channels * cfg.num_attention_heads == cfg.hidden_size
    try:
        dims = parallel_dims(world_size=tp * pp, tp=tp, pp=pp,
                             tie_embeddings=not cfg.untie_embeddings_and_output_weights)
        validate_model(dims, num_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                       num_query_groups=cfg.num_query_groups, hidden_size=cfg.hidden_size if derived_kv else None,
                       ffn_hidden_size=cfg.ffn_hidden_size)  # the layer split included
    except ConfigError as e:
        raise ConvertError(f"target layout --target-tensor-parallel-size {tp} --target-pipeline-parallel-size "
                           f"{pp}: {e}") from None


def save_megatronish(args, src: Source) -> None:
    from ..checkpoint.offline import write_checkpoint

    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    check_target_layout(src.cfg, tp, pp)
    config = {"model": src.cfg.flat(),
              "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
              "convert": {"source": src.origin, "architecture": src.arch, "hf_config": src.hf_config}}
    write_checkpoint(args.save_dir, None, src.tensors(), config, specs=src.specs)  # streams: one tensor at a time


def load_megatron(args) -> Source:
    from .megatron import read_megatron

    return Source(**read_megatron(args))


def save_megatron(args, src: Source) -> None:
    from .megatron import save_megatron as save

    check_target_layout(src.cfg, args.target_tensor_parallel_size, args.target_pipeline_parallel_size)
    save(args, src)


LOADERS: dict[str, Callable] = {"hf": load_hf, "megatronish": load_megatronish, "megatron": load_megatron}
SAVERS: dict[str, Callable] = {"hf": save_hf, "megatronish": save_megatronish, "megatron": save_megatron}
