"""The console entry points of pyproject.toml name a ``main`` that exists, and the Megatron-style scripts
(``pretrain_gpt.py``, ``tools/``) and the benchmarks and examples import the installed package without editing
``sys.path``."""
import importlib
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scripts():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def test_entry_points_resolve():
    scripts = _scripts()
    assert {"megatronish-pretrain-gpt", "megatronish-merge-datasets", "megatronish-convert-checkpoint",
            "megatronish-inspect-checkpoint", "megatronish-plot-timeline"} <= set(scripts)
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        main = getattr(importlib.import_module(module), func)
        assert callable(main) and "argv" in inspect.signature(main).parameters, name


def test_no_sys_path_edits():
    edits = []
    for top in ("tools", "benchmarks", "examples", "scripts", "tests", "megatronish"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    for n, line in enumerate(open(path, encoding="utf-8"), 1):
                        if re.search(r"sys\.path(\.insert|\.append|\[:\]\s*=|\s*=)", line):
                            edits.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not edits, "\n".join(edits)
