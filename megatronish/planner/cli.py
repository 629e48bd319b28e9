"""``megatronish-plan``: ``pretrain_gpt.py``'s flags plus ``--world-size N`` (the launcher's world size) and the
planner's own (``--gpu``, ``--gpus-per-node``, ``--hardware-file``, ``--json``, ``--plot``, ``--search`` and its
``--search-top-k``, ``--search-stack``, ``--search-async-tp``). Every problem the real
launch would report is printed at once (one ``error:`` line each, exit 2); otherwise the plan: memory per pipeline
stage, step time, throughput and MFU (docs/planner.md). No process group is started."""
from __future__ import annotations

import argparse
import json
import sys

from ..arguments import build_parser, configs_from_args, exit_on_config_error
from ..errors import ConfigError
from .hardware import KINDS, load_hardware
from .plan import format_plan, make_plan, plot_plan
from .search import LAYOUT_FIELDS, STACKS, format_search, search

PLANNER_FLAGS = ("world_size", "gpu", "gpus_per_node", "hardware_file", "json", "plot", "search", "search_top_k",
                 "search_stack", "search_async_tp")


def build_plan_parser() -> argparse.ArgumentParser:
    p = build_parser(prog="megatronish-plan", description="Plan a pretrain_gpt.py run: validate the layout, "
                                                           "predict memory per rank and step time.")
    g = p.add_argument_group("planner")
    g.add_argument("--world-size", type=int, required=True, help="the number of processes the launch would start")
    g.add_argument("--gpu", default="H100-SXM", help=f"accelerator: {', '.join(KINDS)} (default H100-SXM)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per NVLink domain (default: the GPU's)")
    g.add_argument("--hardware-file", default=None, help="TOML overriding the accelerator's numbers")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    g.add_argument("--plot", default=None, metavar="FILE", help="draw memory per stage as a PNG (needs matplotlib)")
    g.add_argument("--search", action="store_true", help="rank every valid layout of the model on this world size "
                                                          "and global batch by predicted tokens/s")
    g.add_argument("--search-top-k", type=int, default=5, help="layouts --search prints (default 5)")
    g.add_argument("--search-stack", choices=tuple(STACKS), default="megatron",
                   help="whose choices --search makes: megatron (ours: none / distributed optimizer / FSDP2, "
                        "micro-batch 1-8 with gradient accumulation, Megatron's selective recompute) or torchtitan "
                        "(FSDP2, the DP rank's batch as one microbatch or under PP split per stage, its per-op "
                        "selective checkpointing, its loss and torch.distributed.pipelining)")
    g.add_argument("--search-async-tp", action="store_true",
                   help="--search prices TP with asynchronous TP (the forward passes' TP collectives hidden)")
    return p


def plan_from_argv(argv=None) -> tuple[dict, dict]:
    """Parse, validate (raises the run's :class:`~megatronish.errors.ConfigError` listing every problem) and plan;
    returns the plan and the planner's own options (:data:`PLANNER_FLAGS`)."""
    ns = build_plan_parser().parse_args(argv)
    mine = {k: getattr(ns, k) for k in PLANNER_FLAGS}
    for k in PLANNER_FLAGS:
        delattr(ns, k)
    cfg = configs_from_args(ns, mine["world_size"])
    hw = load_hardware(mine["gpu"], mine["gpus_per_node"], mine["hardware_file"])
    if mine["search_top_k"] < 1:
        raise ConfigError(f"--search-top-k must be >= 1, got {mine['search_top_k']}")
    if mine["search"]:
        res = search(cfg, hw, mine["search_top_k"], STACKS[mine["search_stack"]], tp_overlap=mine["search_async_tp"])
        return {"search": res, "hw": hw, "cfg": cfg}, mine
    return make_plan(cfg, hw), mine


def main(argv=None) -> None:
    plan, opts = exit_on_config_error(lambda: plan_from_argv(argv))
    if opts["search"]:
        print(format_search(plan["search"], plan["hw"], [("the given layout", plan["cfg"], LAYOUT_FIELDS)]))
        return
    if opts["json"]:
        json.dump(plan, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(format_plan(plan))
    if opts["plot"] and not plot_plan(plan, opts["plot"]):
        print(f"note: --plot {opts['plot']}: matplotlib is not installed; no picture", file=sys.stderr)


__all__ = ["main", "build_plan_parser", "plan_from_argv"]
