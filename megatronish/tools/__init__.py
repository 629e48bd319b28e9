"""The command-line tools, one module each with a ``main(argv=None)``.

Installed as console scripts (``pyproject.toml``): ``megatronish-pretrain-gpt``, ``megatronish-merge-datasets``,
``megatronish-convert-checkpoint``, ``megatronish-inspect-checkpoint``, ``megatronish-plot-timeline``. The
Megatron-LM command lines (``pretrain_gpt.py``, ``tools/merge_datasets.py``, ``tools/checkpoint/convert.py``, ...)
are thin scripts that call the same ``main``.
"""
