"""tools/preprocess_data.py with its chunks shrunk to a few bytes: byte ranges cut at line starts, output
byte-identical for every worker/partition count and equal to a direct tokenization, exact line numbers."""
import gzip
import json
import os

import numpy as np
import pytest

from megatronish.data.indexed_dataset import IndexedDataset
from megatronish.data.preprocess import encoder, inputs
from megatronish.data.tokenizers import build_tokenizer
from megatronish.tools import preprocess_data
from support import tokenizer_files as tf

RUNS = [(1, 1), (2, 1), (3, 1), (2, 2), (3, 3)]  # (--workers, --partitions)


def _line(text, title="t"):
    return json.dumps({"text": text, "title": title}, ensure_ascii=False)


def make_inputs(d):
    """Four files matched by one glob: CRLF and LF lines, a line far longer than a chunk, an empty file, a file
    without a trailing newline, an empty title (no tokens), non-ASCII text."""
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta. Epsilon zeta! Eta theta? Iota kappa".split() + ["naïve", "日本語"]
    texts = [" ".join(rng.choice(words, rng.integers(1, 25))) for _ in range(40)]
    texts[7] = " ".join(rng.choice(words, 400))  # spans many chunks
    with open(d / "a.jsonl", "wb") as f:
        for i, t in enumerate(texts[:20]):
            f.write((_line(t, "" if i == 3 else t[:12]) + ("\r\n" if i % 2 else "\n")).encode("utf-8"))
    (d / "b.jsonl").write_bytes(b"")
    with open(d / "c.jsonl", "wb") as f:
        f.write("\n".join(_line(t, t[-9:]) for t in texts[20:30]).encode("utf-8"))  # no newline at the end
    with open(d / "d.jsonl", "wb") as f:
        f.write("".join(_line(t) + "\n" for t in texts[30:]).encode("utf-8"))
    return str(d / "*.jsonl"), texts


def run_tool(*argv):
    return preprocess_data.main([str(a) for a in argv])


def outputs(prefix, keys, level):
    return {k: [open(f"{prefix}_{k}_{level}{e}", "rb").read() for e in (".bin", ".idx")] for k in keys}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(inputs, "CHUNK_BYTES", 37)


def test_segments_and_tasks_cut_at_line_starts(tmp_path, small_chunks):
    pattern, _ = make_inputs(tmp_path)
    files = inputs.expand_inputs(pattern)
    for n in range(1, 7):
        parts = inputs.plan_segments(files, n)
        assert len(parts) == n
        covered = {f: [] for f in files}
        for segs in parts:
            tasks = list(inputs.iter_tasks(segs))
            assert [(t.path, t.start) for t in tasks] == sorted((t.path, t.start) for t in tasks)
            for t in tasks:
                data = open(t.path, "rb").read()
                assert t.start == 0 or data[t.start - 1:t.start] == b"\n"  # starts a line
                assert t.stop == len(data) or data[t.stop - 1:t.stop] == b"\n"  # ends one
                covered[t.path].append((t.start, t.stop))
            assert inputs.segment_bytes(segs) == sum(t.stop - t.start for t in tasks)
        for f, ranges in covered.items():  # every byte once, in order
            assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] if ranges else os.path.getsize(f) == 0
            assert (ranges[-1][1] if ranges else 0) == os.path.getsize(f)


def test_output_identical_for_every_worker_and_partition_count(tmp_path, small_chunks):
    pattern, texts = make_inputs(tmp_path)
    v, m = tf.gpt2_files()
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=v, merge_file=m)
    for split, level in ((False, "document"), (True, "sentence")):
        outs = {}
        for w, p in RUNS:
            prefix = tmp_path / f"w{w}p{p}{level}"
            assert run_tool("--input", pattern, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                            "--vocab-file", v, "--merge-file", m, "--workers", w, "--partitions", p, "--append-eod",
                            "--json-keys", "text", "title", *(["--split-sentences"] if split else [])) == 0
            outs[(w, p)] = outputs(prefix, ("text", "title"), level)
        assert all(o == outs[(1, 1)] for o in outs.values())
        # the reference: each line's text tokenized directly, sentence by sentence, eod after the last non-empty one
        ds = IndexedDataset(str(tmp_path / f"w1p1{level}_text_{level}"))
        di = ds.document_indices
        assert len(di) == len(texts) + 1
        for k, text in enumerate(texts):
            sentences = encoder.split_sentences(text, False) if split else [text]
            want = [tok.tokenize(s) for s in sentences if tok.tokenize(s)]
            want[-1] = want[-1] + [tok.eod]
            assert [ds[j].tolist() for j in range(di[k], di[k + 1])] == want
        title = IndexedDataset(str(tmp_path / f"w1p1{level}_title_{level}"))
        assert title.document_indices[4] - title.document_indices[3] == 0  # the empty title: a document, no sequence
    assert not [f for f in os.listdir(tmp_path) if "_0_" in f or "_1_" in f]  # partition files removed


def test_compressed_inputs_in_the_glob(tmp_path, small_chunks):
    pattern, texts = make_inputs(tmp_path)
    with open(tmp_path / "a.jsonl", "rb") as src, gzip.open(tmp_path / "a.jsonl.gz", "wb") as dst:
        dst.write(src.read())
    os.remove(tmp_path / "a.jsonl")
    outs = {}
    for w, p in ((1, 1), (2, 2), (3, 3)):
        prefix = tmp_path / f"w{w}p{p}"
        assert run_tool("--input", str(tmp_path / "*.jsonl*"), "--output-prefix", prefix, "--tokenizer-type",
                        "TikTokenizer", "--tokenizer-model", tf.make_tiktoken_json(str(tmp_path)), "--workers", w,
                        "--partitions", p, "--append-eod") == 0
        outs[(w, p)] = outputs(prefix, ("text",), "document")
    assert outs[(1, 1)] == outs[(2, 2)] == outs[(3, 3)]
    tok = build_tokenizer("TikTokenizer", tokenizer_model=tf.make_tiktoken_json(str(tmp_path)))
    ds = IndexedDataset(str(tmp_path / "w1p1_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(t) + [tok.eod] for t in texts]


def _json_error(line):
    try:
        json.loads(line)
    except json.JSONDecodeError as err:
        return f"invalid JSON ({err})"


def _bad_lines_input(d):
    """Bad lines at known line numbers of two files, among CRLF lines; the last line of all is cut short and has
    no newline (json's message then differs from the same line with one: the positions)."""
    lines_a = [_line(f"doc {i}") for i in range(30)]
    lines_a[12] = '{"text": "cut short"'
    lines_a[25] = '["a list"]'
    lines_b = [_line(f"more {i}") for i in range(20)]
    lines_b[17] = '{"title": "no text"}'
    (d / "a.jsonl").write_bytes("".join(x + ("\r\n" if i % 3 else "\n") for i, x in enumerate(lines_a)).encode())
    last = '{"text": "end"'
    (d / "b.jsonl").write_bytes(("\n".join(lines_b) + "\n" + last).encode())
    newline = "\n"
    return str(d / "*.jsonl"), [
        f"{d / 'a.jsonl'}:13: {_json_error(lines_a[12] + newline)}",
        f"{d / 'a.jsonl'}:26: expected a JSON object, got list",
        f"{d / 'b.jsonl'}:18: missing key(s) ['text'] (--json-keys text)",
        f"{d / 'b.jsonl'}:21: {_json_error(last)}",
    ]


def test_bad_line_numbers_exact_with_small_chunks(tmp_path, capfd, small_chunks):
    pattern, bad = _bad_lines_input(tmp_path)
    assert "line 2 column 1" in bad[0] and "line 1 column" in bad[3]
    tk = tf.make_tiktoken_json(str(tmp_path))
    for w, p in ((1, 1), (2, 1), (2, 2), (3, 3)):
        prefix = tmp_path / f"w{w}p{p}"
        argv = ["--input", pattern, "--output-prefix", prefix, "--tokenizer-type", "TikTokenizer",
                "--tokenizer-model", tk, "--workers", w, "--partitions", p]
        assert run_tool(*argv) == 2
        err = capfd.readouterr().err
        assert f"error: {bad[0]}; fix the line or pass --skip-bad-lines" in err, err  # the first, in every case
        assert not os.path.exists(f"{prefix}_text_document.idx")
        assert run_tool(*argv, "--append-eod", "--skip-bad-lines") == 0
        err = capfd.readouterr().err
        warned = [line[len("warning: skipped "):] for line in err.splitlines() if line.startswith("warning: skipped ")]
        assert sorted(x for x in warned if "bad line(s)" not in x) == bad  # partitions print side by side
        ds = IndexedDataset(f"{prefix}_text_document")
        assert len(ds.document_indices) - 1 == 30 + 21 - 4


def test_decoded_task_parses_like_each_lines_bytes(tmp_path):
    """A task is decoded once and parsed as text; every line gets the verdict json gives its own bytes: a UTF-8
    BOM, a UTF-16 line, non-ASCII whitespace only, a NUL, invalid UTF-8 (the task falls back to bytes), CRLF."""
    args = preprocess_data.get_parser().parse_args(
        ["--input", "x", "--output-prefix", "x", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
         "--workers", "1", "--skip-bad-lines"])
    enc = encoder.Encoder(args)
    lines = [b'\xef\xbb\xbf{"text": "bom"}', '{"text": "utf16"}'.encode("utf-16-le"), "\u00a0\u2028".encode(),
             b'{"text": "a\x00b"}', b'\x00{"text": 1}', b'{"text": "crlf"}\r', b'["list"]', b'{"text": "ok"}']
    for invalid_utf8 in ([], [b'{"text": "bad \xff"}', '{"text": "bom16"}'.encode("utf-16")]):
        chosen = lines + invalid_utf8
        data = b"\n".join(chosen) + b"\n"
        path = tmp_path / "t.jsonl"
        path.write_bytes(data)
        out, docs = enc.parse_task(inputs.Task(str(path), 0, len(data), None))
        expected_docs, expected_bad = [], []
        for i, line in enumerate(chosen):
            msg = enc._parse(line, expected_docs)
            if msg is not None and msg.startswith("invalid JSON"):
                msg = enc._parse(line + b"\n", [])
            if msg is not None:
                expected_bad.append((i, msg))
        assert out["skipped"] == expected_bad and docs == expected_docs and out["lines"] == len(chosen)
        assert len(expected_bad) >= 4  # the test covers rejected lines as well as accepted ones
