"""Megatron-LM flags: each parses to its namespace and config field; each validation rule names its flags."""
import pytest

from megatronish.arguments import (
    NOT_YET_SUPPORTED,
    build_parser,
    configs_from_args,
    exit_on_config_error,
    parse_args,
    validate_args,
)
from megatronish.config import RunConfig
from megatronish.parallel.dims import ConfigError

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", "100", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100"]


MOE = ["--num-experts", "4", "--disable-bias-linear"]


def cfg_of(extra=(), world=1, base=BASE):
    return configs_from_args(parse_args(list(base) + list(extra)), world)


def errors_of(extra=(), world=1, base=BASE):
    with pytest.raises(ConfigError) as e:
        validate_args(parse_args(list(base) + list(extra)), world)
    return str(e.value).splitlines()


# ------------------------------------------------------------------ every flag parses
# (argv, namespace dest, expected namespace value, config path or None, expected config value)
MOE_ARGS = ["--num-experts", "4", "--disable-bias-linear"]
FLAGS = [
    # model shape
    (["--num-layers", "6"], "num_layers", 6, "model.num_layers", 6),
    (["--hidden-size", "128"], "hidden_size", 128, "model.hidden_size", 128),
    (["--ffn-hidden-size", "200"], "ffn_hidden_size", 200, "model.ffn_hidden_size", 200),
    (["--num-attention-heads", "4"], "num_attention_heads", 4, "model.num_attention_heads", 4),
    (["--kv-channels", "16"], "kv_channels", 16, "model.kv_channels", 16),
    (["--group-query-attention", "--num-query-groups", "2"], "group_query_attention", True,
     "model.num_query_groups", 2),
    (["--num-query-groups", "2"], "num_query_groups", 2, "model.num_query_groups", 8),  # ignored without GQA
    (["--seq-length", "16"], "seq_length", 16, "model.seq_length", 16),
    (["--max-position-embeddings", "64"], "max_position_embeddings", 64, "model.max_position_embeddings", 64),
    (["--position-embedding-type", "rope"], "position_embedding_type", "rope",
     "model.attention.position_embedding_type",
     "rope"),
    (["--rotary-base", "500000"], "rotary_base", 500000, "model.attention.rotary_base", 500000),
    (["--rotary-percent", "0.5"], "rotary_percent", 0.5, "model.attention.rotary_percent", 0.5),
    (["--normalization", "RMSNorm"], "normalization", "RMSNorm", "model.normalization", "RMSNorm"),
    (["--norm-epsilon", "1e-6"], "norm_epsilon", 1e-6, "model.norm_epsilon", 1e-6),
    (["--swiglu"], "swiglu", True, "model.ffn_hidden_size", int(8 * 64 / 3 / 64) * 64),
    (["--openai-gelu"], "openai_gelu", True, "model.openai_gelu", True),
    (["--untie-embeddings-and-output-weights"], "untie_embeddings_and_output_weights", True,
     "parallel.tie_embeddings", False),
    (["--disable-bias-linear"], "add_bias_linear", False, "model.add_bias_linear", False),
    (["--add-qkv-bias"], "add_qkv_bias", True, "model.attention.add_qkv_bias", True),
    (["--qk-layernorm"], "qk_layernorm", True, "model.attention.qk_layernorm", True),
    (["--attention-dropout", "0"], "attention_dropout", 0.0, "model.attention.attention_dropout", 0.0),
    (["--hidden-dropout", "0.2"], "hidden_dropout", 0.2, "model.hidden_dropout", 0.2),
    (["--init-method-std", "0.006"], "init_method_std", 0.006, "model.init_method_std", 0.006),
    (["--make-vocab-size-divisible-by", "64"], "make_vocab_size_divisible_by", 64,
     "model.make_vocab_size_divisible_by", 64),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
     "recompute_method", "block", "model.recompute.recompute_num_layers", 2),
    (["--transformer-impl", "local"], "transformer_impl", "local", None, None),
    # parallelism
    (["--tensor-model-parallel-size", "2"], "tensor_model_parallel_size", 2, "parallel.tp", 2),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2"], "sequence_parallel", True,
     "sequence_parallel", True),
    (["--sequence-parallel"], "sequence_parallel", True, "sequence_parallel", False),  # no-op at TP 1
    (["--distributed-backend", "gloo"], "distributed_backend", "gloo", "train.distributed_backend", "gloo"),
    (["--distributed-backend", "gloo"], "distributed_backend", "gloo", "parallel_backend", "gloo"),
    (["--distributed-timeout-minutes", "3"], "distributed_timeout_minutes", 3,
     "train.distributed_timeout_minutes", 3),
    (["--overlap-grad-reduce"], "overlap_grad_reduce", True, "optim.overlap_grad_reduce", True),
    (["--ddp-bucket-size", "1000"], "ddp_bucket_size", 1000, "optim.ddp_bucket_size", 1000),
    (["--use-cpu-initialization"], "use_cpu_initialization", True, "train.use_cpu_initialization", True),
    (["--use-distributed-optimizer"], "use_distributed_optimizer", True, "optim.use_distributed_optimizer", True),
    (["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], "overlap_param_gather",
     True, "optim.overlap_param_gather", True),
    # precision and recompute
    (["--bf16"], "bf16", True, "optim.accumulate_allreduce_grads_in_fp32", True),  # implied by --bf16
    (["--bf16", "--grad-reduce-in-bf16"], "grad_reduce_in_bf16", True, "optim.accumulate_allreduce_grads_in_fp32",
     False),
    (["--fp16"], "fp16", True, "optim.accumulate_allreduce_grads_in_fp32", False),  # Megatron's fp16 default
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], "accumulate_allreduce_grads_in_fp32", True,
     "optim.accumulate_allreduce_grads_in_fp32", True),
    (["--loss-scale", "128"], "loss_scale", 128.0, "optim.loss_scale", 128.0),
    (["--initial-loss-scale", "65536"], "initial_loss_scale", 65536.0, "optim.initial_loss_scale", 65536.0),
    (["--min-loss-scale", "2"], "min_loss_scale", 2.0, "optim.min_loss_scale", 2.0),
    (["--loss-scale-window", "500"], "loss_scale_window", 500.0, "optim.loss_scale_window", 500),
    (["--hysteresis", "3"], "hysteresis", 3, "optim.hysteresis", 3),
    (["--fp8-format", "hybrid"], "fp8", "hybrid", "model.precision.fp8", "hybrid"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], "fp8_recipe", "tensorwise", "model.precision.fp8_recipe",
     "tensorwise"),
    (["--fp8-margin", "1"], "fp8_margin", 1, "model.precision.fp8_margin", 1),
    (["--fp8-amax-history-len", "16"], "fp8_amax_history_len", 16, "model.precision.fp8_amax_history_len", 16),
    (["--fp8-amax-compute-algo", "max"], "fp8_amax_compute_algo", "max", "model.precision.fp8_amax_compute_algo",
     "max"),
    (["--recompute-granularity", "selective"], "recompute_granularity", "selective",
     "model.recompute.recompute_granularity", "selective"),
    (["--recompute-activations"], "recompute_activations", True, "model.recompute.recompute_granularity", "selective"),
    # batch and iterations
    (["--micro-batch-size", "4"], "micro_batch_size", 4, "num_microbatches", 4),
    (["--global-batch-size", "32"], "global_batch_size", 32, "train.global_batch_size", 32),
    (["--eval-iters", "5"], "eval_iters", 5, "train.eval_iters", 5),
    (["--eval-interval", "50"], "eval_interval", 50, "train.eval_interval", 50),
    (["--skip-train"], "skip_train", True, "train.skip_train", True),
    (["--seed", "42"], "seed", 42, "train.seed", 42),
    # optimizer and schedule
    (["--optimizer", "sgd"], "optimizer", "sgd", "optim.optimizer", "sgd"),
    (["--lr", "3e-4"], "lr", 3e-4, "optim.lr", 3e-4),
    (["--min-lr", "1e-5"], "min_lr", 1e-5, "optim.min_lr", 1e-5),
    (["--lr-decay-style", "cosine"], "lr_decay_style", "cosine", "optim.lr_decay_style", "cosine"),
    (["--lr-decay-style", "inverse-square-root"], "lr_decay_style", "inverse-square-root", "optim.lr_decay_style",
     "inverse-square-root"),
    (["--lr-decay-style", "constant"], "lr_decay_style", "constant", "optim.lr_decay_style", "constant"),
    (["--lr-decay-iters", "80"], "lr_decay_iters", 80, "optim.lr_decay_iters", 80),
    (["--lr-warmup-fraction", "0.1"], "lr_warmup_fraction", 0.1, "optim.lr_warmup_fraction", 0.1),
    (["--lr-warmup-iters", "10"], "lr_warmup_iters", 10, "optim.lr_warmup_iters", 10),
    (["--lr-warmup-init", "1e-6"], "lr_warmup_init", 1e-6, "optim.lr_warmup_init", 1e-6),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-style", "minus_sqrt", "--lr-wsd-decay-iters", "20"],
     "lr_wsd_decay_style", "minus_sqrt", "optim.lr_wsd_decay_iters", 20),
    (["--weight-decay", "0.1"], "weight_decay", 0.1, "optim.end_weight_decay", 0.1),
    (["--start-weight-decay", "0.01", "--end-weight-decay", "0.1", "--weight-decay-incr-style", "cosine"],
     "weight_decay_incr_style", "cosine", "optim.start_weight_decay", 0.01),
    (["--clip-grad", "0.5"], "clip_grad", 0.5, "optim.clip_grad", 0.5),
    (["--adam-beta1", "0.8"], "adam_beta1", 0.8, "optim.adam_beta1", 0.8),
    (["--adam-beta2", "0.95"], "adam_beta2", 0.95, "optim.adam_beta2", 0.95),
    (["--adam-eps", "1e-5"], "adam_eps", 1e-5, "optim.adam_eps", 1e-5),
    (["--sgd-momentum", "0.5"], "sgd_momentum", 0.5, "optim.sgd_momentum", 0.5),
    (["--override-opt_param-scheduler"], "override_opt_param_scheduler", True,
     "optim.override_opt_param_scheduler", True),
    (["--use-checkpoint-opt_param-scheduler"], "use_checkpoint_opt_param_scheduler", True,
     "optim.use_checkpoint_opt_param_scheduler", True),
    # data and tokenizer
    (["--vocab-size", "50"], "vocab_size", 50, "model.vocab_size", 51),  # NullTokenizer: N + eod
    (["--vocab-size", "50"], "vocab_size", 50, "data.vocab_size_flag", 50),
    (["--tokenizer-type", "NullTokenizer"], "tokenizer_type", "NullTokenizer", "data.tokenizer_type",
     "NullTokenizer"),
    (["--split", "98,2,0"], "split", "98,2,0", "data.split", "98,2,0"),
    (["--data-cache-path", "/tmp/c"], "data_cache_path", "/tmp/c", "data.data_cache_path", "/tmp/c"),
    (["--num-workers", "0"], "num_workers", 0, "data.num_workers", 0),
    (["--eod-mask-loss"], "eod_mask_loss", True, "data.eod_mask_loss", True),
    (["--reset-position-ids"], "reset_position_ids", True, "data.reset_position_ids", True),
    (["--train-data-path", "a", "b"], "train_data_path", ["a", "b"], None, None),
    (["--vocab-extra-ids", "0"], "vocab_extra_ids", 0, "data.vocab_extra_ids", 0),
    # logging
    (["--log-interval", "7"], "log_interval", 7, "logging.log_interval", 7),
    (["--log-throughput"], "log_throughput", True, "logging.log_throughput", True),
    (["--log-params-norm"], "log_params_norm", True, "logging.log_params_norm", True),
    (["--tensorboard-dir", "tb"], "tensorboard_dir", "tb", "logging.tensorboard_dir", "tb"),
    (["--wandb-project", "p"], "wandb_project", "p", "logging.wandb_project", "p"),
    (["--wandb-entity", "e"], "wandb_entity", "e", "logging.wandb_entity", "e"),
    (["--wandb-exp-name", "x"], "wandb_exp_name", "x", "logging.wandb_exp_name", "x"),
    (["--wandb-save-dir", "w"], "wandb_save_dir", "w", "logging.wandb_save_dir", "w"),
    (["--timing-log-level", "2"], "timing_log_level", 2, "logging.timing_log_level", 2),
    (["--metrics-file", "m.jsonl"], "metrics_file", "m.jsonl", "logging.metrics_file", "m.jsonl"),
    # checkpointing and exit
    (["--save", "ck"], "save", "ck", "checkpoint.save", "ck"),
    (["--load", "ck"], "load", "ck", "checkpoint.load", "ck"),
    (["--save-interval", "50"], "save_interval", 50, "checkpoint.save_interval", 50),
    (["--persistent-save-interval", "50"], "save_interval", 50, "checkpoint.save_interval", 50),
    (["--async-save"], "async_save", True, "checkpoint.async_save", True),
    (["--no-save-optim"], "no_save_optim", True, "checkpoint.no_save_optim", True),
    (["--no-save-rng"], "no_save_rng", True, "checkpoint.no_save_rng", True),
    (["--no-load-optim"], "no_load_optim", True, "checkpoint.no_load_optim", True),
    (["--no-load-rng"], "no_load_rng", True, "checkpoint.no_load_rng", True),
    (["--finetune"], "finetune", True, "checkpoint.finetune", True),
    (["--exit-on-missing-checkpoint"], "exit_on_missing_checkpoint", True,
     "checkpoint.exit_on_missing_checkpoint", True),
    (["--ckpt-format", "torch_dist"], "ckpt_format", "torch_dist", "checkpoint.ckpt_format", "torch_dist"),
    (["--exit-signal-handler"], "exit_signal_handler", True, "checkpoint.exit_signal_handler", True),
    (["--exit-signal", "SIGUSR1"], "exit_signal", "SIGUSR1", "checkpoint.exit_signal", "SIGUSR1"),
    (["--exit-duration-in-mins", "30"], "exit_duration_in_mins", 30, "checkpoint.exit_duration_in_mins", 30),
    (["--exit-interval", "7"], "exit_interval", 7, "checkpoint.exit_interval", 7),
    # mixture of experts (with --num-experts 4 --disable-bias-linear)
    (MOE_ARGS + ["--moe-layer-freq", "([1]+[0])*2"], "moe_layer_freq", [1, 0, 1, 0], "model.moe.moe_layer_freq",
     [1, 0, 1, 0]),
    (MOE_ARGS + ["--moe-layer-freq", "2"], "moe_layer_freq", 2, "model.moe.moe_layer_freq", 2),
    (MOE_ARGS, "moe_ffn_hidden_size", None, "model.moe.moe_ffn_hidden_size", 256),  # default: --ffn-hidden-size
    (MOE_ARGS + ["--moe-router-topk", "1"], "moe_router_topk", 1, "model.moe.moe_router_topk", 1),
    (MOE_ARGS + ["--moe-router-load-balancing-type", "seq_aux_loss"], "moe_router_load_balancing_type",
     ["seq_aux_loss"], "model.moe.moe_router_load_balancing_type", "seq_aux_loss"),
    (MOE_ARGS + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.1",
                 "0.2"], "moe_aux_loss_coeff", [0.1, 0.2], "model.moe.moe_aux_loss_coeff", [0.1, 0.2]),
    (MOE_ARGS + ["--moe-aux-loss-coeff", "0.01"], "moe_aux_loss_coeff", [0.01], "model.moe.moe_aux_loss_coeff", 0.01),
    (MOE_ARGS + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"],
     "moe_router_enable_expert_bias", True, "model.moe.moe_router_enable_expert_bias", True),
    (MOE_ARGS + ["--moe-expert-capacity-factor", "1.5"], "moe_expert_capacity_factor", 1.5,
     "model.moe.moe_expert_capacity_factor", 1.5),
    (MOE_ARGS + ["--moe-token-dispatcher-type", "alltoall"], "moe_token_dispatcher_type", "alltoall",
     "model.moe.moe_token_dispatcher_type", "alltoall"),
    (MOE_ARGS + ["--moe-grouped-gemm"], "moe_grouped_gemm", True, "model.moe.moe_grouped_gemm", True),
    (MOE_ARGS + ["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate"],
     "moe_shared_expert_gate", True, "model.moe.moe_shared_expert_gate", True),
    (MOE_ARGS + ["--moe-router-dtype", "fp32"], "moe_router_dtype", "fp32", "model.moe.moe_router_dtype", "fp32"),
    (MOE_ARGS + ["--moe-per-layer-logging"], "moe_per_layer_logging", True, "logging.moe_per_layer_logging", True),
    (MOE_ARGS + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                 "--expert-tensor-parallel-size", "1"], "expert_tensor_parallel_size", 1, "parallel.expert_tp", 1),
]


def _get(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("argv, dest, value, path, expected", FLAGS, ids=[" ".join(f[0]) for f in FLAGS])
def test_flag_parses_to_config(argv, dest, value, path, expected):
    world = 2 if "--tensor-model-parallel-size" in argv else 1
    args = parse_args(BASE + argv)
    assert getattr(args, dest) == value
    if path is not None:
        assert _get(configs_from_args(args, world), path) == expected


def _without(*flags, base=BASE):
    """``base`` minus ``flags`` and their values (``--mock-data`` takes none)."""
    out, i = [], 0
    while i < len(base):
        if base[i] in flags:
            i += 1 if base[i] == "--mock-data" else 2
            continue
        out.append(base[i])
        i += 1
    return out


SAMPLE_BASE = _without("--train-iters") + ["--train-samples", "1600"]


@pytest.mark.parametrize("argv, path, expected", [
    (["--lr-decay-samples", "800"], "optim.lr_decay_samples", 800),
    (["--lr-warmup-samples", "160"], "optim.lr_warmup_samples", 160),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "400"], "optim.lr_wsd_decay_samples", 400),
    ([], "train.train_iters", 100),  # Megatron: train_samples // global_batch_size
    ([], "train.train_samples", 1600),
])
def test_sample_based_flags(argv, path, expected):
    assert _get(cfg_of(argv, base=SAMPLE_BASE), path) == expected


def test_data_path_parses_as_list():
    base = _without("--mock-data")
    args = parse_args(base + ["--data-path", "0.3", "a_text_document", "0.7", "b_text_document"])
    assert args.data_path == ["0.3", "a_text_document", "0.7", "b_text_document"]
    cfg = configs_from_args(args, 1)
    assert cfg.data.data_path == args.data_path and cfg.data.split == "969, 30, 1" and not cfg.data.mock_data


def test_file_tokenizer_flags_parse():
    args = parse_args(BASE + ["--vocab-file", "v.json", "--merge-file", "m.txt", "--tokenizer-model", "t.model"])
    assert (args.vocab_file, args.merge_file, args.tokenizer_model) == ("v.json", "m.txt", "t.model")


def test_megatron_defaults():
    a = parse_args([])
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.kv_channels) == (None,) * 5
    assert a.num_query_groups == 1 and not a.group_query_attention
    assert a.position_embedding_type == "learned_absolute" and a.normalization == "LayerNorm"
    assert (a.rotary_base, a.rotary_percent, a.norm_epsilon) == (10000, 1.0, 1e-5)
    assert (a.attention_dropout, a.hidden_dropout, a.init_method_std) == (0.1, 0.1, 0.02)
    assert a.make_vocab_size_divisible_by == 128 and a.add_bias_linear and not a.add_qkv_bias
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size,
            a.expert_model_parallel_size) == (1, 1, 1, 1)
    assert a.distributed_backend is None and a.distributed_timeout_minutes == 10 and a.ddp_bucket_size is None
    assert a.seed == 1234 and a.eval_iters == 100 and a.eval_interval == 1000 and a.log_interval == 100
    assert a.optimizer == "adam" and a.lr is None and a.min_lr == 0.0 and a.lr_decay_style == "linear"
    assert (a.lr_warmup_iters, a.lr_warmup_samples, a.lr_warmup_init) == (0, 0, 0.0)
    assert a.lr_wsd_decay_style == "exponential" and a.weight_decay == 0.01
    assert a.weight_decay_incr_style == "constant" and a.clip_grad == 1.0
    assert (a.adam_beta1, a.adam_beta2, a.adam_eps, a.sgd_momentum) == (0.9, 0.999, 1e-8, 0.9)
    assert a.tokenizer_type is None and a.split is None and a.num_workers == 2 and a.data_path is None
    assert a.wandb_project == "" and a.timing_log_level == 0
    assert a.fp8 is None and a.fp8_recipe == "delayed" and not a.bf16 and not a.fp16


def test_derived_model_values():
    cfg = cfg_of()
    m = cfg.model
    assert (m.ffn_hidden_size, m.kv_channels, m.num_query_groups, m.max_position_embeddings) == (256, 8, 8, 32)
    # default: --seq-length
    assert cfg_of(base=_without("--max-position-embeddings")).model.max_position_embeddings == 32
    assert cfg.num_microbatches == 8 and cfg.train.global_batch_size == 16


def test_global_batch_defaults_to_micro_times_dp():
    cfg = cfg_of(base=_without("--global-batch-size"), world=4)
    assert cfg.train.global_batch_size == 8 and cfg.num_microbatches == 1 and cfg.parallel.dp == 4


def test_run_config_fields():
    cfg = cfg_of(["--tensor-model-parallel-size", "2"], world=4)
    assert isinstance(cfg, RunConfig) and cfg.parallel.dp == 2 and cfg.num_microbatches == 4
    assert cfg.optim.start_weight_decay == cfg.optim.end_weight_decay == 0.01


# ------------------------------------------------------------------ not-yet-supported flags
NOT_YET = [
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex"),
    (["--moe-permute-fusion"], "--moe-permute-fusion"),
    (["--mla-down-proj-fusion"], "--mla-down-proj-fusion"),
    (["--step-batch-size-schedule", "0:16 1B:32"], "--step-batch-size-schedule 0:16 1B:32"),
    (["--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8"),
    (["--fp8-interval", "2"], "--fp8-interval 2"),
    (["--ckpt-format", "torch"], "--ckpt-format torch"),
    (["--position-embedding-type", "mrope"], "--position-embedding-type mrope"),
    (["--tokenizer-type", "BertWordPieceCase"], "--tokenizer-type BertWordPieceCase"),
]


@pytest.mark.parametrize("argv, shown", NOT_YET, ids=[n[1] for n in NOT_YET])
def test_not_yet_supported_is_one_clear_line(argv, shown):
    lines = [line for line in errors_of(argv) if "not available yet" in line]
    assert len(lines) == 1 and lines[0].startswith(shown + ":"), lines


def test_not_yet_table_covers_every_listed_flag():
    parser_dests = {a.dest for a in build_parser()._actions}
    assert set(NOT_YET_SUPPORTED) <= parser_dests
    flagged = {n[0][0] for n in NOT_YET}
    assert {r.flag for r in NOT_YET_SUPPORTED.values()} - flagged <= {
        "--tp-comm-overlap", "--use-megatron-fsdp", "--squared-relu",
        "--use-flash-attn"} | {
        r.flag for r in NOT_YET_SUPPORTED.values() if r.flag.startswith("--moe-")}


def test_not_yet_message_text():
    assert ("--moe-token-dispatcher-type flex: the flex (DeepEP/HybridEP) token dispatcher is not available yet in "
            "this version; use --moe-token-dispatcher-type alltoall or allgather"
            in errors_of(["--moe-token-dispatcher-type", "flex"]))


# ------------------------------------------------------------------ validation rules (one per rule)
RULES = [
    ("world size vs TP x PP x CP", ["--tensor-model-parallel-size", "4"], 6, BASE,
     ["--tensor-model-parallel-size 4", "world size 6"]),
    ("global batch vs micro x DP", ["--global-batch-size", "30", "--micro-batch-size", "4"], 2, BASE,
     ["--global-batch-size 30 is not divisible by --micro-batch-size 4 x data-parallel size 2 = 8"]),
    ("heads vs TP", ["--num-attention-heads", "6", "--hidden-size", "60", "--tensor-model-parallel-size", "4"],
     4, BASE, ["--num-attention-heads 6", "--tensor-model-parallel-size 4"]),
    ("query groups vs TP", ["--group-query-attention", "--num-query-groups", "2",
                            "--tensor-model-parallel-size", "4"], 4, BASE,
     ["--num-query-groups 2", "--tensor-model-parallel-size 4"]),
    ("heads vs query groups", ["--group-query-attention", "--num-query-groups", "3"], 1, BASE,
     ["--num-query-groups 3"]),
    ("layers vs PP x VP", ["--num-layers", "6", "--pipeline-model-parallel-size", "2",
                           "--num-virtual-stages-per-pipeline-rank", "2"], 2, BASE,
     ["--num-layers 6", "--pipeline-model-parallel-size 2"]),
    ("layers per virtual stage", ["--pipeline-model-parallel-size", "2",
                                  "--num-layers-per-virtual-pipeline-stage", "3"], 2, BASE,
     ["--num-layers-per-virtual-pipeline-stage 3"]),
    ("interleaving needs microbatches divisible by PP", ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                                                         "--num-layers-per-virtual-pipeline-stage", "1",
                                                         "--global-batch-size", "6"], 4, BASE,
     ["--global-batch-size 6", "--micro-batch-size 2"]),
    ("both virtual-stage flags", ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                  "1", "--num-virtual-stages-per-pipeline-rank", "2"], 2, BASE,
     ["--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"]),
    ("sequence length vs TP under SP", ["--seq-length", "30", "--tensor-model-parallel-size", "4",
                                        "--sequence-parallel"], 4, BASE, ["--seq-length 30", "--sequence-parallel"]),
    ("hidden vs heads", ["--hidden-size", "60"], 1, BASE, ["--hidden-size 60", "--num-attention-heads 8"]),
    ("missing --lr", [], 1, _without("--lr"), ["--lr is required"]),
    ("required model flag", [], 1, _without("--num-layers"), ["--num-layers is required"]),
    ("required micro batch", [], 1, _without("--micro-batch-size"), ["--micro-batch-size is required"]),
    ("neither train-iters nor train-samples", [], 1, _without("--train-iters"),
     ["--train-iters or --train-samples"]),
    ("both train-iters and train-samples", ["--train-samples", "1600"], 1, BASE,
     ["--train-iters 100 and --train-samples 1600"]),
    ("fp16 with bf16", ["--fp16", "--bf16"], 1, BASE, ["--fp16 and --bf16 are mutually exclusive"]),
    ("param gather without distributed optimizer", ["--overlap-param-gather", "--overlap-grad-reduce"], 1, BASE,
     ["--overlap-param-gather needs --use-distributed-optimizer"]),
    ("param gather without grad overlap", ["--overlap-param-gather", "--use-distributed-optimizer"], 1, BASE,
     ["--overlap-param-gather needs --overlap-grad-reduce"]),
    ("min loss scale", ["--min-loss-scale", "0"], 1, BASE, ["--min-loss-scale 0.0 must be > 0"]),
    ("hysteresis", ["--hysteresis", "0"], 1, BASE, ["--hysteresis must be >= 1"]),
    ("fp8 history", ["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"], 1, BASE,
     ["--fp8-amax-history-len 0 must be >= 1"]),
    ("transformer engine", ["--transformer-impl", "transformer_engine"], 1, BASE,
     ["--transformer-impl transformer_engine needs Transformer Engine with CUDA"]),
    ("warmup fraction with warmup iters", ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], 1, BASE,
     ["--lr-warmup-fraction 0.1 and --lr-warmup-iters 5"]),
    ("warmup fraction with warmup samples", ["--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "5"], 1,
     SAMPLE_BASE, ["--lr-warmup-fraction 0.1 and --lr-warmup-samples 5"]),
    ("decay iters with decay samples", ["--lr-decay-iters", "10", "--lr-decay-samples", "10"], 1, BASE,
     ["--lr-decay-iters 10 and --lr-decay-samples 10"]),
    ("iteration flags with train-samples", ["--lr-decay-iters", "10", "--lr-warmup-iters", "2"], 1, SAMPLE_BASE,
     ["--lr-decay-iters, --lr-warmup-iters", "--train-samples"]),
    ("sample flags with train-iters", ["--lr-warmup-samples", "32"], 1, BASE,
     ["--lr-warmup-samples", "--train-iters"]),
    ("mock data with data path", ["--data-path", "corpus_text_document"], 1, BASE,
     ["--mock-data and --data-path"]),
    ("no data", [], 1, _without("--mock-data"), ["--data-path", "--mock-data"]),
    ("min lr above lr", ["--min-lr", "1e-2"], 1, BASE, ["--min-lr 0.01 is larger than --lr 0.001"]),
    ("warmup init above lr", ["--lr-warmup-init", "1e-2"], 1, BASE, ["--lr-warmup-init 0.01"]),
    ("max positions below seq length", ["--max-position-embeddings", "16"], 1, BASE,
     ["--max-position-embeddings 16 is smaller than --seq-length 32"]),
    ("NullTokenizer without vocab size", [], 1, _without("--vocab-size"),
     ["--tokenizer-type NullTokenizer needs --vocab-size"]),
    ("no tokenizer at all", [], 1, _without("--vocab-size", "--tokenizer-type"), ["--tokenizer-type"]),
    ("GPT2BPETokenizer without files", ["--tokenizer-type", "GPT2BPETokenizer"], 1, _without("--tokenizer-type"),
     ["--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"]),
    ("SentencePiece without model", ["--tokenizer-type", "Llama2Tokenizer"], 1, _without("--tokenizer-type"),
     ["--tokenizer-type Llama2Tokenizer needs --tokenizer-model"]),
    ("WSD without its length", ["--lr-decay-style", "WSD"], 1, BASE, ["--lr-wsd-decay-iters"]),
    ("warmup not shorter than decay", ["--lr-warmup-iters", "100"], 1, BASE,
     ["--lr-warmup-iters", "--lr-decay-iters"]),
    ("start/end wd with constant style", ["--start-weight-decay", "0.0"], 1, BASE,
     ["--start-weight-decay", "--weight-decay-incr-style"]),
    ("wd increment without start/end", ["--weight-decay-incr-style", "linear"], 1, BASE,
     ["--weight-decay-incr-style linear needs both --start-weight-decay and --end-weight-decay"]),
    ("swiglu with openai gelu", ["--swiglu", "--openai-gelu"], 1, BASE, ["--swiglu and --openai-gelu"]),
    ("recompute full without method", ["--recompute-granularity", "full"], 1, BASE,
     ["--recompute-granularity full needs --recompute-method"]),
    ("save interval below 1", ["--save", "ck", "--save-interval", "0"], 1, BASE, ["--save-interval must be >= 1"]),
    ("exit interval below 1", ["--exit-interval", "0"], 1, BASE, ["--exit-interval must be >= 1"]),
    ("checkpoint args without load", ["--use-checkpoint-args"], 1, BASE, ["--use-checkpoint-args needs --load"]),
    # mixture of experts
    ("experts vs EP", MOE + ["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, BASE,
     ["--num-experts 6 is not divisible by --expert-model-parallel-size 4"]),
    ("topk above experts", MOE + ["--moe-router-topk", "5"], 1, BASE,
     ["--moe-router-topk 5 must be between 1 and --num-experts 4"]),
    ("EP x expert-TP vs the ranks of a stage", MOE + ["--expert-model-parallel-size", "4",
                                                     "--pipeline-model-parallel-size", "2"], 4, BASE,
     ["--expert-model-parallel-size 4", "2 ranks of a pipeline stage"]),
    ("EP x TP x PP vs world size", MOE + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                          "--pipeline-model-parallel-size", "2", "--sequence-parallel"], 6, BASE,
     ["--tensor-model-parallel-size 2", "world size 6"]),
    ("alltoall with context parallelism", MOE + ["--moe-token-dispatcher-type", "alltoall",
                                                 "--context-parallel-size", "2"], 2, BASE,
     ["--num-experts with --context-parallel-size 2 is not available yet"]),
    ("capacity factor zero", MOE + ["--moe-expert-capacity-factor", "0"], 1, BASE,
     ["--moe-expert-capacity-factor must be > 0"]),
    ("capacity factor negative", MOE + ["--moe-expert-capacity-factor", "-1"], 1, BASE,
     ["--moe-expert-capacity-factor must be > 0"]),
    ("EP without experts", ["--expert-model-parallel-size", "2"], 2, BASE,
     ["--expert-model-parallel-size 2 need --num-experts"]),
    ("MoE with TP needs SP", MOE + ["--tensor-model-parallel-size", "2"], 2, BASE,
     ["--num-experts with --tensor-model-parallel-size 2 needs --sequence-parallel"]),
    ("expert bias needs sigmoid", MOE + ["--moe-router-enable-expert-bias"], 1, BASE,
     ["--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"]),
    ("MoE with biases", ["--num-experts", "4"], 1, BASE, ["pass --disable-bias-linear"]),
    ("moe ffn vs expert-TP", MOE + ["--moe-ffn-hidden-size", "30", "--tensor-model-parallel-size", "4",
                                    "--sequence-parallel"], 4, BASE,
     ["--moe-ffn-hidden-size 30 is not divisible by the expert tensor-parallel size 4"]),
    ("moe layer pattern length", MOE + ["--moe-layer-freq", "([1]*3)"], 1, BASE,
     ["--moe-layer-freq pattern must hold one 0 or 1 per layer (4)"]),
    ("FSDP2 with per-token loss", ["--use-torch-fsdp2", "--calculate-per-token-loss"], 2, BASE,
     ["--use-torch-fsdp2 with --calculate-per-token-loss"]),
    ("sinkhorn", MOE + ["--moe-router-load-balancing-type", "sinkhorn"], 1, BASE, ["Sinkhorn"]),
    ("group topk without groups", MOE + ["--moe-router-group-topk", "2"], 1, BASE,
     ["--moe-router-group-topk needs --moe-router-num-groups"]),
]


@pytest.mark.parametrize("name, argv, world, base, needles", RULES, ids=[r[0] for r in RULES])
def test_validation_rule(name, argv, world, base, needles):
    lines = errors_of(argv, world, base)
    assert any(all(n in line for n in needles) for line in lines), lines


def test_all_errors_reported_together():
    lines = errors_of(["--global-batch-size", "30", "--micro-batch-size", "4", "--min-lr", "1"], world=2,
                      base=_without("--vocab-size"))
    assert len(lines) == 3
    assert any("--global-batch-size" in line for line in lines) and any("--min-lr" in line for line in lines)
    assert any("--vocab-size" in line for line in lines)


def test_num_query_groups_ignored_without_gqa():
    cfg = cfg_of(["--num-query-groups", "3"])  # 8 heads: 3 would be invalid if it were used
    assert cfg.model.num_query_groups == 8


def test_valid_config_passes():
    validate_args(parse_args(BASE), 1)
    validate_args(parse_args(SAMPLE_BASE + ["--lr-warmup-fraction", "0.01", "--lr-decay-style", "WSD",
                                            "--lr-wsd-decay-samples", "100"]), 1)
    validate_args(parse_args(BASE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--overlap-grad-reduce", "--ddp-bucket-size", "1000"]), 8)


# ------------------------------------------------------------------ entry-point behaviour
def test_exit_on_config_error_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        exit_on_config_error(lambda: configs_from_args(
            parse_args(BASE + ["--global-batch-size", "6", "--micro-batch-size", "4"]), 1))
    assert e.value.code == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --global-batch-size 6") and "Traceback" not in out.err
    assert out.out == ""


def test_exit_on_config_error_returns_value():
    assert exit_on_config_error(lambda: 5) == 5


def test_unknown_flag_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + ["--no-such-flag", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error:") and "--no-such-flag" in err[0] and len(err) <= 2
    assert "--help" in err[-1]


def test_no_abbreviations(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--tensor-model", "2"])
