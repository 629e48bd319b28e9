"""``HuggingFaceTokenizer``: a Hugging Face tokenizer from a local ``tokenizer.json`` or directory."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence

from megatronish.errors import TokenizerError

from .base import MegatronTokenizer


class HuggingFaceTokenizer(MegatronTokenizer):
    """A Hugging Face tokenizer from a local ``tokenizer.json`` or a local directory.

    A ``tokenizer.json`` (alone or in the directory) is run by the ``tokenizers`` library; eos/pad
    come from the directory's ``tokenizer_config.json`` / ``special_tokens_map.json`` when present,
    else from the usual end-of-text token names. Other directories go through
    ``transformers.AutoTokenizer(local_files_only=True)``.
    """

    _EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")

    def __init__(self, path: Optional[str], **kwargs) -> None:
        if not path:
            raise TokenizerError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                                 "(a local tokenizer.json or a tokenizer directory)")
        if not os.path.exists(path):
            raise TokenizerError(f"--tokenizer-model '{path}' does not exist (HuggingFaceTokenizer "
                                 f"reads a local tokenizer.json or directory; nothing is downloaded)")
        self._fast = None
        self._hf = None
        json_file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        eos_token = pad_token = None
        if os.path.isdir(path):
            for name in ("tokenizer_config.json", "special_tokens_map.json"):
                cfg = os.path.join(path, name)
                if os.path.isfile(cfg):
                    try:
                        with open(cfg, "r", encoding="utf-8") as f:
                            data = json.load(f)
                    except ValueError as err:
                        raise TokenizerError(f"'{cfg}' is not valid JSON ({err})") from None
                    eos_token = eos_token or _token_content(data.get("eos_token"))
                    pad_token = pad_token or _token_content(data.get("pad_token"))
        if os.path.isfile(json_file):
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise TokenizerError("HuggingFaceTokenizer needs the `tokenizers` package") from None
            try:
                self._fast = Tokenizer.from_file(json_file)
            except Exception as err:
                raise TokenizerError(f"--tokenizer-model '{json_file}' is not a Hugging Face "
                                     f"tokenizer.json ({err})") from None
            vocab = self._fast.get_vocab(with_added_tokens=True)
            self._vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
        else:
            try:
                import transformers
                self._hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
            except Exception as err:
                raise TokenizerError(f"--tokenizer-model '{path}' is not a loadable Hugging Face "
                                     f"tokenizer directory ({type(err).__name__}: {err})") from None
            vocab = self._hf.get_vocab()
            self._vocab_size = len(self._hf)
            eos_token = eos_token or self._hf.eos_token
            pad_token = pad_token or self._hf.pad_token
        self._vocab = vocab
        if eos_token is None:
            eos_token = next((t for t in self._EOS_NAMES if t in vocab), None)
        self._eod = vocab[eos_token] if eos_token in vocab else None
        self._pad = vocab[pad_token] if pad_token in vocab else -1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise TokenizerError("the Hugging Face tokenizer has no end-of-text token; add an "
                                 "eos_token to its tokenizer_config.json")
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> List[int]:
        if self._fast is not None:
            return self._fast.encode(text).ids
        return self._hf(text)["input_ids"]

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(list(texts))]
        return self._hf(list(texts))["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids)


def _token_content(value) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
