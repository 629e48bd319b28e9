"""Building the GPT datasets of a run (``build_gpt_datasets``): the ``--data-path`` / ``--split`` / per-split
blends into :class:`~megatronish.data.gpt_dataset.GPTDataset` s and
:class:`~megatronish.data.blending.BlendedDataset` s, each index built once (rank 0 first, then the others
read its cache)."""
from __future__ import annotations

import math
import os
from typing import Callable, Dict, List, Optional, Sequence

import numpy
import torch

from megatronish.data.blending import (
    BlendedDataset,
    BlendError,
    get_blend_from_list,
    normalize,
)
from megatronish.data.gpt_dataset import PAD_TOKEN_ID, GPTDataset, GPTDatasetConfig, Split
from megatronish.data.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatronish.parallel import comm_log as comm

__all__ = ["build_gpt_datasets"]


def _check_prefix(prefix: str, flag: str) -> None:
    missing = [p for p in (get_idx_path(prefix), get_bin_path(prefix)) if not os.path.isfile(p)]
    if missing:
        raise BlendError(
            f"{flag}: no dataset at prefix '{prefix}' (missing {', '.join(missing)}); give path "
            f"prefixes without the .bin/.idx suffix, e.g. data/corpus_text_document"
        )


def _is_dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank0_first(fn: Callable, *args):
    """Build on rank 0 (writing the index cache), then on the other ranks (reading it)."""
    if not _is_dist():
        return fn(*args)
    rank = torch.distributed.get_rank()
    result = fn(*args) if rank == 0 else None
    comm.barrier()
    if rank != 0:
        result = fn(*args)
    return result


def _size_per_split_per_dataset(weights: List[float], sizes: Sequence[Optional[int]], surplus: float = 0.0):
    return [
        [None if s is None else int(math.ceil(math.ceil(s * w) * (1 + surplus))) for s in sizes]
        for w in weights
    ]


class _Builder:
    def __init__(self, sizes: Sequence[Optional[int]], config: GPTDatasetConfig) -> None:
        self.sizes = list(sizes)
        self.config = config
        self._low_level: Dict[str, IndexedDataset] = {}

    def _indexed(self, prefix: str) -> IndexedDataset:
        if prefix not in self._low_level:
            self._low_level[prefix] = IndexedDataset(prefix, mmap=self.config.mmap_bin_files)
        return self._low_level[prefix]

    def _splits_of(self, prefix: str, split_matrix, sizes) -> List[Optional[GPTDataset]]:
        ds = self._indexed(prefix)
        n = ds.sequence_lengths.shape[0]
        out: List[Optional[GPTDataset]] = []
        for i, s in enumerate(Split):
            if split_matrix[i] is None:
                out.append(None)
                continue
            beg = int(round(split_matrix[i][0] * float(n)))
            end = int(round(split_matrix[i][1] * float(n)))
            indices = numpy.arange(beg, end, dtype=numpy.int32)
            out.append(_rank0_first(GPTDataset, ds, prefix, indices, sizes[i], s, self.config))
        return out

    def _blend(self, prefixes, weights, split_matrix, sizes, only: Optional[int] = None):
        """Datasets of each split for a multi-prefix blend (``only``: build just that split)."""
        if weights is not None:
            weights = normalize(weights)
            target = _size_per_split_per_dataset(weights, sizes)
            buffered = _size_per_split_per_dataset(weights, sizes, self.config.mid_level_dataset_surplus)
        else:
            buffered = [[None] * 3 for _ in prefixes]
        per_split: List[List[GPTDataset]] = [[], [], []]
        for k, prefix in enumerate(prefixes):
            for i, d in enumerate(self._splits_of(prefix, split_matrix, buffered[k])):
                per_split[i].append(d)
        result: List[Optional[BlendedDataset]] = [None, None, None]
        for i in range(3):
            if split_matrix[i] is None or (only is not None and i != only):
                continue
            if weights is not None:
                if sizes[i] is None:
                    raise BlendError("a weighted blend needs a sample count for every split it builds")
                w_i, size_i = weights, sum(row[i] for row in target)
            else:
                w_i = [len(d) for d in per_split[i]]
                size_i = None if sizes[i] is None else min(sizes[i], sum(w_i))
            result[i] = _rank0_first(BlendedDataset, per_split[i], w_i, size_i, self.config)
        return result

    def build(self):
        cfg = self.config
        if cfg.blend_per_split is None or not any(cfg.blend_per_split):
            prefixes, weights = cfg.blend
            if len(prefixes) == 1 and weights is None:
                return self._splits_of(prefixes[0], cfg.split_matrix, self.sizes)
            return self._blend(prefixes, weights, cfg.split_matrix, self.sizes)
        result = [None, None, None]
        for i in range(3):
            blend = cfg.blend_per_split[i]
            if blend is None:
                continue
            prefixes, weights = blend
            split_spoof = [None, None, None]
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof = [0, 0, 0]
            sizes_spoof[i] = self.sizes[i]
            if len(prefixes) == 1:
                result[i] = self._splits_of(prefixes[0], split_spoof, sizes_spoof)[i]
            else:
                result[i] = self._blend(prefixes, weights, split_spoof, sizes_spoof, only=i)[i]
        return result


def build_gpt_datasets(
    data_path: Optional[Sequence[str]],
    split: Optional[str],
    seq_length: int,
    seed: int,
    num_samples: Sequence[Optional[int]],
    cache_dir: Optional[str] = None,
    eod_id: Optional[int] = None,
    pad_id: int = PAD_TOKEN_ID,
    train_data_path: Optional[Sequence[str]] = None,
    valid_data_path: Optional[Sequence[str]] = None,
    test_data_path: Optional[Sequence[str]] = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
    mid_level_dataset_surplus: float = 0.005,
    mmap_bin_files: bool = True,
):
    """(train, valid, test) datasets, each None where its split is empty.

    ``data_path`` is ``--data-path`` as a list (``[prefix]``, ``[w1, p1, w2, p2, ...]`` or
    ``[p1, p2, ...]``); ``train/valid/test_data_path`` replace it and ``split``. ``num_samples`` is
    (train, valid, test) sample counts (None: one epoch). ``cache_dir`` is ``--data-cache-path``.
    Call it on every rank: under torch.distributed, rank 0 builds the index cache first.
    """
    if len(num_samples) != 3:
        raise ValueError("num_samples must be a (train, valid, test) tuple")
    per_split = [train_data_path, valid_data_path, test_data_path]
    if any(p is not None for p in per_split):
        if data_path:
            raise BlendError("give either --data-path or --train-data-path/--valid-data-path/--test-data-path")
        flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
        blend_per_split = [get_blend_from_list(p, f) for p, f in zip(per_split, flags)]
        for b, f in zip(blend_per_split, flags):
            if b is not None:
                for prefix in b[0]:
                    _check_prefix(prefix, f)
        blend = None
    else:
        if not data_path:
            raise BlendError("no data: pass --data-path (or --train-data-path ...), or --mock-data")
        blend = get_blend_from_list(data_path, "--data-path")
        for prefix in blend[0]:
            _check_prefix(prefix, "--data-path")
        blend_per_split = None
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split if blend is not None else None,
        path_to_cache=cache_dir,
        eod_id=eod_id,
        pad_id=pad_id,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mid_level_dataset_surplus=mid_level_dataset_surplus,
        mmap_bin_files=mmap_bin_files,
    )
    datasets = _Builder(num_samples, config).build()
    return tuple(datasets)
