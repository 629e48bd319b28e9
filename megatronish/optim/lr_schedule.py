"""Learning-rate and weight-decay schedules with Megatron-LM's formulas, counted in samples.

The training loop calls ``scheduler.step(increment=global_batch_size)`` once per iteration, so every step count
below (warm-up, decay, WSD anneal, weight-decay increment) is a number of *samples*.

Learning rate at step ``n`` (``W`` warm-up steps, ``D`` decay steps, ``r = (n - W) / (D - W)``):

* warm-up (``W > 0`` and ``n <= W``): ``init + (max - init) * n / W``
* ``constant``: ``max``
* past the decay (``n > D``): ``min``
* ``inverse-square-root``: ``max(min, max * sqrt(max(W, 1)) / sqrt(max(n, 1)))``
* ``linear``: ``min + (max - min) * (1 - r)``
* ``cosine``: ``min + (max - min) * 0.5 * (cos(pi * r) + 1)``
* ``WSD`` (warm-up, stable, decay): ``max`` until ``D - S`` (``S`` = WSD decay steps), then with
  ``q = (n - (D - S)) / S`` a coefficient ``c`` of ``--lr-wsd-decay-style``: ``linear`` ``1 - q``,
  ``cosine`` ``0.5 * (cos(pi * q) + 1)``, ``exponential`` ``2 * 0.5**q - 1``, ``minus_sqrt`` ``1 - sqrt(q)``;
  lr = ``min + (max - min) * c``.

Weight decay at step ``n`` (``I`` increment steps): ``end`` past ``I``; ``constant`` -> ``end`` (= start);
``linear`` ``start + (end - start) * n / I``; ``cosine`` ``start + (end - start) * 0.5 * (cos(pi * (1 - n / I)) + 1)``.

Each parameter group gets ``lr = lr(n) * group.get("lr_mult", 1)`` and
``weight_decay = wd(n) * group.get("wd_mult", 1)`` (``wd_mult = 0`` for biases and norm weights). A group may also
carry its own ``max_lr`` / ``min_lr``.
"""
from __future__ import annotations

import math

from ..errors import ConfigError

__all__ = ["OptimizerParamScheduler", "scheduler_steps_from_args", "scheduler_steps_from_config",
           "LR_DECAY_STYLES", "WSD_DECAY_STYLES", "WD_INCR_STYLES"]

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every parameter group of ``optimizer`` (if any) at each step.

    ``optimizer`` may be ``None`` (pure schedule, e.g. for tests) and attached later with :meth:`attach`.
    Construction applies step 0 to the optimizer, as Megatron-LM does.
    """

    def __init__(self, optimizer=None, *, max_lr: float, min_lr: float, lr_warmup_steps: int | float,
                 lr_decay_steps: int | float, lr_decay_style: str, start_wd: float, end_wd: float,
                 wd_incr_steps: int | float, wd_incr_style: str, init_lr: float = 0.0,
                 wsd_decay_steps: int | float | None = None, lr_wsd_decay_style: str | None = None,
                 override_opt_param_scheduler: bool = False, use_checkpoint_opt_param_scheduler: bool = False):
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
                              "mutually exclusive; pass at most one")
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self._check()
        self.num_steps = 0
        self.step(0)

    # ------------------------------------------------------------------ checks
    def _check(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {self.lr_decay_style!r}: choose one of {', '.join(LR_DECAY_STYLES)}")
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ConfigError(f"--weight-decay-incr-style {self.wd_incr_style!r}: choose one of "
                              f"{', '.join(WD_INCR_STYLES)}")
        if self.min_lr < 0:
            raise ConfigError(f"--min-lr {self.min_lr} must be >= 0")
        if self.max_lr < self.min_lr:
            raise ConfigError(f"--min-lr {self.min_lr} is larger than --lr {self.max_lr}")
        if self.init_lr > self.max_lr:
            raise ConfigError(f"--lr-warmup-init {self.init_lr} is larger than --lr {self.max_lr}")
        if self.lr_decay_steps <= 0:
            raise ConfigError(f"the LR decay length must be > 0 samples, got {self.lr_decay_steps} "
                              "(--lr-decay-iters / --lr-decay-samples / --train-iters / --train-samples)")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"the LR warm-up length must be >= 0 samples, got {self.lr_warmup_steps}")
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise ConfigError(f"the LR warm-up ({self.lr_warmup_steps} samples) must be shorter than the LR decay "
                              f"({self.lr_decay_steps} samples); lower --lr-warmup-iters/--lr-warmup-samples/"
                              "--lr-warmup-fraction or raise --lr-decay-iters/--lr-decay-samples")
        if self.lr_decay_style == "WSD":
            if self.wsd_decay_steps is None or self.wsd_decay_steps <= 0:
                raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples) > 0")
            if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
                raise ConfigError(f"--lr-wsd-decay-style {self.lr_wsd_decay_style!r}: choose one of "
                                  f"{', '.join(WSD_DECAY_STYLES)}")
        if self.start_wd < 0:
            raise ConfigError(f"--start-weight-decay {self.start_wd} must be >= 0")
        if self.end_wd < self.start_wd:
            raise ConfigError(f"--end-weight-decay {self.end_wd} is smaller than --start-weight-decay "
                              f"{self.start_wd}; the weight-decay schedule only increases")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ConfigError(f"--weight-decay-incr-style constant needs --start-weight-decay {self.start_wd} == "
                              f"--end-weight-decay {self.end_wd}")
        if self.wd_incr_style != "constant" and (self.wd_incr_steps is None or self.wd_incr_steps <= 0):
            raise ConfigError(f"--weight-decay-incr-style {self.wd_incr_style} needs a positive increment length "
                              f"(from --train-iters or --train-samples), got {self.wd_incr_steps}")

    # ------------------------------------------------------------------ schedules
    def get_wd(self, step: int | float | None = None) -> float:
        """Weight decay at ``step`` samples (default: the current step)."""
        n = self.num_steps if step is None else step
        if self.wd_incr_style == "constant" or n > self.wd_incr_steps:
            return self.end_wd
        ratio = n / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, step: int | float | None = None, param_group: dict | None = None) -> float:
        """Learning rate at ``step`` samples (default: the current step), before the group's ``lr_mult``.

        ``param_group`` may override ``max_lr`` / ``min_lr``.
        """
        n = self.num_steps if step is None else step
        group = param_group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        warmup, decay = self.lr_warmup_steps, self.lr_decay_steps

        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1))
            return max(min_lr, lr)

        ratio = (n - warmup) / (decay - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable at max_lr, then anneal over the last wsd_decay_steps of the decay
            anneal_start = decay - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                q = (n - anneal_start) / self.wsd_decay_steps
                style = self.lr_wsd_decay_style
                if style == "linear":
                    coeff = 1.0 - q
                elif style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * q) + 1.0)
                elif style == "exponential":
                    coeff = 2.0 * math.pow(0.5, q) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(q)
        return min_lr + coeff * (max_lr - min_lr)

    # ------------------------------------------------------------------ stepping
    def attach(self, optimizer) -> None:
        """Attach ``optimizer`` and apply the current step's values to its parameter groups."""
        self.optimizer = optimizer
        self._apply()

    def step(self, increment: int | float = 1) -> None:
        """Advance by ``increment`` samples (the global batch size per iteration) and update the optimizer."""
        self.num_steps += increment
        self._apply()

    def _apply(self) -> None:
        if self.optimizer is None:
            return
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(param_group=group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    @property
    def lr(self) -> float:
        return self.get_lr()

    @property
    def weight_decay(self) -> float:
        return self.get_wd()

    # ------------------------------------------------------------------ state
    _HYPER = ("init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
              "wsd_decay_steps", "lr_wsd_decay_style", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")

    def state_dict(self) -> dict:
        sd = {name: getattr(self, name) for name in self._HYPER}
        sd["num_steps"] = self.num_steps
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the step count; hyper-parameters follow Megatron-LM's rule.

        By default a hyper-parameter that differs between this run and the checkpoint is an error;
        ``override_opt_param_scheduler`` keeps this run's values, ``use_checkpoint_opt_param_scheduler`` takes the
        checkpoint's.
        """
        for name in self._HYPER:
            if name not in state_dict:
                continue
            saved, current = state_dict[name], getattr(self, name)
            if self.override_opt_param_scheduler:
                continue
            if self.use_checkpoint_opt_param_scheduler:
                setattr(self, name, saved)
            elif saved != current:
                raise ConfigError(
                    f"LR scheduler {name} differs: checkpoint {saved!r}, this run {current!r}; pass "
                    "--override-opt_param-scheduler to keep this run's value or "
                    "--use-checkpoint-opt_param-scheduler to take the checkpoint's")
        self.num_steps = state_dict["num_steps"]
        self._apply()


def _steps(train_iters, train_samples, global_batch_size, lr_decay_iters, lr_decay_samples, lr_warmup_fraction,
           lr_warmup_iters, lr_warmup_samples, lr_wsd_decay_iters, lr_wsd_decay_samples):
    if train_iters:
        decay = (lr_decay_iters or train_iters) * global_batch_size
        wd_incr = train_iters * global_batch_size
        wsd = lr_wsd_decay_iters * global_batch_size if lr_wsd_decay_iters is not None else None
        warmup = lr_warmup_fraction * decay if lr_warmup_fraction is not None else lr_warmup_iters * global_batch_size
    elif train_samples:
        decay = lr_decay_samples or train_samples
        wd_incr = train_samples
        wsd = lr_wsd_decay_samples
        warmup = lr_warmup_fraction * decay if lr_warmup_fraction is not None else lr_warmup_samples
    else:
        raise ConfigError("pass --train-iters or --train-samples")
    return warmup, decay, wsd, wd_incr


def scheduler_steps_from_args(args) -> tuple:
    """``(warmup_steps, decay_steps, wsd_decay_steps, wd_incr_steps)`` in samples, by Megatron-LM's rules.

    With ``--train-iters``: decay = ``(--lr-decay-iters or --train-iters) * --global-batch-size``; warm-up =
    ``--lr-warmup-fraction * decay`` if given, else ``--lr-warmup-iters * --global-batch-size``; WSD decay =
    ``--lr-wsd-decay-iters * --global-batch-size``; WD increment = ``--train-iters * --global-batch-size``.
    With ``--train-samples``: the ``*-samples`` flags directly.
    """
    def g(name, default=None):
        return getattr(args, name, default)
    return _steps(g("train_iters"), g("train_samples"), g("global_batch_size"), g("lr_decay_iters"),
                  g("lr_decay_samples"), g("lr_warmup_fraction"), g("lr_warmup_iters", 0),
                  g("lr_warmup_samples", 0), g("lr_wsd_decay_iters"), g("lr_wsd_decay_samples"))


def scheduler_steps_from_config(cfg) -> dict:
    """Keyword arguments of :class:`OptimizerParamScheduler` (all but the optimizer) for a ``RunConfig``."""
    o, t = cfg.optim, cfg.train
    warmup, decay, wsd, wd_incr = _steps(
        None if t.train_samples else t.train_iters, t.train_samples, t.global_batch_size, o.lr_decay_iters,
        o.lr_decay_samples, o.lr_warmup_fraction, o.lr_warmup_iters, o.lr_warmup_samples, o.lr_wsd_decay_iters,
        o.lr_wsd_decay_samples)
    return dict(max_lr=o.lr, min_lr=o.min_lr, init_lr=o.lr_warmup_init, lr_warmup_steps=warmup,
                lr_decay_steps=decay, lr_decay_style=o.lr_decay_style, wsd_decay_steps=wsd,
                lr_wsd_decay_style=o.lr_wsd_decay_style, start_wd=o.start_weight_decay, end_wd=o.end_weight_decay,
                wd_incr_steps=wd_incr, wd_incr_style=o.weight_decay_incr_style,
                override_opt_param_scheduler=o.override_opt_param_scheduler,
                use_checkpoint_opt_param_scheduler=o.use_checkpoint_opt_param_scheduler)
