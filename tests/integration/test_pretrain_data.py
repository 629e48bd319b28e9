"""Training from Megatron .bin/.idx files made by tools/preprocess_data.py (GPT-2 BPE on the bundled
corpus), and --mock-data with a file tokenizer."""
import os
import subprocess
import sys

from megatronish.arguments import configs_from_args, parse_args
from megatronish.data.tokenizers import gpt2_files
from megatronish.parallel import groups
from megatronish.testing import run_distributed, subprocess_env
from megatronish.training.pretrain import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--lr", "2e-3", "--lr-warmup-iters", "2", "--attention-dropout", "0", "--hidden-dropout", "0",
         "--log-interval", "100", "--seed", "3"]


def _train(rank, world, argv):
    groups.destroy_model_parallel()
    state = pretrain(configs_from_args(parse_args(argv), world)).state
    return [loss for _, loss in state.history], [loss for _, loss in state.valid_history]


def test_train_from_preprocessed_files(tmp_path):
    vocab, merges = gpt2_files()
    corpus = tmp_path / "docs.jsonl"
    with open(os.path.join(ROOT, "examples", "corpus", "python_docs.jsonl")) as src:
        corpus.write_text("".join(next(src) for _ in range(60)))
    prefix = tmp_path / "docs"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(corpus),
                    "--json-keys", "text", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                    "--merge-file", merges, "--append-eod", "--output-prefix", str(prefix), "--workers", "1"],
                   check=True, capture_output=True, env=subprocess_env())
    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    argv = MODEL + tok + ["--data-path", f"{prefix}_text_document", "--split", "90,10,0", "--train-iters", "12",
                          "--eval-interval", "6", "--eval-iters", "1", "--data-cache-path", str(tmp_path / "cache")]
    (train, valid), (train2, valid2) = run_distributed(_train, 2, argv)  # DP 2
    assert train == train2 and len(train) == 12 and len(valid) == 2
    assert train[-1] < train[0] - 0.5, train
    # the same files, layout and seed give the same run
    (again, _), _ = run_distributed(_train, 2, argv)
    assert again == train


def test_mock_data_with_a_file_tokenizer():
    vocab, merges = gpt2_files()
    argv = MODEL + ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                    "--mock-data", "--train-iters", "3", "--eval-iters", "0"]
    cfg = configs_from_args(parse_args(argv), 1)
    assert cfg.model.vocab_size == 50257
    (train, _), = run_distributed(_train, 1, argv)
    assert len(train) == 3 and all(loss == loss for loss in train)
