"""Batched sample reads: ``get_batch`` equals stacking the per-sample items exactly, and the C++ span copy
equals a plain per-span read of the .bin (every dtype, padded samples, blends, reused buffers)."""
import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from megatronish.data import build_gpt_datasets
from megatronish.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split, get_batch
from megatronish.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

EOD = 0


def make_dataset(prefix, seed, ndocs, dtype=np.int32, max_len=40):
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for _ in range(ndocs):
        n = int(rng.integers(2, max_len))
        t = rng.integers(1, 120, n)
        t[-1] = EOD
        t[rng.random(n) < 0.05] = 7  # a token that doubles as the pad id in one test
        b.add_document(t, [n])
    b.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    paths = {}
    for name, dtype in (("i32", np.int32), ("u16", np.uint16), ("u8", np.uint8), ("i64", np.int64)):
        paths[name] = str(d / name)
        make_dataset(paths[name], 3, 200, dtype)
    return str(d), paths


def reference_tokens(ds, idx):
    """Sample ``idx`` read span by span through ``IndexedDataset.get`` (the definition of a sample)."""
    j = int(ds.shuffle_index[idx])
    (doc_beg, off_beg), (doc_end, off_end) = ds.sample_index[j].tolist(), ds.sample_index[j + 1].tolist()
    want = ds.config.sequence_length + ds._extra
    parts = []
    for i in range(doc_beg, doc_end + 1):
        seq = int(ds.document_index[i])
        offset = off_beg if i == doc_beg else 0
        stop = off_end + ds._extra if i == doc_end else int(ds.dataset.sequence_lengths[seq])
        parts.append(ds.dataset.get(seq, offset, stop - offset).astype(np.int64))
    flat = np.concatenate(parts)[:want]
    return np.concatenate([flat, np.full(want - len(flat), ds._pad_token_id, np.int64)])


def assert_same(batch, items):
    ref = default_collate(items)
    assert batch.keys() == ref.keys()
    for key in ref:
        assert batch[key].dtype == ref[key].dtype, key
        assert torch.equal(batch[key], ref[key]), key


def datasets(data, name, seq=16, **kw):
    d, paths = data
    return build_gpt_datasets([paths[name]], "90,10,0", seq, 1234, (300, 40, None), cache_dir=d + "/cache",
                              eod_id=EOD, **kw)


@pytest.mark.parametrize("name", ["i32", "u16", "u8", "i64"])
def test_span_copy_equals_per_span_reads(data, name):
    train, valid, _ = datasets(data, name)
    for ds in (train, valid):
        idx = np.arange(len(ds))
        out = np.empty((len(idx), ds.config.sequence_length + 1), np.int64)
        ds._read_tokens(idx, out)
        np.testing.assert_array_equal(out, np.stack([reference_tokens(ds, i) for i in idx]))


@pytest.mark.parametrize("kw", [
    {},
    {"create_attention_mask": True},
    {"eod_mask_loss": True, "reset_position_ids": True, "reset_attention_mask": True, "create_attention_mask": True},
    {"pad_id": 7},  # a pad id that is also a real token: its labels are masked and zeroed
])
def test_get_batch_equals_collated_items(data, kw):
    train, valid, _ = datasets(data, "u16", **kw)
    rng = np.random.default_rng(0)
    for ds in (train, valid):
        for b in (1, 5, 32):
            idx = rng.integers(0, len(ds), b)
            assert_same(ds.get_batch(idx), [ds[int(i)] for i in idx])


def test_padded_final_sample(data, tmp_path):
    """A validation split that keeps its last partial sample: padded rows match the per-sample items."""
    d, paths = data
    ds = IndexedDataset(paths["i32"])
    for pad in (-1, 7):
        cfg = GPTDatasetConfig(random_seed=5, sequence_length=24, split="1", path_to_cache=str(tmp_path), eod_id=EOD,
                               pad_id=pad, drop_last_partial_validation_sequence=False)
        valid = GPTDataset(ds, None, np.arange(0, 37, dtype=np.int32), None, Split.valid, cfg)
        idx = np.arange(len(valid))
        padded = valid._read_tokens(idx, np.empty((len(idx), 25), np.int64))
        assert padded.any()
        assert_same(valid.get_batch(idx), [valid[int(i)] for i in idx])


def test_without_extra_token(data, tmp_path):
    d, paths = data
    cfg = GPTDatasetConfig(random_seed=5, sequence_length=16, split="1", path_to_cache=str(tmp_path), eod_id=EOD,
                           add_extra_token_to_sequence=False, eod_mask_loss=True)
    ds = GPTDataset(IndexedDataset(paths["u16"]), None, np.arange(0, 150, dtype=np.int32), 100, Split.train, cfg)
    idx = np.arange(len(ds))[::-1]
    assert_same(ds.get_batch(idx), [ds[int(i)] for i in idx])


def test_reused_buffers(data):
    train = datasets(data, "u16")[0]
    first = train.get_batch([3, 1, 4], reuse=True)
    ptr = first["tokens"].data_ptr()
    second = train.get_batch([1, 5, 9], reuse=True)
    assert second["tokens"].data_ptr() == ptr  # same storage, overwritten
    assert_same(second, [train[i] for i in (1, 5, 9)])
    fresh = train.get_batch([3, 1, 4])
    assert fresh["tokens"].data_ptr() != ptr
    assert_same(fresh, [train[i] for i in (3, 1, 4)])


def test_blend(data):
    d, paths = data
    train = build_gpt_datasets(["0.3", paths["u16"], "0.7", paths["i32"]], "90,10,0", 16, 1234, (200, 20, None),
                               cache_dir=d + "/cache", eod_id=EOD)[0]
    idx = np.random.default_rng(1).integers(0, len(train), 40)
    assert_same(get_batch(train, idx), [train[int(i)] for i in idx])
    assert_same(get_batch(train.datasets[0], idx[:4]), [train.datasets[0][int(i)] for i in idx[:4]])


def test_out_of_range(data):
    train = datasets(data, "u16")[0]
    with pytest.raises(IndexError):
        train.get_batch([len(train)])
