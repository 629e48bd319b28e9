"""`make test` ends with the reason of every skipped test (and the failures and errors), whatever pytest's
addopts say: its pytest line has an ``-r`` option naming skips, failures and errors (the last ``-r`` wins)."""
import os
import re

MAKEFILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "Makefile")


def test_make_test_prints_skip_reasons():
    text = open(MAKEFILE).read()
    target = re.search(r"^test:.*\n((?:\t.*\n)+)", text, re.M)
    assert target, "Makefile has no test target"
    lines = [line for line in target.group(1).splitlines() if "-m pytest" in line]
    assert len(lines) == 1, lines
    chars = re.findall(r"\s-r(\w+)", lines[0])
    assert chars and all(c in chars[-1] for c in "sfE"), f"the pytest line needs -r with s, f and E: {lines[0]}"
