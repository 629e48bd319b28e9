"""The preprocessing progress: a byte-counting tqdm bar on a terminal, log lines otherwise, one summary line."""
import io
import sys

import preprocess_tool

preprocess_data = preprocess_tool.load()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_terminal(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("COLUMNS", "100")
    p = preprocess_data._Progress(1, "", total_bytes=4096)
    for _ in range(4):
        p.update(2, 10, 1024)
    p.report(final=True)
    out = err.getvalue()
    assert "100%" in out and "4.00k/4.00k" in out and "B/s" in out
    assert out.rstrip().splitlines()[-1].startswith("processed 8 documents (")


def test_log_lines_without_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    p = preprocess_data._Progress(3, "[partition 1] ")
    for _ in range(7):
        p.update(1, 5, 100)
    p.report(final=True)
    lines = err.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["[partition 1] processed 3 documents",
                                                      "[partition 1] processed 6 documents",
                                                      "[partition 1] processed 7 documents"]
