"""Megatron-LM's own launch scripts train here on CPU: ``examples/gpt3/train_gpt3_175b_distributed.sh`` and
``examples/llama/train_llama3_8b_h100_fp8.sh`` as megatron-core 0.16.1 ships them (core_v0.16.1). The flag lists
below are those scripts' lists verbatim (their shell variables substituted with the scripts' values); the test
shrinks only sizes (layers, hidden, heads, sequence, batch, iterations, vocabulary, parallel degrees and the
intervals counted in iterations) and replaces the paths with temporary ones and the bundled corpus, then checks
that no flag was dropped and runs ``torchrun pretrain_gpt.py`` with them."""
import json
import os
import re
import subprocess
import sys

import pytest

from megatronish.config import rampup_global_batch_size
from megatronish.data.tokenizers import gpt2_files
from megatronish.testing import subprocess_env
from support.launch import run_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# examples/gpt3/train_gpt3_175b_distributed.sh (core_v0.16.1): GPT_MODEL_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS,
# DATA_ARGS, EVAL_AND_LOGGING_ARGS.
GPT3 = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
    "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size", "16", "16", "5859375",
    "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
    "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--data-path", "$DATA_PATH", "--vocab-file", "$VOCAB_FILE", "--merge-file", "$MERGE_FILE", "--split", "949,50,1",
    "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "$CHECKPOINT_PATH",
    "--load", "$CHECKPOINT_PATH", "--eval-iters", "10", "--tensorboard-dir", "$TENSORBOARD_LOGS_PATH",
]
GPT3_SIZES = {"--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
              "--max-position-embeddings": "32", "--global-batch-size": "8", "--rampup-batch-size": ["2", "2", "18"],
              "--train-iters": "9", "--lr-decay-iters": "8", "--tensor-model-parallel-size": "2",
              "--pipeline-model-parallel-size": "2", "--log-interval": "1", "--save-interval": "6",
              "--eval-interval": "6", "--eval-iters": "1"}

# examples/llama/train_llama3_8b_h100_fp8.sh (core_v0.16.1), its default MOCK data branch: MODEL_ARGS,
# TRAINING_ARGS (+ DDP_ARGS), DTYPE_ARGS (fp8), MODEL_PARALLEL_ARGS, DATA_ARGS_LIST, EVAL_AND_LOGGING_ARGS.
# The script expands "--split '99,1,0'" unquoted, so the value reaches the parser with its quotes.
LLAMA = [
    "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
    "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
    "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr", "0.00001",
    "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
    "--exit-duration-in-mins", "235", "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
    "--fp8-param-gather",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--data-cache-path",
    "$DATA_CACHE_PATH", "--tiktoken-pattern", "v2", "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
    "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
    "torch_dist", "--distributed-timeout-minutes", "60", "--save", "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH",
    "--tensorboard-dir", "$TENSORBOARD_LOGS_PATH",
]
LLAMA_SIZES = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
               "--num-query-groups": "2", "--kv-channels": "16", "--seq-length": "32",
               "--max-position-embeddings": "32", "--global-batch-size": "8", "--train-samples": "64",
               "--lr-decay-samples": "60", "--lr-warmup-samples": "8", "--vocab-size": "256", "--eval-iters": "1",
               "--eval-interval": "4", "--save-interval": "4"}


def _flag_names(argv):
    return [a for a in argv if a.startswith("--")]


def shrink(argv, sizes, paths):
    """``argv`` with the values of the flags in ``sizes`` replaced (one value or a list of values) and every
    ``$VARIABLE`` replaced from ``paths``; flags, their order and every other value stay as they are."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        out.append(paths.get(a, a))
        i += 1
        if a in sizes:
            new = sizes[a] if isinstance(sizes[a], list) else [sizes[a]]
            out += new
            i += len(new)
    return out


def _run(argv, nproc, tmp_path):
    env = subprocess_env(OMP_NUM_THREADS="1", MEGATRONISH_DEVICE="cpu")
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "pretrain_gpt.py"), *argv]
    proc = run_job(cmd, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _iterations(stdout):
    """(iteration, consumed samples, global batch size, lm loss) of every training log line."""
    pat = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) .*? global batch size:\s+(\d+) \| "
                     r"lm loss: (\S+)")
    return [(int(m[1]), int(m[2]), int(m[3]), float(m[4])) for m in pat.finditer(stdout)]


@pytest.fixture(scope="module")
def gpt3_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt3_data")
    vocab, merges = gpt2_files()
    # the bundled corpus, one document per paragraph: enough documents that --split 949,50,1 leaves every split
    # some (the test split gets 0.1% of them)
    corpus = d / "docs.jsonl"
    paragraphs = []
    with open(os.path.join(ROOT, "examples", "corpus", "python_docs.jsonl")) as src:
        for line in src:
            paragraphs += [p for p in json.loads(line)["text"].split("\n\n") if len(p) > 40]
            if len(paragraphs) >= 1200:
                break
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[:1200]))
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(corpus),
                    "--json-keys", "text", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                    "--merge-file", merges, "--append-eod", "--output-prefix", str(d / "docs"), "--workers", "1"],
                   check=True, capture_output=True, env=subprocess_env())
    return {"$DATA_PATH": str(d / "docs_text_document"), "$VOCAB_FILE": vocab, "$MERGE_FILE": merges}


def test_gpt3_175b_script_trains_shrunk(gpt3_data, tmp_path):
    """TP 2 x PP 2 (4 processes), fp16, batch-size ramp-up 2 -> 8, checkpoints, evaluation, then a resume."""
    paths = {**gpt3_data, "$CHECKPOINT_PATH": str(tmp_path / "ckpt"), "$TENSORBOARD_LOGS_PATH": str(tmp_path / "tb")}
    argv = shrink(GPT3, GPT3_SIZES, paths)
    assert _flag_names(argv) == _flag_names(GPT3)  # no flag removed, none added, same order
    out = _run(argv, 4, tmp_path)
    its = _iterations(out)
    assert [i for i, *_ in its] == list(range(1, 10))
    # Megatron's ramp: the batch of each iteration from the samples consumed before it
    consumed = 0
    for _, logged_consumed, batch, loss in its:
        assert batch == rampup_global_batch_size(consumed, 2, 2, 18, 8)
        consumed += batch
        assert logged_consumed == consumed and loss == loss
    assert [b for *_, b, _ in its] == [2, 2, 2, 4, 4, 6, 8, 8, 8]
    assert "validation loss at iteration 6" in out
    saved = sorted(d for d in os.listdir(tmp_path / "ckpt") if d.startswith("iter_"))
    # Megatron saves when the ramp changes the number of microbatches, and at --save-interval and the end
    assert saved == ["iter_0000003", "iter_0000005", "iter_0000006", "iter_0000009"]


def test_llama3_8b_fp8_script_trains_shrunk(tmp_path):
    """DP 2 with the distributed optimizer, bf16 + emulated FP8, per-token loss, decoupled LR, manual GC, the
    native fused cross entropy, mock data; the run saves and exits normally."""
    paths = {"$CHECKPOINT_PATH": str(tmp_path / "ckpt"), "$TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"),
             "$DATA_CACHE_PATH": str(tmp_path / "cache")}
    argv = shrink(LLAMA, LLAMA_SIZES, paths)
    assert _flag_names(argv) == _flag_names(LLAMA)
    out = _run(argv, 2, tmp_path)
    its = _iterations(out)
    assert [i for i, *_ in its] == list(range(1, 9)) and all(loss == loss for *_, loss in its)
    assert its[-1][1] == 64
    for note in ("--fp8-param-gather:", "--use-mcore-models:", "--attention-backend fused:",
                 "--profile without --use-pytorch-profiler"):
        assert f"note: {note}" in out, out[:3000]
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000008")


def test_main_branch_versions_of_the_scripts(tmp_path):
    """Megatron-LM's main branch changed the two scripts after core 0.16.1: the Llama script adds
    ``--normalization RMSNorm`` (with ``--apply-layernorm-1p``: zero-centered RMSNorm), which validates; the GPT-3
    script replaces the ramp by ``--step-batch-size-schedule``, which is one line naming the flag and the fix."""
    from megatronish.arguments import configs_from_args, parse_args, validate_args
    from megatronish.errors import ConfigError

    paths = {"$CHECKPOINT_PATH": str(tmp_path / "ckpt"), "$TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"),
             "$DATA_CACHE_PATH": str(tmp_path / "cache")}
    at = LLAMA.index("--swiglu") + 1
    llama_main = shrink(LLAMA[:at] + ["--normalization", "RMSNorm"] + LLAMA[at:], LLAMA_SIZES, paths)
    cfg = configs_from_args(parse_args(llama_main), 8)
    assert cfg.model.normalization == "RMSNorm" and cfg.model.apply_layernorm_1p
    at = GPT3.index("--rampup-batch-size")
    gpt3_main = GPT3[:at] + ["--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"] + \
        GPT3[at + 4:]
    paths = {"$DATA_PATH": str(tmp_path / "data"), "$VOCAB_FILE": "v.json", "$MERGE_FILE": "m.txt",
             "$CHECKPOINT_PATH": str(tmp_path / "ckpt"), "$TENSORBOARD_LOGS_PATH": str(tmp_path / "tb")}
    with pytest.raises(ConfigError) as e:
        validate_args(parse_args([paths.get(a, a) for a in gpt3_main]), 128)
    lines = [line for line in str(e.value).splitlines() if "--step-batch-size-schedule" in line]
    assert len(lines) == 1 and lines[0].endswith("use --rampup-batch-size START INCREMENT SAMPLES"), str(e.value)
