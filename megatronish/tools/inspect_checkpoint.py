"""Print a checkpoint's iteration, config and tensors with their global shapes.

    megatronish-inspect-checkpoint CKPT_DIR                 # a --save directory (follows its tracker)
    megatronish-inspect-checkpoint CKPT_DIR/iter_0000100 --config --json
    python tools/checkpoint/inspect_checkpoint.py CKPT_DIR  # the same, from a checkout

Runs in one process without torch.distributed; reads no tensor data (``--stats`` reads each model tensor,
one at a time, to print its norm; ``--verify`` reads every tensor item of every shard file and checks it against
its CRC-32s: one line per damaged item, exit 1 if any).
"""
from __future__ import annotations

import json
import math
import sys

from ..checkpoint import dcp_io
from ..checkpoint.offline import CheckpointError, iter_model_tensors, read_checkpoint_meta
from ..errors import CommandLineParser


def _dtype(d) -> str:
    return str(d).removeprefix("torch.") if d is not None else "-"


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def _verify(iter_dir: str) -> int:
    md = dcp_io.read_index(iter_dir)
    dcp_io.check_files(iter_dir, md)
    items, nbytes, problems = dcp_io.verify_directory(iter_dir, md)
    for line in problems:
        sys.stderr.write(f"error: {line}\n")
    print(f"{iter_dir}: {items} tensor items, {nbytes / 1e6:.1f} MB checked, "
          f"{'no damage found' if not problems else f'{len(problems)} damaged'}")
    return 1 if problems else 0


def main(argv=None) -> int:
    p = CommandLineParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="a --save directory or one iter_XXXXXXX / release directory in it")
    p.add_argument("--config", action="store_true", help="print the full stored run config")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--stats", action="store_true", help="also read each model tensor and print its norm")
    p.add_argument("--verify", action="store_true",
                   help="check every tensor item of the checkpoint against its CRC-32s (reads all of it)")
    a = p.parse_args(argv)
    try:
        meta = read_checkpoint_meta(a.path)
        if a.verify:
            return _verify(meta["iter_dir"])
        norms = {name: float(t.float().norm()) for name, t in iter_model_tensors(a.path)} if a.stats else {}
    except CheckpointError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    if a.json:
        out = {k: v for k, v in meta.items() if k != "common"}
        for section in ("tensors", "optimizer_tensors"):
            out[section] = {n: {"shape": list(v["shape"]), "dtype": _dtype(v["dtype"]),
                                **({"norm": norms[n]} if n in norms else {})} for n, v in meta[section].items()}
        out["scheduler"] = meta["common"].get("scheduler")
        out["optimizer"] = meta["common"].get("optimizer")
        print(json.dumps(out, indent=1, default=str))
        return 0

    c = meta["common"]
    model = (meta["config"] or {}).get("model") or {}
    print(f"checkpoint      {meta['iter_dir']}")
    print(f"iteration       {'release' if meta['release'] else meta['iteration']}")
    print(f"consumed        train {meta['consumed_train_samples']} samples, valid {meta['consumed_valid_samples']}")
    print(f"code version    {meta['code_version']}")
    print(f"saved layout    {meta['layout']}")
    shape_keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "vocab_size", "seq_length", "swiglu", "normalization", "position_embedding_type")
    print("model           " + ", ".join(f"{k}={model[k]}" for k in shape_keys if k in model))
    opt = c.get("optimizer")
    opt_text = f"{opt['class']} {opt['param_state_keys']} {opt.get('scalars')}" if opt else "not saved"
    print(f"optimizer       {opt_text}")
    print(f"scheduler       {c.get('scheduler')}")
    print(f"rng states      {'saved' if c.get('has_rng') else 'not saved'}; fp8: {'saved' if c.get('fp8') else 'no'}")
    total = sum(_numel(v["shape"]) for v in meta["tensors"].values())
    print(f"\nmodel tensors ({len(meta['tensors'])}, {total:,} elements):")
    width = max((len(n) for n in meta["tensors"]), default=10)
    for name, v in meta["tensors"].items():
        extra = f"  norm {norms[name]:.6g}" if name in norms else ""
        print(f"  {name:<{width}}  {_dtype(v['dtype']):<9} {list(v['shape'])}{extra}")
    if meta["optimizer_tensors"]:
        print(f"\noptimizer tensors ({len(meta['optimizer_tensors'])}):")
        width = max(len(n) for n in meta["optimizer_tensors"])
        for name, v in meta["optimizer_tensors"].items():
            print(f"  {name:<{width}}  {_dtype(v['dtype']):<9} {list(v['shape'])}")
    if meta["other_entries"]:
        print(f"\nother entries: {', '.join(meta['other_entries'])}")
    if a.config:
        print("\nconfig:")
        print(json.dumps(meta["config"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
