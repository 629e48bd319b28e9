#!/usr/bin/env python
"""Print a checkpoint's iteration, config and tensors: ``megatronish-inspect-checkpoint``
(``megatronish/tools/inspect_checkpoint.py``)."""
import sys

from megatronish.tools.inspect_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
