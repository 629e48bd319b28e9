"""tools/preprocess_data.py loaded as the module ``preprocess_data`` (a script of the checkout, not a package
module; registered under that name so that its worker processes unpickle tasks by name)."""
import importlib.util
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load():
    if "preprocess_data" not in sys.modules:
        spec = importlib.util.spec_from_file_location("preprocess_data",
                                                      os.path.join(REPO, "tools", "preprocess_data.py"))
        sys.modules["preprocess_data"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["preprocess_data"])
    return sys.modules["preprocess_data"]
