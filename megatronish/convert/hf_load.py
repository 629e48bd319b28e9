"""``--load <Hugging Face model directory>``: the weights read straight into this run's layout.

Every rank fills the blocks of the global tensors it holds (the pieces its checkpoint entries describe:
tensor-, expert-, pipeline- and FSDP2-sharded alike) from the safetensors files, reading only those blocks'
bytes: ``safe_open(...).get_slice`` reads the requested rows, and the fused tensors of ours (QKV, ``[gate; up]``,
stacked experts) are read as the runs of source rows they are made of (:mod:`.hf_rows`). No rank holds more
than its own part of the model. Loading is local (no collective): the architecture came from ``config.json``
when the flags were read (``arguments/hf_args.py``), so every rank already has the same model.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ..checkpoint.state import model_entries, named_params
from .core import _check_shape
from .hf_config import GPT2, ConvertError, model_config_from_hf
from .hf_deepseek import DEEPSEEK_V3, SCALE_SUFFIX, fp8_block_reader, mtp_copies, mtp_depths, mtp_layer_names
from .hf_io import HFReader
from .hf_rows import read_block, row_map
from .name_map import VOCAB_TENSORS, build_entries, expected_global_shapes, expert_layout, hf_shapes
from .plugins import check_names

MODEL = "model."


def gpt2_prefix(arch: str, names) -> str | None:
    """``""`` for old GPT-2 files without the ``transformer.`` prefix, else None (the map's default)."""
    return "" if arch == GPT2 and "transformer.wte.weight" not in names and "wte.weight" in names else None


def load_hf_weights(models, cfg, parallel, path: str, reader: HFReader | None = None) -> int:
    """Fill this rank's model chunks (``cfg``: the run's :class:`~megatronish.config.RunConfig`) from the HF
    directory ``path``; returns the data bytes read. ``reader``: the directory's reader (tests count its bytes)."""
    r = reader or HFReader(path, flag="--load")
    try:
        return _load(r, models, cfg.model, parallel, path)
    finally:
        r.close()


def _load(r: HFReader, models, mcfg, parallel, path: str) -> int:
    where = f"--load {path}"
    hf_cfg, arch = model_config_from_hf(r.config, where=f"{path}/config.json")
    if hf_cfg.vocab_size != mcfg.vocab_size:
        raise ConvertError(f"{where}: the run's vocabulary ({mcfg.vocab_size}) is not the model's "
                           f"({hf_cfg.vocab_size}, config.json vocab_size)")
    named = named_params(models)
    padded = next((p.desc.global_shape[0] for n, p in named if n in VOCAB_TENSORS), mcfg.padded_vocab_size())
    names, read = set(r.names()), r.read
    if arch == DEEPSEEK_V3:
        names, read = _deepseek_view(r, names, mcfg, where)
    entries = build_entries(mcfg, arch, padded, gpt2_prefix(arch, names), expert_layout(names))
    check_names(names, entries, mcfg, arch, where)
    expect = hf_shapes(entries, expected_global_shapes(mcfg))
    by_name = {e.ours: e for e in entries}
    maps = {}
    for key, sharded in model_entries(named, parallel).items():
        name = key[len(MODEL):]
        e = by_name.get(name)
        if e is None:
            raise ConvertError(f"{where}: the model's tensor {name!r} has no Hugging Face counterpart for {arch}")
        if name not in maps:
            shapes = [r.shape(h) for h in e.hf]
            for h, shape in zip(e.hf, shapes):
                _check_shape(h, torch.empty(shape, device="meta"), expect[h][0], where, name in VOCAB_TENSORS)
            maps[name] = row_map(e, shapes, gpt2=arch == GPT2)
        for piece in sharded.pieces:
            block = read_block(maps[name], tuple(piece.offsets), tuple(piece.tensor.shape), read,
                               piece.tensor.dtype)
            with torch.no_grad():
                for t in (piece.tensor, *piece.aliases):
                    t.copy_(block)
    return r.bytes_read


def _deepseek_view(r: HFReader, names: set[str], mcfg, where: str):
    """DeepSeek-V3 files as the run needs them: FP8 weights dequantized block by block (their ``_scale_inv``
    tensors not model tensors), the run's ``--mtp-num-layers`` depths kept (their copies of the embedding and
    the output layer not read), the further multi-token-prediction layers skipped with one note."""
    read = fp8_block_reader(r.read, r.shape, names, r.config)
    names = {n for n in names if not (n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in names)}
    keep, present = mcfg.mtp_num_layers or 0, mtp_depths(names, r.config)
    if keep > present:
        raise ConvertError(f"{where}: --mtp-num-layers {keep}, but the directory holds {present} multi-token-"
                           f"prediction layers (num_nextn_predict_layers); give at most {present}")
    skipped = mtp_layer_names(names, r.config, keep)
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        first = int(r.config["num_hidden_layers"]) + keep
        print(f"note: {len(skipped)} tensors of the multi-token-prediction layers (model.layers.{first}...) are not "
              "loaded; --mtp-num-layers trains them", file=sys.stderr, flush=True)
    return names - set(skipped) - set(mtp_copies(mcfg)), read
