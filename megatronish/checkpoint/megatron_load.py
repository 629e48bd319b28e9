"""``--load <Megatron checkpoint>``: resume from (or fine-tune) a Megatron-LM checkpoint at any layout.

megatron-core ``torch_dist``: each rank asks DCP for its slices of the stored global tensors (a layer is an index
into the stacked key, :mod:`.megatron_format`), so a checkpoint saved at any TP/PP loads at any other with no
offline step. The optimizer state is loaded when it is stored per parameter in the model's shape
(``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<key>``: Megatron's non-distributed optimizer, or the
distributed optimizer saved ``fully_reshardable``), with the step, the LR scheduler position, the iteration and
the consumed samples. Other optimizer layouts are tied to the saving run's layout: ``--no-load-optim``.

Legacy (``mp_rank_XX``) checkpoints: every rank reads the files of the pipeline stages holding its layers and
takes its slices (model only).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.init import split_global, split_ranks
from . import dcp_io
from .common import check_model_config
from .dcp_io import CheckpointError, Piece, Sharded
from .megatron_format import TorchDist, model_fields, stored_arg
from .megatron_legacy import Legacy
from .state import Entries, tp_pieces

# our optimizer state key -> Megatron's names for it (fp32_param: Float16Optimizer; param: distributed optimizer
# saved fully_reshardable)
_OPT_KEYS = {"main_param": ("fp32_param", "param")}


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def _find_step(common: dict) -> int:
    """The optimizer step: ``state.common_step`` (megatron-core's optimizers) or a param group's ``step``
    (the distributed optimizer), possibly one ``optimizer`` level down (Float16Optimizer)."""
    opt = common.get("optimizer") or {}
    for holder in (opt, opt.get("optimizer") if isinstance(opt, dict) else None):
        if isinstance(holder, dict):
            st = holder.get("state")
            if isinstance(st, dict) and st.get("common_step") is not None:
                return int(st["common_step"])
            for group in holder.get("param_groups") or []:
                if isinstance(group, dict) and group.get("step") is not None:
                    return int(group["step"])
    return 0


def load_megatron(ckpt, state, iter_dir: str, kind: str) -> bool:
    """Load the Megatron checkpoint ``iter_dir`` into ``ckpt``'s model (and optimizer, scheduler, ``state``)."""
    ck = ckpt.ck
    src = TorchDist(iter_dir) if kind == "torch_dist" else Legacy(iter_dir)
    if src.args is None and kind == "torch_dist":
        # saved with megatron-core's dist_checkpointing alone: the stored global shapes are checked per tensor
        _log(f"WARNING: {src.where} stores no args; the model shape is checked tensor by tensor only")
    else:
        check_model_config({"model": model_fields(src.args, src.where)}, ckpt.cfg.model, iter_dir)
    vocab_rows = src.shape("embedding.word_embeddings.weight")
    if vocab_rows is not None and vocab_rows[0] < ckpt.cfg.model.vocab_size:
        raise CheckpointError(f"Megatron checkpoint {iter_dir} has {vocab_rows[0]} vocabulary rows, this run's "
                              f"tokenizer has {ckpt.cfg.model.vocab_size}; use the tokenizer it was trained with")
    release = bool(str(iter_dir).rstrip("/").endswith("release"))
    fresh = ck.finetune or release
    if kind == "legacy":
        if not fresh and not ck.no_load_optim and ckpt.opt is not None:
            raise CheckpointError(f"{iter_dir}: optimizer state of a legacy (--ckpt-format torch) Megatron checkpoint "
                                  "is not read; pass --no-load-optim (or --finetune)")
        _load_legacy(ckpt, src)
    else:
        load_optim = not fresh and not ck.no_load_optim and ckpt.opt is not None
        _load_torch_dist(ckpt, src, load_optim)
    if not fresh:
        state.iteration = src.iteration
        state.consumed_samples = int(stored_arg(src.args, "consumed_train_samples", 0) or 0)
        state.valid_consumed_samples = int(stored_arg(src.args, "consumed_valid_samples", 0) or 0)
    _log(f"loaded Megatron {kind} checkpoint {iter_dir} (iteration {src.iteration}"
         + (", model only" if fresh or ck.no_load_optim else "") + "); RNG states are derived from --seed")
    return True


def _load_torch_dist(ckpt, src: TorchDist, load_optim: bool) -> None:
    entries = Entries()
    param_state = None
    if load_optim:
        param_state = ckpt.opt.sharded_param_state()
        got = {id(p): states for p, states in param_state}
    for name, p in ckpt.named:
        key, layer = src.key_of(name)
        if key not in src.tensor_keys:
            raise CheckpointError(f"Megatron checkpoint {src.iter_dir} has no tensor {key!r} (needed for {name})")
        tensors = {"": p.data}
        if param_state is not None:
            for k, t in got[id(p)].items():
                prefix = next((f"optimizer.state.{m}." for m in _OPT_KEYS.get(k, (k,))
                               if f"optimizer.state.{m}.{key}" in src.tensor_keys), None)
                if prefix is None:
                    if k == "main_param":  # an fp32 run: the master copy is the model weight
                        prefix = ""
                    else:
                        prefix = f"optimizer.state.{k}."
                        raise CheckpointError(
                            f"Megatron checkpoint {src.iter_dir} has no optimizer state {prefix + key!r} (its "
                            "optimizer state is not stored per parameter: a distributed-optimizer checkpoint saved "
                            "dp_reshardable is tied to its layout); pass --no-load-optim")
                tensors[(prefix, k)] = t
        for which, t in tensors.items():
            prefix = which[0] if which else ""
            desc = p.desc
            resizable = desc.valid_rows is not None
            for pc in tp_pieces(t, desc, *split_ranks(desc, ckpt.parallel)):
                if layer is None:
                    entries.add(prefix + key, Sharded(desc.global_shape, [Piece(pc.tensor, pc.offsets)], resizable))
                else:
                    stored = tuple(src.tensor_keys[prefix + key].size)
                    entries.add(prefix + key, Sharded((stored[0], *desc.global_shape),
                                                      [Piece(pc.tensor.unsqueeze(0), (layer, *pc.offsets))]))
    for key, entry in entries.items():
        stored = tuple(src.tensor_keys[key].size)
        if key.startswith("optimizer.") and stored != tuple(entry.global_shape) and not entry.resizable_rows:
            raise CheckpointError(f"Megatron checkpoint {src.iter_dir} stores {key!r} as {list(stored)}, not in the "
                                  f"parameter's shape {list(entry.global_shape)} (an optimizer layout tied to the "
                                  "saving run); pass --no-load-optim")
        dcp_io.check_shape(key, stored, entry)
    dcp_io.load(entries, src.iter_dir, process_group=ckpt._group, verify=not ckpt.ck.no_verify_checkpoint)
    if param_state is not None:
        ckpt.opt.load_sharded_param_state(lambda p: got[id(p)])
        ckpt.opt.load_scalar_state_dict({"step": _find_step(src.common), "started": True})
        sched = src.common.get("opt_param_scheduler")
        if ckpt.scheduler is not None and isinstance(sched, dict):
            ckpt.scheduler.load_state_dict(sched)


def _load_legacy(ckpt, src: Legacy) -> None:
    with torch.no_grad():
        for name, p in ckpt.named:
            full = src.read(name)
            rows = p.desc.global_shape[0]
            if p.desc.valid_rows is not None and full.size(0) != rows:
                fixed = torch.zeros((rows, *full.shape[1:]), dtype=full.dtype)
                n = min(rows, full.size(0))
                fixed[:n] = full[:n]
                full = fixed
            if tuple(full.shape) != tuple(p.desc.global_shape):
                raise CheckpointError(f"Megatron checkpoint tensor for {name} in {src.iter_dir} has global shape "
                                      f"{list(full.shape)}, this run's model needs {list(p.desc.global_shape)}")
            p.data.copy_(split_global(p.desc, full, *split_ranks(p.desc, ckpt.parallel)))
