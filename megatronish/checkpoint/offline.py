"""Checkpoints in one process, without ``torch.distributed``: write one from global tensors (conversion from
other formats), read its metadata, and stream its model tensors one at a time.

    from megatronish.checkpoint.offline import write_checkpoint, read_checkpoint_meta, iter_model_tensors

    write_checkpoint("ckpts/gpt2", 0, {"embedding.word_embeddings.weight": w, ...}, config={"model": {...}})
    meta = read_checkpoint_meta("ckpts/gpt2")          # follows latest_checkpointed_iteration.txt
    for name, tensor in iter_model_tensors("ckpts/gpt2", names=["decoder.final_layernorm.weight"]):
        ...

Names are global model names (no ``model.`` prefix). A checkpoint written here loads into ``pretrain`` at any
parallel layout (with ``--finetune`` or ``--no-load-optim``, since it holds no optimizer state).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch

from . import dcp_io, layout
from .common import COMMON, MODEL, OPTIMIZER, common_state, normalize_config
from .dcp_io import CheckpointError, Obj, Sharded
from ..config import padded_vocab_size

__all__ = ["write_checkpoint", "read_checkpoint_meta", "iter_model_tensors", "CheckpointError"]

_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _pad_vocab(name: str, t: torch.Tensor, model_cfg: dict) -> torch.Tensor:
    if name not in _VOCAB_ROWS or "vocab_size" not in model_cfg:
        return t
    vocab = int(model_cfg["vocab_size"])
    if t.size(0) < vocab:
        raise CheckpointError(f"{name} has {t.size(0)} rows, fewer than the vocabulary size {vocab} in config")
    padded = padded_vocab_size(vocab, int(model_cfg.get("make_vocab_size_divisible_by", 128)), 1)
    if t.size(0) >= padded:
        return t
    out = torch.zeros((padded, *t.shape[1:]), dtype=t.dtype)
    out[: t.size(0)] = t
    return out


def write_checkpoint(save_dir: str, iteration: int | None, model_tensors: dict[str, torch.Tensor] |
                     Iterable[tuple[str, torch.Tensor]], config, *, consumed_train_samples: int = 0,
                     update_tracker: bool = True) -> str:
    """Write global ``model_tensors`` as ``<save_dir>/iter_{iteration:07d}/`` and point the tracker at it.

    ``iteration=None`` writes ``<save_dir>/release/`` (tracker "release"; loading it starts at iteration 0).
    ``config``: a dict with a ``"model"`` section of ``ModelConfig`` fields (or those fields flat, or a
    ``ModelConfig``/``RunConfig``); it is stored as the checkpoint's config and checked against the run that
    loads it. The word embedding / output layer may have any row count >= ``vocab_size``; fewer rows than
    Megatron's padding (``make_vocab_size_divisible_by``, default 128) are zero-padded. Tensors are stored in
    their own dtype. Returns the iteration directory.
    """
    cfg = normalize_config(config)
    items = model_tensors.items() if isinstance(model_tensors, dict) else model_tensors
    state: dict = {}
    for name, t in items:
        if name.startswith(MODEL):
            raise ValueError(f"{name!r}: pass global model names without the 'model.' prefix")
        t = _pad_vocab(name, torch.as_tensor(t).detach().cpu().contiguous(), cfg["model"])
        state[MODEL + name] = Sharded.whole(t)
    state[COMMON] = Obj(common_state(0 if iteration is None else iteration, cfg,
                                     consumed_train_samples=consumed_train_samples, release=iteration is None))
    target = layout.checkpoint_dir(save_dir, iteration)
    dcp_io.save(state, target, no_dist=True)
    if update_tracker:
        layout.write_tracker(save_dir, iteration)
    return target


def _iter_dir(path: str) -> str:
    found = layout.resolve(path)
    if found is None:
        raise CheckpointError(f"no checkpoint at {path}: no {layout.TRACKER} there and it is not an iter_XXXXXXX "
                              "directory")
    return found[0]


def read_checkpoint_meta(path: str) -> dict:
    """Metadata of the checkpoint at ``path`` (a save directory — its tracker is followed — or an
    ``iter_XXXXXXX``/``release`` directory), without loading tensors::

        {"iter_dir": str, "iteration": int, "release": bool, "config": dict, "code_version": dict,
         "consumed_train_samples": int, "consumed_valid_samples": int, "layout": dict | None,
         "tensors": {name: {"shape": tuple, "dtype": torch.dtype}},          # model tensors, global
         "optimizer_tensors": {"<name>.<state>": {"shape", "dtype"}}, "other_entries": [str],
         "common": the full common state dict}
    """
    iter_dir = _iter_dir(path)
    md = dcp_io.read_index(iter_dir)
    dcp_io.check_files(iter_dir, md)
    common = dcp_io.read_bytes_entry(iter_dir, md, COMMON)
    tensors, opt, other = {}, {}, []
    for key, tmd in sorted(md.state_dict_metadata.items()):
        shape = tuple(getattr(tmd, "size", ()))
        entry = {"shape": shape, "dtype": getattr(getattr(tmd, "properties", None), "dtype", None)}
        if key.startswith(MODEL) and hasattr(tmd, "size"):
            tensors[key[len(MODEL):]] = entry
        elif key.startswith(OPTIMIZER) and hasattr(tmd, "size"):
            opt[key[len(OPTIMIZER):]] = entry
        elif key != COMMON:
            other.append(key)
    return {"iter_dir": iter_dir, "iteration": common.get("iteration", 0), "release": bool(common.get("release")),
            "config": common.get("config", {}), "code_version": common.get("code_version"),
            "consumed_train_samples": common.get("consumed_train_samples", 0),
            "consumed_valid_samples": common.get("consumed_valid_samples", 0), "layout": common.get("layout"),
            "tensors": tensors, "optimizer_tensors": opt, "other_entries": other, "common": common}


def iter_model_tensors(path: str, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(global name, tensor)`` for the model tensors at ``path`` (all, or ``names`` in that order),
    reading one tensor at a time (memory: one global tensor). Tensors are CPU, in their stored dtype, with
    the stored (padded) vocabulary rows."""
    iter_dir = _iter_dir(path)
    md = dcp_io.read_index(iter_dir)
    dcp_io.check_files(iter_dir, md)
    if names is None:
        names = sorted(k[len(MODEL):] for k, v in md.state_dict_metadata.items()
                       if k.startswith(MODEL) and hasattr(v, "size"))
    for name in names:
        if MODEL + name not in md.state_dict_metadata:
            raise CheckpointError(f"checkpoint {iter_dir} has no model tensor {name!r}")
        yield name, dcp_io.read_tensor(iter_dir, md, MODEL + name)


def checkpoint_size_bytes(path: str) -> int:
    """Bytes on disk of one iteration directory."""
    iter_dir = _iter_dir(path)
    return sum(os.path.getsize(os.path.join(iter_dir, f)) for f in os.listdir(iter_dir))
