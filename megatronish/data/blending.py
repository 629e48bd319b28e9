"""Blends: ``--data-path`` parsing, split strings, and the blended dataset over several GPT datasets."""
from __future__ import annotations

import functools
import re
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from megatronish.data import helpers
from megatronish.data.index_cache import IndexCache
from megatronish.errors import BlendError

__all__ = [
    "BlendError",
    "BlendedDataset",
    "get_blend_from_list",
    "normalize",
    "parse_and_normalize_split",
    "convert_split_vector_to_split_matrix",
]


def normalize(weights: Sequence[float]) -> List[float]:
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


def get_blend_from_list(
    blend: Optional[Sequence[str]], flag: str = "--data-path"
) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """``[p]`` / ``[w1, p1, w2, p2, ...]`` / ``[p1, p2, ...]`` -> (prefixes, weights or None)."""
    if blend is None:
        return None
    if isinstance(blend, str):
        blend = blend.split()
    blend = [str(b).strip() for b in blend if str(b).strip()]
    if not blend:
        raise BlendError(f"{flag} is empty; give a path prefix, 'w1 p1 w2 p2 ...' or 'p1 p2 ...'")
    if len(blend) % 2 == 1:
        return list(blend), None
    raw_weights, prefixes = blend[0::2], blend[1::2]
    weights: List[Optional[float]] = []
    for w in raw_weights:
        try:
            weights.append(float(w))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return list(blend), None  # an even number of plain prefixes
    bad = [raw for raw, w in zip(raw_weights, weights) if w is None]
    if bad:
        raise BlendError(
            f"{flag}: weights {bad} do not parse as numbers; write 'weight prefix' pairs "
            f"(e.g. '0.3 data/a_text_document 0.7 data/b_text_document') or only prefixes"
        )
    for raw, w in zip(raw_weights, weights):
        if not numpy.isfinite(w) or w <= 0:
            raise BlendError(f"{flag}: weight {raw!r} must be a positive number")
    return list(prefixes), [float(w) for w in weights]


def parse_and_normalize_split(split: str) -> List[float]:
    """``"969,30,1"`` -> ``[0.969, 0.03, 0.001]`` (missing entries are 0)."""
    values = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not values or len(values) > 3:
        raise BlendError(f"--split {split!r} must hold 1 to 3 non-negative numbers, e.g. '969,30,1'")
    values += [0.0] * (3 - len(values))
    if sum(values) <= 0:
        raise BlendError(f"--split {split!r} sums to zero")
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: Sequence[float], vector_b: Optional[Sequence[float]] = None
) -> List[Optional[Tuple[float, float]]]:
    """Cumulative bookends per split, a zero-width split becoming None; with ``vector_b``, the
    overlap of the two."""
    if vector_b is None:
        vector_b = vector_a
    exp_a = functools.reduce(lambda acc, x: acc + [acc[-1] + x], vector_a, [0])
    exp_b = functools.reduce(lambda acc, x: acc + [acc[-1] + x], vector_b, [0])
    matrix: List[Optional[Tuple[float, float]]] = []
    for (a0, a1), (b0, b1) in zip(zip(exp_a[:-1], exp_a[1:]), zip(exp_b[:-1], exp_b[1:])):
        if min(a1, b1) <= max(a0, b0):
            matrix.append(None)
        else:
            matrix.append((max(a0, b0), min(a1, b1)))
    return matrix


class BlendedDataset:
    """Samples drawn from several datasets in proportion to ``weights``.

    With ``size``: ``size`` samples by the greedy error-minimising rule over the normalized weights.
    Without: exactly ``weights[i]`` (integers) samples of dataset ``i``. Items are
    ``{"dataset_id": i, **datasets[i][j]}``.
    """

    def __init__(self, datasets: Sequence, weights: Sequence, size: Optional[int], config) -> None:
        if len(datasets) != len(weights):
            raise BlendError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= 32767:
            raise BlendError("a blend holds at most 32766 datasets")
        if not all(w > 0 for w in weights):
            raise BlendError(f"blend weights must be positive, got {list(weights)}")
        if size is None and not all(float(w) == int(w) for w in weights):
            raise BlendError("a blend without a size needs integer weights (dataset lengths)")
        if size is not None:
            weights = normalize(weights)
        else:
            weights = [int(w) for w in weights]
        self.datasets = list(datasets)
        self.split = self.datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config

        ids = OrderedDict()
        ids["class"] = type(self).__name__
        ids["datasets"] = [d.unique_identifiers for d in self.datasets]
        ids["split"] = self.split.name
        ids["weights"] = self.weights
        ids["size"] = self.size
        cache = IndexCache.for_description(
            config.path_to_cache, type(self).__name__, self.split.name, ids
        )
        self.unique_description = cache.description
        self.unique_description_hash = cache.hash
        arrays = cache.load_or_build(("dataset_index", "dataset_sample_index"), self._build_indices,
                                     self._index_problem)
        self.dataset_index, self.dataset_sample_index = arrays

    def _index_problem(self, arrays) -> Optional[str]:
        """Why cached blend indices cannot be this blend's, or None."""
        which, sample = arrays
        if which.ndim != 1 or sample.shape != which.shape:
            return "wrong array shapes"
        if self.size is not None and len(which) != self.size:
            return f"{len(which)} samples, {self.size} expected"
        if len(which) and (which.min() < 0 or which.max() >= len(self.datasets) or sample.min() < 0):
            return "dataset ids outside the blend"
        for i, d in enumerate(self.datasets):
            mine = sample[which == i]
            if len(mine) and mine.max() >= len(d):
                return f"sample ids outside dataset {i}"
        return None

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        if self.size is not None:
            dataset_index = numpy.zeros(self.size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(self.size, dtype=numpy.int64)
            helpers.build_blending_indices(
                dataset_index, dataset_sample_index, self.weights, len(self.datasets), self.size, False
            )
        else:
            size = int(sum(self.weights))
            dataset_index = numpy.zeros(size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
            helpers.build_exhaustive_blending_indices(
                dataset_index, dataset_sample_index, numpy.array(self.weights, dtype=numpy.int64),
                len(self.datasets),
            )
        ids, counts = numpy.unique(dataset_index, return_counts=True)
        for i, c in zip(ids, counts):
            if len(self.datasets[i]) < c:
                raise IndexError(
                    f"the {self.split.name} blend asks {int(c)} samples of dataset {int(i)} "
                    f"('{self.datasets[i].dataset_path}') which has only {len(self.datasets[i])}; "
                    f"raise mid_level_dataset_surplus (now {self.config.mid_level_dataset_surplus})"
                )
        return dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, idx: int) -> Dict[str, object]:
        dataset_id = int(self.dataset_index[idx])
        sample_id = int(self.dataset_sample_index[idx])
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][sample_id]}
