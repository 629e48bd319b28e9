"""The default vocab-parallel cross entropy at TP = 1 against ``F.cross_entropy``: loss and logits gradient, across
its cache-sized token chunks (a ragged last chunk), with label smoothing, a padded vocabulary and 16-bit logits."""
import pytest
import torch
import torch.nn.functional as F

import megatronish.parallel.cross_entropy as ce


def _reference(logits, target, vocab, alpha, grad):
    x = logits[..., :vocab].detach().double().requires_grad_()
    loss = F.cross_entropy(x.reshape(-1, vocab), target.reshape(-1), reduction="none",
                           label_smoothing=alpha * vocab / (vocab - 1)).view(target.shape)
    loss.backward(grad.double())
    full = torch.zeros(logits.shape, dtype=torch.float64)
    full[..., :vocab] = x.grad
    return loss, full


@pytest.mark.parametrize("cache_bytes", [ce._CACHE_BYTES, 3 * 4 * 40])  # one chunk; 3 rows per chunk (ragged)
@pytest.mark.parametrize("alpha,vocab", [(0.0, 40), (0.1, 40), (0.0, 33), (0.2, 33)])
def test_matches_dense_cross_entropy(monkeypatch, cache_bytes, alpha, vocab):
    monkeypatch.setattr(ce, "_CACHE_BYTES", cache_bytes)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 2, 40, generator=g) * 4).requires_grad_()
    target = torch.randint(0, vocab, (5, 2), generator=g)
    grad = torch.rand(5, 2, generator=g)
    loss = ce.vocab_parallel_cross_entropy(logits, target, label_smoothing=alpha, vocab_size=vocab)
    loss.backward(grad)
    ref_loss, ref_grad = _reference(logits, target, vocab, alpha, grad)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    assert loss.dtype == torch.float32


def test_bf16_logits():
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(4, 3, 64, generator=g) * 3).bfloat16().requires_grad_()
    target = torch.randint(0, 64, (4, 3), generator=g)
    loss = ce.vocab_parallel_cross_entropy(logits, target)
    loss.sum().backward()
    ref_loss, ref_grad = _reference(logits.float(), target, 64, 0.0, torch.ones(4, 3))
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)  # the loss is computed in fp32
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-2, atol=1e-3)
