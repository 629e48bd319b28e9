"""The training optimizer: AdamW or SGD over fp32 *main* parameters, in three layouts.

:func:`get_megatron_optimizer` builds ONE :class:`MegatronOptimizer` over all model chunks (DDP-wrapped):

- fp32 model: the main parameters are the model parameters; their gradients are the DDP buffers
  (``param.main_grad``).
- 16-bit model (``--bf16`` / ``--fp16``): each model parameter has an fp32 master copy (the main parameter);
  its gradient is the DDP buffer (fp32 with ``--accumulate-allreduce-grads-in-fp32``, otherwise cast to fp32),
  the step updates the master copy, and the result is copied back (rounded) into the model parameter.
  ``--fp16`` adds a loss scaler (:mod:`.grad_scaler`): the schedules multiply the loss by
  :meth:`MegatronOptimizer.scale_loss`, the step unscales the main gradients and checks them for inf/NaN
  (a MAX all-reduce over the model-parallel group, every rank agrees); an overflow skips the step.
- distributed (``--use-distributed-optimizer``, ZeRO-1): DDP reduce-scatters each bucket; this DP rank owns the
  contiguous ``1/DP`` range of every bucket (:meth:`DistributedDataParallel._Bucket.shard`) and keeps fp32 main
  parameters and Adam/SGD states only for the pieces of parameters inside it (for an fp32 model a piece is a
  view of the model parameter). The step updates the pieces, writes them into the model's param buffer and
  all-gathers every bucket. Overflow checks and the grad norm reduce over the whole world (DP shards are
  disjoint; TP replicas and the tied-embedding copy are counted once).
- FSDP2 (``--use-torch-fsdp2``, :mod:`megatronish.parallel.fsdp`): the fp32 model parameters are DP-sharded
  ``DTensor``s; each main parameter is this rank's local shard (a view) and its gradient the reduced local gradient
  shard; norms and overflow checks reduce over the whole world, as for the distributed optimizer. The checkpoint
  state of a parameter is shaped like its local shard.

Step order (Megatron's): gradients -> (fp16) unscale + inf check, scaler update, skip on overflow -> grad norm
over all main gradients, clip (``max_norm / (norm + 1e-6)``) -> skip if the norm is not finite -> inner step ->
copy main params to the model (and all-gather). :meth:`MegatronOptimizer.step` returns
``(update_successful, grad_norm)``.

As in Megatron, biases and 1-D parameters (norm weights) get no weight decay (``wd_mult = 0``); the LR/WD
scheduler sets each group's ``lr`` and ``weight_decay`` every step. With ``--decoupled-lr`` the word embedding and
the output layer (parameters marked ``is_embedding_or_output_parameter``) form groups of their own whose
``max_lr`` / ``min_lr`` are ``--decoupled-lr`` / ``--decoupled-min-lr`` (default ``--min-lr``): the same schedule
shape between other end points (Megatron's param-group overrides). AdamW is torch's: fused on CUDA and CPU,
foreach elsewhere (apex is never needed). The checkpoint interface (``sharded_param_state`` & co.) is documented on the
methods; every state tensor it returns is fp32 and shaped like the model parameter (this rank's TP shard).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from .. import device
from ..parallel import comm_log as comm
from ..parallel.context import ParallelContext
from .clip_grads import (
    clip_coefficient,
    clip_grad_norm,
    counts_once,
    grad_of,
    local_sum_of_squares,
    model_sum_of_squares_terms,
    reduce_sums,
    total_of,
)


def no_weight_decay(name: str, p: torch.Tensor) -> bool:
    return name.endswith(".bias") or p.dim() == 1


def param_groups(named_params) -> list[dict]:
    decay, no_decay = [], []
    for name, p in named_params:
        if p.requires_grad:
            (no_decay if no_weight_decay(name, p) else decay).append(p)
    groups_ = [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
               {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0}]
    return [g for g in groups_ if g["params"]]


def _torch_optimizer(pgs: list[dict], optimizer: str, lr: float, weight_decay: float, adam_beta1: float,
                     adam_beta2: float, adam_eps: float, sgd_momentum: float) -> torch.optim.Optimizer:
    for g in pgs:
        g["weight_decay"] = weight_decay * g["wd_mult"]
    if optimizer == "adam":
        # torch's fused AdamW runs on CUDA and (torch >= 2.4) CPU: one kernel per tensor list instead of a dozen
        # foreach passes over memory, about 6x faster on CPU; other devices keep the foreach path
        extra = {"fused": True} if device.device_type() in ("cuda", "cpu") else {"foreach": True}
        return torch.optim.AdamW(pgs, lr=lr, betas=(adam_beta1, adam_beta2), eps=adam_eps, **extra)
    if optimizer == "sgd":
        return torch.optim.SGD(pgs, lr=lr, momentum=sgd_momentum)
    raise ValueError(f"--optimizer {optimizer!r}: choose adam or sgd")


def build_optimizer(named_params, optimizer: str = "adam", lr: float = 1e-4, weight_decay: float = 0.01,
                    adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_eps: float = 1e-8,
                    sgd_momentum: float = 0.9) -> torch.optim.Optimizer:
    """A bare torch optimizer over ``named_params`` (no DDP, no master weights): ``--optimizer adam`` is AdamW
    (decoupled weight decay, as Megatron's Adam); fused on CUDA and CPU. Training uses
    :func:`get_megatron_optimizer`."""
    return _torch_optimizer(param_groups(named_params), optimizer, lr, weight_decay, adam_beta1, adam_beta2,
                            adam_eps, sgd_momentum)


def use_main_grads(optimizer: torch.optim.Optimizer) -> None:
    """Point each parameter's ``.grad`` at its reduced DDP gradient before ``optimizer.step()``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = getattr(p, "main_grad", None)
            if g is not None:
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)


# ---------------------------------------------------------------------------------------------------------------
# The training optimizer
# ---------------------------------------------------------------------------------------------------------------
class _Slot:
    """One main parameter: the model parameter it belongs to and the flat range ``[lo, hi)`` of it that it
    covers (the whole parameter unless distributed)."""

    __slots__ = ("model", "main", "lo", "hi", "whole", "chunk")

    def __init__(self, model, main, lo, hi, whole, chunk):
        self.model, self.main, self.lo, self.hi, self.whole, self.chunk = model, main, lo, hi, whole, chunk

    def grad_source(self) -> torch.Tensor:
        g = self.model.main_grad
        return g if self.whole else g.view(-1)[self.lo:self.hi]


_REPLICA_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                  "shared_embedding", "is_embedding_or_output_parameter")


class MegatronOptimizer:
    """See the module docstring. Build with :func:`get_megatron_optimizer`."""

    def __init__(self, chunks, *, optimizer: str = "adam", lr: float = 1e-4, weight_decay: float = 0.01,
                 adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_eps: float = 1e-8,
                 sgd_momentum: float = 0.9, clip_grad: float = 1.0, grad_scaler=None,
                 use_distributed_optimizer: bool = False, parallel: ParallelContext | None = None,
                 decoupled_lr: float | None = None, decoupled_min_lr: float | None = None, min_lr: float = 0.0):
        self.chunks = list(chunks)
        self.parallel = parallel or ParallelContext.single()
        self.clip_grad = clip_grad
        self.grad_scaler = grad_scaler
        self.timers = None  # the training loop's timers (megatronish.training.timers), set by the loop
        self.distributed = use_distributed_optimizer
        self.kind = optimizer
        named = [(n, p) for c in self.chunks for n, p in _module(c).named_parameters() if p.requires_grad]
        self.model_params = [p for _, p in named]
        # a mixture-of-experts model (every rank knows from its config): expert weights need their own reductions
        configs = [getattr(_module(c), "config", None) for c in self.chunks]  # None: not a GPT model chunk
        self.has_experts = any(m is not None and m.moe.num_experts for m in configs)
        dtypes = {p.dtype for p in self.model_params}
        if len(dtypes) > 1:
            raise ValueError(f"all model parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.params_dtype = dtypes.pop() if dtypes else torch.float32
        self.float16 = self.params_dtype != torch.float32
        if self.distributed and not all(getattr(c, "use_distributed_optimizer", False) for c in self.chunks):
            raise ValueError("the distributed optimizer needs every chunk wrapped in DistributedDataParallel("
                             "use_distributed_optimizer=True)")
        # FSDP2 chunks (--use-torch-fsdp2): the fp32 parameters are DP-sharded already; each main parameter is this
        # rank's local shard (a view: the step updates the model in place), the gradient its reduced shard
        self.fsdp = any(getattr(c, "fsdp", False) for c in self.chunks)
        if self.fsdp and (self.distributed or self.float16):
            raise ValueError("FSDP2 chunks take neither the distributed optimizer nor 16-bit model parameters "
                             "(FSDP2 keeps fp32 shards and computes in 16 bits through its mixed-precision policy)")
        self.sharded = self.distributed or self.fsdp  # DP ranks hold disjoint gradient pieces

        self.slots: list[_Slot] = []
        self.slot_of: dict[int, _Slot] = {}
        decay, no_decay, decoupled_decay, decoupled_no_decay = [], [], [], []
        for ci, chunk in enumerate(self.chunks):
            for name, p in _module(chunk).named_parameters():
                if not p.requires_grad:
                    continue
                slot = self._make_slot(chunk, ci, p)
                if slot is None:
                    continue
                self.slots.append(slot)
                self.slot_of[id(p)] = slot
                own = decoupled_lr is not None and getattr(p, "is_embedding_or_output_parameter", False)
                if no_weight_decay(name, p):
                    (decoupled_no_decay if own else no_decay).append(slot.main)
                else:
                    (decoupled_decay if own else decay).append(slot.main)
        decoupled = {"max_lr": decoupled_lr, "min_lr": min_lr if decoupled_min_lr is None else decoupled_min_lr,
                     "is_decoupled_lr": True}
        pgs = [g for g in ({"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
                           {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0},
                           {"params": decoupled_decay, "wd_mult": 1.0, "lr_mult": 1.0, **decoupled},
                           {"params": decoupled_no_decay, "wd_mult": 0.0, "lr_mult": 1.0, **decoupled})
               if g["params"]]
        if not pgs:  # a rank that owns no piece of anything (tiny model, large DP): keep the groups' shape
            pgs = [{"params": [], "wd_mult": 1.0, "lr_mult": 1.0}]
        self.optimizer = _torch_optimizer(pgs, optimizer, lr, weight_decay, adam_beta1, adam_beta2, adam_eps,
                                          sgd_momentum) if any(g["params"] for g in pgs) else _EmptyOptimizer(
            pgs, lr, weight_decay)
        self.state_keys = ("exp_avg", "exp_avg_sq") if optimizer == "adam" else (
            ("momentum_buffer",) if sgd_momentum else ())
        self._init_states()
        self.num_steps = 0  # successful inner steps
        self._main_loaded = False

    # ---- construction ------------------------------------------------------------------------------
    def _make_slot(self, chunk, ci: int, p) -> _Slot | None:
        if self.fsdp:
            from ..parallel.fsdp import local_shard

            local = local_shard(p)
            if local.numel() == 0:  # more DP ranks than rows: this rank holds none of it
                return None
            main = torch.nn.Parameter(local)
            _copy_attrs(p, main)
            return _Slot(p, main, 0, local.numel(), True, ci)
        if not self.distributed:
            if not self.float16:
                return _Slot(p, p, 0, p.numel(), True, ci)
            main = torch.nn.Parameter(p.detach().float().clone())
            _copy_attrs(p, main)
            return _Slot(p, main, 0, p.numel(), True, ci)
        bucket = chunk.bucket_of(p)
        shard_lo, shard_hi = bucket.shard()
        p_lo, p_hi = chunk.param_range[id(p)]
        lo, hi = max(p_lo - bucket.start, shard_lo), min(p_hi - bucket.start, shard_hi)
        if lo >= hi:
            return None
        lo, hi = lo - (p_lo - bucket.start), hi - (p_lo - bucket.start)  # relative to the parameter
        flat = p.detach().view(-1)[lo:hi]
        main = torch.nn.Parameter(flat if not self.float16 else flat.float().clone())
        _copy_attrs(p, main)
        return _Slot(p, main, lo, hi, False, ci)

    def _init_states(self) -> None:
        """Allocate the states now (zeros, step 0: what the first step would create), so that loading a
        checkpoint can copy into them and their memory is known up front."""
        fused = isinstance(self.optimizer, torch.optim.AdamW) and any(
            g.get("fused") or g.get("capturable") for g in self.optimizer.param_groups)
        for s in self.slots:
            st = self.optimizer.state[s.main]
            if self.kind == "adam":
                st["step"] = torch.zeros((), dtype=torch.float32, device=s.main.device if fused else None)
            for k in self.state_keys:
                st[k] = torch.zeros_like(s.main, memory_format=torch.preserve_format)

    # ---- the checkpoint contract ---------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _keys(self) -> tuple[str, ...]:
        return self.state_keys + (("main_param",) if self.float16 else ())

    def _slot_state(self, s: _Slot, key: str) -> torch.Tensor:
        return s.main.detach() if key == "main_param" else self.optimizer.state[s.main][key]

    def sharded_param_state(self) -> list[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]]:
        """``[(model param, {key: fp32 tensor shaped like it})]`` for every model parameter of this rank;
        keys ``exp_avg``/``exp_avg_sq`` (adam) or ``momentum_buffer`` (sgd with momentum), plus ``main_param``
        for a 16-bit model. Collective over DP for the distributed optimizer (the shards are all-gathered, so
        the result does not depend on the layout)."""
        keys = self._keys()
        if self.fsdp:  # shaped like this rank's local shard of the parameter
            return [(s.model, {k: self._slot_state(s, k).view_as(s.main) for k in keys}) for s in self.slots]
        if not self.distributed:
            return [(s.model, {k: self._slot_state(s, k).view_as(s.model) for k in keys}) for s in self.slots]
        out = []
        for ci, chunk in enumerate(self.chunks):
            for bucket in chunk.buckets:
                full = {k: self._gather_bucket(chunk, ci, bucket, k) for k in keys}
                for p in bucket.params:
                    lo, hi = chunk.param_range[id(p)]
                    out.append((p, {k: full[k][lo - bucket.start: hi - bucket.start].view_as(p) for k in keys}))
        return out

    def _gather_bucket(self, chunk, ci: int, bucket, key: str) -> torch.Tensor:
        shard_lo, shard_hi = bucket.shard()
        local = torch.zeros(shard_hi - shard_lo, dtype=torch.float32, device=bucket.buffer.device)
        for p in bucket.params:
            s = self.slot_of.get(id(p))
            if s is None or s.chunk != ci:
                continue
            at = chunk.param_range[id(p)][0] - bucket.start + s.lo - shard_lo
            local[at: at + s.hi - s.lo] = self._slot_state(s, key)
        full = torch.empty(bucket.buffer.numel(), dtype=torch.float32, device=local.device)
        if bucket.world == 1:
            full.copy_(local)
        else:
            comm.all_gather_single(full, local, group=bucket.group)
        return full

    def load_sharded_param_state(self, get) -> None:
        """Inverse of :meth:`sharded_param_state`: ``get(model param)`` returns the same keys, shaped like the
        parameter; the distributed optimizer takes its own range. Without ``main_param`` (a checkpoint of an
        fp32 run) the master copies are taken from the (loaded) model parameters."""
        with torch.no_grad():
            for s in self.slots:
                d = get(s.model)
                for k in self.state_keys:
                    src = d[k].reshape(-1)[s.lo:s.hi] if not s.whole else d[k]
                    dst = self.optimizer.state[s.main][k]
                    dst.copy_(src.reshape(dst.shape))
                if self.float16 and "main_param" in d:
                    src = d["main_param"].reshape(-1)[s.lo:s.hi] if not s.whole else d["main_param"]
                    s.main.copy_(src.reshape(s.main.shape))
                    self._main_loaded = True

    def scalar_state_dict(self) -> dict:
        return {"step": self.num_steps, "started": self.num_steps > 0,
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}

    def load_scalar_state_dict(self, d: dict) -> None:
        self.num_steps = int(d.get("step", 0))
        if self.kind == "adam":
            for s in self.slots:
                self.optimizer.state[s.main]["step"].fill_(float(self.num_steps))
        scaler = d.get("grad_scaler")
        if self.grad_scaler is not None and scaler:
            self.grad_scaler.load_state_dict(scaler)

    def reload_model_params(self, force: bool = False) -> None:
        """Copy the (loaded) model parameters into the fp32 master copies, unless a checkpoint's
        ``main_param`` state was loaded (``force`` copies anyway). Call after loading model weights."""
        if not self.float16 or (self._main_loaded and not force):
            return
        with torch.no_grad():
            for s in self.slots:
                src = s.model.detach() if s.whole else s.model.detach().view(-1)[s.lo:s.hi]
                s.main.copy_(src)

    # ---- training step -----------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What the schedules back-propagate: the loss times the current loss scale (fp16)."""
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale

    def _stats_group(self):
        """Where gradient statistics (norm, overflow) are summed: the model-parallel group, or with the
        distributed optimizer the whole world (its DP shards are disjoint)."""
        if self.parallel.world_size == 1:
            return None
        return dist.group.WORLD if self.sharded or self.has_experts else self.parallel.mp_group

    def prepare_grads(self) -> list[torch.Tensor]:
        grads = []
        for s in self.slots:
            g = s.grad_source()
            s.main.grad = g if g.dtype == torch.float32 else g.float()
            grads.append(s.main.grad)
        return grads

    def _found_inf(self, grads) -> bool:
        """Unscale ``grads`` in place by ``1/scale`` and report any inf/NaN anywhere (MAX all-reduce)."""
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
        if grads:
            inv = torch.full((), self.grad_scaler.inv_scale, dtype=torch.float32, device=found.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        group = self._stats_group()
        if group is not None and dist.get_world_size(group) > 1:
            found = found.to(_collective_device())
            comm.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    def grad_norm_terms(self) -> list[tuple[torch.Tensor, object]]:
        """This rank's sums of squared main gradients, each with the group it is summed over (the global norm is
        the square root of their total once summed): each element of the global model counted once."""
        if not self.sharded:
            if self.float16:  # 16-bit master copies, whole parameters: on the main grads
                main = {id(s.model): s.main for s in self.slots}
                params, of = [s.model for s in self.slots], (lambda p: main[id(p)].grad)
            else:  # the DDP buffers are the main grads
                params, of = self.model_params, grad_of
            return model_sum_of_squares_terms(of, params, self.parallel, self.has_experts)
        sq = local_sum_of_squares([s.main.grad for s in self.slots if counts_once(s.model, self.parallel)])
        group = self._stats_group()
        return [(sq.to(_collective_device()) if group is not None else sq, group)]

    def grad_norm(self) -> float:
        """Global L2 norm of the main gradients (:meth:`grad_norm_terms`, summed)."""
        terms = self.grad_norm_terms()
        reduce_sums(terms)
        return math.sqrt(total_of(terms).item())

    def step(self) -> tuple[bool, float | None]:
        """One optimizer step on the reduced gradients; returns ``(update_successful, grad_norm)``
        (``grad_norm`` is None when an fp16 overflow skipped the step)."""
        grads = self.prepare_grads()
        if self.grad_scaler is not None:
            found_inf = self._found_inf(grads)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.release_grads()
                return False, None
        norm = self.grad_norm()
        return self.apply_grads(grads, norm), norm

    def apply_grads(self, grads: list[torch.Tensor], norm: float) -> bool:
        """The step on the prepared main gradients ``grads`` whose global norm is ``norm``: clip
        (``max_norm / (norm + 1e-6)``), skip when the norm is not finite, step, copy to the model; returns whether
        the update was applied."""
        coeff = clip_coefficient(norm, self.clip_grad)
        if coeff is not None and grads:
            torch._foreach_mul_(grads, coeff)
        if not math.isfinite(norm):
            self.release_grads()
            return False
        self.optimizer.step()
        self.num_steps += 1
        self.release_grads()
        self.copy_main_to_model()
        return True

    def release_grads(self) -> None:
        for s in self.slots:
            s.main.grad = None

    def copy_main_to_model(self) -> None:
        with torch.no_grad():
            if self.float16:
                for s in self.slots:
                    dst = s.model.detach() if s.whole else s.model.detach().view(-1)[s.lo:s.hi]
                    dst.copy_(s.main.view_as(dst))
        if self.distributed:
            timer = self.timers("params-all-gather") if self.timers is not None else contextlib.nullcontext()
            with timer:  # --timing-log-level 1 (the gathers' start; their wait under --overlap-param-gather)
                for chunk in self.chunks:
                    chunk.start_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for outstanding parameter all-gathers (``--overlap-param-gather``): call before reading the
        model parameters outside a forward (saving, norms)."""
        for chunk in self.chunks:
            if hasattr(chunk, "finish_param_sync"):
                chunk.finish_param_sync()

    # ---- accounting --------------------------------------------------------------------------------
    def state_bytes(self, include_main_params: bool = True) -> int:
        """Bytes this rank holds for the optimizer: the states, plus fp32 master copies that are not the
        model parameters themselves."""
        total = 0
        for s in self.slots:
            total += sum(t.numel() * t.element_size() for k, t in self.optimizer.state[s.main].items()
                         if k in self.state_keys)
            if include_main_params and self.float16:
                total += s.main.numel() * s.main.element_size()
        return total


class _EmptyOptimizer:
    """Stands in for a torch optimizer on a rank that owns no parameter piece."""

    def __init__(self, pgs, lr, weight_decay):
        for g in pgs:
            g.setdefault("lr", lr)
            g["weight_decay"] = weight_decay * g["wd_mult"]
        self.param_groups = pgs
        self.state = {}

    def step(self):
        pass


def _module(chunk):
    return getattr(chunk, "module", chunk)


def _copy_attrs(src, dst) -> None:
    for a in _REPLICA_ATTRS:
        if hasattr(src, a):
            setattr(dst, a, getattr(src, a))


def _collective_device() -> torch.device:
    return device.current_device() if dist.get_backend() == "nccl" else torch.device("cpu")


def get_megatron_optimizer(chunks, optim_cfg, *, grad_scaler=None, use_distributed_optimizer: bool = False,
                           parallel: ParallelContext | None = None) -> MegatronOptimizer:
    """The run's optimizer over all DDP chunks, from an :class:`~megatronish.config.OptimizerConfig`."""
    o = optim_cfg
    return MegatronOptimizer(chunks, optimizer=o.optimizer, lr=o.lr, weight_decay=o.weight_decay,
                             adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                             sgd_momentum=o.sgd_momentum, clip_grad=o.clip_grad, grad_scaler=grad_scaler,
                             use_distributed_optimizer=use_distributed_optimizer, parallel=parallel,
                             decoupled_lr=o.decoupled_lr, decoupled_min_lr=o.decoupled_min_lr, min_lr=o.min_lr)


__all__ = ["MegatronOptimizer", "get_megatron_optimizer", "build_optimizer", "clip_grad_norm", "no_weight_decay",
           "param_groups", "use_main_grads"]
