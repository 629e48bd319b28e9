"""Tokenizing JSON lines (and text, Parquet, Arrow: :mod:`.formats`) into indexed datasets: the logic behind
``megatronish-preprocess-data`` (``megatronish/tools/preprocess_data.py``): :mod:`.inputs`, :mod:`.formats`,
:mod:`.encoder`, :mod:`.workers`, :mod:`.pipeline`."""
