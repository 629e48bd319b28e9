#!/usr/bin/env python
"""Merge indexed datasets (``.bin/.idx`` pairs) into one: ``megatronish-merge-datasets``
(``megatronish/tools/merge_datasets.py``), under Megatron-LM's script name."""
import sys

from megatronish.tools.merge_datasets import main

if __name__ == "__main__":
    sys.exit(main())
