"""A misspelt flag on any entry point is one ``error:`` line that names the closest known flag, exit status 2
(``megatronish.errors.CommandLineParser``, the parser of every entry point)."""
import ast
import os
import subprocess
import sys

import pytest

from megatronish.errors import CommandLineParser
from megatronish.testing import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*argv):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=subprocess_env())


@pytest.mark.parametrize("argv, line", [
    (["pretrain_gpt.py", "--num-layers", "2", "--hiden-size", "64"],
     "error: unrecognized arguments: --hiden-size 64; did you mean --hidden-size?"),
    (["tools/preprocess_data.py", "--inptu", "c.jsonl", "--output-prefix", "c", "--tokenizer-type", "NullTokenizer",
      "--workers", "1"],  # argparse reports the required flag as missing; the line still names the misspelling's fix
     "error: the following arguments are required: --input; did you mean --input?"),
    (["-m", "megatronish.tools.merge_datasets", "--input", "a", "--output-prefx", "out"],
     "error: the following arguments are required: --output-prefix; did you mean --output-prefix?"),
], ids=["pretrain_gpt", "preprocess_data", "merge_datasets"])
def test_a_misspelt_flag_names_the_closest_one(argv, line):
    r = _run(*argv)
    assert r.returncode == 2, r.stderr
    assert [x for x in r.stderr.splitlines() if "error:" in x] == [line], r.stderr


def test_suggestions_only_for_close_flags(capsys):
    p = CommandLineParser(prog="x", allow_abbrev=False)
    p.add_argument("--hidden-size")
    p.add_argument("--num-layers", required=True)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--hiden-size=3", "--num-layer", "2", "--completely-unknown"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    # the missing required flag is what argparse reports; the suggestions still name both misspellings
    assert err[0] == ("error: the following arguments are required: --num-layers; did you mean --hidden-size (for "
                      "--hiden-size), --num-layers (for --num-layer)?"), err
    with pytest.raises(SystemExit):
        p.parse_args(["--num-layers", "2", "--completely-unknown"])
    assert capsys.readouterr().err.splitlines()[0] == "error: unrecognized arguments: --completely-unknown"


ENTRY_POINTS = [os.path.join("megatronish", "tools", f) for f in os.listdir(os.path.join(ROOT, "megatronish", "tools"))
                if f.endswith(".py")] + \
               [os.path.join(d, f) for d in ("tools", os.path.join("tools", "checkpoint"))
                for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")] + ["pretrain_gpt.py"]


@pytest.mark.parametrize("path", sorted(ENTRY_POINTS))
def test_entry_points_use_the_common_parser(path):
    """No entry point builds a bare ``argparse.ArgumentParser`` (its errors would be usage text without the
    suggestion)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    bare = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "ArgumentParser"]
    assert not bare, f"{path}:{bare}: use megatronish.errors.CommandLineParser"


def test_one_line_per_node_under_a_launcher(capsys, monkeypatch):
    """Under a launcher every process of a node parses the same command line: local rank 0 prints the line, the
    others exit with the same status silently."""
    p = CommandLineParser(prog="x", allow_abbrev=False)
    p.add_argument("--hidden-size")
    for local_rank, printed in (("1", []), ("0", ["error: unrecognized arguments: --hiden-size=3; did you mean "
                                                  "--hidden-size?"])):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--hiden-size=3"])
        assert e.value.code == 2
        assert [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")] == printed
