"""GPT dataset: coverage, determinism, resume, blending, caching, errors, and megatron-core parity."""
import os
import warnings

import numpy as np
import pytest
import torch

from megatronish.data import BlendError, build_gpt_datasets
from megatronish.data.gpt_dataset import _get_ltor_masks_and_position_ids
from megatronish.data.indexed_dataset import IndexedDatasetBuilder
from megatronish.data.sampler import MegatronPretrainingSampler, collate, global_batch_indices

EOD = 0


def make_dataset(prefix, seed, ndocs, max_len=40):
    """Documents whose tokens are unique ids (so coverage can be counted), each ending in EOD."""
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    next_id = 1 + seed * 1_000_000
    for _ in range(ndocs):
        n = int(rng.integers(2, max_len))
        t = np.arange(next_id, next_id + n)
        t[-1] = EOD
        next_id += n
        b.add_document(t, [n])
    b.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt")
    a, b = str(d / "a"), str(d / "b")
    make_dataset(a, 1, 300)
    make_dataset(b, 2, 150)
    return str(d), a, b


def stream_of(ds):
    return [ds[i] for i in range(len(ds))]


def test_every_token_once_per_epoch(data):
    d, a, _ = data
    train, valid, test = build_gpt_datasets([a], "80,15,5", 16, 1234, (None, None, None), cache_dir=d + "/c1",
                                            eod_id=EOD)
    from megatronish.data.indexed_dataset import IndexedDataset

    ind = IndexedDataset(a)
    n = len(ind)
    for ds, (lo, hi) in zip((train, valid, test), [(0, 0.8), (0.8, 0.95), (0.95, 1.0)]):
        seqs = range(int(round(lo * n)), int(round(hi * n)))
        expected = np.concatenate([ind[i] for i in seqs])
        counts = {}
        for i in range(len(ds)):
            # each sample's labels start where its tokens start + 1: count the tokens only
            for t in ds[i]["tokens"].tolist():
                counts[t] = counts.get(t, 0) + 1
        ids = expected[expected != EOD]
        covered = [counts.get(int(t), 0) for t in ids]
        # one epoch: every token of the split is an input token exactly once, except the tail that
        # does not fill a whole sample (fewer than seq_length + 1 tokens)
        assert all(c <= 1 for c in covered)
        missing = len(expected) - sum(len(ds[i]["tokens"]) for i in range(len(ds)))
        assert 0 <= missing <= 16
        assert sum(covered) >= len(ids) - 16
        assert len(ds) == (len(expected) - 1) // 16


def test_seed_determinism_and_order(data):
    d, a, _ = data
    one = build_gpt_datasets([a], "90,8,2", 16, 7, (100, 10, 1), cache_dir=d + "/s1", eod_id=EOD)[0]
    same = build_gpt_datasets([a], "90,8,2", 16, 7, (100, 10, 1), cache_dir=d + "/s2", eod_id=EOD)[0]
    other = build_gpt_datasets([a], "90,8,2", 16, 8, (100, 10, 1), cache_dir=d + "/s3", eod_id=EOD)[0]
    x = torch.stack([one[i]["tokens"] for i in range(len(one))])
    y = torch.stack([same[i]["tokens"] for i in range(len(same))])
    z = torch.stack([other[i]["tokens"] for i in range(min(len(other), len(one)))])
    assert torch.equal(x, y)
    assert not torch.equal(x[: len(z)], z)
    # cache: the second build read the arrays as memory maps from md5-named files
    files = sorted(os.listdir(d + "/s2"))
    assert any(f.endswith("-GPTDataset-train-shuffle_index.npy") for f in files)
    again = build_gpt_datasets([a], "90,8,2", 16, 7, (100, 10, 1), cache_dir=d + "/s2", eod_id=EOD)[0]
    assert isinstance(again.sample_index, np.memmap)
    assert torch.equal(torch.stack([again[i]["tokens"] for i in range(len(again))]), x)


def test_labels_shift_and_masks(data):
    d, a, _ = data
    ds = build_gpt_datasets([a], "1", 32, 3, (20, None, None), cache_dir=d + "/m", eod_id=EOD,
                            reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)[0]
    for i in range(len(ds)):
        s = ds[i]
        assert torch.equal(s["tokens"][1:], s["labels"][:-1])
        assert s["tokens"].dtype == torch.int64 and s["loss_mask"].dtype == torch.float32
        eods = (s["tokens"] == EOD).nonzero().flatten().tolist()
        assert torch.equal(s["loss_mask"] == 0, s["tokens"] == EOD)
        prev = 0
        for j in range(32):
            assert int(s["position_ids"][j]) == j - prev
            if j in eods:
                prev = j + 1
    tokens = torch.tensor([5, 0, 6, 7, 0, 8])
    mask, loss, pos = _get_ltor_masks_and_position_ids(tokens, 0, True, True, True, True)
    assert pos.tolist() == [0, 1, 0, 1, 2, 0]
    assert loss.tolist() == [1, 0, 1, 1, 0, 1]
    assert mask.shape == (1, 6, 6) and bool(mask[0, 2, 1]) and not bool(mask[0, 2, 2]) and bool(mask[0, 0, 1])


def test_resume_from_consumed_samples(data):
    d, a, _ = data
    ds = build_gpt_datasets([a], "1", 16, 5, (64, None, None), cache_dir=d + "/r", eod_id=EOD)[0]
    full = [b for b in MegatronPretrainingSampler(len(ds), 0, 2, 1, 3)]
    resumed = [b for b in MegatronPretrainingSampler(len(ds), 18, 2, 1, 3)]
    assert resumed == full[3:]
    assert full[0] == [2, 3] and full[1] == [8, 9]
    loader = torch.utils.data.DataLoader(ds, batch_sampler=MegatronPretrainingSampler(len(ds), 18, 2, 1, 3))
    first = next(iter(loader))
    assert torch.equal(first["tokens"], torch.stack([ds[20]["tokens"], ds[21]["tokens"]]))



def test_training_order_is_the_sampler_order(data):
    """The loop's per-iteration indices are the sampler's batches, iteration after iteration, for every DP rank."""
    d, a, _ = data
    ds = build_gpt_datasets([a], "1", 16, 5, (64, None, None), cache_dir=d + "/o", eod_id=EOD)[0]
    mbs, dp, num_mb = 2, 3, 2
    for rank in range(dp):
        sampled = list(MegatronPretrainingSampler(len(ds), 6, mbs, rank, dp))
        steps = [global_batch_indices(6 + it * mbs * dp * num_mb, mbs, dp, rank, num_mb) for it in range(4)]
        assert [idx for step in steps for idx in step] == sampled[: 4 * num_mb]
    batch = collate([ds[i] for i in global_batch_indices(6, mbs, dp, 1, 1)[0]])
    assert torch.equal(batch["tokens"], torch.stack([ds[8]["tokens"], ds[9]["tokens"]]))

def test_blend_proportions(data):
    d, a, b = data
    for weights in ((0.3, 0.7), (0.9, 0.1), (1, 1)):
        train = build_gpt_datasets([str(weights[0]), a, str(weights[1]), b], "98,1,1", 16, 11, (150, 5, 5),
                                   cache_dir=d + "/bl", eod_id=EOD)[0]
        ids = np.array([train[i]["dataset_id"] for i in range(len(train))])
        w = np.array(weights, float) / sum(weights)
        counts = np.bincount(ids, minlength=2)
        assert np.all(np.abs(counts - w * len(train)) <= 1), (counts, w)
    # unweighted prefixes: weights are the component lengths, size capped at their sum
    train = build_gpt_datasets([a, b], "98,1,1", 16, 11, (100, 5, 5), cache_dir=d + "/bl", eod_id=EOD)[0]
    assert len(train) == 100


@pytest.mark.parametrize("data_path, message", [
    (["0.5", "{a}", "x", "{b}"], "do not parse as numbers"),
    (["0.5", "{a}", "-1", "{b}"], "must be a positive number"),
    (["{a}", "{d}/missing_text_document"], "missing_text_document"),
    ([], "no data"),
])
def test_bad_blend(data, data_path, message):
    d, a, b = data
    path = [p.format(a=a, b=b, d=d) for p in data_path]
    with pytest.raises(BlendError, match=message):
        build_gpt_datasets(path, "969,30,1", 16, 1, (10, 1, 1), cache_dir=d + "/bad", eod_id=EOD)


def test_bad_split_and_empty_split(data):
    d, a, _ = data
    with pytest.raises(BlendError, match="--split"):
        build_gpt_datasets([a], "a,b", 16, 1, (10, 1, 1), cache_dir=d + "/bad", eod_id=EOD)
    with pytest.raises(ValueError, match="change --split"):
        build_gpt_datasets([a], "1000,0,0.1", 16, 1, (10, 1, 1), cache_dir=d + "/bad", eod_id=EOD)


def test_per_split_paths(data):
    d, a, b = data
    train, valid, test = build_gpt_datasets(None, None, 16, 1, (30, 5, None), cache_dir=d + "/ps",
                                            eod_id=EOD, train_data_path=[a], valid_data_path=[b])
    assert len(train) >= 30 and len(valid) >= 5 and test is None
    with pytest.raises(BlendError, match="--train-data-path"):
        build_gpt_datasets(None, None, 16, 1, (30, 5, None), cache_dir=d + "/ps", eod_id=EOD,
                           train_data_path=[d + "/nothing"])


# --------------------------------------------------------------------- megatron-core as oracle
def test_same_samples_as_megatron_core(data):
    from support.megatron_core_support import import_or_skip  # under CI a failure, not a skip
    import_or_skip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset as MGPTDataset
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MConfig
        from megatron.core.datasets.utils import get_blend_from_list

    class Tok:
        eod = EOD
        vocab_size = None
        unique_identifiers = {"class": "Tok"}

    d, a, b = data
    cases = [([a], (300, 40, 10), 16, True), (["0.3", a, "0.7", b], (200, 20, 10), 33, False),
             ([a, b], (90, 10, 5), 16, False), ([a], (2500, 7, 1), 20, True)]
    for data_path, sizes, seq, flags in cases:
        cfg = MConfig(random_seed=9, sequence_length=seq, blend=get_blend_from_list(data_path), split="90,8,2",
                      path_to_cache=None, tokenizer=Tok(), reset_position_ids=flags, reset_attention_mask=False,
                      eod_mask_loss=flags, create_attention_mask=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = BlendedMegatronDatasetBuilder(MGPTDataset, list(sizes), lambda: True, cfg).build()
        ours = build_gpt_datasets(data_path, "90,8,2", seq, 9, sizes, cache_dir=d + "/oracle", eod_id=EOD,
                                  reset_position_ids=flags, eod_mask_loss=flags)
        for t, o in zip(theirs, ours):
            assert len(t) == len(o)
            for i in range(len(t)):
                x, y = t[i], o[i]
                for k in ("tokens", "labels", "loss_mask", "position_ids"):
                    assert torch.equal(x[k], y[k]), (data_path, i, k)
                if "dataset_id" in x:
                    assert int(x["dataset_id"]) == y["dataset_id"]
