"""Conversion between Hugging Face tensors and our global tensors (streaming, one entry at a time), and
between global tensors and a model at any parallel layout."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from ..config import ModelConfig
from ..parallel.init import split_global
from .hf_config import ConvertError
from .name_map import (
    PER_EXPERT,
    VOCAB_TENSORS,
    build_entries,
    expected_global_shapes,
    expert_layout,
    hf_shapes,
    pad_vocab,
)


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], where: str, vocab_rows: bool) -> None:
    got = tuple(t.shape)
    ok = got == shape or (vocab_rows and len(got) == len(shape) and got[1:] == shape[1:] and got[0] >= shape[0])
    if not ok:
        need = f"[>={shape[0]}, {', '.join(map(str, shape[1:]))}]" if vocab_rows else list(shape)
        raise ConvertError(f"{where}: tensor {name!r} has shape {list(got)}, the config needs {need}; the weights "
                           "do not match the config")


def hf_to_ours(get: Callable[[str], torch.Tensor], cfg: ModelConfig, arch: str, padded_vocab: int, *,
               prefix: str | None = None, experts: str = PER_EXPERT,
               where: str = "Hugging Face checkpoint") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield our ``(global name, tensor)`` in file order, reading HF tensors through ``get(name)`` only when
    needed (memory: one of our tensors and its sources). ``get`` raises ``KeyError`` for a missing tensor.
    ``experts``: the HF expert layout of MoE models (``name_map.PER_EXPERT`` or ``FUSED``)."""
    entries = build_entries(cfg, arch, padded_vocab, prefix, experts)
    ours = expected_global_shapes(cfg)
    expect = hf_shapes(entries, ours)
    for e in entries:
        srcs = []
        for name in e.hf:
            try:
                t = get(name)
            except KeyError:
                raise ConvertError(f"{where}: missing tensor {name!r} (needed for {e.ours}); the file does not "
                                   f"hold a complete {arch}") from None
            _check_shape(name, t, expect[name][0], where, e.ours in VOCAB_TENSORS)
            srcs.append(t)
        yield e.ours, e.to_ours(*srcs)
        del srcs


def ours_to_hf(items: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, arch: str, *,
               prefix: str | None = None, experts: str = PER_EXPERT,
               where: str = "checkpoint") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield HF ``(name, tensor)`` for our global tensors (in the order given; vocabulary rows past
    ``cfg.vocab_size`` dropped). Every tensor the map needs must come; others are an error. MoE experts are
    written in ``experts`` layout (default per expert, as ``save_pretrained`` and published checkpoints)."""
    entries = {e.ours: e for e in build_entries(cfg, arch, cfg.padded_vocab_size(), prefix, experts)}
    shapes = expected_global_shapes(cfg)
    seen = set()
    for name, t in items:
        e = entries.get(name)
        if e is None:
            raise ConvertError(f"{where}: unexpected tensor {name!r} for a {arch} of this config")
        _check_shape(name, t, (cfg.vocab_size, *shapes[name][1:]) if name in VOCAB_TENSORS else shapes[name],
                     where, name in VOCAB_TENSORS)
        seen.add(name)
        yield from zip(e.hf, e.to_hf(t))
    missing = [n for n in entries if n not in seen]
    if missing:
        raise ConvertError(f"{where}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                                                        if len(missing) > 1 else ""))


# ---- in memory ----------------------------------------------------------------------------------------------

def hf_state_dict_to_ours(sd: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: str,
                          tp: int = 1) -> dict[str, torch.Tensor]:
    """A HF state dict -> our global tensors (vocabulary padded for ``tp``); MoE experts in either layout
    (transformers 5's in-memory ``state_dict()`` is fused, files are per expert)."""
    prefix = None if arch != "GPT2LMHeadModel" or "transformer.wte.weight" in sd else ""
    return dict(hf_to_ours(sd.__getitem__, cfg, arch, cfg.padded_vocab_size(tp), prefix=prefix,
                           experts=expert_layout(sd)))


def ours_to_hf_state_dict(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: str,
                          experts: str = PER_EXPERT) -> dict[str, torch.Tensor]:
    return dict(ours_to_hf(tensors.items(), cfg, arch, experts=experts))


def load_into_model(model, tensors: Mapping[str, torch.Tensor], tp_rank: int = 0, tp: int = 1,
                    parallel=None) -> None:
    """Copy global tensors into a model chunk at tensor-parallel rank ``tp_rank`` of ``tp`` (or, with a
    ``parallel`` context, at its tensor-, expert- and expert-tensor-parallel ranks): each parameter takes its
    slice (``split_global`` with its ``TensorDesc``); vocabulary rows are padded or cut to the chunk's padded size
    (extra rows must be zero padding)."""
    if parallel is not None:
        tp_rank, tp = parallel.tp_rank, parallel.tp_size
    with torch.no_grad():
        for name, p in model.named_global_parameters():
            if name not in tensors:
                raise ConvertError(f"no tensor for parameter {name!r}")
            full = tensors[name]
            rows = p.desc.global_shape[0]
            if name in VOCAB_TENSORS and full.size(0) != rows:
                if full.size(0) > rows and full[rows:].any():
                    raise ConvertError(f"{name}: {full.size(0)} rows do not fit the model's padded vocabulary "
                                       f"({rows} rows)")
                full = pad_vocab(full[:rows], rows)
            if tuple(full.shape) != tuple(p.desc.global_shape):
                raise ConvertError(f"{name}: global shape {list(full.shape)}, the model needs "
                                   f"{list(p.desc.global_shape)}")
            if p.desc.expert and parallel is not None:
                p.copy_(split_global(p.desc, full.to(p.device), parallel.etp_rank, parallel.etp_size,
                                     parallel.ep_rank, parallel.ep_size))
            else:
                p.copy_(split_global(p.desc, full.to(p.device), tp_rank, tp))


def model_global_tensors(model) -> dict[str, torch.Tensor]:
    """Global tensors of a one-process (TP=1) model (tied output copies deduplicated)."""
    return {name: p.detach().clone() for name, p in model.named_global_parameters()}
