"""The repository holds source, docs and small data: no built packages, shared objects or archives, no file
over 1 MB except the bundled example corpus, and test modules a pytest run can all collect."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 1 << 20  # bytes
ALLOWED_LARGE = ("examples/corpus/",)
BINARY_SUFFIXES = (".whl", ".so", ".tar.gz")


def _tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files to check")
    return [p for p in out.stdout.decode().split("\0") if p]


def test_no_built_packages_or_archives_are_tracked():
    bad = [p for p in _tracked_files() if p.endswith(BINARY_SUFFIXES)]
    assert not bad, f"remove these from the repository (git rm): {bad}"


def test_no_large_files_are_tracked():
    big = []
    for p in _tracked_files():
        path = os.path.join(ROOT, p)
        if p.startswith(ALLOWED_LARGE) or not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        if size > LIMIT:
            big.append(f"{p} ({size} bytes)")
    assert not big, f"tracked files over {LIMIT} bytes: {big}"


def test_test_modules_have_unique_basenames():
    """The test directories are not packages: pytest imports each test module by its basename, so two files of one
    name in different directories stop the collection of the suite."""
    seen = {}
    for p in _tracked_files():
        name = os.path.basename(p)
        if p.startswith("tests/") and name.startswith("test_") and name.endswith(".py"):
            seen.setdefault(name, []).append(p)
    assert not {n: ps for n, ps in seen.items() if len(ps) > 1}, "rename one of each pair"
