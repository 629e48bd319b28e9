"""Indexed dataset (.bin/.idx): golden bytes, hand-built files, merging, bad files, megatron-core."""
import os
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest

from megatronish.data.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
)
from megatronish.testing import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def hand_built(docs, dtype):
    """(.bin bytes, .idx bytes) written straight from the format description with struct."""
    lengths, pointers, doc_idx, bin_bytes, ptr = [], [], [0], b"", 0
    for doc in docs:
        for seq in doc:
            arr = np.asarray(seq, dtype=dtype)
            bin_bytes += arr.tobytes()
            lengths.append(len(seq))
            pointers.append(ptr)
            ptr += len(seq) * np.dtype(dtype).itemsize
        doc_idx.append(len(lengths))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype])
    idx += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    return bin_bytes, idx


DOCS = [[[1, 2, 3], [4]], [[5, 6, 7, 8, 9]], [], [[10], [11, 12], [13]]]


def write_with_builder(prefix, docs, dtype, by="document"):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        if by == "document":
            flat = [t for seq in doc for t in seq]
            b.add_document(np.array(flat, dtype=np.int64), [len(s) for s in doc])
        else:
            for seq in doc:
                b.add_item(np.array(seq))
            b.end_document()
    b.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", list(CODES))
def test_builder_matches_golden_bytes(tmp_path, dtype):
    prefix = str(tmp_path / "ds")
    write_with_builder(prefix, DOCS, dtype)
    gold_bin, gold_idx = hand_built(DOCS, dtype)
    assert open(prefix + ".bin", "rb").read() == gold_bin
    assert open(prefix + ".idx", "rb").read() == gold_idx
    write_with_builder(prefix + "2", DOCS, dtype, by="item")
    assert open(prefix + "2.idx", "rb").read() == gold_idx
    assert not os.path.exists(prefix + ".idx.tmp")


def test_add_documents_batch_matches_golden(tmp_path):
    prefix = str(tmp_path / "ds")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    flat = [t for doc in DOCS for seq in doc for t in seq]
    b.add_documents(np.array(flat), [len(s) for doc in DOCS for s in doc], [len(doc) for doc in DOCS])
    b.finalize(prefix + ".idx")
    gold_bin, gold_idx = hand_built(DOCS, np.uint16)
    assert open(prefix + ".bin", "rb").read() == gold_bin
    assert open(prefix + ".idx", "rb").read() == gold_idx


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.float32])
def test_hand_built_files_read_back(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [[list(rng.integers(0, 60000, rng.integers(0, 9))) for _ in range(rng.integers(0, 4))] for _ in range(30)]
    gold_bin, gold_idx = hand_built(docs, dtype)
    prefix = str(tmp_path / "hand")
    open(prefix + ".bin", "wb").write(gold_bin)
    open(prefix + ".idx", "wb").write(gold_idx)
    ds = IndexedDataset(prefix)
    seqs = [s for d in docs for s in d]
    assert len(ds) == len(seqs)
    assert ds.index.dtype == dtype
    expected_docs = np.cumsum([0] + [len(d) for d in docs])
    np.testing.assert_array_equal(ds.document_indices, expected_docs)
    np.testing.assert_array_equal(ds.sequence_lengths, [len(s) for s in seqs])
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], np.asarray(s, dtype=dtype))
        assert ds[i].dtype == dtype
        if len(s) >= 3:
            np.testing.assert_array_equal(ds.get(i, 1, 2), np.asarray(s[1:3], dtype=dtype))
            np.testing.assert_array_equal(ds.get(i, 1), np.asarray(s[1:], dtype=dtype))
    for got, s in zip(ds[2:7], seqs[2:7]):
        np.testing.assert_array_equal(got, np.asarray(s, dtype=dtype))
    with pytest.raises(IndexError):
        ds.get(0, 0, len(seqs[0]) + 1)


def test_pickle_reopens(tmp_path):
    import pickle

    prefix = str(tmp_path / "ds")
    write_with_builder(prefix, DOCS, np.int32)
    ds = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    np.testing.assert_array_equal(ds[3], [10])
    np.testing.assert_array_equal(ds[4], [11, 12])


def test_merge_equals_one_pass(tmp_path):
    rng = np.random.default_rng(1)
    parts = [[[list(rng.integers(0, 500, rng.integers(1, 7))) for _ in range(rng.integers(1, 3))] for _ in range(n)]
             for n in (5, 0, 8, 3)]
    prefixes = []
    for k, docs in enumerate(parts):
        prefixes.append(str(tmp_path / f"part{k}"))
        write_with_builder(prefixes[-1], docs, np.uint16)
    merged = str(tmp_path / "merged")
    b = IndexedDatasetBuilder(merged + ".bin", dtype=np.uint16)
    for p in prefixes:
        b.add_index(p)
    b.finalize(merged + ".idx")
    one = str(tmp_path / "one")
    write_with_builder(one, [d for docs in parts for d in docs], np.uint16)
    for ext in (".bin", ".idx"):
        assert open(merged + ext, "rb").read() == open(one + ext, "rb").read()
    # the CLI does the same
    cli = str(tmp_path / "cli")
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "merge_datasets.py"), "--input", *prefixes,
                        "--output-prefix", cli], capture_output=True, text=True, env=subprocess_env())
    assert r.returncode == 0, r.stderr
    for ext in (".bin", ".idx"):
        assert open(cli + ext, "rb").read() == open(one + ext, "rb").read()


def test_merge_rejects_other_dtype(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_with_builder(a, DOCS, np.uint16)
    write_with_builder(b, DOCS, np.int32)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    builder.add_index(a)
    with pytest.raises(ValueError, match="share a dtype"):
        builder.add_index(b)
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "merge_datasets.py"), "--input", a, b,
                        "--output-prefix", str(tmp_path / "m2")], capture_output=True, text=True, env=subprocess_env())
    assert r.returncode == 2 and "share a dtype" in r.stderr and "Traceback" not in r.stderr


def test_optimal_dtype_and_overflow(tmp_path):
    assert DType.optimal_dtype(50257) == np.uint16
    assert DType.optimal_dtype(65499) == np.uint16
    assert DType.optimal_dtype(65500) == np.int32
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="does not fit"):
        b.add_item(np.array([70000]))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda idx, bin_: (b"NOTANIDX!" + idx[9:], bin_), "not an indexed dataset index"),
        (lambda idx, bin_: (idx[:9] + struct.pack("<Q", 2) + idx[17:], bin_), "version 2"),
        (lambda idx, bin_: (idx[:17] + b"\x09" + idx[18:], bin_), "unknown dtype code 9"),
        (lambda idx, bin_: (idx[:20], bin_), "truncated"),
        (lambda idx, bin_: (idx[:-8], bin_), "truncated"),
        (lambda idx, bin_: (idx + b"\x00", bin_), "trailing bytes"),
        (lambda idx, bin_: (idx, bin_[:-2]), "the pair is truncated or mismatched"),
    ],
)
def test_bad_files_give_one_clear_error(tmp_path, corrupt, message):
    prefix = str(tmp_path / "ds")
    gold_bin, gold_idx = hand_built(DOCS, np.uint16)
    idx, bin_ = corrupt(gold_idx, gold_bin)
    open(prefix + ".idx", "wb").write(idx)
    open(prefix + ".bin", "wb").write(bin_)
    with pytest.raises(IndexedDatasetError, match=message) as err:
        IndexedDataset(prefix)
    assert "ds." in str(err.value)  # names the file


def test_missing_files(tmp_path):
    with pytest.raises(IndexedDatasetError, match="does not exist"):
        IndexedDataset(str(tmp_path / "nothing"))
    prefix = str(tmp_path / "half")
    open(prefix + ".bin", "wb").write(b"\x00\x00")
    with pytest.raises(IndexedDatasetError, match=r"half\.idx' does not exist"):
        IndexedDataset(prefix)


# ---------------------------------------------------------------------- megatron-core as oracle
def _mcore_indexed():
    from support.megatron_core_support import import_or_skip  # under CI a failure, not a skip
    import_or_skip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset as mc
    return mc


def test_megatron_core_reads_ours_and_we_read_theirs(tmp_path):
    mc = _mcore_indexed()
    rng = np.random.default_rng(5)
    docs = [[list(rng.integers(0, 50000, rng.integers(1, 20))) for _ in range(rng.integers(1, 4))] for _ in range(40)]
    ours = str(tmp_path / "ours")
    write_with_builder(ours, docs, np.uint16)
    theirs_view = mc.IndexedDataset(ours)
    seqs = [s for d in docs for s in d]
    assert len(theirs_view) == len(seqs)
    np.testing.assert_array_equal(theirs_view.document_indices, np.cumsum([0] + [len(d) for d in docs]))
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(theirs_view[i], s)

    theirs = str(tmp_path / "theirs")
    b = mc.IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
    for d in docs:
        b.add_document(np.array([t for s in d for t in s]), [len(s) for s in d])
    b.finalize(theirs + ".idx")
    for ext in (".bin", ".idx"):
        assert open(theirs + ext, "rb").read() == open(ours + ext, "rb").read()
    ds = IndexedDataset(theirs)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
