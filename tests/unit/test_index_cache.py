"""The dataset index cache is read with ``allow_pickle=False``: a planted pickle never runs; a cache file that does
not match its description (tampered text, wrong contents, unreadable array) is named in a warning and rebuilt, and
the rebuilt dataset gives the same samples as a fresh build."""
import glob
import os
import pickle

import numpy as np
import pytest
from test_data_gpt_dataset import EOD, make_dataset, stream_of

from megatronish.data import build_gpt_datasets
from megatronish.data.index_cache import IndexCache


class _Bomb:
    def __reduce__(self):
        return (open, ("/tmp/megatronish-pickle-ran", "w"))


def _build(a, b, cache):
    return build_gpt_datasets(["0.6", a, "0.4", b], "90,10,0", 16, 5, (200, 20, None), cache_dir=cache, eod_id=EOD)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    a, b = str(d / "a"), str(d / "b")
    make_dataset(a, 1, 200)
    make_dataset(b, 2, 120)
    reference = [stream_of(ds) for ds in _build(a, b, None)[:2]]  # no cache at all
    return d, a, b, reference


def _same(x, y):
    return len(x) == len(y) and all(np.array_equal(np.asarray(p[k]), np.asarray(q[k])) for p, q in zip(x, y)
                                    for k in p)


def _files(cache, name):
    return sorted(glob.glob(os.path.join(cache, f"*-{name}.npy")))


@pytest.mark.parametrize("damage", ["pickle", "description", "out_of_range", "truncated", "floats"])
def test_damaged_cache_is_rebuilt(data, tmp_path, capsys, damage):
    d, a, b, reference = data
    cache = str(tmp_path / "c")
    _build(a, b, cache)
    capsys.readouterr()
    again = _build(a, b, cache)  # a clean hit: no warning, same samples
    assert "WARNING" not in capsys.readouterr().err
    assert all(_same(stream_of(ds), ref) for ds, ref in zip(again[:2], reference))

    if damage == "pickle":
        target = _files(cache, "shuffle_index")[0]
        with open(target, "wb") as f:
            np.save(f, np.array([_Bomb()], dtype=object), allow_pickle=True)
    elif damage == "description":
        target = glob.glob(os.path.join(cache, "*-description.txt"))[0]
        with open(target, "a") as f:
            f.write(" ")
    elif damage == "out_of_range":
        target = _files(cache, "document_index")[0]
        arr = np.load(target)
        arr[0] = 10 ** 6
        np.save(target, arr)
    elif damage == "truncated":
        target = _files(cache, "dataset_sample_index")[0]
        with open(target, "r+b") as f:
            f.truncate(100)
    else:
        target = _files(cache, "sample_index")[0]
        np.save(target, np.load(target).astype(np.float64))
    if os.path.exists("/tmp/megatronish-pickle-ran"):
        os.remove("/tmp/megatronish-pickle-ran")
    rebuilt = _build(a, b, cache)
    err = capsys.readouterr().err
    assert "WARNING: dataset index cache" in err and "rebuilding it" in err, err
    assert not os.path.exists("/tmp/megatronish-pickle-ran")
    assert all(_same(stream_of(ds), ref) for ds, ref in zip(rebuilt[:2], reference))
    capsys.readouterr()
    _build(a, b, cache)  # and the rewritten cache is a clean hit again
    assert "WARNING" not in capsys.readouterr().err


def test_cache_files_hold_no_pickles(data, tmp_path):
    d, a, b, _ = data
    cache = str(tmp_path / "c")
    _build(a, b, cache)
    for path in glob.glob(os.path.join(cache, "*.npy")):
        np.load(path, allow_pickle=False)  # raises on an object array
    with pytest.raises(ValueError, match="not a readable index array"):
        bad = IndexCache(cache, "x", "{}", "0")
        with open(bad.path("description.txt"), "w") as f:
            f.write("{}")
        with open(bad.path("a.npy"), "wb") as f:
            pickle.dump([1, 2], f)
        bad.load(["a"])
