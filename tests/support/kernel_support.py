"""Import ``megatronish.kernels`` so that its Triton kernels run through Triton's interpreter on CPU.

Triton decides whether to interpret when it is first imported and when each kernel is defined, so
``TRITON_INTERPRET=1`` is set around the import and the environment is put back afterwards. A test module calls
:func:`import_interpreted` at import time: it skips the module with the reason when triton is not installed
(the ``kernels`` extra) or was imported earlier in this process without the interpreter.
"""
import importlib
import os

import pytest


def import_interpreted(*modules: str):
    """Import ``megatronish.kernels`` and the named submodules interpreted; returns ``(kernels, _triton, mods)``
    and sets nothing else. ``pytestmark`` should use :func:`not_interpreted_mark`."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton", reason="triton is not installed: the kernels extra "
                                             "(pip install -e '.[kernels]')")
        try:
            kernels = importlib.import_module("megatronish.kernels")
            _triton = importlib.import_module("megatronish.kernels._triton")
            mods = [importlib.import_module(f"megatronish.kernels.{m}") for m in modules]
        except ImportError as e:  # triton was imported earlier in this process without the interpreter
            pytest.skip(f"cannot run the kernels through Triton's interpreter here: {e}", allow_module_level=True)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return kernels, _triton, mods


def not_interpreted_mark(_triton):
    return pytest.mark.skipif(not _triton.INTERPRETED,
                              reason="megatronish.kernels was loaded compiled before this module set "
                                     "TRITON_INTERPRET=1")
