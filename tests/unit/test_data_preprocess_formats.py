"""tools/preprocess_data.py over every --input format: Parquet, zstd and gzip JSON lines, text (a document per line
and per file) and a datasets.save_to_disk directory give the .bin/.idx bytes of JSON lines of the same documents,
for any --workers / --partitions; bad rows and missing columns or packages are one error line."""
import gzip
import json
import os
import sys

import pytest

from megatronish.data.preprocess import formats, inputs, pipeline
from megatronish.tools import preprocess_data
from support import tokenizer_files as tf

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "examples", "corpus", "python_docs.jsonl")
N_DOCS = 200
RUNS = [(1, 1), (2, 2)]  # (--workers, --partitions)


@pytest.fixture(scope="module")
def docs():
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(N_DOCS), f)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, docs, run_tool):
    """The JSON-lines files of the documents and of their lines: {"docs" | "lines": (.bin, .idx) bytes}."""
    d = tmp_path_factory.mktemp("reference")
    out = {}
    for name, texts in (("docs", docs), ("lines", lines_of(docs))):
        (d / f"{name}.jsonl").write_bytes(jsonl_bytes(texts))
        assert run_tool(d / f"{name}.jsonl", d / name) == 0
        out[name] = outputs(d / name)
    return out


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(inputs, "CHUNK_BYTES", 1 << 14)  # tasks of ~16 KiB: many tasks, rows cut across batches


@pytest.fixture(scope="module")
def run_tool(tmp_path_factory):
    """The tool with a small tiktoken vocabulary (built in 10 ms: a run is mostly its input)."""
    ranks = tf.make_tiktoken_json(str(tmp_path_factory.mktemp("tok")))

    def run(src, prefix, *flags, workers=1, partitions=1, on_read=None):
        argv = [str(a) for a in (
            "--input", src, "--output-prefix", prefix, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", ranks,
            "--append-eod", "--workers", workers, "--partitions", partitions, *flags)]
        if on_read is None:
            return preprocess_data.main(argv)
        pipeline.run(preprocess_data.get_parser().parse_args(argv), on_read)  # with the test hook
        return 0

    return run


def outputs(prefix, key="text"):
    return [open(f"{prefix}_{key}_document{e}", "rb").read() for e in (".bin", ".idx")]


def jsonl_bytes(docs):
    return "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)).encode("utf-8")


def write_parquet(path, docs, row_group_size=37, **columns):
    table = pa.table({"id": list(range(len(docs))), "text": docs, **columns})
    pq.write_table(table, path, row_group_size=row_group_size)


def write_save_to_disk(directory, docs, shards=2, batch_rows=50):
    """The layout datasets.Dataset.save_to_disk writes: Arrow streaming-format shards named
    data-0000i-of-0000n.arrow, listed in order by state.json, and dataset_info.json."""
    os.makedirs(directory)
    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    bounds = [len(docs) * i // shards for i in range(shards + 1)]
    for name, a, b in zip(names, bounds[:-1], bounds[1:]):
        with pa.OSFile(os.path.join(directory, name), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                for batch in table.slice(a, b - a).to_batches(max_chunksize=batch_rows):
                    writer.write_batch(batch)
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_format_columns": None,
                   "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}, f)
    with open(os.path.join(directory, "dataset_info.json"), "w") as f:
        json.dump({"features": {"text": {"dtype": "string", "_type": "Value"},
                                "id": {"dtype": "int64", "_type": "Value"}}}, f)


def lines_of(docs):
    """The documents' non-empty lines: the documents of a text file read a document per line."""
    return [x.rstrip("\r") for d in docs for x in d.split("\n") if x.rstrip("\r")]


def write_input(kind, d, docs):
    """``docs`` written as ``kind`` under ``d``; returns the --input value and the extra flags."""
    if kind == "jsonl":
        (d / "in.jsonl").write_bytes(jsonl_bytes(docs))
        return d / "in.jsonl", []
    if kind == "parquet":
        half = len(docs) // 2  # two files matched by a glob
        write_parquet(d / "a.parquet", docs[:half])
        write_parquet(d / "b.parquet", docs[half:], row_group_size=500)
        return d / "*.parquet", []
    if kind == "jsonl.zst":
        (d / "in.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(docs)))
        return d / "in.jsonl.zst", []
    if kind == "jsonl.gz":
        (d / "in.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(docs)))
        return d / "in.jsonl.gz", []
    if kind == "txt-file":
        os.makedirs(d / "docs")
        for i, t in enumerate(docs):
            (d / "docs" / f"{i:05d}.txt").write_bytes(t.encode("utf-8"))
        return d / "docs" / "*.txt", ["--text-document-per", "file"]
    if kind == "txt-line":
        (d / "in.txt").write_bytes("".join(x + ("\r\n" if i % 3 else "\n\n") for i, x in enumerate(docs)).encode())
        return d / "in.txt", ["--text-document-per", "line"]
    if kind == "txt-line.zst":
        (d / "in.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("\n".join(docs).encode()))
        return d / "in.txt.zst", []
    if kind == "save_to_disk":
        write_save_to_disk(d / "saved", docs)
        return d / "saved", []
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["parquet", "jsonl.zst", "jsonl.gz", "txt-file", "txt-line", "txt-line.zst",
                                  "save_to_disk"])
def test_every_format_gives_the_json_lines_bytes(tmp_path, run_tool, docs, reference, kind):
    want = reference["lines" if kind.startswith("txt-line") else "docs"]
    src, flags = write_input(kind, tmp_path, lines_of(docs) if kind.startswith("txt-line") else docs)
    for w, p in RUNS + ([(2, 1)] if kind in ("parquet", "save_to_disk") else []):
        prefix = tmp_path / f"{kind}-w{w}p{p}"
        assert run_tool(src, prefix, *flags, workers=w, partitions=p) == 0
        assert outputs(prefix) == want, (kind, w, p)


@pytest.mark.parametrize("chunk_bytes, rows_per_group, partitions", [(1 << 20, 20, 1), (1 << 14, 100, 1),
                                                                    (1 << 14, 100, 2)])
def test_workers_read_their_own_row_groups(tmp_path, run_tool, monkeypatch, docs, reference, chunk_bytes,
                                           rows_per_group, partitions):
    """With 2 workers the workers, not the main process, decode the Parquet rows: a row group that is one task is
    decoded by one worker alone, once; one cut into several tasks is decoded at most once by each worker (the
    rows between a worker's tasks are skipped in its batch iterator, not read again). The files are the JSON lines'."""
    monkeypatch.setattr(inputs, "CHUNK_BYTES", chunk_bytes)  # 1 MiB: a row group of 20 rows is one task
    monkeypatch.setattr(pipeline, "_main_parses", lambda *a, **k: False)  # the workers read, whatever the cores
    write_parquet(tmp_path / "in.parquet", docs, row_group_size=rows_per_group)
    log = tmp_path / "reads.log"

    def on_read(path, group, start, stop):  # runs in the process that decodes the batch
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {group} {start} {stop}\n")

    assert run_tool(tmp_path / "in.parquet", tmp_path / "out", workers=2, partitions=partitions, on_read=on_read) == 0
    assert outputs(tmp_path / "out") == reference["docs"]
    reads = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    pids = {pid for pid, *_ in reads}
    assert os.getpid() not in pids and len(pids) == 2, pids
    groups = {}  # (pid, group) -> rows decoded, in order
    for pid, group, start, stop in reads:
        groups.setdefault((pid, group), []).extend(range(start, stop))
    n_groups = -(-len(docs) // rows_per_group)
    for (pid, group), rows in groups.items():
        assert rows == list(range(len(rows))), (pid, group)  # from the group's start, each row once
    assert {g for _, g in groups} == set(range(n_groups))
    if chunk_bytes == 1 << 20:  # a group per task: each group read by one worker, whole
        assert sorted(g for _, g in groups) == list(range(n_groups))
        assert sum(len(rows) for rows in groups.values()) == len(docs)


def test_datasets_save_to_disk_directory(tmp_path, run_tool, docs, reference):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": docs[::-1], "id": list(range(len(docs)))})
    ds.select(range(len(docs) - 1, -1, -1)).save_to_disk(str(tmp_path / "saved"), num_shards=3)  # indices mapping
    assert run_tool(tmp_path / "saved", tmp_path / "out", workers=2, partitions=2) == 0
    assert outputs(tmp_path / "out") == reference["docs"]
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(formats.PreprocessError, match="several splits .*dict/train"):
        inputs.expand_inputs(str(tmp_path / "dict"))


@pytest.mark.parametrize("w, p", [(1, 1), (2, 2)])
def test_bad_rows_are_one_line_with_file_and_row(tmp_path, run_tool, capfd, docs, w, p):
    values = list(docs)
    values[150] = None  # a null in the text column: row 151 (1-based), in the second partition
    write_parquet(tmp_path / "in.parquet", values)
    assert run_tool(tmp_path / "in.parquet", tmp_path / "out", workers=w, partitions=p) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: {tmp_path / 'in.parquet'}:151: key 'text' holds NoneType, expected text; "
                       "fix the row or pass --skip-bad-lines"), err
    assert not os.path.exists(f"{tmp_path / 'out'}_text_document.idx")
    assert run_tool(tmp_path / "in.parquet", tmp_path / "out", "--skip-bad-lines", workers=w, partitions=p) == 0
    assert f"warning: skipped {tmp_path / 'in.parquet'}:151: key 'text' holds NoneType" in capfd.readouterr().err
    (tmp_path / "in.jsonl").write_bytes(jsonl_bytes(docs[:150] + docs[151:]))
    assert run_tool(tmp_path / "in.jsonl", tmp_path / "ref") == 0
    assert outputs(tmp_path / "out") == outputs(tmp_path / "ref")


def test_non_text_column_missing_column_and_bad_text(tmp_path, run_tool, capfd, docs):
    write_parquet(tmp_path / "in.parquet", docs[:10])
    assert run_tool(tmp_path / "in.parquet", tmp_path / "out", "--json-keys", "id") == 2
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'in.parquet'}:1: key 'id' holds int, expected text; fix the row or pass "
        "--skip-bad-lines")
    assert run_tool(tmp_path / "in.parquet", tmp_path / "out", "--json-keys", "text", "body") == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        f"error: --input file '{tmp_path / 'in.parquet'}' has no column 'body' (--json-keys text body; its columns: "
        "id, text)"]
    write_save_to_disk(tmp_path / "saved", docs[:10])
    assert run_tool(tmp_path / "saved", tmp_path / "out", "--json-keys", "body") == 2
    assert "/saved/data-00000-of-00002.arrow' has no column 'body'" in capfd.readouterr().err
    (tmp_path / "in.txt").write_bytes(b"fine\n\nalso fine\nbad \xff byte\n")
    assert run_tool(tmp_path / "in.txt", tmp_path / "out", workers=2) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: {tmp_path / 'in.txt'}:4: not UTF-8 text ('utf-8' codec can't decode byte 0xff")
    assert run_tool(tmp_path / "in.txt", tmp_path / "out", "--text-document-per", "file") == 2
    assert capfd.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: {tmp_path / 'in.txt'}: not UTF-8 text (")
    assert run_tool(tmp_path / "in.txt", tmp_path / "out", "--json-keys", "a", "b") == 2
    assert "is text (one document per line or file): give one --json-keys" in capfd.readouterr().err


@pytest.mark.parametrize("module, name", [("pyarrow", "in.parquet"), ("zstandard", "in.jsonl.zst")])
def test_missing_package_is_one_line_naming_the_extra(tmp_path, run_tool, capfd, monkeypatch, module, name):
    (tmp_path / name).write_bytes(b"")
    for mod in [m for m in sys.modules if m == module or m.startswith(module + ".")] + [module]:
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    assert run_tool(tmp_path / name, tmp_path / "out") == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        f"error: reading --input file '{tmp_path / name}' needs the '{module}' package: pip install "
        f"'megatronish[data]' (or pip install {module})"]
