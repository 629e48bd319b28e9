#!/usr/bin/env python
"""Draw a pipeline timeline as a PNG and print the bubble: ``megatronish-plot-timeline``
(``megatronish/tools/plot_timeline.py``)."""
from megatronish.tools.plot_timeline import main

if __name__ == "__main__":
    main()
