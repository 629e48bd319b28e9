"""Every derived configuration value: its formula, and that it is worked out in one place only.

Each test checks the value against its formula, that the consumers read the one definition (the same property or
function), and a grep over ``megatronish/`` that the formula is not written out anywhere else.
"""
import dataclasses
import json
import os
import re

import pytest

from megatronish import arguments, parallel_config
from megatronish.arguments import configs_from_args, exit_on_config_error, parse_args, validate_args
from megatronish.checkpoint.common import jsonable
from megatronish.config import DataConfig, ModelConfig, RunConfig, default_ffn_hidden_size, gpt2
from megatronish.errors import ConfigError, UserError
from megatronish.parallel import dims as dims_module
from megatronish.parallel.dims import DegreeError, ParallelDims
from megatronish.parallel_config import check_layer_split, validate_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "megatronish")

FLAGS = {"--num-layers": "8", "--hidden-size": "64", "--num-attention-heads": "8", "--seq-length": "32",
         "--micro-batch-size": "2", "--train-iters": "100", "--lr": "1e-3", "--mock-data": None,
         "--tokenizer-type": "NullTokenizer", "--vocab-size": "100"}


def without(*dropped: str) -> list[str]:
    """The base command line minus the ``dropped`` flags (and their values)."""
    return [part for flag, value in FLAGS.items() if flag not in dropped
            for part in ((flag,) if value is None else (flag, value))]


BASE = without()


def cfg_of(extra=(), world=1, base=BASE):
    return configs_from_args(parse_args(list(base) + list(extra)), world)


def modules_matching(pattern: str) -> set[str]:
    """Package-relative paths of the modules under ``megatronish/`` whose code (comments and docstring lines
    aside) matches ``pattern``."""
    rx, hits = re.compile(pattern), set()
    for root, _, files in os.walk(PKG):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path) as f:
                code = [line.split("#")[0] for line in f if not line.lstrip().startswith(("#", '"', "``"))]
            if any(rx.search(line) for line in code):
                hits.add(os.path.relpath(path, PKG))
    return hits


# ------------------------------------------------------------------ global batch size default
def test_global_batch_size_default_is_micro_times_dp():
    cfg = cfg_of(world=4)
    assert cfg.train.global_batch_size == 2 * 4 == cfg.data_parallel_batch_size
    assert cfg_of(["--global-batch-size", "32"], world=4).train.global_batch_size == 32
    # one place: RunConfig fills it; no other module multiplies the micro batch by the DP size for it
    assert modules_matching(r"micro_batch_size \* (self\.)?(parallel|dims|par)\.dp") == {"config.py"}
    assert modules_matching(r"argparse\.Namespace\(\*\*") == set()  # the old fake-namespace probe is gone


def test_train_iters_from_train_samples():
    cfg = cfg_of(["--train-samples", "1600", "--global-batch-size", "16"], base=without("--train-iters"))
    assert cfg.train.train_iters == 1600 // 16
    assert modules_matching(r"train_samples // ") == {"config.py"}


# ------------------------------------------------------------------ number of microbatches
def test_num_microbatches_is_one_property():
    cfg = cfg_of(["--global-batch-size", "32"], world=2)
    assert cfg.num_microbatches == 32 // (2 * 2) == 8
    assert isinstance(RunConfig.__dict__["num_microbatches"], property)
    assert "num_microbatches" not in {f.name for f in dataclasses.fields(RunConfig)}
    assert modules_matching(r"global_batch_size // ") == {"config.py"}


# ------------------------------------------------------------------ effective sequence parallelism
@pytest.mark.parametrize("flag, tp", [(False, 1), (True, 1), (False, 2), (True, 2), (True, 4)])
def test_effective_sequence_parallel(flag, tp):
    expected = flag and tp > 1
    cfg = cfg_of(["--tensor-model-parallel-size", str(tp)] + (["--sequence-parallel"] if flag else []), world=tp)
    assert cfg.sequence_parallel is expected and cfg.sequence_parallel_flag is flag
    # consumers take the resolved boolean: the pipeline tensor shape and the memory formula
    from megatronish.parallel.pipeline.schedules import pipeline_tensor_shape
    from megatronish.training.memory import activation_bytes_per_layer

    sp = cfg.sequence_parallel
    assert pipeline_tensor_shape(32, 2, 64, tp=tp, sequence_parallel=sp)[0] == (32 // tp if expected else 32)
    assert activation_bytes_per_layer(32, 2, 64, 8, t=tp, sequence_parallel=sp, recompute="full") == \
        2 * 32 * 2 * 64 / (tp if expected else 1)


def test_effective_sequence_parallel_in_one_place():
    assert isinstance(RunConfig.__dict__["sequence_parallel"], property)
    assert modules_matching(r"sequence_parallel(_flag)?\)? and (self\.)?[\w.]+ > 1") == {"config.py"}
    assert modules_matching(r"effective_sequence_parallel") == set()


def test_layers_take_the_resolved_sequence_parallel():
    from megatronish.parallel.layers import ColumnParallelLinear, RowParallelLinear

    for sp in (False, True):
        assert ColumnParallelLinear(8, 8, sequence_parallel=sp).sequence_parallel is sp
        assert RowParallelLinear(8, 8, sequence_parallel=sp).sequence_parallel is sp


# ------------------------------------------------------------------ FFN hidden size default
def test_ffn_hidden_size_default():
    assert default_ffn_hidden_size(64) == 256
    assert default_ffn_hidden_size(96, swiglu=True) == int(4 * 96 * 2 / 3 / 64) * 64 == 256
    assert gpt2(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=8).ffn_hidden_size == 256
    assert cfg_of(["--swiglu"]).model.ffn_hidden_size == default_ffn_hidden_size(64, swiglu=True)
    assert cfg_of(["--ffn-hidden-size", "200"]).model.ffn_hidden_size == 200
    # the memory formula's default is the same function
    from megatronish.training.memory import activation_bytes_per_layer

    for swiglu in (False, True):
        assert activation_bytes_per_layer(32, 2, 96, 8, swiglu=swiglu) == activation_bytes_per_layer(
            32, 2, 96, 8, swiglu=swiglu, ffn_hidden_size=default_ffn_hidden_size(96, swiglu))
    assert modules_matching(r"\(4 \* \w+ \* 2 / 3\)") == {"model_config.py"}
    assert modules_matching(r"4 \* h if ffn_hidden_size is None") == set()


# ------------------------------------------------------------------ max position embeddings default
def test_max_position_embeddings_default():
    assert cfg_of().model.max_position_embeddings == 32  # = --seq-length
    assert cfg_of(["--max-position-embeddings", "64"]).model.max_position_embeddings == 64
    assert gpt2(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=8, seq_length=12) \
        .max_position_embeddings == 12
    assert modules_matching(r"\bmax_position_embeddings or ") == set()
    assert modules_matching(r"max_position_embeddings\"?\]? = self\.seq_length") == {"model_config.py"}


# ------------------------------------------------------------------ one sequence length
def test_one_seq_length():
    assert "seq_length" not in {f.name for f in dataclasses.fields(DataConfig)}
    assert "seq_length" in {f.name for f in dataclasses.fields(ModelConfig)}
    assert modules_matching(r"\bdata\.seq_length|\bd\.seq_length") == set()


# ------------------------------------------------------------------ layers per stage and chunk
@pytest.mark.parametrize("layers, pp, vp", [(8, 1, 1), (8, 2, 1), (8, 2, 2), (16, 4, 2), (12, 3, 4)])
def test_layers_per_stage(layers, pp, vp):
    d = ParallelDims(world_size=pp, pp=pp, vp=vp)
    assert d.layers_per_stage(layers) == layers // (pp * vp)
    ranges = [d.layer_range(layers, r, c) for r in range(pp) for c in range(vp)]
    assert all(len(r) == d.layers_per_stage(layers) for r in ranges)
    assert sorted(i for r in ranges for i in r) == list(range(layers))


def test_layer_split_is_one_rule_with_one_message():
    from megatronish.model import build

    assert build.check_layer_split is check_layer_split  # re-exported, not redefined
    with pytest.raises(ConfigError) as direct:
        check_layer_split(6, 2, 2)
    message = str(direct.value)
    d = ParallelDims(world_size=2, pp=2, vp=2)
    with pytest.raises(DegreeError) as via_range:  # parallel/ states the numbers, config names the flags
        d.layer_range(6, 0, 0)
    assert "--" not in str(via_range.value) and via_range.value.kind == "layer_split"
    with pytest.raises(ConfigError) as via_model:
        validate_model(d, num_layers=6, num_attention_heads=2)
    with pytest.raises(ConfigError) as via_flags:
        validate_args(parse_args(without("--num-layers") + ["--num-layers", "6", "--pipeline-model-parallel-size", "2",
                                                           "--num-virtual-stages-per-pipeline-rank", "2"]), 2)
    assert str(via_model.value) == message
    assert message in str(via_flags.value).splitlines()
    assert modules_matching(r"num_layers % \(pp \* vp\)|\blayers % pp") == {"parallel/dims.py"}


# ------------------------------------------------------------------ virtual stages from layers per stage
def test_virtual_stages_from_layers_per_virtual_stage():
    cfg = cfg_of(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                  "--global-batch-size", "8"], world=2)
    assert cfg.parallel.vp == 8 // (2 * 2) == parallel_config.virtual_stages_from_layers(8, 2, 2)
    assert cfg_of(["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "4",
                   "--global-batch-size", "8"], world=2).parallel.vp == 4
    assert modules_matching(r"virtual_stages_from_layers\(") == {"parallel_config.py", "arguments/mapping.py"}


# ------------------------------------------------------------------ the tokenizer, built once
def test_tokenizer_built_once(monkeypatch):
    from megatronish.data import tokenizers

    calls = []
    real = tokenizers.build_tokenizer
    monkeypatch.setattr(tokenizers, "build_tokenizer", lambda *a, **k: calls.append(a) or real(*a, **k))
    cfg = cfg_of()
    assert cfg.model.vocab_size == cfg.data.tokenizer.vocab_size == 101  # NullTokenizer: N + eod
    assert cfg.data.tokenizer is cfg.data.tokenizer and len(calls) == 1
    # the data pipeline takes the run's tokenizer; nothing else in the package builds one (but the preprocessing
    # tool, which has no run)
    assert modules_matching(r"build_tokenizer\(") == {"config.py", "data/tokenizers/__init__.py",
                                                      "data/preprocess/encoder.py"}
    # never serialized into a checkpoint's config, and the saved config is plain JSON
    saved = jsonable(cfg)
    assert "tokenizer" not in saved["data"] and json.loads(json.dumps(saved)) == saved
    assert saved["model"]["seq_length"] == 32 and "seq_length" not in saved["data"]


def test_tokenizer_file_error_is_one_config_error(tmp_path):
    args = parse_args(without("--vocab-size", "--tokenizer-type") + [
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "missing.json"),
        "--merge-file", str(tmp_path / "missing.txt")])
    with pytest.raises(ConfigError) as e:
        configs_from_args(args, 1)
    assert len(str(e.value).splitlines()) == 1


# ------------------------------------------------------------------ flags -> configs by field name
def test_every_config_field_comes_from_its_flag_or_a_rule():
    dests = {a.dest for a in arguments.build_parser()._actions}
    rules = arguments._rules(parse_args(BASE))
    for cls in (arguments.ModelConfig, arguments.TrainingConfig, arguments.OptimizerConfig,
                arguments.LoggingConfig, arguments.DataConfig, arguments.CheckpointConfig):
        # the model config's groups hold Megatron's flat names: one flag per field, groups included
        names = ModelConfig.flat_names() if cls is arguments.ModelConfig else {f.name for f in dataclasses.fields(cls)}
        unnamed = names - dests - set(rules.get(cls, {}))
        assert unnamed <= {"vocab_size"}, (cls.__name__, unnamed)  # the model's vocabulary is the tokenizer's
        assert set(rules.get(cls, {})) <= names


# ------------------------------------------------------------------ frozen configs, a grouped model config
def test_every_config_is_frozen_and_derived_copies_leave_the_original():
    from megatronish import config as config_module
    from megatronish import model_config

    classes = [c for mod in (config_module, model_config) for c in vars(mod).values()
               if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == mod.__name__]
    assert len(classes) >= 12
    assert [c.__name__ for c in classes if not c.__dataclass_params__.frozen] == []
    cfg = cfg_of()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.train_iters = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.moe.num_experts = 2
    given = dataclasses.replace(cfg.train, global_batch_size=None)
    derived = RunConfig(model=cfg.model, parallel=cfg.parallel, train=given, optim=cfg.optim, logging=cfg.logging,
                        data=cfg.data)
    assert derived.train.global_batch_size == cfg.data_parallel_batch_size and given.global_batch_size is None
    # a flat Megatron name read from the top says where it lives; replace() takes flat names
    with pytest.raises(AttributeError, match=r"ModelConfig\.moe_router_topk is ModelConfig\.moe\.moe_router_topk"):
        cfg.model.moe_router_topk  # noqa: B018
    other = cfg.model.replace(moe_router_topk=1, rotary_base=500000, hidden_size=cfg.model.hidden_size)
    assert (other.moe.moe_router_topk, other.attention.rotary_base) == (1, 500000)
    assert (cfg.model.moe.moe_router_topk, cfg.model.attention.rotary_base) == (2, 10000)
    assert ModelConfig.from_flat(cfg.model.flat()) == cfg.model


# ------------------------------------------------------------------ validate() on a config
def test_validate_on_a_config_lists_every_problem():
    cfg = cfg_of(["--global-batch-size", "16"], world=2)
    arguments.validate(cfg)
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=30),
                              optim=dataclasses.replace(cfg.optim, min_lr=1.0))
    with pytest.raises(ConfigError) as e:
        arguments.validate(bad)
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and any("--global-batch-size 30" in line for line in lines)
    assert any("--min-lr" in line for line in lines)


# ------------------------------------------------------------------ one error family
def test_user_errors_are_one_family(capsys):
    from megatronish.checkpoint.dcp_io import CheckpointError
    from megatronish.data.blending import BlendError
    from megatronish.data.indexed_dataset import IndexedDatasetError
    from megatronish.data.tokenizers import TokenizerError

    for cls in (ConfigError, CheckpointError, TokenizerError, BlendError, IndexedDatasetError):
        assert issubclass(cls, UserError) and issubclass(cls, ValueError)
    assert dims_module.ConfigError is ConfigError

    def bad_split():
        raise BlendError("--split 'x' must hold 1 to 3 non-negative numbers")

    with pytest.raises(SystemExit) as e:
        exit_on_config_error(bad_split)
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: --split 'x' must hold 1 to 3 non-negative numbers\n"


# ------------------------------------------------------------------ FSDP2 active
@pytest.mark.parametrize("flag, world", [(False, 2), (True, 1), (True, 2)])
def test_fsdp_active_is_one_property(flag, world):
    cfg = cfg_of(["--use-torch-fsdp2"] if flag else [], world=world)
    assert cfg.fsdp_active is (flag and world > 1)
    assert isinstance(RunConfig.__dict__["fsdp_active"], property)
    assert modules_matching(r"use_torch_fsdp2.*\.dp \* ") == {"config.py"}
