"""``--profile``: torch.profiler or the CUDA profiler over a range of iterations, as Megatron-LM does."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import device

__all__ = ["Profiler"]


class Profiler:
    """``--profile``: iterations ``[--profile-step-start, --profile-step-end)`` of the ranks in ``--profile-ranks``,
    with torch.profiler (``--use-pytorch-profiler``: a TensorBoard trace in ``--tensorboard-dir``) or the CUDA
    profiler (``nsys ... --capture-range=cudaProfilerApi``), as Megatron-LM does."""

    def __init__(self, cfg):
        t = cfg.train
        self.on = t.profile and dist.get_rank() in t.profile_ranks
        self.start_step, self.end_step, self.torch_profiler = t.profile_step_start, t.profile_step_end, None
        self.cuda = self.on and not t.use_pytorch_profiler and device.device_type() == "cuda"
        if self.on and t.use_pytorch_profiler:
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(self.start_step - 1, 0),
                                                 warmup=1 if self.start_step > 0 else 0,
                                                 active=self.end_step - self.start_step, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(cfg.logging.tensorboard_dir),
                record_shapes=True, with_stack=True)
            self.torch_profiler.start()

    def before_iteration(self, iteration: int) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif self.cuda and iteration == self.start_step:
            device.cuda_profiler(True)

    def after_iteration(self, iteration: int) -> None:
        if iteration != self.end_step:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        elif self.cuda:
            device.cuda_profiler(False)

