"""Flag groups around the run: checkpointing and exit, data and tokenizer, logging."""
from __future__ import annotations

from ._group import flag, on
from .not_yet import TOKENIZER_TYPES


def add_checkpoint_flags(p) -> None:
    """Saving, loading and when to exit."""
    g = p.add_argument_group("checkpointing and exit")
    flag(g, "--save", default=None, help="directory to save checkpoints to")
    flag(g, "--load", default=None, help="directory to resume from (its latest complete checkpoint), or a Hugging "
         "Face model directory to start from (its config.json gives the model flags)")
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                   help="save every N iterations")
    flag(g, "--save-hf", default=None, help="also write the model as a Hugging Face directory here "
         "(DIR/iter_XXXXXXX, DIR/latest)")
    flag(g, "--save-hf-interval", type=int, default=None,
         help="write --save-hf every N iterations (default: at every checkpoint save) and at the end")
    flag(g, "--async-save", **on, help="write checkpoints in the background while training continues")
    flag(g, "--no-save-optim", **on, help="leave the optimizer state out of saved checkpoints")
    flag(g, "--no-save-rng", **on, help="leave the RNG states out of saved checkpoints")
    flag(g, "--no-load-optim", **on, help="do not load the optimizer state (nor the LR/WD schedule position)")
    flag(g, "--no-load-rng", **on, help="do not load the RNG states")
    flag(g, "--finetune", **on, help="load the model only: iteration 0, fresh optimizer, schedule and RNG")
    flag(g, "--exit-on-missing-checkpoint", **on, help="with --load: a missing checkpoint is an error")
    flag(g, "--use-checkpoint-args", **on, help="take the model-shape flags from the --load checkpoint")
    flag(g, "--no-verify-checkpoint", **on, help="skip the CRC-32 check of the checkpoint data read on load")
    flag(g, "--ckpt-format", default="torch_dist",
         choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
         help="checkpoint format (only torch_dist is available)")
    flag(g, "--exit-signal-handler", **on, help="on --exit-signal: finish the iteration, save, exit 0")
    flag(g, "--exit-signal", default="SIGTERM", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"])
    flag(g, "--exit-duration-in-mins", type=int, default=None, help="save and exit after this many minutes")
    flag(g, "--exit-interval", type=int, default=None, help="save and exit after an iteration divisible by this")


def add_data_flags(p) -> None:
    """Datasets and the tokenizer."""
    g = p.add_argument_group("data and tokenizer")
    flag(g, "--mock-data", **on, help="synthetic, learnable data (no files)")
    flag(g, "--data-path", nargs="*", default=None, help="prefix, or weight prefix weight prefix ...")
    flag(g, "--split", default=None, help="train, valid, test weights (default '969, 30, 1')")
    flag(g, "--train-data-path", nargs="*", default=None, help="training prefixes (instead of --data-path/--split)")
    flag(g, "--valid-data-path", nargs="*", default=None)
    flag(g, "--test-data-path", nargs="*", default=None)
    flag(g, "--data-cache-path", default=None)
    flag(g, "--num-workers", type=int, default=2)
    flag(g, "--tokenizer-type", default=None, choices=list(TOKENIZER_TYPES))
    flag(g, "--vocab-file", default=None)
    flag(g, "--merge-file", default=None)
    flag(g, "--tokenizer-model", default=None)
    flag(g, "--vocab-size", type=int, default=None, help="NullTokenizer: token ids 0..N-1, eod N")
    flag(g, "--vocab-extra-ids", type=int, default=0)
    flag(g, "--eod-mask-loss", **on)
    flag(g, "--reset-position-ids", **on)
    flag(g, "--reset-attention-mask", **on)


def add_logging_flags(p) -> None:
    """Log line, metrics sinks, timers."""
    g = p.add_argument_group("logging")
    flag(g, "--log-interval", type=int, default=100)
    flag(g, "--log-throughput", **on)
    flag(g, "--log-params-norm", **on)
    flag(g, "--tensorboard-dir", default=None)
    flag(g, "--wandb-project", default="")
    flag(g, "--wandb-entity", default="")
    flag(g, "--wandb-exp-name", default="")
    flag(g, "--wandb-save-dir", default="")
    flag(g, "--mlflow-experiment-name", default=None,
         help="log to MLflow: the metrics file's scalars and the run's flags, in this experiment (made if new)")
    flag(g, "--mlflow-run-name", default=None, help="with --mlflow-experiment-name: the name of a new run")
    flag(g, "--mlflow-tracking-uri", default=None,
         help="with --mlflow-experiment-name: the tracking store (default $MLFLOW_TRACKING_URI, else the local "
              "file store file:<--save, else .>/mlruns)")
    flag(g, "--timing-log-level", type=int, default=0, choices=[0, 1, 2],
         help="0: iteration time; 1: + forward-backward, gradient reduction, optimizer; 2: + batch reading "
              "((min, max) over ranks each log interval)")
    flag(g, "--log-straggler", **on, help="each log interval: every rank's compute time; name the slowest rank")
    flag(g, "--straggler-minmax-count", type=int, default=1,
         help="with --log-straggler: how many fastest and slowest ranks to name")
    flag(g, "--metrics-file", default=None, help="JSON lines: one object per logged iteration and per evaluation")
    flag(g, "--pipeline-timeline", default=None,
         help="write a Chrome trace (Perfetto) of the last training iteration's pipeline events to this path")
    flag(g, "--report-plan", **on, help="(ours) rank 0 prints the layout planner's prediction for this run (memory "
         "per stage, step time, MFU) and, after the first --log-interval window, the measured step time and peak "
         "memory beside it (docs/planner.md)")
    flag(g, "--report-plan-gpu", default=None, metavar="KIND",
         help="(ours) with --report-plan: the planner's hardware (megatronish-plan --gpu's kinds; default the "
              "detected GPU, or cpu-this-machine without CUDA)")


