"""The training loop's state, in two kinds: what a checkpoint saves and restores (:class:`TrainCounters`:
iteration, consumed samples) and what one process keeps of the run (:class:`TrainState`: the counters plus the
loss histories and why training ended), apart from the run's live objects (:class:`TrainContext`, made by
:func:`megatronish.training.initialize.setup`; no part of the state). ``pretrain`` returns both, a
:class:`TrainResult`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Union

if TYPE_CHECKING:
    import torch

    from ..checkpoint.manager import Checkpointer
    from ..config import RunConfig
    from ..convert.hf_save import HFExport
    from ..data.blending import BlendedDataset
    from ..data.gpt_dataset import GPTDataset
    from ..data.mock import MockGPTDataset
    from ..model.gpt import GPTModel
    from ..optim.lr_schedule import OptimizerParamScheduler
    from ..optim.optimizer import MegatronOptimizer
    from ..optim.post_validation import PostValidation
    from ..parallel.context import ParallelContext
    from ..parallel.ddp import DistributedDataParallel
    from ..parallel.fsdp import FullyShardedDataParallel
    from ..parallel.random import RNGStatesTracker
    from ..precision.fp8 import Fp8Manager
    from ..precision.te_layers import TeManager
    from .compile import Compiler
    from .memory import ActivationMeter
    from .rerun import RerunMachine
    from .timers import Timers

    Dataset = Union[MockGPTDataset, GPTDataset, BlendedDataset]

__all__ = ["TrainCounters", "TrainState", "TrainContext", "TrainResult", "StepResult"]


@dataclass
class TrainCounters:
    """What a checkpoint saves and restores of the loop (``--load`` resumes from them)."""

    iteration: int = 0
    consumed_samples: int = 0
    valid_consumed_samples: int = 0  # evaluations continue through the validation set, as Megatron's do


@dataclass
class TrainState(TrainCounters):
    """The counters, and what this process keeps of the run for its callers (not checkpointed)."""

    history: list = field(default_factory=list)  # (iteration, lm loss) of every iteration, for callers
    valid_history: list = field(default_factory=list)
    test_history: list = field(default_factory=list)  # (iteration, lm loss) of the test-split evaluation at the end
    exit_reason: str | None = None  # set when --exit-interval / --exit-duration-in-mins / a signal ended training


@dataclass
class TrainContext:
    """The run's live objects, made by ``setup`` (callers of ``pretrain`` reach them through
    ``TrainResult.context``)."""

    models: list[GPTModel]  # this rank's model chunks (virtual pipeline stages)
    chunks: list[DistributedDataParallel | FullyShardedDataParallel]  # the same chunks, wrapped for data parallelism
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler | None = None
    fp8: Fp8Manager | TeManager | None = None  # under --fp8-format / --transformer-impl (its state is checkpointed)
    memory: ActivationMeter | None = None  # the activation estimate and the first iteration's measurement
    parallel: ParallelContext | None = None  # the degrees and this rank's process groups
    cfg: RunConfig | None = None
    schedule: Callable[..., list[dict]] | None = None  # the pipeline schedule, bound to its dtype and context
    forward_step: Callable | None = None  # Megatron's forward_step(data_iterator, model) -> (output, loss_func)
    train_ds: Dataset | None = None
    valid_ds: Dataset | None = None
    test_ds: Dataset | None = None  # --split's third share or --test-data-path: evaluated once at the end
    timers: Timers | None = None  # --timing-log-level, --log-straggler
    checkpointer: Checkpointer | None = None
    device: torch.device | None = None
    compiler: Compiler | None = None  # under --torch-compile
    rng_tracker: RNGStatesTracker | None = None  # the RNG streams of the model and the checkpoint
    rerun: RerunMachine | None = None  # --rerun-mode and the spike and gradient-norm checks (training/rerun.py)
    hf_export: HFExport | None = None  # under --save-hf: when and how the model is written for transformers
    post_validation: PostValidation | None = None  # --enable-optimizer-post-validation: the step awaiting validation


@dataclass
class TrainResult:
    """What ``pretrain`` returns: the loop's state at the end and the run's live objects (models, optimizer, ...)."""

    state: TrainState
    context: TrainContext


@dataclass
class StepResult:
    loss: float
    update_successful: bool
    grad_norm: float | None
    global_batch_size: int = 0  # samples of this iteration (ramping under --rampup-batch-size)
    moe: dict | None = None  # mixture of experts: moe_stats.step_metrics
    mtp: dict | None = None  # multi-token prediction: each depth's loss, {"mtp_<k> loss": value}
