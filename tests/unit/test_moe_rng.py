"""The expert RNG stream: Megatron's ``seed + 1024 + 100 * ep_rank + etp_rank`` (after the pipeline offset)."""
import torch

from megatronish.parallel.random import EXPERT_PARALLEL_RNG, MODEL_PARALLEL_RNG, get_rng_tracker, set_random_seed


def _draw(stream):
    with get_rng_tracker().fork(stream):
        return torch.rand(4)


def _expected(seed):
    return torch.rand(4, generator=torch.Generator().manual_seed(seed))


def test_expert_stream_seed():
    for pp, tp, ep, etp in [(0, 0, 0, 0), (1, 1, 3, 0), (2, 0, 1, 1)]:
        set_random_seed(1000, pp_rank=pp, tp_rank=tp, ep_rank=ep, etp_rank=etp)
        s = 1000 + 100 * pp
        assert torch.equal(_draw(EXPERT_PARALLEL_RNG), _expected(s + 1024 + 100 * ep + etp))
        assert torch.equal(_draw(MODEL_PARALLEL_RNG), _expected(s + 2718 + tp))
    # without an expert-TP rank the TP rank stands in (expert-TP size defaults to the TP size)
    set_random_seed(7, tp_rank=1, ep_rank=2)
    assert torch.equal(_draw(EXPERT_PARALLEL_RNG), _expected(7 + 1024 + 201))
