"""``--save-hf``'s tokenizer files for a run whose tokenizer is a SentencePiece model: transformers'
``AutoTokenizer`` reads the exported directory and encodes text exactly as the run's tokenizer does (bos where the
type prepends it, the prefix space only where the model adds its dummy prefix)."""
import os

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.convert.hf_save import _write_side_files
from megatronish.data.tokenizers import build_tokenizer
from support.tokenizer_files import TEXTS, make_sentencepiece

pytest.importorskip("sentencepiece")


def _dummy_prefix_model(directory):
    """The same corpus as the test model, with Llama 2's settings: the dummy prefix, identity normalization, runs
    of spaces kept."""
    import sentencepiece as spm

    corpus = os.path.join(directory, "sp_corpus.txt")
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(directory, "prefixed"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2,
                                   num_threads=1, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True)
    return os.path.join(directory, "prefixed.model")


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPTSentencePieceTokenizer", "SentencePieceTokenizer"])
def test_exported_sentencepiece_tokenizer_encodes_like_the_run(tmp_path, kind):
    from transformers import AutoTokenizer

    plain = make_sentencepiece(str(tmp_path))
    for model in (plain, _dummy_prefix_model(str(tmp_path))):
        argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                "--max-position-embeddings", "16", "--tokenizer-type", kind, "--tokenizer-model", model,
                "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                "--lr", "1e-3"]
        cfg = configs_from_args(parse_args(argv), 1)
        out = tmp_path / f"{kind}-{os.path.basename(model)}"
        out.mkdir()
        _write_side_files(str(out), cfg, torch.float32, None, None)
        ours, theirs = build_tokenizer(kind, tokenizer_model=model), AutoTokenizer.from_pretrained(str(out))
        for text in TEXTS:
            assert theirs(text)["input_ids"] == ours.tokenize(text), (kind, model, text)
        assert theirs.bos_token_id == ours.bos and theirs.eos_token_id == ours.eos
