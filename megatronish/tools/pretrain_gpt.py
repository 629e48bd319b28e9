"""Pretrain a GPT model with Megatron-LM's flags: ``torchrun --nproc-per-node N pretrain_gpt.py <flags>``, or
``torchrun --nproc-per-node N --no-python megatronish-pretrain-gpt <flags>`` where the package is installed."""
import os

from ..arguments import configs_from_args, exit_on_config_error, parse_args


def main(argv=None):
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Every flag is validated here, before any process group starts; a bad flag is one line, exit 2.
    cfg = exit_on_config_error(lambda: configs_from_args(parse_args(argv), world_size), once_per_node=True)
    from ..planner.report import PlanReport
    from ..training.failure import run_rank
    from ..training.pretrain import pretrain
    from ..training.watchdog import Watch

    # A bad data file, tokenizer file or checkpoint is one line (once for the job), exit 2; a non-finite loss exits
    # 3, a lost peer 4; the other ranks stop within seconds (docs/reliability.md).
    # A collective that fails while every rank is alive: one line naming it and the rank that is elsewhere, every
    # rank's collectives in collectives-<attempt>.json beside the metrics file, else in --save, else here.
    metrics = cfg.logging.metrics_file
    report_dir = (os.path.dirname(metrics) or ".") if metrics else cfg.checkpoint.save
    report = exit_on_config_error(lambda: PlanReport.check(cfg), once_per_node=True)  # --report-plan
    watch = Watch()  # this process's rank watchdog: the run starts it, run_rank ends the job through it
    run_rank(lambda: pretrain(cfg, watch, report), watch=watch, report_dir=report_dir)

