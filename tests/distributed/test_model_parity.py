"""A GPT model split over TP ranks is the same model as on one process: logits, loss and every parameter
gradient (gathered to its global shape) equal the TP=1 model built from the same seed. No weights are
copied: layout-invariant initialization makes the models equal."""
import pytest
import torch

from megatronish.config import gpt2, llama
from megatronish.model import GPTModel
from megatronish.parallel import groups
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.init import gather_to_global
from megatronish.parallel.layers import allreduce_sequence_parallel_grads
from megatronish.parallel.mappings import gather_from_tensor_model_parallel_region
from megatronish.parallel.random import set_random_seed
from megatronish.testing import run_distributed

SEED, B, S, V = 1234, 2, 16, 100
FLAVORS = {
    "gpt2": lambda: gpt2(num_layers=4, hidden_size=64, num_attention_heads=8, vocab_size=V, seq_length=S,
                         attention_dropout=0.0, hidden_dropout=0.0),
    "llama": lambda: llama(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                           ffn_hidden_size=96, vocab_size=V, seq_length=S, attention_dropout=0.0,
                           hidden_dropout=0.0),
    "qk_layernorm": lambda: llama(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                                  kv_channels=16, ffn_hidden_size=96, vocab_size=V, seq_length=S,
                                  attention_dropout=0.0, hidden_dropout=0.0, qk_layernorm=True),
}


def _batch():
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def _run(model):
    """Logits (global vocab, true entries only), mean loss, and {global name: global grad}."""
    ids, labels = _batch()
    tp_group = model.parallel.tp_group
    logits = gather_from_tensor_model_parallel_region(model(ids).detach(), tp_group)[..., :V]
    loss = model(ids, labels=labels).mean()
    loss.backward()
    allreduce_sequence_parallel_grads(model, tp_group)
    grads = {n: gather_to_global(p.grad, p.desc, tp_group) for n, p in model.named_global_parameters()}
    return logits, loss.detach(), grads


def _reference(flavor):
    set_random_seed(SEED)
    model = GPTModel(FLAVORS[flavor]())
    model.init_parameters(SEED)
    return _run(model)


def _compare(flavor, sp, ref):
    set_random_seed(SEED, tp_rank=groups.get_tensor_model_parallel_rank())
    model = GPTModel(FLAVORS[flavor](), sequence_parallel=sp, parallel=groups.get_context())
    model.init_parameters(SEED)
    logits, loss, grads = _run(model)
    r_logits, r_loss, r_grads = ref
    what = f"{flavor} TP={groups.get_tensor_model_parallel_world_size()} SP={sp}"
    torch.testing.assert_close(loss, r_loss, rtol=1e-5, atol=0, msg=lambda m: f"{what} loss: {m}")
    torch.testing.assert_close(logits, r_logits, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} logits: {m}")
    assert grads.keys() == r_grads.keys(), what
    for name, g in grads.items():
        ref_g = r_grads[name]
        if g.shape != ref_g.shape:  # the vocabulary is padded further at higher TP: padding grads are zero
            assert torch.all(g[ref_g.shape[0]:] == 0), f"{what} {name}: padding rows got gradient"
            g = g[: ref_g.shape[0]]
            assert torch.all(ref_g[V:] == 0)
        torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} grad {name}: {m}")


def _worker(rank, world, tp, refs):
    groups.initialize_model_parallel(ParallelDims(world_size=world, tp=tp))
    for flavor, ref in refs.items():
        for sp in (False, True):
            _compare(flavor, sp, ref)
    return True


@pytest.fixture(scope="module")
def references():
    return {flavor: _reference(flavor) for flavor in FLAVORS}


@pytest.mark.parametrize("tp", [2, 4])
def test_model_tp_parity(tp, references):
    # world 4: TP=2 runs with two data-parallel replicas, TP=4 with one
    assert all(run_distributed(_worker, 4, tp, references))
