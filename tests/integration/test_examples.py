"""The GPU example scripts' flag sets are valid: each script is run with a stand-in for the launcher that
parses and validates its ``pretrain_gpt.py`` flags for the script's world size (no training)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from megatronish.data.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatronish.testing import subprocess_env
from support.launch import run_job
from support.tokenizer_files import make_hf_tokenizer_json

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Stands in for `python`: `-c`/plain invocations run Python; `-m torch.distributed.run ... pretrain_gpt.py FLAGS`
# validates FLAGS for --nproc-per-node ranks and prints the resulting model shape.
LAUNCHER = r'''#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "torch.distributed.run" ]; then
  shift 2
  while [ "$1" != "pretrain_gpt.py" ]; do
    if [ "$1" = "--nproc-per-node" ]; then NPROC=$2; shift; fi
    shift
  done
  shift
  exec {python} -c '
import sys
from megatronish.arguments import configs_from_args, exit_on_config_error, parse_args
cfg = exit_on_config_error(lambda: configs_from_args(parse_args(sys.argv[2:]), int(sys.argv[1])))
m = cfg.model
print("VALID", m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, cfg.parallel.tp)
' "$NPROC" "$@"
fi
exec {python} "$@"
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("examples")
    prefix = str(d / "corpus_text_document")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(64):
        builder.add_document(rng.integers(0, 200, size=300, dtype=np.int32), [300])
    builder.finalize(get_idx_path(prefix))
    launcher = d / "python"
    launcher.write_text(LAUNCHER.format(python=sys.executable))
    launcher.chmod(0o755)
    tok = make_hf_tokenizer_json(str(d))
    return {"PYTHON": str(launcher), "DATA": prefix, "TOKENIZER": tok, "OUT": str(d / "out")}


@pytest.mark.parametrize("script,shape", [("gpt2_124m.sh", "12 768 12 12 1"), ("llama_1b.sh", "16 2048 32 8 2")])
def test_example_flags_validate(env, script, shape):
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", script)], env={**subprocess_env(), **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"VALID {shape}" in proc.stdout


def test_deepseek_v3_example_flags_validate(env):
    """examples/deepseek_v3/pretrain_deepseek_v3.sh: DeepSeek-V3's shape validates for 1024 ranks (TP 8, EP 64)."""
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "deepseek_v3", "pretrain_deepseek_v3.sh")],
                          env={**subprocess_env(), **env, "NPROC": "1024", "NNODES": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "VALID 61 7168 128 128 8" in proc.stdout


def test_deepseek_v3_tiny_example_runs(tmp_path):
    """examples/deepseek_v3/tiny.sh on CPU: trains at EP 2, exports to transformers, and transformers' logits
    equal ours (its compare step exits 1 otherwise)."""
    proc = run_job(["bash", os.path.join(REPO, "examples", "deepseek_v3", "tiny.sh"), "--train-iters", "4"],
                   env={**subprocess_env(), "PYTHON": sys.executable, "OUT": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DeepseekV3ForCausalLM: max |logits - ours|" in proc.stdout
    assert (tmp_path / "hf" / "config.json").is_file()
