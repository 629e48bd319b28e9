"""Tokenizers and tools/preprocess_data.py: round trips, worker/partition invariance, bad input."""
import gzip
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from megatronish.data.indexed_dataset import IndexedDataset
from megatronish.data.preprocess import encoder, inputs, pipeline
from megatronish.data.preprocess import workers as preprocess_workers
from megatronish.data.tokenizers import TokenizerError, build_tokenizer
from megatronish.testing import subprocess_env
from megatronish.tools import preprocess_data
from support import tokenizer_files as tf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NULL_TEXTS = ["1 2 3", "999 0 5 5", "7"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return str(d), tf.tokenizer_configs(str(d))


def texts_for(name):
    return NULL_TEXTS if name == "NullTokenizer" else tf.TEXTS


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t, "other": 1}) + "\n")


def test_tokenizer_attributes(tok_dir):
    _, configs = tok_dir
    toks = {name: build_tokenizer(name, **kw) for name, kw, _ in configs}
    gpt2 = toks["GPT2BPETokenizer"]
    assert (gpt2.vocab_size, gpt2.eod, gpt2.pad) == (50257, 50256, -1)
    assert gpt2.tokenize("Hello world") == [15496, 995]  # GPT-2's published ids
    null = toks["NullTokenizer"]
    assert (null.vocab_size, null.eod, null.pad) == (1001, 1000, -1)
    sp = toks["SentencePieceTokenizer"]
    assert sp.eod == sp.vocab["<EOD>"] and sp.vocab_size == 400 + 4  # <CLS> <SEP> <EOD> <MASK> added
    assert sp.pad == 3  # the model's own pad piece
    assert toks["GPTSentencePieceTokenizer"].eod == 2 and toks["Llama2Tokenizer"].eod == 2
    assert toks["Llama2Tokenizer"].tokenize("Short.")[0] == 1  # bos prepended
    tk = toks["TikTokenizer"]
    assert (tk.eod, tk.pad, tk.vocab_size) == (2, 4, 1000 + 262)
    hf = toks["HuggingFaceTokenizer"]
    assert hf.eod == hf.vocab["<|endoftext|>"]


def test_tokenizer_round_trip(tok_dir):
    _, configs = tok_dir
    for name, kw, _ in configs:
        tok = build_tokenizer(name, **kw)
        for text in texts_for(name):
            ids = tok.tokenize(text)
            assert all(0 <= i < tok.vocab_size for i in ids), name
            assert tok.detokenize(ids) == text, name
        assert tok.tokenize_batch(texts_for(name)) == [tok.tokenize(t) for t in texts_for(name)], name
        flat, lengths = tok.tokenize_batch_flat(texts_for(name))
        ids = [tok.tokenize(t) for t in texts_for(name)]
        assert lengths.tolist() == [len(x) for x in ids] and flat.tolist() == sum(ids, []), name
    for name in ("GPT2BPETokenizer", "TikTokenizer"):  # tiktoken's arrays: specials as text, lone surrogates
        tok = build_tokenizer(name, **dict((c[0], c[1]) for c in configs)[name])
        texts = ["", "a <|endoftext|> b </s>", "lone \ud800 surrogate", "x"]
        flat, lengths = tok.tokenize_batch_flat(texts)
        want = [tok._enc.encode_ordinary(t) for t in texts]
        assert lengths.tolist() == [len(x) for x in want] and flat.tolist() == sum(want, []), name
        assert tok.tokenize_batch(texts) == want


def test_bad_tokenizer_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    v, m = tf.gpt2_files()
    with pytest.raises(TokenizerError, match="--vocab-file '/nope.json' does not exist"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="/nope.json", merge_file=m)
    with pytest.raises(TokenizerError, match=r"--vocab-file '.*bad.json' is not a GPT-2 encoder.json"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(bad), merge_file=m)
    merges = open(m, encoding="utf-8").read()
    (tmp_path / "three.bpe").write_text(merges + "a b c\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="merge line 'a b c' is not two symbols"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=v, merge_file=str(tmp_path / "three.bpe"))
    encoder = json.load(open(v, encoding="utf-8"))
    for stray in ("\x00", "\xad", "\u2603"):  # a control byte, a non-printable latin-1 one, a non-byte character
        # in a merge and in the vocabulary, consistently: still no GPT-2 byte symbol
        (tmp_path / "stray.bpe").write_text(merges + f"a{stray} b\n", encoding="utf-8")
        (tmp_path / "stray.json").write_text(json.dumps({**encoder, f"a{stray}b": len(encoder) - 1}))
        with pytest.raises(TokenizerError, match="do not form a GPT-2 BPE vocabulary"):
            build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "stray.json"),
                            merge_file=str(tmp_path / "stray.bpe"))
    # the same shapes with real symbols (bytes 0-3) pass
    (tmp_path / "ok.bpe").write_text(merges + "\u0100\u0101 \u0102\u0103\n", encoding="utf-8")
    (tmp_path / "ok.json").write_text(json.dumps({**encoder, "\u0100\u0101\u0102\u0103": len(encoder) - 1}))
    assert build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "ok.json"),
                           merge_file=str(tmp_path / "ok.bpe")).tokenize("Hello world") == [15496, 995]
    with pytest.raises(TokenizerError, match="needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=v)
    with pytest.raises(TokenizerError, match="is not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(bad))
    with pytest.raises(TokenizerError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bad))
    with pytest.raises(TokenizerError, match="is not a tiktoken ranks file"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(bad))
    with pytest.raises(TokenizerError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(TokenizerError, match="not supported"):
        build_tokenizer("BertWordPieceCase")


def run_tool(*argv):
    return preprocess_data.main([str(a) for a in argv])


def read_docs(prefix):
    ds = IndexedDataset(prefix)
    di = ds.document_indices
    return [np.concatenate([ds[j] for j in range(di[k], di[k + 1])] or [np.zeros(0, ds.index.dtype)])
            for k in range(len(di) - 1)]


def test_preprocess_round_trip_every_tokenizer(tok_dir, tmp_path):
    _, configs = tok_dir
    for name, kw, flags in configs:
        texts = texts_for(name)
        src = tmp_path / f"{name}.jsonl"
        write_jsonl(src, texts)
        prefix = tmp_path / name
        assert run_tool("--input", src, "--output-prefix", prefix, "--tokenizer-type", name, *flags,
                        "--workers", 1, "--append-eod") == 0
        tok = build_tokenizer(name, **kw)
        docs = read_docs(f"{prefix}_text_document")
        assert len(docs) == len(texts)
        for doc, text in zip(docs, texts):
            assert int(doc[-1]) == tok.eod, name
            assert tok.detokenize(doc[:-1].tolist()) == text, name
            assert doc[:-1].tolist() == tok.tokenize(text), name


def test_workers_and_partitions_give_identical_bytes(tmp_path):
    v, m = tf.gpt2_files()
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta. Iota kappa! Lambda?".split()
    texts = [" ".join(rng.choice(words, rng.integers(1, 60))) for _ in range(700)]
    src = tmp_path / "in.jsonl.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "title": t[:10]}) + "\n")
    outs = {}
    for w, p in [(1, 1), (2, 1), (2, 2)]:
        prefix = tmp_path / f"w{w}p{p}"
        assert run_tool("--input", src, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                        "--vocab-file", v, "--merge-file", m, "--workers", w, "--partitions", p,
                        "--append-eod", "--json-keys", "text", "title", "--split-sentences") == 0
        outs[(w, p)] = {k: [open(f"{prefix}_{k}_sentence{e}", "rb").read() for e in (".bin", ".idx")]
                        for k in ("text", "title")}
    assert outs[(1, 1)] == outs[(2, 1)] == outs[(2, 2)]
    assert not [f for f in os.listdir(tmp_path) if "_0_" in f or "_1_" in f]  # partition files removed
    ds = IndexedDataset(str(tmp_path / "w1p1_text_sentence"))
    assert len(ds.document_indices) == 701 and len(ds) > 700  # several sentences per document


def test_sentence_split_keeps_text():
    text = "First one. Second one! Third?  Fourth\n\nNew para. end"
    parts = encoder.split_sentences(text, keep_newlines=True)
    assert parts == ["First one. ", "Second one! ", "Third?  ", "Fourth\n\n", "New para. end"]


@pytest.mark.parametrize("line, message", [
    ("{not json", "invalid JSON"),
    ('{"other": 1}', "missing key(s) ['text']"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_line_reported_with_file_and_line(tmp_path, capsys, line, message):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "1 2"}\n{"text": "3"}\n' + line + "\n")
    prefix = tmp_path / "out"
    rc = run_tool("--input", src, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                  "--vocab-size", 10, "--workers", 1)
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{src}:3: " in err and message in err and "--skip-bad-lines" in err
    assert not os.path.exists(f"{prefix}_text_document.idx")
    assert not os.path.exists(f"{prefix}_text_document.bin")
    rc = run_tool("--input", src, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                  "--vocab-size", 10, "--workers", 2, "--skip-bad-lines")
    assert rc == 0
    assert [d.tolist() for d in read_docs(f"{prefix}_text_document")] == [[1, 2], [3]]


def test_cli_errors_without_traceback(tmp_path):
    tool = os.path.join(REPO, "tools", "preprocess_data.py")
    cases = [
        (["--input", str(tmp_path / "none*.jsonl"), "--workers", "1", "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "5"], "matches no file"),
        (["--input", tool, "--workers", "3", "--partitions", "2", "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "5"], "must be a multiple of --partitions"),
        (["--input", tool, "--workers", "1", "--tokenizer-type", "GPT2BPETokenizer",
          "--vocab-file", "/missing/encoder.json", "--merge-file", "/missing/vocab.bpe"], "/missing/encoder.json"),
    ]
    for argv, message in cases:
        r = subprocess.run([sys.executable, tool, "--output-prefix", str(tmp_path / "o"), *argv],
                           capture_output=True, text=True, env=subprocess_env())
        assert r.returncode == 2, r.stderr
        assert message in r.stderr and "Traceback" not in r.stderr


def test_interrupted_run_leaves_no_valid_index(tmp_path, monkeypatch):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, ["1 2 3"] * 600)
    prefix = tmp_path / "out"
    # a stale, valid dataset from an earlier run at the same prefix
    assert run_tool("--input", src, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                    "--vocab-size", 10, "--workers", 1) == 0
    monkeypatch.setattr(inputs, "CHUNK_BYTES", 1024)  # many chunks
    calls = {"n": 0}
    real = pipeline.Progress.update

    def interrupted(self, *a):  # Ctrl-C while the main process appends the second chunk's results
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, *a)

    monkeypatch.setattr(pipeline.Progress, "update", interrupted)
    assert run_tool("--input", src, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                    "--vocab-size", 10, "--workers", 1) == 130
    assert calls["n"] == 2
    assert not os.path.exists(f"{prefix}_text_document.idx")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_failures_stop_the_run_cleanly(tmp_path, capsys, monkeypatch, workers):
    """An error a worker hits (a file that changed under it) reaches the user as one line, as does a worker that
    dies; nothing is left at the output prefix, and no worker outlives the run."""
    src = tmp_path / "in.jsonl"
    write_jsonl(src, ["1 2 3"] * 600)
    prefix = tmp_path / "out"
    monkeypatch.setattr(inputs, "CHUNK_BYTES", 1024)  # many tasks, spread over the workers
    real_read = encoder.Encoder.read

    def changed(task):  # the third task's bytes come up short, as for a file truncated while it is read
        if task.start >= 2048 and task.data is None:
            raise inputs.PreprocessError(f"--input file '{task.path}' changed while it was read")
        return real_read(task)

    monkeypatch.setattr(encoder.Encoder, "read", staticmethod(changed))
    rc = run_tool("--input", src, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                  "--vocab-size", 10, "--workers", workers)
    assert rc == 2 and f"--input file '{src}' changed while it was read" in capsys.readouterr().err
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")]

    def dies(self, out, columns):
        os._exit(3)

    monkeypatch.setattr(encoder.Encoder, "read", staticmethod(real_read))
    monkeypatch.setattr(encoder.Encoder, "tokenize_task", dies)
    rc = run_tool("--input", src, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
                  "--vocab-size", 10, "--workers", workers)
    assert rc == 2 and "a tokenizer worker process died (exit code 3)" in capsys.readouterr().err
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")]
    import multiprocessing
    assert not multiprocessing.active_children()


def test_a_slow_worker_gets_fewer_chunks(tmp_path, monkeypatch):
    """Chunks go to the worker with the fewest unread results: a worker that takes 40 ms a chunk gets a small share
    of them (not every other one, as in turn), and the files are those of a single worker."""
    import multiprocessing

    src = tmp_path / "in.jsonl"
    write_jsonl(src, [" ".join(str(j % 7) for j in range(i % 13 + 1)) for i in range(1200)])
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", 10, "--append-eod"]
    monkeypatch.setattr(inputs, "CHUNK_BYTES", 512)
    assert run_tool("--input", src, "--output-prefix", tmp_path / "one", *null, "--workers", 1) == 0
    order = multiprocessing.Value("i", 0)  # which worker started first: that one is slow
    real_main, real_tokenize = preprocess_workers.worker_main, encoder.Encoder.tokenize_task

    def worker_main(enc, tasks_in, results_out):
        with order.get_lock():
            slow, order.value = order.value == 0, order.value + 1

        def tokenize(self, out, columns):
            if slow:
                time.sleep(0.04)
            return {**real_tokenize(self, out, columns), "pid": os.getpid()}

        encoder.Encoder.tokenize_task = tokenize
        real_main(enc, tasks_in, results_out)

    pids = []
    real_receive = preprocess_workers.Workers.receive
    monkeypatch.setattr(preprocess_workers, "worker_main", worker_main)
    monkeypatch.setattr(preprocess_workers.Workers, "receive", lambda self, i: (res := real_receive(self, i),
                                                                               pids.append(res["pid"]))[0])
    assert run_tool("--input", src, "--output-prefix", tmp_path / "two", *null, "--workers", 2) == 0
    counts = sorted(pids.count(p) for p in set(pids))
    assert len(pids) > 60 and len(counts) == 2 and counts[1] >= 1.5 * counts[0], counts  # round robin: equal
    for ext in ("bin", "idx"):
        assert open(f"{tmp_path}/one_text_document.{ext}", "rb").read() == \
            open(f"{tmp_path}/two_text_document.{ext}", "rb").read()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipe buffer sizes are set on Linux only")
def test_worker_pipes_hold_a_whole_result():
    """The task and result pipes get a kernel buffer of PIPE_BYTES (or the system's maximum, if less): four times a
    chunk's bytes, so a worker's result goes into its pipe whole, even while the main process is busy."""
    import fcntl
    import multiprocessing

    with open("/proc/sys/fs/pipe-max-size") as f:
        want = min(preprocess_workers.PIPE_BYTES, int(f.read()))
    assert preprocess_workers.PIPE_BYTES >= 4 * inputs.CHUNK_BYTES
    pool = preprocess_workers.Workers(encoder.Encoder(None), 2)
    try:
        for conn in pool.tasks + pool.results:
            assert fcntl.fcntl(conn.fileno(), fcntl.F_GETPIPE_SZ) == want
    finally:
        pool.close(finished=True)
    r, w = multiprocessing.Pipe(duplex=False)
    assert fcntl.fcntl(w.fileno(), fcntl.F_GETPIPE_SZ) < want  # not the default
    r.close()
    w.close()


def test_main_process_parsing_gives_the_same_files(tmp_path, capsys, monkeypatch, tok_dir):
    """Chunks parsed by the main process (a spare core) or by the workers: the same bytes, and the same first bad
    line, whichever the machine picks."""
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer"] + next(c[2] for c in tok_dir[1] if c[0] == "GPT2BPETokenizer")
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [t for _ in range(40) for t in tf.TEXTS])
    monkeypatch.setattr(inputs, "CHUNK_BYTES", 700)
    files = {}
    for where in ("main", "workers"):
        monkeypatch.setattr(pipeline, "_main_parses", lambda *a, where=where: where == "main")
        prefix = tmp_path / where
        assert run_tool("--input", src, "--output-prefix", prefix, *gpt2, "--append-eod",
                        "--workers", 2) == 0
        files[where] = [open(f"{prefix}_text_document.{ext}", "rb").read() for ext in ("bin", "idx")]
    assert files["main"] == files["workers"] and len(files["main"][0]) > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(src.read_text() + "{oops\n" + src.read_text())
    capsys.readouterr()
    errors = {}
    for where in ("main", "workers"):
        monkeypatch.setattr(pipeline, "_main_parses", lambda *a, where=where: where == "main")
        assert run_tool("--input", bad, "--output-prefix", tmp_path / "bad", *gpt2, "--workers", 2) == 2
        errors[where] = capsys.readouterr().err
    assert errors["main"] == errors["workers"] and f"{bad}:{40 * len(tf.TEXTS) + 1}: invalid JSON" in errors["main"]


ODD_LINES = [
    '{"text": "plain"}', '{"text": ["two", "sentences"]}', '{"text": "a", "text": "dup"}', '  {"text": "pad"}  ',
    '{"text": "\\ud800 lone surrogate"}', '{"text": NaN}', '{"text": 123456789012345678901234567890}',
    '{"text": 1e400}', '\ufeff{"text": "bom"}', '{"text": "nul \\u0000"}', '{"text": "x"} trailing', "   ", "[1]",
    '{"other": 1}', '{"text": ["a", 2]}', '{"text": null}', '{"text": ' + "[" * 3000 + "]" * 3000 + "}",
    b'{"text": "\xff bad utf-8"}', '{"text": "emoji \U0001F600 and \\u00e9"}',
]


@pytest.mark.parametrize("split", [False, True])
def test_fast_json_parser_agrees_with_json(monkeypatch, split):
    """Lines parsed by orjson (when installed) or json: the same documents and the same message for every line,
    including those only json accepts (NaN, lone surrogates) and those where orjson reads another value (a
    30-digit integer: json's int, orjson's float)."""
    pytest.importorskip("orjson")
    assert encoder._FAST_LOADS is not None
    args = preprocess_data.get_parser().parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-type",
                                                    "NullTokenizer", "--vocab-size", "10", "--workers", "1"]
                                                   + (["--split-sentences"] if split else []))
    enc = encoder.Encoder(args)
    raw = [line.encode("utf-8") if isinstance(line, str) else line for line in ODD_LINES]  # as parse_task has them
    fast = [(enc._parse(line, docs := []), docs) for line in ODD_LINES]
    fast_raw = [(enc._parse(line, docs := []), docs) for line in raw]
    monkeypatch.setattr(encoder, "_FAST_LOADS", None)
    plain = [(enc._parse(line, docs := []), docs) for line in ODD_LINES]
    plain_raw = [(enc._parse(line, docs := []), docs) for line in raw]
    assert fast == plain and fast_raw == plain and plain_raw == plain  # a line's bytes parse as its text does
    assert sum(msg is None for msg, _ in plain) >= 8 and sum(msg is not None for msg, _ in plain) >= 8
