"""Flags -> configs: by field name (argparse dest == dataclass field), a rule only where the names differ."""
from __future__ import annotations

import dataclasses

from .. import config as configs
from ..errors import ConfigError
from ..parallel.dims import ParallelDims
from ..parallel.pipeline.layout import LayoutError, parse_layout
from ..parallel_config import check_layout_mtp, parallel_dims, virtual_stages_from_layers
from .flag_checks import _missing_required


def _one_or_list(value):
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _recompute_modules(args):
    """``--recompute-modules``; Megatron's ``--moe-layer-recompute`` adds ``moe`` (to the default ``core_attn``)."""
    modules = None if args.recompute_modules is None else tuple(args.recompute_modules)
    if not args.moe_layer_recompute:
        return modules
    modules = ("core_attn",) if modules is None else modules
    return modules if "moe" in modules else modules + ("moe",)


def _rules(args, load_resolved: tuple[str, int | None] | None = None) -> dict[type, dict]:
    """The config fields whose value is not the flag of the same name: a renamed flag or Megatron's rule (and
    the ``--load`` checkpoint that ``--use-checkpoint-args`` resolved)."""
    constant_wd = args.weight_decay_incr_style == "constant"
    return {
        configs.ModelConfig: dict(
            # Megatron uses --num-query-groups only under --group-query-attention (None: one group per head)
            num_query_groups=args.num_query_groups if args.group_query_attention else None,
            recompute_granularity="selective" if args.recompute_activations or args.moe_layer_recompute
            else args.recompute_granularity,
            recompute_modules=_recompute_modules(args),
            transformer_impl=args.transformer_impl or "local",
            # Megatron: one load-balancing type (and coefficient) given as a list of one is that value
            moe_router_load_balancing_type=_one_or_list(args.moe_router_load_balancing_type),
            moe_aux_loss_coeff=_one_or_list(args.moe_aux_loss_coeff),
        ),
        configs.OptimizerConfig: dict(
            start_weight_decay=args.weight_decay if constant_wd else args.start_weight_decay,
            end_weight_decay=args.weight_decay if constant_wd else args.end_weight_decay,
            loss_scale_window=int(args.loss_scale_window) if float(args.loss_scale_window).is_integer()
            else args.loss_scale_window,  # not whole: reported by _flag_problems
            # Megatron: bf16 accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16
            accumulate_allreduce_grads_in_fp32=(not args.grad_reduce_in_bf16) if args.bf16
            else args.accumulate_allreduce_grads_in_fp32,
        ),
        configs.TrainingConfig: dict(notes=_notes(args)),
        configs.DataConfig: dict(data_path=list(args.data_path or []),
                         split=args.split if args.split is not None else configs.DataConfig.split,
                         vocab_size_flag=args.vocab_size),
        configs.CheckpointConfig: dict(load_resolved=load_resolved, load_hf=_is_hf_dir(args.load)),
    }


def _is_hf_dir(path) -> bool:
    from ..checkpoint.layout import is_hf_model_dir

    return is_hf_model_dir(path)


def _notes(args) -> list[str]:
    """One log line per flag that is accepted but does something different here (printed once at set-up)."""
    notes = []
    if args.fp8_param_gather:
        notes.append("--fp8-param-gather: parameters are kept and all-gathered in their own dtype; the FP8 linears "
                     "cast them on use (same training, twice the all-gather bytes of FP8 parameters)")
    if args.use_mcore_models:
        notes.append("--use-mcore-models: accepted; it is the only model here (the flag is deprecated in "
                     "Megatron-LM)")
    if args.vocab_size is not None and args.tokenizer_type not in (None, "NullTokenizer", "TikTokenizer"):
        notes.append(f"--vocab-size {args.vocab_size}: not used by --tokenizer-type {args.tokenizer_type} (the "
                     "vocabulary is the tokenizer's, as in Megatron-LM)")
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        notes.append(f"--tiktoken-pattern {args.tiktoken_pattern}: used by TikTokenizer only (this run's tokenizer "
                     f"is {args.tokenizer_type or 'the default'}), as in Megatron-LM")
    if args.cache_mla_latents:
        notes.append("--cache-mla-latents: chooses how text generation attends from multi-latent attention's "
                     "latent cache; training does not use it (as in Megatron-LM)")
    if args.mock_data and args.split is not None:
        notes.append(f"--split {args.split}: --mock-data draws its own synthetic samples for training and "
                     "validation; there is no corpus to split")
    return notes


def _from_flags(cls, args, rules: dict, **init_only):
    """``cls`` with every field taken from the flag of the same name, or from ``rules``; a group of the model
    config (``ModelConfig.moe``, ...) is built the same way from its own fields' flags."""
    kw = {}
    for f in dataclasses.fields(cls):
        if cls is configs.ModelConfig and f.name in configs.GROUPS:
            kw[f.name] = _from_flags(configs.GROUPS[f.name], args, rules)
        elif f.name in rules:
            kw[f.name] = rules[f.name]
        elif hasattr(args, f.name):
            kw[f.name] = getattr(args, f.name)
        else:
            raise TypeError(f"{cls.__name__}.{f.name} has no flag of that name and no rule in arguments._rules")
    return cls(**kw, **init_only)


def _virtual_stages(args) -> int:
    """Virtual stages per pipeline rank from either virtual-pipeline flag or the layout's stage count (1 without
    them)."""
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    if per_stage is not None and per_rank is not None:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are "
                          "mutually exclusive; pass one")
    layout, pp = args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size
    if layout is not None:
        given = "--num-layers-per-virtual-pipeline-stage" if per_stage is not None else \
            "--num-virtual-stages-per-pipeline-rank" if per_rank is not None else None
        if given:  # Megatron-LM: at most one of the three
            raise ConfigError(f"--pipeline-model-parallel-layout sets the virtual stages (its stage count / "
                              f"--pipeline-model-parallel-size); drop {given}")
        stages = _layout_stages(args)
        if args.pipeline_schedule in ("zbv", "dualpipev") and stages not in (None, 2 * pp):
            raise ConfigError(f"--pipeline-schedule {args.pipeline_schedule} runs 2 chunks per pipeline rank in a V, "
                              f"so --pipeline-model-parallel-layout needs 2 x --pipeline-model-parallel-size {pp} = "
                              f"{2 * pp} stages; it has {stages}")
        return _layout_vp(args)
    if per_rank is not None:
        return per_rank
    if per_stage is not None and (args.decoder_first_pipeline_num_layers is not None
                                  or args.decoder_last_pipeline_num_layers is not None):
        raise ConfigError("--num-layers-per-virtual-pipeline-stage assumes an even layer split; with "
                          "--decoder-first/last-pipeline-num-layers give --num-virtual-stages-per-pipeline-rank")
    if per_stage is not None:
        extra = int(args.account_for_embedding_in_pipeline_split) + int(args.account_for_loss_in_pipeline_split)
        return virtual_stages_from_layers(args.num_layers, pp, per_stage, extra)
    return 2 if args.pipeline_schedule in ("zbv", "dualpipev") else 1  # two chunks per rank, in a V


def _layout_stages(args) -> int | None:
    """The stage count of ``--pipeline-model-parallel-layout`` (None: no layout, or one ``ParallelDims`` rejects)."""
    if args.pipeline_model_parallel_layout is None:
        return None
    try:
        return len(parse_layout(args.pipeline_model_parallel_layout))
    except LayoutError:
        return None


def _layout_vp(args) -> int:
    """Virtual stages per rank that the layout gives (1 where it gives none: ``ParallelDims`` names the problem)."""
    stages, pp = _layout_stages(args), args.pipeline_model_parallel_size
    return stages // pp if stages is not None and pp >= 1 and stages % pp == 0 else 1


def _cp_inner(args) -> int | None:
    """The all-to-all level of ``--cp-comm-type a2a+p2p``: ``--hierarchical-context-parallel-sizes``' first size
    when the pair multiplies to ``--context-parallel-size`` (else None: ``checks`` names the flags)."""
    sizes = args.hierarchical_context_parallel_sizes
    if "a2a+p2p" not in args.cp_comm_type or sizes is None or len(sizes) != 2 or min(sizes) < 1 \
            or sizes[0] * sizes[1] != args.context_parallel_size:
        return None
    return sizes[0]


def _parallel_dims(args, world_size: int, errors: list[str]) -> ParallelDims | None:
    try:
        vp = _virtual_stages(args)
    except ConfigError as e:
        errors.append(str(e))
        vp = _layout_vp(args)
    try:
        dims = parallel_dims(world_size=world_size, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, vp=vp, cp=args.context_parallel_size,
                            ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                            # the last stage holds the word embedding when the output layer is tied to it or
                            # multi-token prediction looks tokens up there
                            tie_embeddings=not args.untie_embeddings_and_output_weights or bool(args.mtp_num_layers),
                            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                            cp_inner=_cp_inner(args),
                            pipeline_schedule=args.pipeline_schedule,
                            decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
                            decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
                            pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
                            account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
                            account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split)
        check_layout_mtp(dims, args.mtp_num_layers)
    except ConfigError as e:
        errors.append(str(e))
        return None
    return dims


@dataclasses.dataclass
class _Draft:
    """The configs built from the flags before validation. ``model`` is built unchecked (its problems are
    listed with the others) with a placeholder vocabulary; ``model``/``parallel`` are None when the flags
    cannot make one (a required flag missing, impossible degrees: already reported), and then ``run`` is None."""

    model: configs.ModelConfig | None
    parallel: ParallelDims | None
    train: configs.TrainingConfig
    optim: configs.OptimizerConfig
    logging: configs.LoggingConfig
    data: configs.DataConfig
    checkpoint: configs.CheckpointConfig
    sequence_parallel_flag: bool
    hierarchical_cp_sizes: list | None = None  # --hierarchical-context-parallel-sizes as given
    run: configs.RunConfig | None = None

    def __post_init__(self):
        if self.run is None and self.model is not None and self.parallel is not None:
            self.run = configs.RunConfig(model=self.model, parallel=self.parallel, train=self.train,
                                         optim=self.optim, logging=self.logging, data=self.data,
                                         checkpoint=self.checkpoint, sequence_parallel_flag=self.sequence_parallel_flag)
        if self.run is not None:
            self.train = self.run.train  # with the derived batch values filled in

    @classmethod
    def of(cls, cfg: configs.RunConfig) -> "_Draft":
        dims = cfg.parallel
        sizes = None if dims.cp_inner is None else [dims.cp_inner, dims.cp_outer]
        return cls(cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.logging, cfg.data, cfg.checkpoint,
                   cfg.sequence_parallel_flag, sizes, run=cfg)


def _draft(args, world_size: int, errors: list[str], load_resolved=None) -> _Draft:
    rules = _rules(args, load_resolved)
    parallel = _parallel_dims(args, world_size, errors)
    model = None
    if not _missing_required(args):
        model = _from_flags(configs.ModelConfig, args, {**rules[configs.ModelConfig], "vocab_size": 1}, check=False)

    def built(cls):
        return _from_flags(cls, args, rules.get(cls, {}))

    return _Draft(model=model, parallel=parallel, train=built(configs.TrainingConfig),
                  optim=built(configs.OptimizerConfig), logging=built(configs.LoggingConfig),
                  data=built(configs.DataConfig), checkpoint=built(configs.CheckpointConfig),
                  sequence_parallel_flag=args.sequence_parallel,
                  hierarchical_cp_sizes=args.hierarchical_context_parallel_sizes)
