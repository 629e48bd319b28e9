"""SentencePiece models: ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer``
(bos prepended)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from megatronish.errors import TokenizerError

from .base import MegatronTokenizer, require_file


def _load_sentencepiece(model_file: Optional[str], tokenizer_type: str):
    require_file(model_file, "--tokenizer-model", tokenizer_type, "a SentencePiece .model file")
    try:
        import sentencepiece
    except ImportError:
        raise TokenizerError(f"{tokenizer_type} needs the `sentencepiece` package: pip install sentencepiece") from None
    sp = sentencepiece.SentencePieceProcessor()
    try:
        ok = sp.Load(model_file)
    except Exception as err:
        raise TokenizerError(
            f"--tokenizer-model '{model_file}' is not a SentencePiece model ({err})"
        ) from None
    if not ok:
        raise TokenizerError(f"--tokenizer-model '{model_file}' is not a SentencePiece model")
    return sp


class SentencePieceTokenizer(MegatronTokenizer):
    """SentencePiece model plus Megatron's added special tokens <CLS> <SEP> <EOD> <MASK>, pad, bos,
    eos (each appended to the vocabulary unless the model has it) and ``vocab_extra_ids``."""

    def __init__(self, model_file: Optional[str], vocab_extra_ids: int = 0) -> None:
        self._sp = _load_sentencepiece(model_file, "SentencePieceTokenizer")
        self._vocab: Dict[str, int] = {}
        for i in range(self._sp.GetPieceSize()):
            self._vocab[self._sp.IdToPiece(i)] = i
        self._special: Dict[str, int] = {}
        self._inv_special: Dict[int, str] = {}

        def add(token: str) -> int:
            if token not in self._vocab:
                self._vocab[token] = len(self._vocab)
            self._special[token] = self._vocab[token]
            self._inv_special[self._vocab[token]] = token
            return self._vocab[token]

        def piece_or(piece_id: int, fallback: str) -> str:
            if 0 <= piece_id < self._sp.GetPieceSize():
                return self._sp.IdToPiece(piece_id)
            return fallback

        self._cls = add("<CLS>")
        self._sep = add("<SEP>")
        self._eod = add("<EOD>")
        self._mask = add("<MASK>")
        self._pad = add(piece_or(self._sp.pad_id(), "<PAD>"))
        self._bos = add(piece_or(self._sp.bos_id(), "<BOS>"))
        self._eos = add(piece_or(self._sp.eos_id(), "<EOS>"))
        self._t5_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for t in self._t5_tokens:
            add(t)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def cls(self) -> int:
        return self._cls

    @property
    def sep(self) -> int:
        return self._sep

    @property
    def mask(self) -> int:
        return self._mask

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def eos(self) -> int:
        return self._eos

    def tokenize(self, text: str) -> List[int]:
        # Special-token strings in the text map to their ids; the rest goes through SentencePiece.
        ids: List[int] = []
        pos = 0
        while True:
            best, best_at = None, -1
            for token in self._special:
                at = text.find(token, pos)
                if at >= 0 and (best_at < 0 or at < best_at):
                    best, best_at = token, at
            if best is None:
                break
            ids.extend(self._sp.EncodeAsIds(text[pos:best_at]))
            ids.append(self._special[best])
            pos = best_at + len(best)
        ids.extend(self._sp.EncodeAsIds(text[pos:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        text, last = "", 0
        for i, tid in enumerate(ids):
            if tid in self._inv_special:
                text += self._sp.DecodeIds(ids[last:i]) + " "
                text += self._inv_special[tid] + " "
                last = i + 1
        return text + self._sp.DecodeIds(ids[last:])


class GPTSentencePieceTokenizer(MegatronTokenizer):
    """A SentencePiece model as is: eod is the model's eos, pad its pad."""

    _TYPE = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: Optional[str]) -> None:
        self._sp = _load_sentencepiece(model_file, self._TYPE)

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def vocab(self) -> Dict[str, int]:
        return {self._sp.IdToPiece(i): i for i in range(self._sp.GetPieceSize())}

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    def tokenize(self, text: str) -> List[int]:
        return self._sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.Encode(list(texts))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama-2's SentencePiece model: ``tokenize`` prepends bos (``bos=True, eos=False``)."""

    _TYPE = "Llama2Tokenizer"

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        ids = self._sp.EncodeAsIds(text)
        if bos:
            ids = [self.bos] + ids
        if eos:
            ids = ids + [self.eos]
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [[self.bos] + ids for ids in self._sp.Encode(list(texts))]
