"""Index helpers of the GPT dataset, compiled in ``megatronish._C`` (csrc/helpers.cpp).

Same names, signatures and semantics as Megatron-LM's ``megatron.core.datasets.helpers``:

- ``build_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
  drop_last_partial_sequence=True, add_extra_token_to_sequence=1)`` -> ``[num_samples + 1, 2]``
  array of (position in ``document_idx``, token offset) where each sample starts; int32 when every
  value fits, else int64.
- ``build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size,
  verbose)`` fills the int16 / int64 output arrays in place.
- ``build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets)``
  fills them with exactly ``sizes[i]`` samples of dataset ``i``.
"""
from __future__ import annotations

import numpy

try:
    from megatronish import _C
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError(
        "megatronish._C (the compiled data helpers) is missing; build it with "
        "`pip install -e .` (or `python setup.py build_ext --inplace`) from the repository root"
    ) from err

build_sample_idx_int32 = _C.build_sample_idx_int32
build_sample_idx_int64 = _C.build_sample_idx_int64

__all__ = [
    "build_sample_idx",
    "build_sample_idx_int32",
    "build_sample_idx_int64",
    "build_blending_indices",
    "build_exhaustive_blending_indices",
]


def build_sample_idx(
    sizes: numpy.ndarray,
    document_idx: numpy.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> numpy.ndarray:
    """The 2-D sample index; int32 if ``max(len(document_idx), sizes.max())`` fits in int32."""
    sizes = numpy.ascontiguousarray(sizes, dtype=numpy.int32)
    document_idx = numpy.ascontiguousarray(document_idx, dtype=numpy.int32)
    largest = max(document_idx.shape[0], int(sizes.max()) if sizes.size else 0)
    fn = build_sample_idx_int32 if largest <= numpy.iinfo(numpy.int32).max else build_sample_idx_int64
    return fn(
        sizes,
        document_idx,
        int(seq_length),
        int(num_epochs),
        int(tokens_per_epoch),
        bool(drop_last_partial_sequence),
        1 if add_extra_token_to_sequence else 0,
    )


def _check_outputs(dataset_index: numpy.ndarray, dataset_sample_index: numpy.ndarray, fn: str) -> None:
    # The outputs are written in place, so a wrong dtype would silently fill a converted copy.
    if not (isinstance(dataset_index, numpy.ndarray) and dataset_index.dtype == numpy.int16
            and dataset_index.flags.c_contiguous and dataset_index.flags.writeable):
        raise ValueError(f"{fn}: dataset_index must be a writable contiguous numpy int16 array")
    if not (isinstance(dataset_sample_index, numpy.ndarray) and dataset_sample_index.dtype == numpy.int64
            and dataset_sample_index.flags.c_contiguous and dataset_sample_index.flags.writeable):
        raise ValueError(f"{fn}: dataset_sample_index must be a writable contiguous numpy int64 array")


def build_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    weights,
    num_datasets: int,
    size: int,
    verbose: bool,
) -> None:
    _check_outputs(dataset_index, dataset_sample_index, "build_blending_indices")
    _C.build_blending_indices(
        dataset_index,
        dataset_sample_index,
        numpy.ascontiguousarray(weights, dtype=numpy.float64),
        int(num_datasets),
        int(size),
        bool(verbose),
    )


def build_exhaustive_blending_indices(
    dataset_index: numpy.ndarray,
    dataset_sample_index: numpy.ndarray,
    sizes,
    num_datasets: int,
) -> None:
    _check_outputs(dataset_index, dataset_sample_index, "build_exhaustive_blending_indices")
    _C.build_exhaustive_blending_indices(
        dataset_index,
        dataset_sample_index,
        numpy.ascontiguousarray(sizes, dtype=numpy.int64),
        int(num_datasets),
    )
