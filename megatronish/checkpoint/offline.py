"""Checkpoints in one process, without ``torch.distributed``: write one from global tensors (conversion from
other formats), read its metadata, and stream its model tensors one at a time.

    from megatronish.checkpoint.offline import write_checkpoint, read_checkpoint_meta, iter_model_tensors

    write_checkpoint("ckpts/gpt2", 0, {"embedding.word_embeddings.weight": w, ...}, config={"model": {...}})
    write_checkpoint("ckpts/llama", None, generator_of_name_tensor, config, specs=[(name, shape, dtype), ...])
    meta = read_checkpoint_meta("ckpts/gpt2")          # follows latest_checkpointed_iteration.txt
    for name, tensor in iter_model_tensors("ckpts/gpt2", names=["decoder.final_layernorm.weight"]):
        ...

Writing streams when the shapes are known up front (``specs``, or ``(name, shape, dtype, factory)`` items):
about one tensor is in memory. Names are global model names (no ``model.`` prefix). A checkpoint written here
loads into ``pretrain`` at any parallel layout (with ``--finetune`` or ``--no-load-optim``, since it holds no
optimizer state).
"""
from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from ..config import padded_vocab_size
from . import dcp_io, layout
from .common import COMMON, MODEL, OPTIMIZER, common_state, normalize_config
from .dcp_io import CheckpointError, Obj, Sharded

__all__ = ["write_checkpoint", "read_checkpoint_meta", "iter_model_tensors", "CheckpointError"]

_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _padded_rows(name: str, rows: int, model_cfg: dict) -> int:
    """Row count ``name`` is stored with: the word embedding / output layer padded to Megatron's vocabulary."""
    if name not in _VOCAB_ROWS or "vocab_size" not in model_cfg:
        return rows
    vocab = int(model_cfg["vocab_size"])
    if rows < vocab:
        raise CheckpointError(f"{name} has {rows} rows, fewer than the vocabulary size {vocab} in config")
    return max(rows, padded_vocab_size(vocab, int(model_cfg.get("make_vocab_size_divisible_by", 128)), 1))


def _pad_vocab(name: str, t: torch.Tensor, model_cfg: dict) -> torch.Tensor:
    if t.dim() == 0:
        return t
    rows = _padded_rows(name, t.size(0), model_cfg)
    if rows == t.size(0):
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[: t.size(0)] = t
    return out


def _stored_shape(name: str, shape, model_cfg: dict) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    return (_padded_rows(name, shape[0], model_cfg), *shape[1:]) if shape else shape


class _Lazy:
    """A tensor planned from its shape and dtype and produced by ``make()`` only when DCP writes it."""

    __slots__ = ("name", "shape", "dtype", "make")

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, make: Callable[[], torch.Tensor]):
        self.name, self.shape, self.dtype, self.make = name, shape, dtype, make


class _Ordered:
    """Hands out the tensors of a one-pass ``(name, tensor)`` iterable by name. Asked for in the iterable's
    order (what the writer does), it holds nothing; a tensor asked for later than it comes is kept until then."""

    def __init__(self, items: Iterable, names: list[str]):
        self._it = iter(items)
        self._left = set(names)
        self._early: dict[str, torch.Tensor] = {}

    def take(self, name: str) -> torch.Tensor:
        self._left.discard(name)
        if name in self._early:
            t = self._early.pop(name)
        else:
            t = None
            for got, value in self._it:
                if got == name:
                    t = value
                    break
                if got not in self._left or got in self._early:
                    raise ValueError(f"{got!r}: a tensor the specs do not list, or listed once and produced twice")
                self._early[got] = value
            if t is None:
                raise ValueError(f"the model tensors ended before {name!r}, which the specs list")
        if not self._left:
            for got, _ in self._it:  # runs the iterable to its end (its clean-up, its own checks)
                raise ValueError(f"{got!r}: a tensor the specs do not list, or listed once and produced twice")
        return t


class _StreamingPlanner(dcp_io.SavePlanner):
    """:class:`dcp_io.SavePlanner` that produces :class:`_Lazy` entries when DCP resolves their write item;
    the state dict holds only meta-tensor placeholders of the right size and dtype for planning."""

    def __init__(self, lazy: dict[str, _Lazy], model_cfg: dict):
        super().__init__()
        self._lazy = lazy
        self._model_cfg = model_cfg
        self.failure: BaseException | None = None  # the source's own exception, re-raised unwrapped

    def lookup_object(self, index):
        lazy = self._lazy.get(index.fqn)
        if lazy is None:
            return super().lookup_object(index)
        try:
            t = lazy.make()
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{lazy.name!r}: produced a {type(t).__name__}, not a tensor")
            t = _pad_vocab(lazy.name, t.detach().cpu().contiguous(), self._model_cfg)
            if tuple(t.shape) != lazy.shape or t.dtype != lazy.dtype:
                raise CheckpointError(f"model tensor {lazy.name!r} came as {list(t.shape)} {t.dtype}; its spec "
                                      f"says {list(lazy.shape)} {lazy.dtype} (stored shape); pass specs that match "
                                      "the tensors")
            return t
        except BaseException as e:
            self.failure = e
            raise


def _save_streaming(state: dict, iter_dir: str, planner: _StreamingPlanner) -> None:
    """One DCP save with a file per write item: DCP's one-file-per-rank writer keeps every tensor of its file
    alive until the file is closed; with a file each, a tensor is released once written."""
    os.makedirs(iter_dir, exist_ok=True)
    stale = os.path.join(iter_dir, dcp_io.METADATA_FILE)
    if os.path.exists(stale):  # a failed rewrite must not leave an old index over new data files
        os.remove(stale)
    writer = FileSystemWriter(iter_dir, single_file_per_rank=False, sync_files=True, thread_count=1,
                              overwrite=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    except dcp.api.CheckpointException as e:
        if planner.failure is not None:
            raise planner.failure from None
        raise CheckpointError(dcp_io.first_failure(e, iter_dir, "saving")) from None


def write_checkpoint(save_dir: str, iteration: int | None, model_tensors, config, *,
                     specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]] | None = None,
                     consumed_train_samples: int = 0, update_tracker: bool = True) -> str:
    """Write global ``model_tensors`` as ``<save_dir>/iter_{iteration:07d}/`` and point the tracker at it.

    ``model_tensors``: a dict ``{name: tensor}``, or an iterable of ``(name, tensor)`` and/or
    ``(name, shape, dtype, factory)`` items (``factory()`` returns the tensor; it is called once, when the
    tensor is written). ``specs``: ``(name, shape, dtype)`` of every tensor a one-pass ``(name, tensor)``
    iterable (a generator) yields, in the order it yields them; the iterable is then consumed while writing.
    Tensors given as factories or with ``specs`` are held one at a time; tensors given directly are held by the
    caller anyway. Shapes in specs are the tensors' own (before vocabulary padding).

    ``iteration=None`` writes ``<save_dir>/release/`` (tracker "release"; loading it starts at iteration 0).
    ``config``: a dict with a ``"model"`` section of ``ModelConfig`` fields (or those fields flat, or a
    ``ModelConfig``/``RunConfig``); it is stored as the checkpoint's config and checked against the run that
    loads it. The word embedding / output layer may have any row count >= ``vocab_size``; fewer rows than
    Megatron's padding (``make_vocab_size_divisible_by``, default 128) are zero-padded. Tensors are stored in
    their own dtype. Returns the iteration directory.
    """
    cfg = normalize_config(config)
    model_cfg = cfg["model"]
    if specs is not None:
        specs = [(n, tuple(s), d) for n, s, d in specs]
        source = _Ordered(model_tensors.items() if isinstance(model_tensors, dict) else model_tensors,
                          [n for n, _, _ in specs])
        items = [(n, s, d, functools.partial(source.take, n)) for n, s, d in specs]
    else:
        items = model_tensors.items() if isinstance(model_tensors, dict) else model_tensors
    state: dict = {}
    lazy: dict[str, _Lazy] = {}
    for item in items:
        name = item[0]
        if name.startswith(MODEL):
            raise ValueError(f"{name!r}: pass global model names without the 'model.' prefix")
        if MODEL + name in state:
            raise ValueError(f"{name!r}: given twice")
        if len(item) == 4:
            _, shape, dtype, factory = item
            shape = _stored_shape(name, shape, model_cfg)
            lazy[MODEL + name] = _Lazy(name, shape, dtype, factory)
            state[MODEL + name] = Sharded.whole(torch.empty(shape, dtype=dtype, device="meta"))
        else:
            t = _pad_vocab(name, torch.as_tensor(item[1]).detach().cpu().contiguous(), model_cfg)
            state[MODEL + name] = Sharded.whole(t)
    state[COMMON] = Obj(common_state(0 if iteration is None else iteration, cfg,
                                     consumed_train_samples=consumed_train_samples, release=iteration is None))
    target = layout.checkpoint_dir(save_dir, iteration)
    _save_streaming(state, target, _StreamingPlanner(lazy, model_cfg))
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
