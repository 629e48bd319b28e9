#!/usr/bin/env python
"""Plan a run from ``pretrain_gpt.py``'s flags plus ``--world-size N``: ``megatronish-plan``
(``megatronish/planner/cli.py``)."""
from megatronish.planner.cli import main

if __name__ == "__main__":
    main()
