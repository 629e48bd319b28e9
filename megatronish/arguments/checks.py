"""The configs' checks, one function per flag group: every problem is one line naming the flags."""
from __future__ import annotations

from typing import Callable

from .. import config as configs
from ..config import rampup_problems, rampup_steps
from ..errors import ConfigError
from ..parallel.dims import ParallelDims
from ..parallel_config import check_interleaving


def _collect(errors: list[str], check: Callable[[], None]) -> bool:
    """Run ``check``; append its :class:`ConfigError` to ``errors``. True when it passed."""
    try:
        check()
    except ConfigError as e:
        errors.append(str(e))
        return False
    return True


def _check_fsdp(o: configs.OptimizerConfig, m: configs.ModelConfig | None, errors: list[str],
                t: configs.TrainingConfig | None = None) -> None:
    if not o.use_torch_fsdp2:
        given = [f for f, on in (("--fsdp-reshard-after-forward", o.fsdp_reshard_after_forward != "default"),
                                 ("--fsdp-prefetch-layers", o.fsdp_prefetch_layers != 1)) if on]
        if given:
            errors.append(f"{' and '.join(given)} set FSDP2 options; add --use-torch-fsdp2 or drop them")
        return
    for flag, on in (("--overlap-grad-reduce", o.overlap_grad_reduce), ("--ddp-bucket-size", o.ddp_bucket_size)):
        if on:
            errors.append(f"{flag} is our DDP's; FSDP2 (--use-torch-fsdp2) reduce-scatters each layer's gradients "
                          "as its backward ends; drop the flag")
    if o.use_distributed_optimizer:
        errors.append("--use-torch-fsdp2 and --use-distributed-optimizer are mutually exclusive (FSDP2 shards the "
                      "optimizer state itself); pass one")
    if o.fsdp_prefetch_layers < 0:
        errors.append(f"--fsdp-prefetch-layers must be >= 0, got {o.fsdp_prefetch_layers}")
    if m is not None and m.moe.num_experts is not None:
        errors.append("--use-torch-fsdp2 with --num-experts: FSDP2 does not shard expert weights over expert-DP "
                      "yet (as in Megatron-LM); drop --use-torch-fsdp2 (use --use-distributed-optimizer)")
    if m is not None and m.precision.fp8 is not None:
        errors.append("--use-torch-fsdp2 with --fp8-format is not available yet; drop one of them")
    if t is not None and t.calculate_per_token_loss:
        errors.append("--use-torch-fsdp2 with --calculate-per-token-loss is not available yet (FSDP2 averages the "
                      "gradients it reduce-scatters); drop one of them")


def _check_batch(t: configs.TrainingConfig, run: configs.RunConfig | None, errors: list[str]) -> None:
    mbs, gbs = t.micro_batch_size, t.global_batch_size
    if mbs is not None and mbs < 1:
        errors.append(f"--micro-batch-size must be >= 1, got {mbs}")
        return
    if gbs is not None and gbs < 1:
        errors.append(f"--global-batch-size must be >= 1, got {gbs}")
        return
    if run is None or mbs is None:
        return
    dims, per_step = run.parallel, run.data_parallel_batch_size
    if gbs % per_step:
        errors.append(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel "
                      f"size {dims.dp} = {per_step}")
    elif dims.vp > 1 and not dims.v_shape:
        _collect(errors, lambda: check_interleaving(dims.pp, dims.vp, run.num_microbatches, micro_batch_size=mbs,
                                                    global_batch_size=gbs, data_parallel_size=dims.dp))
    elif dims.pipeline_schedule == "dualpipev" and run.num_microbatches < 2 * dims.pp:
        errors.append(f"--pipeline-schedule dualpipev needs at least 2 x --pipeline-model-parallel-size = "
                      f"{2 * dims.pp} microbatches per iteration, but --global-batch-size {gbs} / (--micro-batch-size "
                      f"{mbs} x data-parallel size {dims.dp}) is {run.num_microbatches}; raise --global-batch-size "
                      "or use --pipeline-schedule zbv")
    if t.rampup_batch_size is not None and not gbs % per_step:
        problems = rampup_problems(t.rampup_batch_size, gbs, per_step)
        errors += problems
        if not problems and dims.vp > 1 and not dims.v_shape:  # every ramp size must suit the interleaved schedule
            for b in sorted({b for _, b in rampup_steps(t.rampup_batch_size, gbs)}):
                if not _collect(errors, lambda b=b: check_interleaving(
                        dims.pp, dims.vp, b // per_step, micro_batch_size=mbs, global_batch_size=b,
                        data_parallel_size=dims.dp)):
                    break
        if not problems and dims.pipeline_schedule == "dualpipev":  # every ramp size needs 2 x PP microbatches
            smallest = min(b for _, b in rampup_steps(t.rampup_batch_size, gbs))
            if smallest // per_step < 2 * dims.pp:
                errors.append(f"--pipeline-schedule dualpipev needs at least 2 x --pipeline-model-parallel-size = "
                              f"{2 * dims.pp} microbatches per iteration, but --rampup-batch-size starts at a batch of "
                              f"{smallest} = {smallest // per_step} microbatches; start the ramp at "
                              f"{2 * dims.pp * per_step} or more, or use --pipeline-schedule zbv")


def _check_schedule(o: configs.OptimizerConfig, errors: list[str]) -> None:
    if o.lr is None:
        errors.append("--lr is required (the peak learning rate)")
    elif o.min_lr > o.lr:
        errors.append(f"--min-lr {o.min_lr} is larger than --lr {o.lr}")
    elif o.lr_warmup_init > o.lr:
        errors.append(f"--lr-warmup-init {o.lr_warmup_init} is larger than --lr {o.lr}")
    if o.min_lr < 0:
        errors.append(f"--min-lr {o.min_lr} must be >= 0")
    if o.lr_warmup_fraction is not None and o.lr_warmup_iters:
        errors.append(f"--lr-warmup-fraction {o.lr_warmup_fraction} and --lr-warmup-iters "
                      f"{o.lr_warmup_iters} are mutually exclusive; pass one")
    if o.lr_warmup_fraction is not None and o.lr_warmup_samples:
        errors.append(f"--lr-warmup-fraction {o.lr_warmup_fraction} and --lr-warmup-samples "
                      f"{o.lr_warmup_samples} are mutually exclusive; pass one")
    if o.lr_decay_iters is not None and o.lr_decay_samples is not None:
        errors.append(f"--lr-decay-iters {o.lr_decay_iters} and --lr-decay-samples {o.lr_decay_samples} are "
                      "mutually exclusive; pass one")
    if o.lr_wsd_decay_iters is not None and o.lr_wsd_decay_samples is not None:
        errors.append("--lr-wsd-decay-iters and --lr-wsd-decay-samples are mutually exclusive; pass one")
    if o.lr_decay_style == "WSD" and o.lr_wsd_decay_iters is None and o.lr_wsd_decay_samples is None:
        errors.append("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with "
                      "--train-samples)")
    if o.weight_decay_incr_style != "constant" and None not in (o.start_weight_decay, o.end_weight_decay) \
            and not 0 <= o.start_weight_decay <= o.end_weight_decay:
        errors.append(f"--start-weight-decay {o.start_weight_decay} must be >= 0 and <= "
                      f"--end-weight-decay {o.end_weight_decay}")


def _check_warmup_vs_decay(cfg: configs.RunConfig, errors: list[str]) -> None:
    """Megatron asserts warm-up < decay (in samples); checked once the lengths are known."""
    t = cfg.train
    if (t.train_iters is None and t.train_samples is None) or t.global_batch_size is None:
        return
    from ..optim.lr_schedule import scheduler_steps_from_config  # the schedule's own rule

    steps = scheduler_steps_from_config(cfg)
    warmup, decay, wsd = steps["lr_warmup_steps"], steps["lr_decay_steps"], steps["wsd_decay_steps"]
    if decay <= 0:
        errors.append(f"the LR decay length must be > 0 (got {decay} samples); check --lr-decay-iters/"
                      "--lr-decay-samples/--train-iters/--train-samples")
    elif warmup >= decay:
        errors.append(f"the LR warm-up ({warmup:g} samples) must be shorter than the LR decay ({decay} samples); "
                      "lower --lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction or raise "
                      "--lr-decay-iters/--lr-decay-samples")
    if cfg.optim.lr_decay_style == "WSD" and wsd is not None and not 0 < wsd <= decay:
        errors.append(f"--lr-wsd-decay-iters/--lr-wsd-decay-samples gives {wsd} samples; it must be > 0 and at "
                      f"most the LR decay length ({decay} samples)")


def _check_data(d: configs.DataConfig, errors: list[str], for_training: bool = True) -> None:
    per_split = d.train_data_path or d.valid_data_path or d.test_data_path
    if d.num_workers < 0:
        errors.append(f"--num-workers must be >= 0 (0: read batches in the training process), got {d.num_workers}")
    if d.mock_data and (d.data_path or per_split):
        errors.append("--mock-data and --data-path (or --train/valid/test-data-path) are mutually exclusive; pass one")
    elif d.data_path and per_split:
        errors.append("--data-path with --split and --train/valid/test-data-path are mutually exclusive; pass one")
    elif for_training and not d.mock_data and not d.data_path and not d.train_data_path:
        errors.append("no training data: pass --data-path PREFIX (or weighted prefixes), --train-data-path, "
                      "or --mock-data")
    if d.mock_data and d.reset_attention_mask:
        errors.append("--reset-attention-mask needs document boundaries from real data (--data-path); --mock-data "
                      "has none")


def _check_precision(o: configs.OptimizerConfig, m: configs.ModelConfig | None, errors: list[str]) -> None:
    if o.fp16 and o.bf16:
        errors.append("--fp16 and --bf16 are mutually exclusive; pass at most one")
    if o.overlap_param_gather and not o.use_distributed_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer (it overlaps that optimizer's "
                      "parameter all-gather)")
    elif o.overlap_param_gather and not o.overlap_grad_reduce:
        errors.append("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it")
    if o.loss_scale is not None and o.loss_scale <= 0:
        errors.append(f"--loss-scale must be > 0, got {o.loss_scale}")
    if not 0 < o.min_loss_scale <= o.initial_loss_scale:
        errors.append(f"--min-loss-scale {o.min_loss_scale} must be > 0 and <= --initial-loss-scale "
                      f"{o.initial_loss_scale}")
    if o.hysteresis < 1:
        errors.append(f"--hysteresis must be >= 1, got {o.hysteresis}")
    if m is None:
        return
    p = m.precision
    if p.fp8 is not None:
        from ..precision.fp8 import Fp8Recipe  # only with --fp8-format

        _collect(errors, lambda: Fp8Recipe(
            fp8_format=p.fp8, fp8_recipe=p.fp8_recipe if p.fp8_recipe in ("delayed", "tensorwise") else "delayed",
            fp8_margin=p.fp8_margin, fp8_amax_history_len=p.fp8_amax_history_len,
            fp8_amax_compute_algo=p.fp8_amax_compute_algo))
    if m.precision.transformer_impl != "local":
        from ..precision.fp8 import check_transformer_impl  # imports TE lazily

        _collect(errors, lambda: check_transformer_impl(m.precision.transformer_impl))


def _check_model(m: configs.ModelConfig | None, errors: list[str]) -> None:
    if m is None:
        return
    mpe, s = m.max_position_embeddings, m.seq_length
    if m.attention.position_embedding_type == "learned_absolute" and mpe < s:
        errors.append(f"--max-position-embeddings {mpe} is smaller than --seq-length {s} with learned absolute "
                      "positions; raise --max-position-embeddings")
    if m.swiglu and m.openai_gelu:
        errors.append("--swiglu and --openai-gelu are mutually exclusive; pass one")
    # The fused Triton kernels need triton and CUDA, or TRITON_INTERPRET=1 (kernels on CPU).
    k = m.kernels
    asked = [f for f, on in (("--use-triton-kernels", k.use_triton_kernels),
                             ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te",
                              k.cross_entropy_loss_fusion and k.cross_entropy_fusion_impl == "te")) if on]
    if asked:
        from ..kernels import check_kernels_available  # only when asked for

        _collect(errors, lambda: check_kernels_available(asked))


def _check_context_parallel(m: configs.ModelConfig | None, dims: ParallelDims | None, sizes: list | None,
                            errors: list[str]) -> None:
    """``sizes``: ``--hierarchical-context-parallel-sizes`` as given (``ParallelDims.cp_inner`` holds it once it
    fits)."""
    if m is None:
        return
    types = m.attention.cp_comm_types
    if len(types) not in (1, m.num_layers):
        errors.append(f"--cp-comm-type takes one type or one per layer (--num-layers {m.num_layers}), got "
                      f"{len(types)}")
    if sizes is not None and "a2a+p2p" not in types:
        errors.append("--hierarchical-context-parallel-sizes goes with --cp-comm-type a2a+p2p; drop it or use that "
                      "type")
    if dims is None or dims.cp == 1:
        return
    cp, tp, flag = dims.cp, dims.tp, f"--context-parallel-size {dims.cp}"
    if m.attention.attention_dropout:
        errors.append(f"{flag} needs --attention-dropout 0 (attention dropout inside context-parallel attention is "
                      f"not available yet; Megatron's default is 0.1)")
    heads, groups = m.num_attention_heads, m.num_query_groups
    if "a2a" in types and ((heads // tp) % cp or (groups // tp) % cp):
        errors.append(f"--cp-comm-type a2a scatters the local attention heads over {flag}: the heads per TP rank "
                      f"({heads} / {tp}) and the query groups per TP rank ({groups} / {tp}) must divide by {cp}")
    if "a2a+p2p" in types:
        if sizes is None or len(sizes) != 2 or sizes[0] * sizes[1] != cp or min(sizes) < 1:
            errors.append(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes INNER OUTER with INNER "
                          f"x OUTER = {flag} (INNER adjacent ranks use all-to-all, the ring spans OUTER), got "
                          f"{sizes}")
        elif (heads // tp) % sizes[0] or (groups // tp) % sizes[0]:
            errors.append(f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]}: the heads per TP rank "
                          f"({heads} / {tp}) and the query groups per TP rank ({groups} / {tp}) must divide by the "
                          f"all-to-all size {sizes[0]}")


def _check_moe(m: configs.ModelConfig | None, dims: ParallelDims | None, sequence_parallel: bool,
               errors: list[str]) -> None:
    """Mixture of experts against the layout (the MoE flags' own problems are ``configs.MoEConfig.problems``)."""
    if m is None or dims is None:
        return
    ep, etp = dims.ep, dims.expert_tp
    if m.moe.num_experts is None:
        given = [f for f, on in ((f"--expert-model-parallel-size {ep}", ep > 1),
                                 (f"--expert-tensor-parallel-size {dims.etp}", dims.etp not in (None, dims.tp)))
                 if on]
        if given:
            errors.append(f"{' and '.join(given)} need --num-experts (a mixture-of-experts model)")
        return
    if m.moe.num_experts < 1:
        return  # named by MoEConfig.problems
    if m.moe.num_experts % ep:
        errors.append(f"--num-experts {m.moe.num_experts} is not divisible by --expert-model-parallel-size {ep}; every "
                      "expert-parallel rank holds the same number of experts")
    ffn = m.moe.moe_ffn_hidden_size or m.ffn_hidden_size
    if ffn % etp:
        errors.append(f"--moe-ffn-hidden-size {ffn} is not divisible by the expert tensor-parallel size {etp} "
                      "(--expert-tensor-parallel-size, default --tensor-model-parallel-size)")
    shared = m.moe.moe_shared_expert_intermediate_size
    if shared and shared % dims.tp:
        errors.append(f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                      f"--tensor-model-parallel-size {dims.tp}")
    if dims.tp > 1 and not sequence_parallel:
        errors.append(f"--num-experts with --tensor-model-parallel-size {dims.tp} needs --sequence-parallel (as in "
                      "Megatron-LM: the expert layers take each tensor-parallel rank's own tokens)")
    if dims.cp > 1:
        errors.append(f"--num-experts with --context-parallel-size {dims.cp} is not available yet in this version; "
                      "use --context-parallel-size 1")


def _check_pipeline_schedule(dims: ParallelDims | None, t: configs.TrainingConfig, errors: list[str],
                             for_training: bool = True) -> None:
    """``--pipeline-schedule`` zb-h1 / zbv / dualpipev (the split backward) against what it does not run with; the
    degrees' rules (PP, virtual stages) are ``ParallelDims``' (``parallel_config``'s lines)."""
    if dims is None or dims.pipeline_schedule not in ("zb-h1", "zbv", "dualpipev"):
        return
    flag = f"--pipeline-schedule {dims.pipeline_schedule}"
    if not for_training and dims.v_shape:
        errors.append(f"{flag}: text generation runs the stages in rank order and {dims.pipeline_schedule} places "
                      "them in a V; "
                      "generate without --pipeline-schedule (any checkpoint loads into any layout)")
    if t.torch_compile:
        errors.append(f"{flag} with --torch-compile is not supported: the compiled layers' backward cannot be split "
                      "into input and weight gradients; drop one of them")


def _check_logging(lg: configs.LoggingConfig, errors: list[str]) -> None:
    if lg.straggler_minmax_count < 1:
        errors.append(f"--straggler-minmax-count must be >= 1, got {lg.straggler_minmax_count}")
    if lg.log_interval is not None and lg.log_interval < 1:
        errors.append(f"--log-interval must be >= 1, got {lg.log_interval}")
    if lg.mlflow_experiment_name:
        import importlib.util

        if importlib.util.find_spec("mlflow") is None:  # imported by the logging rank only, once training starts
            errors.append("--mlflow-experiment-name needs the mlflow package: pip install mlflow-skinny (or "
                          "pip install -e '.[mlflow]')")
    else:
        given = [f for f, v in (("--mlflow-run-name", lg.mlflow_run_name),
                                ("--mlflow-tracking-uri", lg.mlflow_tracking_uri)) if v]
        if given:
            errors.append(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --mlflow-experiment-name "
                          "(MLflow logging is on with an experiment name)")


def _check_rerun(t: configs.TrainingConfig, errors: list[str]) -> None:
    """The rerun engine's flags (training/rerun.py)."""
    modes = ("disabled", "validate_results", "report_stats")
    if t.rerun_mode not in modes:
        errors.append(f"--rerun-mode must be one of {', '.join(modes)}, got {t.rerun_mode}")
    rate = t.error_injection_rate
    if rate < 0:
        errors.append(f"--error-injection-rate must be >= 0 (0: no injected faults), got {rate}")
    elif rate == 0 and t.error_injection_type != "transient_error":
        errors.append(f"--error-injection-type {t.error_injection_type} needs --error-injection-rate N (a fault in "
                      "about one iteration in N)")
    elif rate > 0 and t.rerun_mode != "validate_results":
        errors.append(f"--error-injection-rate {rate} injects faults for --rerun-mode validate_results to find; got "
                      f"--rerun-mode {t.rerun_mode}")
    elif rate > 0 and not t.check_for_nan_in_loss_and_grad:
        errors.append(f"--error-injection-rate {rate} injects NaNs, which --check-for-nan-in-loss-and-grad finds; "
                      "drop --no-check-for-nan-in-loss-and-grad")


def _check_post_validation(o: configs.OptimizerConfig, t: configs.TrainingConfig, errors: list[str]) -> None:
    """``--enable-optimizer-post-validation`` (optim/post_validation.py) against what must see the state before the
    step."""
    if not o.enable_optimizer_post_validation:
        return
    flag = "--enable-optimizer-post-validation"
    if o.fp16:
        errors.append(f"{flag} with --fp16 is not supported: the loss scaler must know of an overflow before the next "
                      "iteration's backward; use --bf16")
    judges = [f for f, on in (("--check-for-spiky-loss", t.check_for_spiky_loss),
                              ("--check-for-large-grads", t.check_for_large_grads)) if on]
    if judges:
        errors.append(f"{flag} with {' and '.join(judges)} is not supported: the iteration is judged after the next "
                      "one has run; drop one of them")
    if t.rerun_mode == "report_stats" or (t.rerun_mode == "validate_results" and t.check_for_nan_in_loss_and_grad):
        errors.append(f"{flag} validates a step after the next iteration, when --rerun-mode {t.rerun_mode} can no "
                      "longer run the iteration again: add --rerun-mode disabled (a NaN or Inf still stops training, "
                      "one iteration later, with --check-for-nan-in-loss-and-grad's error)")


def _check_checkpoint(c: configs.CheckpointConfig, errors: list[str]) -> None:
    for name in ("save_interval", "exit_interval", "exit_duration_in_mins", "save_hf_interval"):
        value = getattr(c, name)
        if value is not None and value < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if c.save_hf_interval is not None and not c.save_hf:
        errors.append("--save-hf-interval needs --save-hf (the directory to write the Hugging Face model to)")
    if c.use_checkpoint_args and not c.load:
        errors.append("--use-checkpoint-args needs --load (the checkpoint to take the model flags from)")
