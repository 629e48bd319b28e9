#!/usr/bin/env python
"""Tokenize JSON lines, text, Parquet or datasets.save_to_disk data into indexed datasets:
``megatronish-preprocess-data`` (``megatronish/tools/preprocess_data.py``), under Megatron-LM's script name."""
import sys

from megatronish.tools.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())
