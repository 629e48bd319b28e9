"""``--loader megatron`` / ``--saver megatron`` of ``tools/checkpoint/convert.py``: Megatron-LM checkpoints
(megatron-core ``torch_dist``, or the legacy ``mp_rank_XX/model_optim_rng.pt`` files) in, megatron-core
``torch_dist`` out. The formats and the name map are :mod:`megatronish.checkpoint.megatron_format`'s; the
tensors are our global tensors, so any saver (``hf``, ``megatronish``, ``megatron``) takes a Megatron source.
"""
from __future__ import annotations

import os

from ..checkpoint import layout
from ..checkpoint.megatron_format import CheckpointError, model_fields, open_checkpoint, true_vocab_size
from ..config import ModelConfig
from ..errors import ConfigError
from .hf_config import ConvertError, architecture_of
from .name_map import VOCAB_TENSORS, expected_global_shapes, pad_vocab


def read_megatron(args) -> dict:
    """The fields of a :class:`~megatronish.convert.plugins.Source` for ``--load-dir``."""
    where = f"--load-dir {args.load_dir}"
    try:
        ck = open_checkpoint(args.load_dir)
        fields = model_fields(ck.args, ck.where)
    except CheckpointError as e:
        raise ConvertError(f"{where}: {e}") from None
    rows_shape = ck.shape("embedding.word_embeddings.weight")
    if rows_shape is None:
        raise ConvertError(f"{where}: {ck.iter_dir} holds no embedding.word_embeddings.weight")
    rows = rows_shape[0]
    vocab = args.true_vocab_size or true_vocab_size(ck.args) or rows
    if vocab > rows:
        raise ConvertError(f"--true-vocab-size {vocab} is larger than the padded vocabulary of {ck.iter_dir} "
                           f"({rows} rows); pass at most {rows}")
    try:
        cfg = ModelConfig.from_flat(fields, vocab_size=vocab)
    except ConfigError as e:
        raise ConvertError(f"{ck.where}: the stored args describe no valid model: {e}") from None
    if args.saver == "hf":
        arch = architecture_of(cfg, ck.where)
    else:
        try:
            arch = architecture_of(cfg, ck.where)
        except ConvertError:
            arch = "GPT model"  # no Hugging Face equivalent; fine for the other savers
    expect = expected_global_shapes(cfg)
    names = list(expect)
    for name in names:
        got = ck.shape(name)
        if got is None:
            raise ConvertError(f"{where}: missing tensor for {name!r} in {ck.iter_dir}; the checkpoint does not hold "
                               "a complete model of its args")
        shape = expect[name]
        bad = (got[1:] != shape[1:] or got[0] < vocab) if name in VOCAB_TENSORS else got != shape
        if bad:
            raise ConvertError(f"{where}: tensor for {name!r} has shape {list(got)}, the args need {list(shape)}")
    _check_unexpected(ck, set(names), where)
    specs = [(n, ck.shape(n), ck.dtype(n)) for n in names]

    def tensors():
        for n in names:
            yield n, ck.read(n)

    return {"cfg": cfg, "arch": arch, "specs": specs, "tensors": tensors, "origin": f"megatron:{ck.iter_dir}"}


def _check_unexpected(ck, names: set[str], where: str) -> None:
    if hasattr(ck, "model_keys"):  # torch_dist: every model key must be used
        used = {ck.key_of(n)[0] for n in names}
        extra = [k for k in ck.model_keys() if k not in used]
    else:
        extra = [n for n in ck.names() if n not in names]
    if extra:
        raise ConvertError(f"{where}: unexpected tensor {extra[0]!r} for the model its args describe")


def save_megatron(args, src) -> None:
    """``<save-dir>/release`` (tracker ``release``), a torch_dist checkpoint laid out for the target TP x PP
    (already checked to split the model); ``src``: a :class:`~megatronish.convert.plugins.Source`."""
    from ..checkpoint.megatron_write import write_torch_dist

    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    cfg = src.cfg
    padded = cfg.padded_vocab_size(tp)
    specs = [(n, (padded, *s[1:]) if n in VOCAB_TENSORS else tuple(s), d) for n, s, d in src.specs]

    def tensors():
        for name, t in src.tensors():
            if name in VOCAB_TENSORS and t.size(0) != padded:
                if t.size(0) > padded and t[padded:].any():
                    raise ConvertError(f"{src.origin}: {name} has non-zero rows past the padded vocabulary "
                                       f"{padded} of TP {tp}; pass --true-vocab-size")
                t = pad_vocab(t[:padded], padded)
            yield name, t

    iter_dir = layout.checkpoint_dir(args.save_dir, None)
    try:
        write_torch_dist(iter_dir, cfg, specs, tensors(), tp=tp, pp=pp, padded_vocab=padded)
    except CheckpointError as e:
        raise ConvertError(f"--save-dir {args.save_dir}: {e}") from None
    layout.write_tracker(args.save_dir, None)
    if not os.path.isfile(os.path.join(iter_dir, ".metadata")):
        raise ConvertError(f"--save-dir {args.save_dir}: the checkpoint index was not written")

