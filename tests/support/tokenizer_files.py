"""Small local tokenizer files for the data tests (built on the fly, nothing downloaded)."""
import base64
import json
import os

from megatronish.data.tokenizers import gpt2_files

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It barked!",
    "Python's docs: lists, dicts and sets.\n\nA second paragraph, with  two spaces.",
    "Numbers 12345 and symbols #@$% mixed; unicode: café, naïve, 東京.",
    "Short.",
    "Tabs\tand trailing space ",
]


def _training_text():
    base = " ".join(TEXTS)
    words = ("the of and to in is was for on that with as by at from this be are or an "
             "python list dict function class module object value return print string").split()
    lines = [base] + [" ".join(words[i:] + words[:i]) + "." for i in range(len(words))]
    return "\n".join(lines * 4)


def make_sentencepiece(directory):
    """A byte-fallback SentencePiece model with identity normalization (exact round trips)."""
    import sentencepiece as spm

    path = os.path.join(directory, "sp.model")
    if os.path.exists(path):
        return path
    corpus = os.path.join(directory, "sp_corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write(_training_text())
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=os.path.join(directory, "sp"), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=False,
        remove_extra_whitespaces=False, split_digits=True, pad_id=3, unk_id=0, bos_id=1, eos_id=2,
        character_coverage=1.0, minloglevel=2, num_threads=1,
    )
    return path


def make_hf_tokenizer_json(directory):
    """A byte-level BPE tokenizer.json with an <|endoftext|> token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = os.path.join(directory, "tokenizer.json")
    if os.path.exists(path):
        return path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_training_text()], trainer)
    tok.save(path)
    return path


def make_tiktoken_json(directory, extra_merges=(b"th", b"the", b" the", b"in", b"ing", b"on")):
    """A ranks file in Megatron's TikTokenizer format: [{rank, token_bytes, token_str}]."""
    path = os.path.join(directory, "tiktoken.json")
    if os.path.exists(path):
        return path
    tokens = [bytes([i]) for i in range(256)] + list(extra_merges)
    items = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
             for i, t in enumerate(tokens)]
    with open(path, "w") as f:
        json.dump(items, f)
    return path


def tokenizer_configs(directory):
    """(name, build_tokenizer kwargs, preprocess CLI flags) for every tokenizer type."""
    vocab, merges = gpt2_files()
    sp = make_sentencepiece(directory)
    hf = make_hf_tokenizer_json(directory)
    tk = make_tiktoken_json(directory)
    return [
        ("GPT2BPETokenizer", dict(vocab_file=vocab, merge_file=merges),
         ["--vocab-file", vocab, "--merge-file", merges]),
        ("SentencePieceTokenizer", dict(tokenizer_model=sp), ["--tokenizer-model", sp]),
        ("GPTSentencePieceTokenizer", dict(tokenizer_model=sp), ["--tokenizer-model", sp]),
        ("Llama2Tokenizer", dict(tokenizer_model=sp), ["--tokenizer-model", sp]),
        ("HuggingFaceTokenizer", dict(tokenizer_model=hf), ["--tokenizer-model", hf]),
        ("TikTokenizer", dict(tokenizer_model=tk), ["--tokenizer-model", tk]),
        ("NullTokenizer", dict(vocab_size=1000), ["--vocab-size", "1000"]),
    ]
