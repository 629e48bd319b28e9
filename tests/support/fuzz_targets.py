"""Fuzz targets run by tests/unit/test_fuzz_readers.py, one category per process (a segfault in a reader,
compiled helpers included, ends only this process and is reported with the example that caused it):

    PYTHONPATH=.:tests python tests/support/fuzz_targets.py <idx|bin|checkpoint|tokenizer> <work dir> <examples>

Each example damages one good file (a truncation, or 1-4 byte flips) chosen by hypothesis (derandomized), and the
reader must either raise the project's user error for that file or return exactly what the (damaged) file says.
Before each example its description is written to ``<work dir>/current``.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatronish.errors import CheckpointError, IndexedDatasetError, TokenizerError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

TEXT = "The quick brown fox, 12345 times: café naïve 東京!\n\tend"


def mutations(size: int):
    trunc = st.integers(0, max(0, size - 1)).map(lambda n: ("truncate", n))
    flips = st.lists(st.tuples(st.integers(0, size - 1), st.integers(1, 255)), min_size=1, max_size=4)
    return st.one_of(trunc, flips.map(lambda f: ("flip", tuple(f))))


def apply(data: bytes, mutation) -> bytes:
    kind, arg = mutation
    if kind == "truncate":
        return data[:arg]
    out = bytearray(data)
    for pos, xor in arg:
        out[pos] ^= xor
    return bytes(out)


def _note(work, what):
    with open(os.path.join(work, "current"), "w") as f:
        f.write(what)


# ------------------------------------------------------------------------------------------- .idx / .bin
def _dataset(work):
    from megatronish.data.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(work, "good")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(12):
        for _ in range(int(rng.integers(1, 3))):
            b.add_item(rng.integers(0, 60000, int(rng.integers(0, 9))))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def _check_dataset(prefix):
    """Open the pair; a success must read every sequence as the index describes it, inside the .bin file, through
    both the Python reads and the C++ gather."""
    from megatronish.data.indexed_dataset import IndexedDataset

    try:
        ds = IndexedDataset(prefix)
    except IndexedDatasetError:
        return "error"
    raw = open(prefix + ".bin", "rb").read()
    idx = ds.index
    size = np.dtype(idx.dtype).itemsize
    n = len(ds)
    for i in range(n):
        p, ln = int(idx.sequence_pointers[i]), int(idx.sequence_lengths[i])
        assert 0 <= p and p + ln * size <= len(raw), (i, p, ln, len(raw))
        want = np.frombuffer(raw[p:p + ln * size], dtype=idx.dtype)
        assert np.array_equal(ds[i], want) and np.array_equal(ds.get(i), want), i
    if n:
        docs = np.arange(n, dtype=np.int32)
        bounds = np.array([[0, 0, n - 1, max(0, int(idx.sequence_lengths[-1]) - 1)]], dtype=np.int64)
        want_len = int(idx.sequence_lengths.sum())
        out = np.full((1, max(1, want_len)), -1, dtype=np.int64)
        ds.gather(docs, bounds, 1, -7, out)
        whole = np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(n)])
        assert np.array_equal(out[0, :len(whole)], whole[:out.shape[1]])
    return "ok"


def run_index(work, which, examples):
    prefix = _dataset(work)
    target = prefix + "." + which
    good = open(target, "rb").read()
    case = os.path.join(work, "case")
    shutil.copyfile(prefix + ".bin", case + ".bin")
    shutil.copyfile(prefix + ".idx", case + ".idx")
    outcomes = {}

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations(len(good)))
    def fuzz(m):
        _note(work, f"{which} {m}")
        with open(case + "." + which, "wb") as f:
            f.write(apply(good, m))
        r = _check_dataset(case)
        outcomes[r] = outcomes.get(r, 0) + 1

    fuzz()
    return outcomes


# ------------------------------------------------------------------------------------------- checkpoint
def _checkpoint(work):
    ck = os.path.join(work, "ck")
    flags = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
             "--max-position-embeddings", "8", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
             "32", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0",
             "--save", ck, "--num-workers", "0"]
    env = dict(os.environ, MEGATRONISH_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags], env=env, check=True,
                   capture_output=True)
    return ck


def run_checkpoint(work, examples):
    import torch

    from megatronish.checkpoint.offline import iter_model_tensors, read_checkpoint_meta

    ck = _checkpoint(work)
    meta_path = os.path.join(ck, "iter_0000001", ".metadata")
    good = open(meta_path, "rb").read()
    reference = {name: t.clone() for name, t in iter_model_tensors(ck)}
    outcomes = {}

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations(len(good)))
    def fuzz(m):
        _note(work, f"checkpoint .metadata {m}")
        with open(meta_path, "wb") as f:
            f.write(apply(good, m))
        try:
            meta = read_checkpoint_meta(ck)
            tensors = dict(iter_model_tensors(ck))
        except CheckpointError:
            outcomes["error"] = outcomes.get("error", 0) + 1
            return
        # A damaged index that still reads returns the stored values: a flipped byte inside a name renames an
        # entry (a run loading it then misses that name: one error line), never changes or invents a value.
        assert len(tensors) == len(reference)
        unused = list(reference.values())
        for name, t in tensors.items():
            assert tuple(meta["tensors"][name]["shape"]) == tuple(t.shape)
            same = [i for i, r in enumerate(unused) if r.dtype == t.dtype and r.shape == t.shape and torch.equal(r, t)]
            assert same, f"{name}: values not in the checkpoint"
            unused.pop(same[0])
        outcomes["ok"] = outcomes.get("ok", 0) + 1

    try:
        fuzz()
    finally:
        with open(meta_path, "wb") as f:
            f.write(good)
    return outcomes


# ------------------------------------------------------------------------------------------- tokenizers
def _gpt2_small(work):
    """A small byte-level GPT-2 encoder.json + vocab.bpe: the 256 byte symbols, a few merges, <|endoftext|>."""
    byte_chars = _bytes_to_unicode()
    encoder = {c: i for i, c in enumerate(byte_chars)}
    merges = [("t", "h"), ("th", "e"), ("Ġ", "t"), ("i", "n"), ("in", "g"), ("o", "n")]
    for a, b in merges:
        encoder[a + b] = len(encoder)
    encoder["<|endoftext|>"] = len(encoder)
    vocab, merge = os.path.join(work, "encoder.json"), os.path.join(work, "vocab.bpe")
    with open(vocab, "w") as f:
        json.dump(encoder, f)
    with open(merge, "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab, merge


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]  # GPT-2's encoder.json order: the printable bytes first, then the rest


def run_tokenizer(work, examples):
    from megatronish.data.tokenizers import build_tokenizer
    from support.tokenizer_files import make_hf_tokenizer_json, make_sentencepiece, make_tiktoken_json

    vocab, merge = _gpt2_small(work)
    files = {"sp": make_sentencepiece(work), "hf": make_hf_tokenizer_json(work), "tiktoken": make_tiktoken_json(work),
             "gpt2_vocab": vocab, "gpt2_merges": merge}
    goods = {k: open(p, "rb").read() for k, p in files.items()}
    case = os.path.join(work, "case")
    os.makedirs(case, exist_ok=True)

    def build(kind):
        c = {k: os.path.join(case, os.path.basename(p)) for k, p in files.items()}
        if kind == "sp":
            return build_tokenizer("SentencePieceTokenizer", tokenizer_model=c["sp"])
        if kind == "hf":
            return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=c["hf"])
        if kind == "tiktoken":
            return build_tokenizer("TikTokenizer", tokenizer_model=c["tiktoken"], vocab_size=None,
                                   tiktoken_num_special_tokens=10)
        return build_tokenizer("GPT2BPETokenizer", vocab_file=c["gpt2_vocab"], merge_file=c["gpt2_merges"])

    for p in files.values():
        shutil.copyfile(p, os.path.join(case, os.path.basename(p)))
    outcomes = {}

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(files)).flatmap(lambda k: st.tuples(st.just(k), mutations(len(goods[k])))))
    def fuzz(km):
        kind, m = km
        _note(work, f"tokenizer {kind} {m}")
        target = os.path.join(case, os.path.basename(files[kind]))
        with open(target, "wb") as f:
            f.write(apply(goods[kind], m))
        try:
            tok = build("gpt2" if kind.startswith("gpt2") else kind)
            ids = tok.tokenize(TEXT)
            assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids), (ids, tok.vocab_size)
            assert isinstance(tok.detokenize(ids), str)
            assert 0 <= tok.eod < tok.vocab_size
            r = "ok"
        except TokenizerError:
            r = "error"
        finally:
            with open(target, "wb") as f:
                f.write(goods[kind])
        outcomes[f"{kind} {r}"] = outcomes.get(f"{kind} {r}", 0) + 1

    fuzz()
    return outcomes


if __name__ == "__main__":
    category, work, examples = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.makedirs(work, exist_ok=True)
    if category in ("idx", "bin"):
        result = run_index(work, category, examples)
    elif category == "checkpoint":
        result = run_checkpoint(work, examples)
    else:
        result = run_tokenizer(work, examples)
    print(json.dumps(result, sort_keys=True))
