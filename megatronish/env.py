"""``python -m megatronish.env``: the environment report (the logic is ``megatronish.tools.env``, also the
``megatronish-env`` console script)."""
import sys

from megatronish.tools.env import main

if __name__ == "__main__":
    sys.exit(main())
