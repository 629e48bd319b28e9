"""``NullTokenizer``: text is space-separated integer ids."""
from __future__ import annotations

from typing import List, Optional, Sequence

from megatronish.errors import TokenizerError

from .base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Text is space-separated integer ids; ``vocab_size`` is N + 1 and eod is N."""

    def __init__(self, vocab_size: Optional[int]) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N (N > 0)")
        self._n = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    def tokenize(self, text: str) -> List[int]:
        try:
            return [int(x) for x in text.split(" ")]
        except ValueError:
            raise TokenizerError(
                f"NullTokenizer reads space-separated integers; got {text[:40]!r}"
            ) from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(x)) for x in ids)
