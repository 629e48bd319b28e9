"""What only the command line shows (which flags were given), checked on the flags: one line per problem."""
from __future__ import annotations

from .not_yet import _TOKENIZER_MODEL_TYPES, NOT_YET_SUPPORTED

_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")


def _missing_required(args) -> list[str]:
    """One line for all the missing required flags."""
    missing = [f"--{dest.replace('_', '-')}" for dest in _REQUIRED if getattr(args, dest) is None]
    return [f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required"] if missing else []


def _flag_problems(args, for_training: bool = True) -> list[str]:
    """Rules about which flags were given: not-yet-available features, required flags, mutually exclusive and
    dependent flags whose difference the configs no longer show."""
    errors = [rule.message(getattr(args, dest)) for dest, rule in NOT_YET_SUPPORTED.items()
              if getattr(args, dest) not in rule.allowed]
    errors += _missing_required(args)
    iters, samples = args.train_iters, args.train_samples
    if for_training and iters is None and samples is None:
        errors.append("pass --train-iters or --train-samples (the training length)")
    elif iters is not None and samples is not None:
        errors.append(f"--train-iters {iters} and --train-samples {samples} are mutually exclusive; pass one")
    # Iteration-based flags go with --train-iters, sample-based ones with --train-samples (Megatron's rule).
    iter_flags = [f"--{n.replace('_', '-')}" for n in ("lr_decay_iters", "lr_wsd_decay_iters")
                  if getattr(args, n) is not None] + (["--lr-warmup-iters"] if args.lr_warmup_iters else [])
    sample_flags = [f"--{n.replace('_', '-')}" for n in ("lr_decay_samples", "lr_wsd_decay_samples")
                    if getattr(args, n) is not None] + (["--lr-warmup-samples"] if args.lr_warmup_samples else [])
    if samples is not None and iter_flags:
        errors.append(f"{', '.join(iter_flags)} count iterations but --train-samples counts samples; use the "
                      "*-samples flags with --train-samples")
    if iters is not None and sample_flags:
        errors.append(f"{', '.join(sample_flags)} count samples but --train-iters counts iterations; use the "
                      "*-iters flags with --train-iters")
    if args.weight_decay_incr_style == "constant":
        given = [f for f, v in (("--start-weight-decay", args.start_weight_decay),
                                ("--end-weight-decay", args.end_weight_decay)) if v is not None]
        if given:
            errors.append(f"{' and '.join(given)} need --weight-decay-incr-style linear or cosine (with the "
                          "constant style use --weight-decay)")
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        errors.append(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both "
                      "--start-weight-decay and --end-weight-decay")
    if not args.loss_scale_window >= 1 or not float(args.loss_scale_window).is_integer():
        errors.append(f"--loss-scale-window must be a whole number >= 1, got {args.loss_scale_window}")
    if args.moe_layer_recompute and args.recompute_granularity == "full":
        errors.append("--moe-layer-recompute (selective recompute of the MoE layers) does not go with "
                      "--recompute-granularity full; drop one of them (as Megatron-LM)")
    if args.cache_mla_latents and not args.multi_latent_attention:
        errors.append("--cache-mla-latents applies to --multi-latent-attention (its latent generation cache); "
                      "drop it")
    _check_compat_flags(args, errors)
    _check_tokenizer_flags(args, errors)
    return errors


def _check_compat_flags(args, errors: list[str]) -> None:
    """Flag-level rules of the Megatron-LM compatibility flags."""
    if args.manual_gc_interval < 0:
        errors.append(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        errors.append(f"--profile-step-start {args.profile_step_start} must be >= 0 and below --profile-step-end "
                      f"{args.profile_step_end}")
    if args.profile and args.use_pytorch_profiler and not args.tensorboard_dir:
        errors.append("--profile --use-pytorch-profiler writes its trace to --tensorboard-dir; pass it")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        errors.append("--decoupled-min-lr needs --decoupled-lr (the peak LR of the embedding and output layer)")
    elif args.decoupled_lr is not None:
        floor = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if not 0 <= floor <= args.decoupled_lr or args.lr_warmup_init > args.decoupled_lr:
            errors.append(f"--decoupled-lr {args.decoupled_lr} must be >= --decoupled-min-lr (default --min-lr) "
                          f"{floor} >= 0 and >= --lr-warmup-init {args.lr_warmup_init}")


def _check_tokenizer_flags(args, errors: list[str]) -> None:
    t = args.tokenizer_type
    if t is None:
        if args.vocab_size is None and not (args.vocab_file and args.merge_file):
            errors.append("no tokenizer: pass --tokenizer-type NullTokenizer --vocab-size N (mock data), or "
                          "--tokenizer-type with its files (--vocab-file/--merge-file or --tokenizer-model)")
    elif t == "NullTokenizer":
        if args.vocab_size is None:
            errors.append("--tokenizer-type NullTokenizer needs --vocab-size")
    elif t == "GPT2BPETokenizer":
        if not (args.vocab_file and args.merge_file):
            errors.append("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    elif t in _TOKENIZER_MODEL_TYPES and not args.tokenizer_model:
        errors.append(f"--tokenizer-type {t} needs --tokenizer-model")
    if args.vocab_size is not None and args.vocab_size < 1:
        errors.append(f"--vocab-size must be >= 1, got {args.vocab_size}")
