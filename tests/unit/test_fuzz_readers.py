"""Fuzzing the readers of user files with hypothesis (derandomized, 1,000 examples per category): random
truncations and byte flips of a ``.idx``, a ``.bin``, a checkpoint's ``.metadata`` and tokenizer files
(SentencePiece model, tokenizer.json, tiktoken ranks, GPT-2 encoder.json / vocab.bpe) give the project's user error
or exactly what the damaged file says, every time: never another exception, a segfault (the compiled sample reader
and the tokenizer libraries included: each category runs in its own process) or a hang (a time limit).
The targets are in tests/support/fuzz_targets.py."""
import json
import os
import subprocess
import sys

import pytest

from megatronish.testing import subprocess_env

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = os.path.join(os.path.dirname(HERE), "support", "fuzz_targets.py")
EXAMPLES = 1000
CATEGORIES = ("idx", "bin", "checkpoint", "tokenizer")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    env = subprocess_env(OMP_NUM_THREADS="1", MEGATRONISH_DEVICE="cpu", TIKTOKEN_CACHE_DIR=str(root / "tt"))
    env["PYTHONPATH"] += os.pathsep + os.path.dirname(HERE)  # the targets import tests/support/tokenizer_files.py
    procs = {c: subprocess.Popen([sys.executable, TARGETS, c, str(root / c), str(EXAMPLES)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in CATEGORIES}
    out = {}
    for c, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        current = root / c / "current"
        out[c] = (p.returncode, stdout, stderr, current.read_text() if current.exists() else "")
    return out


@pytest.mark.parametrize("category", CATEGORIES)
def test_damaged_files_give_a_clean_error_or_their_data(fuzzed, category):
    code, stdout, stderr, last = fuzzed[category]
    if code is not None and code < 0:
        pytest.fail(f"{category}: the reader died of signal {-code} on example {last}\n{stderr[-3000:]}")
    assert code == 0, f"{category}: failed on example {last}\n{stderr[-5000:]}"
    outcomes = json.loads(stdout.strip().splitlines()[-1])
    assert sum(outcomes.values()) == EXAMPLES
    # both outcomes occur: the damage is detected, and harmless damage still reads
    assert any("error" in k for k in outcomes) and any("ok" in k for k in outcomes), outcomes


def test_gpt2_files_are_read_fresh(tmp_path):
    """An edited encoder.json / vocab.bpe at the same path is read again (tiktoken's loader would cache it)."""
    from megatronish.data.tokenizers import build_tokenizer
    from support.fuzz_targets import _gpt2_small

    vocab, merges = _gpt2_small(str(tmp_path))
    first = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert first.tokenize("the") == [257] and first.vocab_size == 263
    with open(merges) as f:
        lines = f.read().splitlines()
    with open(merges, "w") as f:
        f.write("\n".join(lines[:2]) + "\n")  # only the merge "t h"
    with open(vocab) as f:
        enc = json.load(f)
    enc = {k: v for k, v in enc.items() if v < 257}
    enc["<|endoftext|>"] = 257
    with open(vocab, "w") as f:
        json.dump(enc, f)
    second = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert second.vocab_size == 258 and second.tokenize("the") == [256, first.tokenize("e")[0]]
