"""Loss scaling for ``--fp16`` (Megatron's ``ConstantGradScaler`` / ``DynamicGradScaler`` rule).

The loss is multiplied by ``scale`` before backward; the optimizer unscales the gradients (``* 1/scale``) into
the fp32 main gradients and checks them for inf/NaN (all-reduced so every rank agrees). An overflow skips the
step and calls :meth:`DynamicGradScaler.update` with ``found_inf=True``:

- overflow: ``growth_tracker = 0``; ``hysteresis_tracker -= 1``; when ``hysteresis_tracker <= 0`` the scale
  backs off: ``scale = max(scale * backoff_factor, min_scale)``. (Clean steps do not reset the hysteresis
  tracker; only a growth does, so after ``hysteresis`` overflows every further overflow backs off until the
  scale grows again.)
- clean step: ``growth_tracker += 1``; when it reaches ``growth_interval`` (``--loss-scale-window``):
  ``growth_tracker = 0``, ``hysteresis_tracker = hysteresis``, ``scale *= growth_factor``.

Defaults as Megatron builds it: ``--initial-loss-scale 2**32``, ``--min-loss-scale 1``, growth factor 2,
backoff 0.5, ``--loss-scale-window 1000``, ``--hysteresis 2``; ``--loss-scale X`` selects the constant scaler.
"""
from __future__ import annotations


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``); overflowing steps are still skipped."""

    def __init__(self, scale: float):
        if not scale > 0:
            raise ValueError(f"--loss-scale must be > 0, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        pass  # the constant comes from the command line


class DynamicGradScaler(ConstantGradScaler):
    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        super().__init__(initial_scale)
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale {min_scale} must be > 0 and <= --initial-loss-scale {initial_scale}")
        if not growth_factor > 1.0:
            raise ValueError("growth_factor must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError("backoff_factor must be in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"--loss-scale-window must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"--hysteresis must be >= 1, got {hysteresis}")
        self.min_scale, self.growth_factor, self.backoff_factor = float(min_scale), growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(fp16: bool, loss_scale: float | None = None, initial_loss_scale: float = 2.0 ** 32,
                      min_loss_scale: float = 1.0, loss_scale_window: int = 1000, hysteresis: int = 2):
    """None unless ``fp16`` (bf16 and fp32 train unscaled, as in Megatron)."""
    if not fp16:
        return None
    if loss_scale:
        return ConstantGradScaler(loss_scale)
    return DynamicGradScaler(initial_scale=initial_loss_scale, min_scale=min_loss_scale, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=loss_scale_window, hysteresis=hysteresis)
