"""The megatron-core oracle cannot vanish silently: without it the tests that use it skip with the reason, and
under CI (environment variable ``CI`` set) they fail in one line instead; the dev extra installs it."""
import os
import re
import sys

import pytest

from support import megatron_core_support as mcs

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def broken_module(tmp_path, monkeypatch):
    """A module whose import raises something other than ImportError (a broken install)."""
    (tmp_path / "broken_oracle_module.py").write_text("raise RuntimeError('symbol lookup failed\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "broken_oracle_module"
    sys.modules.pop("broken_oracle_module", None)


@pytest.mark.parametrize("ci", ["", "0", "false"])
def test_skips_with_the_reason_outside_ci(monkeypatch, broken_module, ci):
    monkeypatch.setenv("CI", ci)
    for module, error in (("no_such_oracle_module", "ModuleNotFoundError"), (broken_module, "RuntimeError")):
        with pytest.raises(pytest.skip.Exception) as stop:
            mcs.import_or_skip(module)
        assert str(stop.value).startswith(f"{module} is not importable ({error}: "), stop.value
        assert "install the dev extra" in str(stop.value)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_fails_in_one_line_under_ci(monkeypatch, broken_module, ci):
    monkeypatch.setenv("CI", ci)
    for module in ("no_such_oracle_module", broken_module):
        with pytest.raises(pytest.fail.Exception) as stop:
            mcs.import_or_skip(module)
        msg = str(stop.value)
        assert "\n" not in msg and msg.startswith(f"{module} is not importable (") and "CI is set" in msg, msg
        assert not stop.value.pytrace


def test_importable_module_is_returned(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert mcs.import_or_skip("json").__name__ == "json"


def test_no_test_bypasses_the_rule():
    """Every use of megatron-core in the tests goes through import_or_skip / require_checkpointing."""
    offenders = []
    for root, _, files in os.walk(TESTS):
        for f in files:
            if f.endswith(".py") and f != os.path.basename(__file__):
                text = open(os.path.join(root, f)).read()
                if re.search(r"importorskip\(\s*['\"]megatron", text):
                    offenders.append(os.path.relpath(os.path.join(root, f), TESTS))
    assert not offenders, offenders


def test_dev_extra_installs_megatron_core():
    text = open(os.path.join(os.path.dirname(TESTS), "pyproject.toml")).read()
    dev = re.search(r"^dev = \[(.*?)^\]", text, re.M | re.S)
    assert dev and re.search(r'^\s*"megatron-core\b', dev.group(1), re.M), "megatron-core is not in the dev extra"
