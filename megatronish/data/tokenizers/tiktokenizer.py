"""``TikTokenizer``: Megatron-LM's tiktoken tokenizer from a ranks file (Megatron's .json list or a .tiktoken
file), with its special tokens."""
from __future__ import annotations

import base64
import json
import os
from typing import Dict, Optional

from megatronish.errors import TokenizerError

from .base import TiktokenTokenizer, require_file

_TIKTOKEN_PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
_TIKTOKEN_PATTERN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TIKTOKEN_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


def _load_tiktoken_ranks(path: str) -> Dict[bytes, int]:
    """Ranks from Megatron's JSON list ([{rank, token_bytes, token_str}]) or a .tiktoken file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise TokenizerError(f"--tokenizer-model '{path}' cannot be read ({err})") from None
    ranks: Dict[bytes, int] = {}
    stripped = raw.lstrip()
    try:
        if stripped.startswith(b"["):
            items = json.loads(raw.decode("utf-8"))
            for i, item in enumerate(items):
                if item["rank"] != i:
                    raise ValueError(f"entry {i} has rank {item['rank']}")
                ranks[base64.b64decode(item["token_bytes"])] = i
        else:
            for line in raw.splitlines():
                if not line.strip():
                    continue
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except Exception as err:
        raise TokenizerError(
            f"--tokenizer-model '{path}' is not a tiktoken ranks file (a JSON list of "
            f"{{rank, token_bytes, token_str}} or '<base64 token> <rank>' lines): {err}"
        ) from None
    if not ranks:
        raise TokenizerError(f"--tokenizer-model '{path}' holds no tokens")
    return ranks


class TikTokenizer(TiktokenTokenizer):
    """tiktoken BPE from a local ranks file, ids shifted up by ``num_special_tokens`` special tokens
    (<unk> <s> </s> <mask> <pad> <cls> <sep>, then <SPECIAL_i> fillers)."""

    def __init__(self, path: Optional[str], pattern: str = "v2", vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000) -> None:
        require_file(path, "--tokenizer-model", "TikTokenizer", "a tiktoken ranks file")
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError("TikTokenizer needs the `tiktoken` package: pip install tiktoken") from None
        if pattern == "v1":
            pat = _TIKTOKEN_PATTERN_V1
        elif pattern == "v2":
            pat = _TIKTOKEN_PATTERN_V2
        else:
            raise TokenizerError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        if num_special_tokens < len(_TIKTOKEN_SPECIAL_TOKENS):
            raise TokenizerError(f"--tiktoken-num-special-tokens must be >= {len(_TIKTOKEN_SPECIAL_TOKENS)}")
        ranks = _load_tiktoken_ranks(path)
        inner = len(ranks)
        if vocab_size is not None:
            if vocab_size <= num_special_tokens:
                raise TokenizerError(f"--vocab-size {vocab_size} must exceed --tiktoken-num-special-tokens "
                                     f"{num_special_tokens}")
            inner = min(inner, vocab_size - num_special_tokens)
        ranks = {k: v + num_special_tokens for k, v in ranks.items() if v < inner}
        self._num_special = num_special_tokens
        specials = _TIKTOKEN_SPECIAL_TOKENS + [
            f"<SPECIAL_{i}>" for i in range(len(_TIKTOKEN_SPECIAL_TOKENS), num_special_tokens)
        ]
        self._specials = specials
        self._vocab_size = num_special_tokens + len(ranks)
        try:
            self._enc = tiktoken.Encoding(
                name=os.path.basename(path), pat_str=pat, mergeable_ranks=ranks,
                special_tokens={t: i for i, t in enumerate(specials)},
                explicit_n_vocab=self._vocab_size,
            )
        except Exception as err:
            raise TokenizerError(f"--tokenizer-model '{path}': tiktoken rejected the ranks ({err})") from None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return 2

    @property
    def eos(self) -> int:
        return 2

    @property
    def bos(self) -> int:
        return 1

    @property
    def pad(self) -> int:
        return 4

