"""GPT dataset over indexed datasets: Megatron-LM's sample order, splits, blending and caching.

Index construction (one ``numpy.random.RandomState(seed)`` used in this order):

1. document index: the split's sequence ids tiled ``num_epochs`` times, shuffled (with a separate
   final epoch when it would contribute fewer than 80% of an epoch's samples: the first
   ``num_epochs - 1`` epochs shuffled together, then the last one on its own);
2. sample index: ``helpers.build_sample_idx`` (C++), samples of ``seq_length + 1`` tokens that
   overlap by the one label token;
3. shuffle index: a permutation of the samples (again two ranges with a separate final epoch).

The three arrays are cached as ``.npy`` under md5-of-description names and memory-mapped. A run's datasets are
built by :func:`megatronish.data.gpt_builder.build_gpt_datasets`.
"""
from __future__ import annotations

import enum
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy
import torch

from megatronish import device
from megatronish.data import helpers
from megatronish.data.blending import (
    BlendedDataset,
    BlendError,
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatronish.data.index_cache import IndexCache
from megatronish.data.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

__all__ = [
    "Split",
    "GPTDatasetConfig",
    "GPTDataset",
    "get_batch",
    "BlendError",
]

PAD_TOKEN_ID = -1


class Split(enum.Enum):
    train = 0
    valid = 1
    test = 2


@dataclass
class GPTDatasetConfig:
    """What identifies a GPT dataset (the cache key) plus how its items are shaped."""

    random_seed: int
    sequence_length: int
    blend: Optional[Tuple[List[str], Optional[List[float]]]] = None
    blend_per_split: Optional[List[Optional[Tuple[List[str], Optional[List[float]]]]]] = None
    split: Optional[str] = None
    path_to_cache: Optional[str] = None
    eod_id: Optional[int] = None
    pad_id: int = PAD_TOKEN_ID
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    mid_level_dataset_surplus: float = 0.005
    mmap_bin_files: bool = True
    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.sequence_length is None or int(self.sequence_length) < 2:
            raise ValueError(f"--seq-length must be at least 2, got {self.sequence_length}")
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise BlendError("give either --data-path or --train/valid/test-data-path, not both")
            self.split_matrix = None
        else:
            if self.split is None:
                raise BlendError("--split is required with --data-path (e.g. '969,30,1')")
            self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))
        if (self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss) and self.eod_id is None:
            raise ValueError("--reset-position-ids/--reset-attention-mask/--eod-mask-loss need the "
                             "tokenizer's eod id (pass eod_id)")

    @property
    def tokenizer_identifiers(self) -> Dict[str, object]:
        return {"eod": self.eod_id, "pad": self.pad_id}


def _get_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod_token: Optional[int],
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
):
    """Causal attention mask (True = masked), loss mask and position ids of one sample."""
    seq_length = tokens.numel()
    attention_mask = None
    if create_attention_mask:
        attention_mask = torch.tril(torch.ones((seq_length, seq_length))).unsqueeze(0)
    loss_mask = torch.ones(seq_length, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long)
    if reset_position_ids or reset_attention_mask:
        eod_positions = torch.nonzero(tokens == eod_token).flatten().tolist()
        prev = 0
        for i in eod_positions:
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, i + 1:, : i + 1] = 0
            if reset_position_ids:
                position_ids[i + 1:] -= i + 1 - prev
                prev = i + 1
    if attention_mask is not None:
        attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


def document_ids(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """``--reset-attention-mask`` in compact form: the document of each token, counted from 0 (``[..., s]``). An
    end-of-document token closes its document, so tokens after it start the next one; a token attends only to
    earlier tokens of its own document (Megatron's mask ``[i+1:, :i+1] = 0`` for each eod at ``i``)."""
    is_eod = (tokens == eod_token).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length samples from the sequences ``indexed_indices`` of ``indexed_dataset``.

    ``num_samples`` is the minimum number of samples wanted (None: one epoch). Item ``i`` is a dict
    of ``tokens``, ``labels`` (int64), ``loss_mask`` (float32), ``position_ids`` (int64), with
    ``create_attention_mask`` ``attention_mask``, and with ``reset_attention_mask`` ``document_ids`` (int64).
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: Optional[str],
        indexed_indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = indexed_indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self._extra = 1 if config.add_extra_token_to_sequence else 0

        ids = OrderedDict()
        ids["class"] = type(self).__name__
        ids["dataset_path"] = dataset_path
        ids["num_samples"] = num_samples
        ids["index_split"] = index_split.name
        ids["random_seed"] = config.random_seed
        ids["sequence_length"] = config.sequence_length
        ids["split"] = config.split
        ids["split_matrix"] = config.split_matrix
        ids["tokenizer"] = config.tokenizer_identifiers
        ids["add_extra_token_to_sequence"] = config.add_extra_token_to_sequence
        self.unique_identifiers = ids

        self._pad_token_id = config.pad_id
        if config.eod_id is not None and self._pad_token_id == config.eod_id:
            self._pad_token_id = PAD_TOKEN_ID  # a pad that is also eod would unmask real tokens

        path_to_cache = config.path_to_cache
        if path_to_cache is None and dataset_path is not None:
            path_to_cache = os.path.join(dataset_path, "cache", f"{type(self).__name__}_indices")
        cache = IndexCache.for_description(path_to_cache, type(self).__name__, index_split.name, ids)
        self.unique_description = cache.description
        self.unique_description_hash = cache.hash
        self.document_index, self.sample_index, self.shuffle_index = cache.load_or_build(
            ("document_index", "sample_index", "shuffle_index"), self._build_indices, self._index_problem
        )
        self._cached_masks = None
        self._reused: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        # plain ndarray views (memmap-backed on a cache hit) index faster than numpy.memmap objects
        self._documents = numpy.ascontiguousarray(self.document_index, dtype=numpy.int32).view(numpy.ndarray)
        self._sample = numpy.asarray(self.sample_index).view(numpy.ndarray)
        self._shuffle = numpy.asarray(self.shuffle_index).view(numpy.ndarray)

    # ----------------------------------------------------------------------------------- indices
    def _index_problem(self, arrays) -> Optional[str]:
        """Why cached indices cannot be this dataset's (shapes and ranges), or None."""
        documents, samples, shuffle = arrays
        if documents.ndim != 1 or samples.ndim != 2 or samples.shape[1] != 2 or shuffle.ndim != 1:
            return "wrong array shapes"
        if len(samples) < 1 or len(shuffle) != len(samples) - 1:
            return "the shuffle index does not match the sample index"
        if len(documents) and (documents.min() < 0 or documents.max() >= len(self.dataset.sequence_lengths)):
            return "document ids outside the dataset"
        if samples[:, 0].min() < 0 or samples[:, 0].max() > len(documents) or samples[:, 1].min() < 0:
            return "sample boundaries outside the document index"
        if len(shuffle) and (shuffle.min() < 0 or shuffle.max() >= len(samples) - 1):
            return "shuffled sample ids outside the sample index"
        if self.num_samples is not None and len(shuffle) < self.num_samples:
            return f"{len(shuffle)} samples, {self.num_samples} needed"
        return None

    def _num_tokens_per_epoch(self) -> int:
        return int(numpy.sum(self.dataset.sequence_lengths[self.indices], dtype=numpy.int64))

    def _num_epochs(self, tokens_per_epoch: int) -> int:
        if self.num_samples is None:
            return 1
        requested = self.num_samples * self.config.sequence_length + self._extra
        if tokens_per_epoch <= 0:
            raise ValueError(
                f"the {self.index_split.name} split of '{self.dataset_path}' holds no tokens; "
                f"change --split or add data"
            )
        return max(1, -(-requested // tokens_per_epoch))

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        seq_length = self.config.sequence_length
        extra = self._extra
        tokens_per_epoch = self._num_tokens_per_epoch()
        if tokens_per_epoch <= extra:
            raise ValueError(
                f"the {self.index_split.name} split of '{self.dataset_path}' has {tokens_per_epoch} "
                f"tokens, too few for one sample of --seq-length {seq_length}; change --split or add data"
            )
        num_epochs = self._num_epochs(tokens_per_epoch)
        separate_final_epoch = False
        samples_sans_final = None
        if num_epochs > 1:
            samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
            samples_from_final = self.num_samples - samples_sans_final
            samples_per_epoch = (tokens_per_epoch - extra) // seq_length
            assert 0 <= samples_from_final <= samples_per_epoch + 1
            separate_final_epoch = samples_from_final < int(0.80 * samples_per_epoch)

        rng = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, num_epochs, rng, separate_final_epoch)

        drop_last = True
        if self.index_split == Split.valid:
            drop_last = self.config.drop_last_partial_validation_sequence
        sizes = self.dataset.sequence_lengths
        if len(document_index) * 2 > len(sizes):
            sizes = numpy.array(sizes)  # dense access: read the lengths into memory once
        sample_index = helpers.build_sample_idx(
            sizes, document_index, seq_length, num_epochs, tokens_per_epoch, drop_last, extra
        )
        num_samples_total = sample_index.shape[0] - 1
        if separate_final_epoch:
            shuffle_index = _build_shuffle_index(samples_sans_final, num_samples_total, rng)
        else:
            shuffle_index = _build_shuffle_index(num_samples_total, num_samples_total, rng)
        return document_index, sample_index, shuffle_index

    # ----------------------------------------------------------------------------------- items
    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def _bounds(self, idx: numpy.ndarray) -> numpy.ndarray:
        """``[b, 4]`` int64 (doc_beg, off_beg, doc_end, off_end) of samples ``idx`` (shuffled order)."""
        j = self._shuffle[idx].astype(numpy.int64)
        bounds = numpy.empty((j.shape[0], 4), dtype=numpy.int64)
        bounds[:, :2] = self._sample[j]
        bounds[:, 2:] = self._sample[j + 1]
        return bounds

    def _read_tokens(self, idx: numpy.ndarray, out: numpy.ndarray) -> numpy.ndarray:
        """Fills ``out`` ``[b, seq_length + extra]`` with the tokens of samples ``idx`` (pad past a short
        sample's end); returns which rows were padded."""
        filled = self.dataset.gather(self._documents, self._bounds(idx), self._extra, self._pad_token_id, out)
        return filled < out.shape[1]

    def _query(self, idx: int) -> Tuple[numpy.ndarray, bool]:
        """Tokens of sample ``idx`` (seq_length + extra of them) as int64, and whether it was padded."""
        j = int(self._shuffle[idx])
        bounds = numpy.empty((1, 4), dtype=numpy.int64)
        bounds[0, :2] = self._sample[j]
        bounds[0, 2:] = self._sample[j + 1]
        out = numpy.empty((1, self.config.sequence_length + self._extra), dtype=numpy.int64)
        filled = self.dataset.gather(self._documents, bounds, self._extra, self._pad_token_id, out)
        return out[0], bool(filled[0] < out.shape[1])

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        array, padded = self._query(0 if idx is None else idx)
        text = torch.from_numpy(array)
        if self._extra:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id
        cfg = self.config
        cacheable = not (cfg.reset_position_ids or cfg.reset_attention_mask or cfg.eod_mask_loss)
        if cacheable and self._cached_masks is not None:
            attention_mask, loss_mask, position_ids = self._cached_masks
            loss_mask = loss_mask.clone()
        else:
            attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens, cfg.eod_id, cfg.reset_position_ids, cfg.reset_attention_mask,
                cfg.eod_mask_loss, cfg.create_attention_mask,
            )
            if cacheable:
                self._cached_masks = (attention_mask, loss_mask.clone(), position_ids)
        docs = document_ids(tokens, cfg.eod_id) if cfg.reset_attention_mask else None
        pad = self._pad_token_id
        if padded or pad >= 0:  # pad ids can only appear in padded samples or as real tokens
            pad_labels = labels == pad
            loss_mask[pad_labels] = 0.0
            labels[pad_labels] = 0
            tokens[tokens == pad] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)
        item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if cfg.create_attention_mask:
            item["attention_mask"] = attention_mask
        if docs is not None:
            item["document_ids"] = docs
        return item


    def get_batch(self, indices: Sequence[int], reuse: bool = False) -> Dict[str, torch.Tensor]:
        """Samples ``indices`` as one batch: the values of stacking ``[self[i] for i in indices]``
        (``torch.utils.data.default_collate``), read in one C++ pass.

        The tokens of all samples are copied once, one contiguous copy per document span, into a
        ``[b, seq_length + 1]`` int64 buffer; ``tokens`` (``[:, :-1]``) and ``labels`` (``[:, 1:]``) are
        views of it (not contiguous). ``loss_mask`` is ``[b, s]`` float32; ``position_ids`` ``[b, s]`` and
        ``attention_mask`` ``[b, 1, s, s]`` are read-only broadcast views unless ``--reset-position-ids`` /
        ``--reset-attention-mask`` / ``--eod-mask-loss`` make them differ per sample.
        ``reuse``: write into buffers this dataset keeps per batch size (page-locked when training on
        CUDA, so the host-to-device copy can be asynchronous); the next ``reuse`` call overwrites them.
        """
        idx = numpy.asarray(indices, dtype=numpy.int64).reshape(-1)
        b, s, want = idx.shape[0], self.config.sequence_length, self.config.sequence_length + self._extra
        text, loss_mask = self._batch_buffers(b, want, reuse)
        # buffer-wide work in numpy: torch's intra-op threads cost more than they save on arrays this small
        text_np, loss_mask_np = text.numpy(), loss_mask.numpy()
        padded = self._read_tokens(idx, text_np)
        cfg, pad = self.config, self._pad_token_id
        if self._extra:
            tokens, labels = text[:, :-1], text[:, 1:]
        else:
            tokens, labels = text, torch.empty_like(text)
            labels[:, :-1] = text[:, 1:]
            labels[:, -1] = pad
        attention_mask = None
        if not (cfg.reset_position_ids or cfg.reset_attention_mask or cfg.eod_mask_loss):
            if self._cached_masks is None:
                self._cached_masks = _get_ltor_masks_and_position_ids(
                    tokens[0] if b else torch.zeros(s, dtype=torch.long), cfg.eod_id, False, False, False,
                    cfg.create_attention_mask)
                self._cached_masks = (self._cached_masks[0], self._cached_masks[1].clone(), self._cached_masks[2])
            attention_mask, _, positions = self._cached_masks
            loss_mask_np.fill(1.0)
            position_ids = positions.expand(b, s)
            if attention_mask is not None:
                attention_mask = attention_mask.expand(b, 1, s, s)
        else:
            rows = [_get_ltor_masks_and_position_ids(tokens[k], cfg.eod_id, cfg.reset_position_ids,
                                                     cfg.reset_attention_mask, cfg.eod_mask_loss,
                                                     cfg.create_attention_mask) for k in range(b)]
            position_ids = torch.stack([r[2] for r in rows]) if b else torch.zeros((0, s), dtype=torch.long)
            if b:
                torch.stack([r[1] for r in rows], out=loss_mask)
            if cfg.create_attention_mask:
                attention_mask = torch.stack([r[0] for r in rows]) if b else torch.zeros((0, 1, s, s), dtype=torch.bool)
        docs = document_ids(tokens, cfg.eod_id) if cfg.reset_attention_mask else None  # before pads are zeroed
        if pad >= 0 or padded.any():  # pad ids can only appear in padded samples or as real tokens
            labels_np = labels.numpy()
            pad_labels = labels_np == pad
            loss_mask_np[pad_labels] = 0.0
            if self._extra:
                text_np[text_np == pad] = 0  # tokens and labels share the buffer: every position once
            else:
                labels_np[pad_labels] = 0
                text_np[text_np == pad] = 0
        batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if cfg.create_attention_mask:
            batch["attention_mask"] = attention_mask
        if docs is not None:
            batch["document_ids"] = docs
        return batch

    def _batch_buffers(self, b: int, want: int, reuse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """The token buffer ``[b, want]`` int64 and loss mask ``[b, seq_length]`` float32 of a batch."""
        if reuse and b in self._reused:
            return self._reused[b]
        pin = reuse and device.device_type() == "cuda"
        buffers = (torch.empty((b, want), dtype=torch.int64, pin_memory=pin),
                   torch.empty((b, self.config.sequence_length), dtype=torch.float32, pin_memory=pin))
        if reuse:
            self._reused[b] = buffers
        return buffers


def get_batch(dataset, indices: Sequence[int], reuse: bool = False) -> Dict[str, torch.Tensor]:
    """Samples ``indices`` of a :class:`GPTDataset` or a :class:`BlendedDataset` of them as one batch, equal to
    ``default_collate([dataset[i] for i in indices])`` (see :meth:`GPTDataset.get_batch`; a blend adds
    ``dataset_id`` and reads each member's samples in one pass)."""
    if isinstance(dataset, GPTDataset):
        return dataset.get_batch(indices, reuse)
    if not isinstance(dataset, BlendedDataset):
        raise TypeError(f"get_batch reads a GPTDataset or a BlendedDataset, not {type(dataset).__name__}")
    idx = numpy.asarray(indices, dtype=numpy.int64).reshape(-1)
    which = numpy.asarray(dataset.dataset_index[idx], dtype=numpy.int64)
    samples = numpy.asarray(dataset.dataset_sample_index[idx], dtype=numpy.int64)
    batch: Dict[str, torch.Tensor] = {}
    for d in numpy.unique(which).tolist():
        rows = torch.from_numpy(numpy.nonzero(which == d)[0])
        part = dataset.datasets[d].get_batch(samples[rows.numpy()])
        for key, value in part.items():
            if key not in batch:
                batch[key] = torch.empty((idx.shape[0], *value.shape[1:]), dtype=value.dtype)
            batch[key][rows] = value
    batch["dataset_id"] = torch.from_numpy(which)
    return batch


def _build_document_index(
    documents: numpy.ndarray, num_epochs: int, rng: numpy.random.RandomState, separate_final_epoch: bool
) -> numpy.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents, dtype=numpy.int32), num_epochs)
        rng.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, rng, False)
    last = _build_document_index(documents, 1, rng, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(num_samples: int, total_size: int, rng: numpy.random.RandomState) -> numpy.ndarray:
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return numpy.concatenate((first, last))
