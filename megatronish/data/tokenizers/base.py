"""The tokenizers' base class (Megatron-LM's attribute names) and what several families share: the check
that a tokenizer file exists, tiktoken's batched encodes."""
from __future__ import annotations

import itertools
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from megatronish.errors import TokenizerError


def require_file(path: Optional[str], flag: str, tokenizer_type: str, what: str) -> str:
    if not path:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag} ({what})")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} '{path}' does not exist ({what} for --tokenizer-type {tokenizer_type})")
    return path


class MegatronTokenizer:
    """Base class: Megatron-LM's attribute names."""

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod(self) -> int:
        raise NotImplementedError

    @property
    def pad(self) -> int:
        return -1

    @property
    def vocab(self) -> Dict[str, int]:
        raise NotImplementedError(f"{type(self).__name__} has no vocab table")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(t) for t in texts]

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """``tokenize_batch(texts)`` concatenated: (int64 ids, int64 length of each text's ids)."""
        ids = self.tokenize_batch(texts)
        lengths = numpy.fromiter(map(len, ids), dtype=numpy.int64, count=len(ids))
        flat = numpy.fromiter(itertools.chain.from_iterable(ids), dtype=numpy.int64, count=int(lengths.sum()))
        return flat, lengths

    @property
    def unique_identifiers(self) -> Dict[str, object]:
        return {"class": type(self).__name__, "vocab_size": self.vocab_size}


class TiktokenTokenizer(MegatronTokenizer):
    """A tokenizer run by a tiktoken ``Encoding`` (``self._enc``, set by the subclass): encoding, batches, decoding."""

    _enc = None

    def tokenize(self, text: str) -> List[int]:
        return self._enc.encode_ordinary(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """``encode_ordinary`` of each text, in this thread (tiktoken's own batch call goes through a thread pool
        even for one thread)."""
        encode = self._enc.encode_ordinary
        return [encode(t) for t in texts]

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """The ids of ``encode_ordinary`` as uint32 arrays straight from tiktoken (no Python int lists), joined."""
        encode = self._enc.encode_to_numpy
        arrays = []
        for text in texts:
            try:
                arrays.append(encode(text, disallowed_special=()))
            except UnicodeEncodeError:  # lone surrogates: replaced exactly as encode_ordinary replaces them
                arrays.append(encode(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"),
                                     disallowed_special=()))
        lengths = numpy.fromiter(map(len, arrays), dtype=numpy.int64, count=len(arrays))
        flat = numpy.concatenate(arrays) if arrays else numpy.zeros(0, numpy.uint32)
        return flat, lengths

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])
