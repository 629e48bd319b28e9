"""Datasets from ``--data-path`` (or per-split paths) through the data package, with Megatron's sample counts:
``train = train_iters * gbs``, ``valid = (train_iters // eval_interval + 1) * eval_iters * gbs``,
``test = eval_iters * gbs``."""
from __future__ import annotations

from ..data import build_gpt_datasets, build_tokenizer


def build_file_datasets(cfg):
    d, t = cfg.data, cfg.train
    tokenizer = build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                                tokenizer_model=d.tokenizer_model, vocab_size=d.vocab_size_flag,
                                vocab_extra_ids=d.vocab_extra_ids)
    gbs = t.global_batch_size
    train_iters = 0 if t.skip_train else (t.train_iters or 0)
    evals = (train_iters // t.eval_interval + 1) if t.eval_interval else 1
    num_samples = (train_iters * gbs, evals * t.eval_iters * gbs, t.eval_iters * gbs)
    train, valid, _test = build_gpt_datasets(
        d.data_path or None, d.split, d.seq_length, t.seed, num_samples, cache_dir=d.data_cache_path,
        eod_id=tokenizer.eod, pad_id=tokenizer.pad, train_data_path=d.train_data_path,
        valid_data_path=d.valid_data_path, test_data_path=d.test_data_path,
        reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss)
    return train, valid
