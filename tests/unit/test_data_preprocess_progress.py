"""The preprocessing progress: a byte-counting tqdm bar on a terminal, log lines otherwise, one summary line."""
import io
import os
import sys

from megatronish.data.preprocess import inputs, pipeline
from megatronish.tools import preprocess_data


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_terminal(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("COLUMNS", "100")
    p = pipeline.Progress(1, "", total_bytes=4096)
    for _ in range(4):
        p.update(2, 10, 1024)
    p.report(final=True)
    out = err.getvalue()
    assert "100%" in out and "4.00k/4.00k" in out and "B/s" in out
    assert out.rstrip().splitlines()[-1].startswith("processed 8 documents (")


def test_log_lines_without_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    p = pipeline.Progress(3, "[partition 1] ")
    for _ in range(7):
        p.update(1, 5, 100)
    p.report(final=True)
    lines = err.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["[partition 1] processed 3 documents",
                                                      "[partition 1] processed 6 documents",
                                                      "[partition 1] processed 7 documents"]


def test_bar_counts_the_input_bytes_with_small_chunks(tmp_path, monkeypatch):
    for i, (sep, end) in enumerate((("\n", "\n"), ("\r\n", "\r\n"), ("\n", ""))):  # the last: no final newline
        (tmp_path / f"{i}.jsonl").write_bytes((sep.join(f'{{"text": "{k} {i}"}}' for k in range(40)) + end).encode())
    total = sum(os.path.getsize(tmp_path / f"{i}.jsonl") for i in range(3))
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setattr(inputs, "CHUNK_BYTES", 50)
    seen = []
    real = pipeline.Progress.report

    def report(self, final=False):
        if final:
            seen.append((self.bar.n, self.bar.total, self.bytes, self.docs))
        return real(self, final)

    monkeypatch.setattr(pipeline.Progress, "report", report)
    assert preprocess_data.main(["--input", str(tmp_path / "*.jsonl"), "--output-prefix", str(tmp_path / "o"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--workers", "2"]) == 0
    assert seen == [(total, total, total, 120)]
    assert "100%" in sys.stderr.getvalue()
