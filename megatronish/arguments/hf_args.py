"""``--load <Hugging Face model directory>``: the model flags from its ``config.json``.

The architecture flags are taken from the directory as ``--use-checkpoint-args`` takes them from one of our
checkpoints (``checkpoint/args.py``), with one difference: a flag given on the command line that contradicts the
config is an error naming both (a checkpoint's config silently wins there, as in Megatron-LM). ``--seq-length``
stays the command line's (default: ``max_position_embeddings``), and so does ``--max-position-embeddings`` for
rotary models (it decides no weight). The run starts from iteration 0 with a fresh optimizer (as ``--finetune``).
A DeepSeek-V3 directory's multi-token-prediction layers are the run's only with ``--mtp-num-layers`` (at most
``num_nextn_predict_layers``).

The tokenizer: with no tokenizer flag, a directory holding ``tokenizer.json`` or ``tokenizer_config.json`` gives
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <dir>``; otherwise ``NullTokenizer`` over the model's
vocabulary (pre-tokenized data), as ``--use-checkpoint-args`` does. The model's vocabulary is ``vocab_size`` of
``config.json`` (every row of the embedding is kept, as the loss over them is transformers'); a tokenizer with more
tokens is an error.
"""
from __future__ import annotations

import json
import os

from ..checkpoint.args import _FORCED, _IF_UNSET
from ..convert.hf_config import ConvertError, model_config_from_hf
from ..convert.hf_deepseek import DEEPSEEK_V3
from ..errors import ConfigError

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
# The run's choice with a Hugging Face directory, whatever its config: the multi-token-prediction depths it trains
# (at most the directory's num_nextn_predict_layers, checked by ``_mtp_errors``) and their loss weight.
_RUN_CHOOSES = ("mtp_num_layers", "mtp_loss_scaling_factor")
_FREE = ("seq_length",)  # the command line's, whatever the config says
_FREE_WITH_ROPE = ("max_position_embeddings",)
# the config's unless given: training choices that decide no weight
_UNLESS_GIVEN = ("moe_aux_loss_coeff", "moe_grouped_gemm")


def read_hf_config(path: str) -> dict:
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg) as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--load {path}: cannot read {cfg} ({e}); give a Hugging Face model directory with a "
                          "valid config.json") from None
    if not isinstance(out, dict):
        raise ConfigError(f"--load {path}: {cfg} is not a JSON object")
    return out


def _options(parser) -> dict[str, tuple[str, object]]:
    """dest -> (first option string, default) of every flag; a dest two flags share (``--x`` / ``--no-x``)
    keeps its first flag's, whose default argparse puts in the namespace."""
    out: dict[str, tuple[str, object]] = {}
    for a in parser._actions:
        if a.option_strings:
            out.setdefault(a.dest, (a.option_strings[0], a.default))
    return out


def hf_arg_values(args, path: str, parser) -> tuple[dict, int]:
    """``(flag values by dest, the model's vocabulary size)`` that the HF directory ``path`` gives a run with the
    flags ``args`` (only read); ``parser``: the parser that made ``args`` (for the defaults). One
    :class:`ConfigError` line per contradicting flag."""
    where = f"{path}/config.json"
    hf = read_hf_config(path)
    try:
        model, arch = model_config_from_hf(hf, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                           where=where)
    except ConvertError as e:
        raise ConfigError(f"--load {path}: {e}") from None
    flat = model.flat()
    opts = _options(parser)
    free = _FREE + (_FREE_WITH_ROPE if flat.get("position_embedding_type") == "rope" else ())
    groups = flat["num_query_groups"]
    wanted = {f: flat[f] for f in (*_IF_UNSET, *_FORCED, *_UNLESS_GIVEN)
              if f in flat and hasattr(args, f) and f not in _RUN_CHOOSES}
    wanted.update(group_query_attention=groups != flat["num_attention_heads"], num_query_groups=groups)
    values, errors = {}, []
    for dest, value in wanted.items():
        given = getattr(args, dest)
        option, default = opts.get(dest, (f"--{dest.replace('_', '-')}", None))
        if dest in free or dest in _UNLESS_GIVEN:
            if given is None or (dest in _UNLESS_GIVEN and given == default):
                values[dest] = value
            continue
        if dest == "num_query_groups" and not args.group_query_attention:
            given = default  # without --group-query-attention the flag is not used
        if given != default and given != value and not (isinstance(value, float) and given == float(value)):
            errors.append(f"{option} {_show(given)} contradicts --load {where}, which gives {dest} {_show(value)}; "
                          f"drop {option} (the model's architecture is its config's)")
        values[dest] = value
    errors += _mtp_errors(args, hf, arch, where)
    if errors:
        raise ConfigError("\n".join(errors))
    if args.tokenizer_type is None and args.vocab_file is None and args.tokenizer_model is None \
            and args.vocab_size is None:
        if any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_MARKERS):
            values.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path)
        else:
            values.update(tokenizer_type="NullTokenizer", vocab_size=flat["vocab_size"] - 1)
    return values, int(flat["vocab_size"])


def _mtp_errors(args, hf: dict, arch: str, where: str) -> list[str]:
    """``--mtp-num-layers N`` loads the first N multi-token-prediction layers of a DeepSeek-V3 directory (the
    config's ``num_nextn_predict_layers`` does not turn them on: transformers leaves them unused and Megatron-LM
    trains without them unless given)."""
    n = getattr(args, "mtp_num_layers", None)
    if not n:
        return []
    if arch != DEEPSEEK_V3:
        return [f"--mtp-num-layers {n} with --load {where}: only {DEEPSEEK_V3} directories carry multi-token-"
                f"prediction weights ({arch} does not); drop --mtp-num-layers"]
    have = int(hf.get("num_nextn_predict_layers") or 0)
    if n > have:
        return [f"--mtp-num-layers {n}: --load {where} has num_nextn_predict_layers {have}; give at most {have} "
                "or drop --mtp-num-layers"]
    return []


def _show(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
