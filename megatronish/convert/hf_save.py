"""``--save-hf DIR``: the run's model written as a Hugging Face directory by every rank at once.

Each export is ``DIR/iter_XXXXXXX/`` (``config.json``, ``generation_config.json``, the safetensors files with
``model.safetensors.index.json``, and the tokenizer's files when the run's tokenizer came from files); ``DIR/latest``
is a link to the newest complete one, so ``from_pretrained("DIR/latest")`` loads it.

1. Every rank describes the blocks of the global tensors it holds (its checkpoint pieces: name, offsets, shape)
   and the ranks exchange these descriptions (a small object all-gather); no tensor data moves between ranks.
2. Each rank plans the same files from them: the HF tensors in the name map's order, one file per pipeline stage
   (the tensors of its layers), split further past ``max_shard_bytes``. Rank 0 creates the files: each one's
   header and its full size.
3. Every block is written by one rank, the lowest that holds it (ranks holding the same replica, data-parallel or
   the tied embedding's copies, do not write it again), straight into its place in the file: the block's runs of
   HF rows (:mod:`.hf_rows`; a fused QKV block becomes rows of ``q_proj``, ``k_proj``, ``v_proj``) are copied into
   a memory map of the tensor's byte range. Ranks write disjoint bytes of the same files in parallel.
4. Once all have written, rank 0 writes the index, the configs and the tokenizer files, then moves ``latest``.

The bytes equal ``tools/checkpoint/convert.py --saver hf`` of a checkpoint of the same state (the same data
movements); only the split into files differs.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.layout import iter_dir_name
from ..checkpoint.state import model_entries, named_params
from ..parallel import comm_log as comm
from .hf_config import GPT2, architecture_of, hf_config_from_model
from .hf_deepseek import mtp_copies_of
from .hf_io import CONFIG, INDEX, SINGLE, safetensors_header
from .hf_rows import row_map, write_block
from .name_map import build_entries, hf_shapes

GENERATION_CONFIG = "generation_config.json"
# What a tokenizer directory may hold that transformers reads back
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "vocab.txt")
MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default
MODEL = "model."


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _blocks(models, parallel) -> list[tuple]:
    """``(name, offsets, shape, dtype, global shape)`` of each block of ours this rank holds, and its pieces."""
    out = []
    for key, sharded in model_entries(named_params(models), parallel).items():
        for p in sharded.pieces:
            out.append(((key[len(MODEL):], tuple(p.offsets), tuple(p.tensor.shape), str(p.tensor.dtype),
                         tuple(sharded.global_shape)), p.tensor))
    return out


def _plan(described: list[list[tuple]], entries, max_shard_bytes: int, copies_of: dict[str, list[str]]):
    """From every rank's ``(block description, pp rank)`` lists: the writer of each block, and the files:
    ``[[(hf name, shape, dtype, begin, end)]]`` (``copies_of``: HF tensors written again under other names, each
    copy right after its tensor). The same on every rank."""
    writer, stage, ours, covered = {}, {}, {}, {}
    for rank, (pp_rank, blocks) in enumerate(described):
        for b in blocks:
            name, offsets, shape, dtype, global_shape = b
            if (name, offsets, shape) not in writer:
                writer[(name, offsets, shape)] = rank
                covered[name] = covered.get(name, 0) + math.prod(shape)
            stage[name] = min(stage.get(name, pp_rank), pp_rank)
            ours[name] = (global_shape, getattr(torch, dtype.removeprefix("torch.")))
    for name, (shape, _) in ours.items():
        if covered[name] != math.prod(shape):
            raise RuntimeError(f"the ranks' blocks of {name} cover {covered[name]} of {math.prod(shape)} elements")
    missing = [e.ours for e in entries if e.ours not in ours]
    if missing:
        raise RuntimeError(f"no rank holds {missing[0]!r}, which the Hugging Face model needs")
    hf = hf_shapes(entries, {n: s for n, (s, _) in ours.items()}, {n: d for n, (_, d) in ours.items()})
    files: list[list] = []
    last_stage, size = None, 0
    for e in sorted(entries, key=lambda e: stage[e.ours]):  # stable: the map's order within a stage
        for h, src in ((x, n) for n in e.hf for x in (n, *copies_of.get(n, ()))):
            shape, dtype = hf[src]
            n = math.prod(shape) * dtype.itemsize
            if not files or stage[e.ours] != last_stage or (files[-1] and size + n > max_shard_bytes):
                files.append([])
                size = 0
            files[-1].append((h, shape, dtype, size, size + n))
            size += n
            last_stage = stage[e.ours]
    return writer, files


class _Files:
    """Memory maps of the HF tensors' byte ranges in the planned files, opened on first write."""

    def __init__(self, root: str, names: list[str], files: list[list]):
        self.where = {}
        for fname, tensors in zip(names, files):
            start = len(safetensors_header(tensors))
            for h, shape, dtype, b, _ in tensors:
                self.where[h] = (os.path.join(root, fname), start + b, shape, dtype)
        self.maps: dict[str, np.memmap] = {}

    def write(self, name: str, index: tuple[slice, ...], t: torch.Tensor) -> None:
        path, offset, shape, dtype = self.where[name]
        if name not in self.maps:
            self.maps[name] = np.memmap(path, dtype=np.uint8, mode="r+", offset=offset,
                                        shape=(*shape, dtype.itemsize))
        data = t.detach().to("cpu", dtype).contiguous()
        self.maps[name][index] = data.view(torch.uint8).reshape(*data.shape, dtype.itemsize).numpy()

    def write_with(self, copies_of: dict[str, list[str]]):
        """:meth:`write` that also writes each tensor's copies (``copies_of``) at the same index."""
        def write(name: str, index: tuple[slice, ...], t: torch.Tensor) -> None:
            for n in (name, *copies_of.get(name, ())):
                self.write(n, index, t)
        return write

    def close(self) -> None:
        for m in self.maps.values():
            m.flush()
        self.maps.clear()


def _file_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _tokenizer_files(data_cfg) -> list[tuple[str, str]]:
    """``(source, name in the export)`` of the run's tokenizer files that transformers reads."""
    t, model = data_cfg.tokenizer_type, data_cfg.tokenizer_model
    if t == "HuggingFaceTokenizer" and model:
        if os.path.isdir(model):
            return [(os.path.join(model, f), f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(model, f))]
        return [(model, "tokenizer.json")] if os.path.isfile(model) else []
    if t == "GPT2BPETokenizer" and data_cfg.vocab_file and data_cfg.merge_file:
        return [(data_cfg.vocab_file, "vocab.json"), (data_cfg.merge_file, "merges.txt")]
    if t in SENTENCEPIECE_TYPES and model and os.path.isfile(model):
        return [(model, "tokenizer.model")]
    return []


# SentencePiece tokenizer types and whether their ``tokenize`` prepends bos (transformers' ``add_bos_token``)
SENTENCEPIECE_TYPES = {"Llama2Tokenizer": True, "GPTSentencePieceTokenizer": False, "SentencePieceTokenizer": False}


def _sentencepiece_config(model_file: str, tokenizer_type: str, max_length: int) -> dict:
    """transformers' ``tokenizer_config.json`` for a SentencePiece model: its LlamaTokenizer reads
    ``tokenizer.model`` and, with these settings, encodes text as this run's tokenizer does (the model's own bos /
    eos / unk pieces, bos prepended only for ``Llama2Tokenizer``, the prefix space only where the model adds its
    dummy prefix). Megatron's extra special tokens of ``SentencePieceTokenizer`` (<CLS>, <SEP>, <EOD>, <MASK>
    appended after the model's pieces) are not part of it."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)

    def piece(i: int, fallback: str | None) -> str | None:
        return sp.IdToPiece(i) if 0 <= i < sp.GetPieceSize() else fallback

    return {"tokenizer_class": "LlamaTokenizer", "model_max_length": max_length,
            "add_bos_token": SENTENCEPIECE_TYPES[tokenizer_type], "add_eos_token": False,
            "add_prefix_space": sp.EncodeAsPieces("a")[0].startswith("\u2581"),
            "bos_token": piece(sp.bos_id(), None), "eos_token": piece(sp.eos_id(), None),
            "unk_token": piece(sp.unk_id(), None), "pad_token": piece(sp.pad_id(), None)}


def _write_side_files(out: str, cfg, dtype: torch.dtype, source: dict | None, source_dir: str | None) -> None:
    """config.json, generation_config.json and the tokenizer files (rank 0)."""
    mcfg = cfg.model
    config = hf_config_from_model(mcfg, str(dtype).removeprefix("torch."), base=source)
    with open(os.path.join(out, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    gen = os.path.join(source_dir, GENERATION_CONFIG) if source_dir else None
    if gen and os.path.isfile(gen):
        shutil.copyfile(gen, os.path.join(out, GENERATION_CONFIG))
    else:
        keys = ("bos_token_id", "eos_token_id", "pad_token_id")
        with open(os.path.join(out, GENERATION_CONFIG), "w") as f:
            json.dump({"_from_model_config": True, **{k: config[k] for k in keys if config.get(k) is not None}},
                      f, indent=2)
    copied = _tokenizer_files(cfg.data)
    for src, name in copied:
        shutil.copyfile(src, os.path.join(out, name))
    if cfg.data.tokenizer_type == "GPT2BPETokenizer" and copied:
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": mcfg.max_position_embeddings,
                       "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
                      f, indent=2)
    if cfg.data.tokenizer_type in SENTENCEPIECE_TYPES and copied:
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump(_sentencepiece_config(copied[0][0], cfg.data.tokenizer_type, mcfg.max_position_embeddings),
                      f, indent=2)


def _point_latest(root: str, name: str) -> None:
    link, tmp = os.path.join(root, "latest"), os.path.join(root, f".latest.{os.getpid()}")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, link)


def export_hf(models, cfg, parallel, root: str, iteration: int, *, source_dir: str | None = None,
              max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """Write this state of the model as ``root/iter_XXXXXXX/`` (collective over the world; see the module
    docstring). ``source_dir``: the HF directory the run loaded (its ``config.json`` keys that do not decide the
    weights and its ``generation_config.json`` are kept). Returns the directory written."""
    group = parallel.io_group if dist.is_initialized() else None
    rank, world = _world()
    out = os.path.join(root, iter_dir_name(iteration))
    mine = _blocks(models, parallel)
    described = [None] * world
    if world > 1:
        comm.all_gather_object(described, (parallel.pp_rank, [b for b, _ in mine]), group=group)
    else:
        described = [(parallel.pp_rank, [b for b, _ in mine])]
    source = None
    if source_dir:
        with open(os.path.join(source_dir, CONFIG)) as f:
            source = json.load(f)
    arch = architecture_of(cfg.model, f"--save-hf {root}", base=source)
    padded = next(b[4][0] for _, bs in described for b in bs if b[0] == "embedding.word_embeddings.weight")
    entries = build_entries(cfg.model, arch, padded)
    copies_of = mtp_copies_of(cfg.model, arch)  # DeepSeek-V3's multi-token-prediction copies of shared tensors
    writer, files = _plan(described, entries, max_shard_bytes, copies_of)
    names = _file_names(len(files))
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        for fname, tensors in zip(names, files):
            with open(os.path.join(out, fname), "wb") as f:
                f.write(safetensors_header(tensors))
                f.truncate(f.tell() + (tensors[-1][4] if tensors else 0))
    if world > 1:
        comm.barrier(group=group)
    by_name = {e.ours: e for e in entries}
    hf_shape = {t[0]: t[1] for f in files for t in f}
    maps, mm = {}, _Files(out, names, files)
    try:
        for desc, tensor in mine:
            if writer[desc[:3]] != rank:
                continue  # a replica: a lower rank writes it
            name, offsets = desc[0], desc[1]
            if name not in maps:
                e = by_name[name]
                maps[name] = row_map(e, [hf_shape[h] for h in e.hf], gpt2=arch == GPT2)
            write_block(maps[name], offsets, tensor, mm.write_with(copies_of))
    finally:
        mm.close()
    if world > 1:
        comm.barrier(group=group)
    if rank == 0:
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(t[4] - t[3] for f in files for t in f)},
                     "weight_map": {t[0]: fname for fname, f in zip(names, files) for t in f}}
            with open(os.path.join(out, INDEX), "w") as f:
                json.dump(index, f, indent=2)
        dtype = max((t[2] for f in files for t in f), key=lambda d: d.itemsize)
        _write_side_files(out, cfg, dtype, source, source_dir)
        _point_latest(root, iter_dir_name(iteration))
        print(f"saved Hugging Face model {out}", flush=True)
    return out


class HFExport:
    """When ``--save-hf`` writes: at every checkpoint save (no ``--save-hf-interval``), or every
    ``--save-hf-interval`` iterations; and at the end of training unless that state was just written."""

    def __init__(self, cfg, models, parallel):
        self.cfg, self.models, self.parallel = cfg, models, parallel
        ck = cfg.checkpoint
        self.source_dir = ck.load if ck.load_hf else None
        self.last: int | None = None

    def export(self, iteration: int) -> None:
        if iteration != self.last:
            export_hf(self.models, self.cfg, self.parallel, self.cfg.checkpoint.save_hf, iteration,
                      source_dir=self.source_dir)
            self.last = iteration

    def on_checkpoint_saved(self, iteration: int) -> None:
        if self.cfg.checkpoint.save_hf_interval is None:
            self.export(iteration)

    def after_iteration(self, iteration: int) -> None:
        every = self.cfg.checkpoint.save_hf_interval
        if every and iteration % every == 0:
            self.export(iteration)

    def finish(self, iteration: int) -> None:
        if iteration > 0:
            self.export(iteration)
