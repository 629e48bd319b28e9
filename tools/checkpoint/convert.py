#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and megatronish: ``megatronish-convert-checkpoint``
(``megatronish/tools/convert_checkpoint.py``), under Megatron-LM's script name."""
import sys

from megatronish.tools.convert_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
