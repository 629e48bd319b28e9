"""Dropout under TP is deterministic for a seed and draws from Megatron's streams; activation
checkpointing replays the RNG so recomputed dropout (and hence every gradient) is identical."""
import torch

from megatronish.config import gpt2, llama
from megatronish.model import GPTModel
from megatronish.parallel import groups
from megatronish.parallel.context import ParallelContext
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.random import EXPERT_PARALLEL_RNG, checkpoint, get_rng_tracker, set_random_seed
from megatronish.testing import run_distributed

SEED, B, S, V = 77, 2, 16, 100


def _cfg(flavor, **kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=V, seq_length=S,
                attention_dropout=0.2, hidden_dropout=0.2)
    base.update(kw)
    return (gpt2 if flavor == "gpt2" else llama)(**base)


def _loss_and_grads(cfg, sp, seed=SEED):
    ctx = groups.get_context() if groups.is_initialized() else ParallelContext.single()
    set_random_seed(seed, tp_rank=ctx.tp_rank)
    model = GPTModel(cfg, sequence_parallel=sp, parallel=ctx)
    model.init_parameters(SEED)
    model.train()
    g = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    losses = []
    for _ in range(2):  # two microbatches: the streams must advance identically too
        loss = model(ids, labels=labels).mean()
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b, what):
    la, ga = a
    lb, gb = b
    assert torch.equal(la, lb), f"{what}: losses differ {la} vs {lb}"
    for n in ga:
        assert torch.equal(ga[n], gb[n]), f"{what}: grad {n} differs"


def _check(flavor, sp):
    cfg = _cfg(flavor)
    plain = _loss_and_grads(cfg, sp)
    _assert_same(plain, _loss_and_grads(cfg, sp), f"{flavor} sp={sp} same seed")
    other = _loss_and_grads(cfg, sp, seed=SEED + 1)
    assert not torch.equal(plain[0], other[0]), "a different seed must give different dropout"
    no_dropout = _loss_and_grads(_cfg(flavor, attention_dropout=0.0, hidden_dropout=0.0), sp)
    assert not torch.allclose(plain[0], no_dropout[0]), "dropout must be active"
    for method, n in (("uniform", 2), ("uniform", 3), ("block", 1)):
        ckpt = _loss_and_grads(_cfg(flavor, recompute_granularity="full", recompute_method=method,
                                    recompute_num_layers=n), sp)
        _assert_same(plain, ckpt, f"{flavor} sp={sp} recompute {method}/{n}")


def test_streams_follow_megatron_seeds():
    set_random_seed(1000, pp_rank=2, tp_rank=1)  # default stream: 1000 + 100*2
    tracker = get_rng_tracker()
    a = torch.rand(4)
    torch.manual_seed(1200)
    assert torch.equal(a, torch.rand(4)), "default stream must be seed + 100 * pp_rank"
    set_random_seed(1000, pp_rank=2, tp_rank=1)
    with tracker.fork():
        b = torch.rand(4)
    torch.manual_seed(1200 + 2718 + 1)
    assert torch.equal(b, torch.rand(4)), "model-parallel stream must be seed + 2718 + tp_rank"
    # the expert-parallel stream: seed + 1024 + 100 * ep_rank + expert-TP rank
    set_random_seed(1000, pp_rank=2, tp_rank=1, ep_rank=3, etp_rank=0)
    with tracker.fork(EXPERT_PARALLEL_RNG):
        c = torch.rand(4)
    torch.manual_seed(1200 + 1024 + 300 + 0)
    assert torch.equal(c, torch.rand(4)), "expert-parallel stream must be seed + 1024 + 100 * ep_rank + etp_rank"
    # forking does not disturb the default stream
    set_random_seed(1000, pp_rank=2, tp_rank=1)
    with tracker.fork():
        torch.rand(10)
    torch.manual_seed(1200)
    assert torch.equal(torch.rand(4), a)


def test_checkpoint_function_replays_dropout():
    set_random_seed(3)
    x = torch.randn(6, 5, requires_grad=True)
    w = torch.randn(5, 5, requires_grad=True)

    def f(h):
        return torch.nn.functional.dropout(h @ w, p=0.5, training=True).tanh()

    state = torch.get_rng_state()
    f(x).sum().backward()
    ref_x, ref_w = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch.set_rng_state(state)
    checkpoint(f, x).sum().backward()
    assert torch.equal(x.grad, ref_x) and torch.equal(w.grad, ref_w)


def test_dropout_and_recompute_single_process():
    _check("gpt2", False)


def _worker(rank, world):
    groups.initialize_model_parallel(ParallelDims(world_size=world, tp=2))
    tp_rank = groups.get_tensor_model_parallel_rank()
    for flavor in ("gpt2", "llama"):
        for sp in (False, True):
            _check(flavor, sp)
    # the model-parallel stream differs across TP ranks, the default stream does not
    set_random_seed(SEED, tp_rank=tp_rank)
    default = torch.rand(8)
    with get_rng_tracker().fork():
        mp = torch.rand(8)
    both = [torch.zeros(2, 8) for _ in range(2)]
    torch.distributed.all_gather(both, torch.stack([default, mp]), group=groups.get_tensor_model_parallel_group())
    assert torch.equal(both[0][0], both[1][0]) and not torch.equal(both[0][1], both[1][1])
    return True


def test_dropout_and_recompute_under_tp():
    assert all(run_distributed(_worker, 2))
