"""Datasets from ``--data-path`` (or per-split paths) through the data package, with Megatron's sample counts:
``train = train_iters * gbs``, ``valid = (train_iters // eval_interval + 1) * eval_iters * gbs``,
``test = eval_iters * gbs``. The tokenizer is the run's one (``cfg.data.tokenizer``, built when the config was)."""
from __future__ import annotations

from ..data import build_gpt_datasets


def build_file_datasets(cfg):
    d, t = cfg.data, cfg.train
    tokenizer = d.tokenizer
    gbs = t.global_batch_size
    train_iters = 0 if t.skip_train else (t.train_iters or 0)
    evals = (train_iters // t.eval_interval + 1) if t.eval_interval else 1
    num_samples = (train_iters * gbs, evals * t.eval_iters * gbs, t.eval_iters * gbs)
    train, valid, test = build_gpt_datasets(
        d.data_path or None, d.split, cfg.model.seq_length, t.seed, num_samples, cache_dir=d.data_cache_path,
        eod_id=tokenizer.eod, pad_id=tokenizer.pad, train_data_path=d.train_data_path,
        valid_data_path=d.valid_data_path, test_data_path=d.test_data_path,
        reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss, mmap_bin_files=d.mmap_bin_files)
    return train, valid, test
