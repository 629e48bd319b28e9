"""Continued pretraining of a Hugging Face Qwen3-MoE on the bundled corpus, where real routing is uneven.

A random ``Qwen3MoeForCausalLM`` (4 experts, top-2, Qwen's unrenormalised routing) is saved as transformers
saves it, converted by tools/checkpoint/convert.py's code and trained by ``pretrain``'s step for 12 iterations
(``--use-checkpoint-args --finetune``; dropout off, which Megatron's ``--use-checkpoint-args`` leaves to the
command line) on GPT-2 BPE tokens of the corpus, at EP 2 and at EP 2 x TP 2 with sequence parallelism, with both
token dispatchers. Within these iterations the routing becomes uneven enough that some layer's local experts on
some rank get no tokens (the test checks that it happened); every rank must still run the same collectives.

The reference is transformers' model trained by ``torch.optim.AdamW`` on the same global batches (the mean token
cross entropy of each micro-batch, averaged over the micro-batches), with Megatron's defaults for everything not on
the command line (weight decay 0.01 on matrices only, global grad-norm clip 1.0, betas 0.9 / 0.999, eps 1e-8) and
its cosine schedule with linear warm-up. Every iteration's loss equals it (fp32, rtol 1e-5).
"""
import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.data.tokenizers import gpt2_files
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training import pretrain as training
from megatronish.training.data_wiring import build_file_datasets
from support.hf_training import GBS, ITERS, SEQ, corpus, hf_adamw_losses, schedule_flags


def _argv(ours, prefix, dispatcher, layout):
    vocab, merges = gpt2_files()
    return ["--use-checkpoint-args", "--load", ours, "--finetune", "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), *schedule_flags(), "--data-path", prefix, "--split", "100,0,0",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
            "--log-interval", "1000", "--eval-iters", "0", "--moe-token-dispatcher-type", dispatcher,
            # what --use-checkpoint-args leaves to the command line (as Megatron's does): transformers trains
            # these models without dropout
            "--hidden-dropout", "0", "--attention-dropout", "0"] + layout


def _worker(rank, world, cases):
    """Each case's losses, and the fewest tokens any rank's local experts got in one MoE layer's call."""
    out = {}
    for name, argv in cases.items():
        groups.destroy_model_parallel()
        run, state = training.setup(configs_from_args(parse_args(argv), world))
        fewest = []
        for model in run.models:
            for module in model.modules():
                if hasattr(module, "dispatcher") and hasattr(module, "experts"):
                    forward = module.experts.forward

                    def counted(x, counts, probs, forward=forward):
                        fewest.append(x.size(0))
                        return forward(x, counts, probs)
                    module.experts.forward = counted
        losses = [training.train_step(run, state).loss for _ in range(ITERS)]
        least = torch.tensor([min(fewest)])
        torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
        out[name] = (losses, int(least))
    return out


def prepare(root):
    """The HF model (saved and converted under ``root``), the tokenized corpus, and the first iterations'
    samples in order: ``(hf, our checkpoint, data prefix, samples)``."""
    import transformers

    from megatronish.tools import convert_checkpoint

    transformers.logging.set_verbosity_error()
    cfg = transformers.Qwen3MoeConfig(vocab_size=50257, hidden_size=64, intermediate_size=160,
                                      moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(11)
    hf = transformers.Qwen3MoeForCausalLM(cfg)
    hf.save_pretrained(root / "hf")
    convert_checkpoint.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatronish",
                             "--load-dir", str(root / "hf"), "--save-dir", str(root / "ours")])
    prefix, ours = corpus(root), str(root / "ours")
    train = build_file_datasets(configs_from_args(parse_args(_argv(ours, prefix, "allgather", [])), 1))[0]
    return hf, ours, prefix, [train[i] for i in range(ITERS * GBS)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf, ours, prefix, samples = prepare(tmp_path_factory.mktemp("qwen3moe"))
    return ours, prefix, hf_adamw_losses(hf, samples)


EP2 = ["--expert-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.mark.parametrize("world,layout", [(2, EP2), (4, EP2 + TP2)], ids=["ep2", "ep2-tp2-sp"])
def test_uneven_routing_trains_like_hf_adamw(setup, world, layout):
    ours, prefix, want = setup
    cases = {d: _argv(ours, prefix, d, layout) for d in ("allgather", "alltoall")}
    results = run_distributed(_worker, world, cases, timeout=600)
    for name in cases:
        losses, least = results[0][name]
        assert all(r[name] == (losses, least) for r in results), f"{name}: ranks disagree"
        assert least == 0, f"{name}: every rank's experts got tokens in every layer; the case is not exercised"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{name}: losses {losses} against transformers' {want}: {m}")
