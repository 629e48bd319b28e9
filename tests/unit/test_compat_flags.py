"""Megatron-LM's run-time flags of its example scripts: --attention-backend, --apply-layernorm-1p, --decoupled-lr /
--decoupled-min-lr, --manual-gc*, --empty-unused-memory-level, and the flags accepted with a note."""
import math
import os

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args, validate_args
from megatronish.config import gpt2, llama
from megatronish.errors import ConfigError
from megatronish.model import GPTModel
from megatronish.optim.lr_schedule import OptimizerParamScheduler, scheduler_steps_from_config
from megatronish.optim.optimizer import get_megatron_optimizer
from megatronish.parallel.ddp import DistributedDataParallel
from megatronish.parallel.random import set_random_seed
from megatronish.testing import run_distributed

V = 90
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
        "--micro-batch-size", "2", "--lr", "1e-3", "--attention-dropout", "0", "--hidden-dropout", "0"]


def _loss_and_grads(cfg, docs=False):
    set_random_seed(4)
    model = GPTModel(cfg)
    model.init_parameters(4)
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, V, (2, 16), generator=g), torch.randint(0, V, (2, 16), generator=g)
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 4 + [2] * 3]) if docs else None
    loss = model(ids, labels=labels, document_ids=doc_ids).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_global_parameters()}


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "document-mask"])
def test_attention_backends_compute_the_same_attention(docs):
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=V, seq_length=16,
              attention_dropout=0.0, hidden_dropout=0.0)
    ref_loss, ref_grads = _loss_and_grads(llama(**kw), docs)
    for backend in ("unfused", "local", "flash", "fused"):  # flash / fused run as auto on CPU
        loss, grads = _loss_and_grads(llama(**kw, attention_backend=backend), docs)
        assert loss == pytest.approx(ref_loss, rel=1e-6), backend
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{backend} {n}: {m}")


def test_attention_backend_flag_and_cpu_note(monkeypatch):
    from megatronish.training.initialize import run_notes

    monkeypatch.setenv("MEGATRONISH_DEVICE", "cpu")
    for backend in ("auto", "flash", "fused", "unfused", "local"):
        cfg = configs_from_args(parse_args(BASE + ["--train-iters", "2", "--attention-backend", backend]), 1)
        assert cfg.model.attention.attention_backend == backend
        notes = [n for n in run_notes(cfg) if n.startswith("--attention-backend")]
        if backend in ("flash", "fused"):
            assert notes == [f"--attention-backend {backend}: SDPA's {backend} kernels need CUDA (this is cpu); "
                             "running as auto"]
        else:
            assert notes == []
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--attention-backend", "magic"])


@pytest.mark.parametrize("make", [gpt2, llama], ids=["LayerNorm", "RMSNorm"])
def test_layernorm_1p_is_the_norm_with_weight_plus_one(make):
    """Same seed: the 1p model's norm weights start at 0 where the plain model's start at 1, every other tensor
    is the same, and the two compute the same loss and gradients."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, seq_length=16,
              attention_dropout=0.0, hidden_dropout=0.0)
    set_random_seed(4)
    one_p = GPTModel(make(**kw, apply_layernorm_1p=True))
    one_p.init_parameters(4)
    norms = [n for n, _ in one_p.named_global_parameters() if "layernorm.weight" in n]
    assert len(norms) == 5 and all(not p.any() for n, p in one_p.named_global_parameters() if n in norms)
    ref_loss, ref_grads = _loss_and_grads(make(**kw))
    loss, grads = _loss_and_grads(make(**kw, apply_layernorm_1p=True))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")


def _cosine(n, lo, hi, warmup, decay):
    if n <= warmup:
        return hi * n / warmup
    return lo + (hi - lo) * 0.5 * (math.cos(math.pi * (n - warmup) / (decay - warmup)) + 1)


@pytest.mark.parametrize("untie", [False, True])
def test_decoupled_lr_schedules_embedding_and_output_layer(untie):
    argv = BASE + ["--global-batch-size", "2", "--train-iters", "20", "--lr-warmup-iters", "4", "--lr-decay-style",
                   "cosine", "--min-lr", "1e-4", "--decoupled-lr", "5e-3", "--decoupled-min-lr", "4e-4"]
    cfg = configs_from_args(parse_args(argv + (["--untie-embeddings-and-output-weights"] if untie else [])), 1)
    model = GPTModel(cfg.model)
    opt = get_megatron_optimizer([DistributedDataParallel(model)], cfg.optim)
    sched = OptimizerParamScheduler(opt, **scheduler_steps_from_config(cfg))
    own = {id(model.embedding.word_embeddings.weight)} | (
        {id(model.output_layer.weight)} if untie else set())
    for it in range(21):
        n = it * 2  # samples
        for group in opt.param_groups:
            decoupled = {id(p) for p in group["params"]} & own
            assert not decoupled or decoupled == {id(p) for p in group["params"]}  # own groups only
            lo, hi = (4e-4, 5e-3) if decoupled else (1e-4, 1e-3)
            assert group["lr"] == pytest.approx(_cosine(n, lo, hi, 8, 40), rel=1e-9, abs=1e-15), (it, decoupled)
        assert sched.lr == pytest.approx(_cosine(n, 1e-4, 1e-3, 8, 40))  # what the log line shows
        sched.step(increment=2)
    assert sum(len(g["params"]) for g in opt.param_groups if g.get("is_decoupled_lr")) == len(own)
    # without --decoupled-min-lr the decoupled schedule ends at --min-lr
    cfg = configs_from_args(parse_args(argv[:-2]), 1)
    opt = get_megatron_optimizer([DistributedDataParallel(GPTModel(cfg.model))], cfg.optim)
    assert {g["min_lr"] for g in opt.param_groups if g.get("is_decoupled_lr")} == {1e-4}


def test_decoupled_lr_bad_values_are_one_line():
    argv = BASE + ["--global-batch-size", "2", "--train-iters", "20"]
    with pytest.raises(ConfigError, match="^--decoupled-min-lr needs --decoupled-lr"):
        validate_args(parse_args(argv + ["--decoupled-min-lr", "1e-4"]), 1)
    with pytest.raises(ConfigError, match="^--decoupled-lr 0.0001 must be >= --decoupled-min-lr"):
        validate_args(parse_args(argv + ["--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-3"]), 1)


# ------------------------------------------------------------------ the loop: garbage collection, allocator cache
class _Recorder:
    def __init__(self, real):
        self.real, self.events = real, []

    def __getattr__(self, name):
        def call(*args):
            self.events.append(name)
            return getattr(self.real, name)(*args)
        return call


def _loop_events(rank, world, argv):
    import gc

    from megatronish import device
    from megatronish.parallel import groups
    from megatronish.training import evaluate as evaluation
    from megatronish.training import pretrain as loop

    groups.destroy_model_parallel()
    rec = _Recorder(gc)
    loop.gc = evaluation.gc = rec  # the loop's collections and those around evaluations
    emptied = []
    device.empty_cache = lambda: emptied.append(1)
    argv = BASE + ["--global-batch-size", "2", "--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1",
                   "--log-interval", "100"] + argv
    state = loop.pretrain(configs_from_args(parse_args(argv), world)).state
    return rec.events, len(emptied), gc.isenabled(), len(state.history)


def test_manual_gc_and_empty_unused_memory():
    cases = [[], ["--manual-gc", "--manual-gc-interval", "2"],
             ["--manual-gc", "--manual-gc-interval", "2", "--no-manual-gc-eval"], ["--manual-gc"],
             ["--empty-unused-memory-level", "1"], ["--empty-unused-memory-level", "2"]]
    def runs(rank, world):
        import gc

        gc.freeze()  # the collections the loop asks for scan what it builds, not the heap inherited through fork
        return [_loop_events(rank, world, argv) for argv in cases]

    (off, gc2, gc2_no_eval, gc0, mem1, mem2), = run_distributed(runs, 1)
    assert off[0] == [] and off[1] == 0 and off[2]
    # disable + collect at the start; every 2nd iteration (2, 4, 6); before and after the evaluations at 3, at the
    # end, and of the test split after it (Megatron's "on test set")
    assert gc2[0] == ["disable"] + ["collect"] * 10 + ["enable"]
    assert gc2[2] and gc2[3] == 6
    assert gc2_no_eval[0] == ["disable", "collect", "collect", "collect", "collect", "enable"]
    assert gc0[0] == ["disable"] + ["collect"] * 7 + ["enable"]
    # level 1: after every backward (6) and every evaluation step (3, the test split's included); level 2: also
    # after every step (6)
    assert mem1[1] == 9 and mem2[1] == 15


def test_pytorch_profiler_writes_a_trace(tmp_path):
    argv = ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4",
            "--tensorboard-dir", str(tmp_path)]
    run_distributed(lambda r, w: _loop_events(r, w, argv), 1)
    traces = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".pt.trace.json")]
    assert len(traces) == 1, traces


def test_accepted_with_a_note():
    argv = BASE + ["--global-batch-size", "2", "--train-iters", "2"]
    cfg = configs_from_args(parse_args(argv + ["--fp8-param-gather", "--use-mcore-models",
                                               "--no-create-attention-mask-in-dataloader", "--tiktoken-pattern",
                                               "v2"]), 1)
    assert [n.split(":")[0] for n in cfg.train.notes] == ["--fp8-param-gather", "--use-mcore-models",
                                                          "--tiktoken-pattern v2"]
    assert cfg.data.tiktoken_pattern == "v2" and cfg.data.mmap_bin_files
    assert not configs_from_args(parse_args(argv + ["--no-mmap-bin-files"]), 1).data.mmap_bin_files
    with pytest.raises(ConfigError, match="--profile --use-pytorch-profiler writes its trace to --tensorboard-dir"):
        validate_args(parse_args(argv + ["--profile", "--use-pytorch-profiler"]), 1)
    with pytest.raises(ConfigError, match="--profile-step-start 5 must be >= 0 and below --profile-step-end 5"):
        validate_args(parse_args(argv + ["--profile", "--profile-step-start", "5", "--profile-step-end", "5"]), 1)
    with pytest.raises(ConfigError, match="--manual-gc-interval must be >= 0"):
        validate_args(parse_args(argv + ["--manual-gc", "--manual-gc-interval", "-1"]), 1)
