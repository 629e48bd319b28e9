"""GPT-2's byte-level BPE (``GPT2BPETokenizer``) from its encoder.json and vocab.bpe, run by tiktoken."""
from __future__ import annotations

import json
from typing import Dict, List, Optional

from megatronish.errors import TokenizerError

from .base import TiktokenTokenizer, require_file

# GPT-2's pre-tokenization regex (tiktoken's r50k_base).
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class GPT2BPETokenizer(TiktokenTokenizer):
    """GPT-2's byte-level BPE from its encoder.json + vocab.bpe, run by tiktoken."""

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str]) -> None:
        require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer", "GPT-2 encoder.json")
        require_file(merge_file, "--merge-file", "GPT2BPETokenizer", "GPT-2 vocab.bpe merges")
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError("GPT2BPETokenizer needs the `tiktoken` package: pip install tiktoken") from None
        try:
            with open(vocab_file, "r", encoding="utf-8") as f:
                encoder = json.load(f)
            if not isinstance(encoder, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as err:
            raise TokenizerError(f"--vocab-file '{vocab_file}' is not a GPT-2 encoder.json ({err})") from None
        try:  # read here, not through tiktoken's loader (it caches local files by path: an edited file is stale)
            with open(merge_file, "r", encoding="utf-8") as f:
                merges = f.read()
            ranks = _gpt2_ranks(encoder, merges)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise TokenizerError(
                f"--merge-file '{merge_file}' and --vocab-file '{vocab_file}' do not form a GPT-2 "
                f"BPE vocabulary ({type(err).__name__}: {err})"
            ) from None
        if "<|endoftext|>" not in encoder:
            raise TokenizerError(f"--vocab-file '{vocab_file}' has no '<|endoftext|>' token")
        self._eod = int(encoder["<|endoftext|>"])
        self._vocab_size = len(encoder)
        self._encoder = encoder
        self._enc = tiktoken.Encoding(
            name="gpt2_local", pat_str=_GPT2_PATTERN, mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": self._eod},
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        return self._encoder

    @property
    def eod(self) -> int:
        return self._eod



def _gpt2_byte_symbols() -> List[str]:
    """GPT-2's printable stand-in for each byte, in its vocabulary order: the printable bytes (not space) as
    themselves, then the other bytes as U+0100 upwards. Index = rank of the one-byte token."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in set(printable)]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))], printable + others


def _gpt2_ranks(encoder: Dict[str, int], merges: str) -> Dict[bytes, int]:
    """tiktoken's mergeable ranks from GPT-2's encoder.json and vocab.bpe: the 256 one-byte tokens in GPT-2's byte
    order, then one token per merge line in order; the encoder must give each exactly that id.

    The merges are checked against the encoder as symbol strings (each symbol stands for one byte, one to one),
    then the tokens are turned into bytes once: str.translate + encode run in C. Any character that is not a
    symbol fails the encode (a latin-1 character that is not a symbol is first mapped to U+FFFD so it cannot pass
    as a byte)."""
    symbols, order = _gpt2_byte_symbols()
    table = {c: "\ufffd" for c in range(256)}
    table.update((ord(sym), chr(b)) for sym, b in zip(symbols, order))

    def raw(token: str) -> bytes:
        return token.translate(table).encode("latin-1")

    lines = merges.split("\n")[1:]  # the first line is the version header
    pairs = [line.split() for line in lines]
    bad = next((i for i, p in enumerate(pairs) if p and len(p) != 2), None)
    if bad is not None:
        raise ValueError(f"merge line {lines[bad][:40]!r} is not two symbols")
    ranks = dict(zip(symbols, range(len(symbols))))
    for token in ["".join(p) for p in pairs if p]:  # a pair's token: its two symbols' bytes
        ranks.setdefault(token, len(ranks))
    special = ("<|endoftext|>", "<|startoftext|>")
    vocab = {k: int(v) for k, v in encoder.items() if k not in special}
    if vocab != ranks:
        diff = next((k for k in ranks if vocab.get(k) != ranks[k]), None) or next(k for k in vocab if k not in ranks)
        try:
            shown = raw(diff)
        except UnicodeEncodeError:
            shown = diff
        raise ValueError(f"token {shown!r} has id {vocab.get(diff)} in the vocabulary, {ranks.get(diff)} from the "
                         "merges")
    return dict(zip([raw(k) for k in ranks], ranks.values()))
