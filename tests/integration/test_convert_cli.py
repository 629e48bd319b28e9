"""tools/checkpoint/convert.py end to end.

* HF -> megatronish -> HF through files is bitwise identical per tensor (GPT-2 and Llama with GQA through the
  script in a subprocess; Mistral, Qwen2 with tied embeddings and Qwen3 through its ``main`` in this process;
  the export sharded into several safetensors files with an index) and loads in transformers as the same
  family with the same logits.
* A checkpoint trained by ``pretrain`` at TP 2 x PP 2 (GPT-2 with --openai-gelu; Llama with GQA, untied,
  padded vocabulary) exported to HF: transformers' loss on the validation batch equals our evaluation loss on
  the same batch; converted back HF -> megatronish and loaded with ``--finetune`` at TP 2 x PP 2 it evaluates
  to the same loss again.
"""
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatronish.arguments import configs_from_args, parse_args
from megatronish.convert.hf_io import HFReader
from megatronish.convert.tiny import tiny_hf_model
from megatronish.data.mock import MockGPTDataset
from megatronish.data.sampler import collate
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(ROOT, "tools", "checkpoint", "convert.py")


def _convert_in_process(*argv):
    from megatronish.tools import convert_checkpoint

    convert_checkpoint.main(["--model-type", "GPT", *argv])


def _convert(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, CLI, "--model-type", "GPT", *argv], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_round_trip_bitwise(tmp_path):
    from transformers import AutoModelForCausalLM

    for arch, over, convert in (("GPT2LMHeadModel", {}, _convert), ("LlamaForCausalLM", {}, _convert),
                                ("MistralForCausalLM", {}, _convert_in_process),
                                ("Qwen2ForCausalLM", {"tied": True}, _convert_in_process),
                                ("Qwen3ForCausalLM", {}, _convert_in_process)):
        src, ours, back = (str(tmp_path / f"{arch}_{x}") for x in ("hf", "ours", "back"))
        hf = tiny_hf_model(arch, vocab=100, **over)
        hf.save_pretrained(src)
        convert("--loader", "hf", "--saver", "megatronish", "--load-dir", src, "--save-dir", ours,
                "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
        assert open(os.path.join(ours, "latest_checkpointed_iteration.txt")).read().strip() == "release"
        convert("--loader", "megatronish", "--saver", "hf", "--load-dir", ours, "--save-dir", back,
                "--max-shard-size", "60KB")
        assert os.path.exists(os.path.join(back, "model.safetensors.index.json"))
        a, b = HFReader(src), HFReader(back)
        assert sorted(a.names()) == sorted(b.names()), arch
        for name in a.names():
            x, y = a.get(name), b.get(name)
            assert x.dtype == y.dtype and torch.equal(x, y), f"{arch} {name}"
        reloaded = AutoModelForCausalLM.from_pretrained(back).eval()
        assert type(reloaded).__name__ == arch
        ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, hf(ids).logits), arch


COMMON = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--attention-dropout", "0",
          "--hidden-dropout", "0", "--log-interval", "1000", "--seed", "7", "--train-iters", "3",
          "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
FLAVORS = {
    "gpt2": ["--openai-gelu"],
    "llama": ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
              "--ffn-hidden-size", "48"],
}


def _pretrain(argv, world):
    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(COMMON + argv), world)
    state = pretrain(cfg).state
    return state, cfg


def _hf_loss(hf_dir, cfg, valid_start):
    """transformers' mean token loss on the validation samples our evaluation used."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ds = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed + 1)
    batch = collate([ds[i] for i in range(valid_start, valid_start + cfg.train.global_batch_size)])
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"].long()).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch["labels"].long().reshape(-1)).item()


def _e2e_worker(rank, world, root):
    out = {}
    for name, flags in FLAVORS.items():
        d, hf_dir, back = (os.path.join(root, name, x) for x in ("ckpt", "hf", "back"))
        _pretrain(flags + ["--eval-iters", "0", "--save", d], world)
        state, cfg = _pretrain(flags + ["--eval-iters", "1", "--load", d, "--finetune", "--skip-train"], world)
        (_, ours), = state.valid_history
        start = state.valid_consumed_samples - cfg.train.global_batch_size
        if rank == 0:
            _convert("--loader", "megatronish", "--saver", "hf", "--load-dir", d, "--save-dir", hf_dir)
            _convert("--loader", "hf", "--saver", "megatronish", "--load-dir", hf_dir, "--save-dir", back,
                     "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
        dist.barrier()
        state2, _ = _pretrain(flags + ["--eval-iters", "1", "--load", back, "--finetune", "--skip-train"], world)
        (_, again), = state2.valid_history
        hf = _hf_loss(hf_dir, cfg, start) if rank == 0 else None
        out[name] = (ours, again, hf, cfg.model.vocab_size, cfg.model.padded_vocab_size(2))
    return out


def test_pretrained_tp2_pp2_to_hf(tmp_path):
    res = run_distributed(_e2e_worker, 4, str(tmp_path), timeout=600)[0]
    for name, (ours, again, hf, vocab, padded) in res.items():
        assert vocab == 97 and padded == 256  # NullTokenizer: 96 + 1; padded to 128 x TP 2
        assert abs(hf - ours) <= 1e-4 * abs(ours), (name, ours, hf)
        assert abs(again - ours) <= 1e-5 * abs(ours), (name, ours, again)
