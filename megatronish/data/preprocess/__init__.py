"""Tokenizing JSON-lines text into indexed datasets: the logic behind ``megatronish-preprocess-data``
(``megatronish/tools/preprocess_data.py``): :mod:`.inputs`, :mod:`.encoder`, :mod:`.workers`, :mod:`.pipeline`."""
