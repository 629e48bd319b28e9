"""Optimizer construction: AdamW or SGD from torch over parameter groups with and without weight decay.

As in Megatron, biases and 1-D parameters (norm weights) get no weight decay (``wd_mult = 0``); the LR/WD
scheduler sets each group's ``lr`` and ``weight_decay`` every step. Gradients are taken from the DDP
buffers (``main_grad``) when present.
"""
from __future__ import annotations

import torch

from .. import device
from .clip_grads import clip_grad_norm


def no_weight_decay(name: str, p: torch.Tensor) -> bool:
    return name.endswith(".bias") or p.dim() == 1


def param_groups(named_params) -> list[dict]:
    decay, no_decay = [], []
    for name, p in named_params:
        if p.requires_grad:
            (no_decay if no_weight_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
              {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params, optimizer: str = "adam", lr: float = 1e-4, weight_decay: float = 0.01,
                    adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_eps: float = 1e-8,
                    sgd_momentum: float = 0.9) -> torch.optim.Optimizer:
    """``--optimizer adam`` is AdamW (decoupled weight decay, as Megatron's Adam); fused on CUDA."""
    pgs = param_groups(named_params)
    for g in pgs:
        g["weight_decay"] = weight_decay * g["wd_mult"]
    if optimizer == "adam":
        extra = {"fused": True} if device.device_type() == "cuda" else {"foreach": True}
        return torch.optim.AdamW(pgs, lr=lr, betas=(adam_beta1, adam_beta2), eps=adam_eps, **extra)
    if optimizer == "sgd":
        return torch.optim.SGD(pgs, lr=lr, momentum=sgd_momentum)
    raise ValueError(f"--optimizer {optimizer!r}: choose adam or sgd")


def use_main_grads(optimizer: torch.optim.Optimizer) -> None:
    """Point each parameter's ``.grad`` at its reduced DDP gradient before ``optimizer.step()``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = getattr(p, "main_grad", None)
            if g is not None:
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)


__all__ = ["build_optimizer", "clip_grad_norm", "no_weight_decay", "param_groups", "use_main_grads"]
