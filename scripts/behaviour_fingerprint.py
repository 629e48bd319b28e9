#!/usr/bin/env python
"""Training's numbers, bit for bit: a fingerprint to compare before and after a change that must not change them.

Runs ``pretrain_gpt``'s training (``configs_from_args`` -> ``training.setup`` -> ``training.train_step``) for a
few iterations of tiny fp32 models in six layouts (one process; TP 2 + SP; PP 2 x VP 2 with the distributed
optimizer; CP 2 x TP 2; EP 2 x PP 2 MoE; FSDP2 DP 2), each in forked gloo ranks (``megatronish.testing``), and
writes every iteration's loss and gradient norm as exact float hex to a JSON file.

Checkpoints: the layouts in ``CHECKPOINTED`` also save their final state under ``--ckpt-dir`` (when it holds no
checkpoint of that layout yet) and then train ``RESUME_ITERS`` more iterations from the checkpoint found there;
those losses are in the fingerprint too. Keep the directory from the first run and pass it again to check that
checkpoints written by the old code load, and train the same, under the new one.

    python scripts/behaviour_fingerprint.py --out /tmp/fingerprint_before.json --ckpt-dir /tmp/fingerprint_ckpt
    python scripts/behaviour_fingerprint.py --out /tmp/fingerprint_after.json --ckpt-dir /tmp/fingerprint_ckpt \
        --compare /tmp/fingerprint_before.json

``--compare`` exits 1 and lists every value that differs in any bit.
"""
import argparse
import json
import os
import sys

ITERS = 3
RESUME_ITERS = 2
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1000",
        "--seed", "7"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
MOE = ["--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-ffn-hidden-size", "16",
       "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall"]
LAYOUTS = {  # name: (world size, flags)
    "one-process": (1, ["--swiglu"]),
    "tp2-sp": (2, TP2 + ["--sequence-parallel"]),
    "pp2-vp2-distopt": (4, PP2 + ["--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer"]),
    "cp2-tp2": (4, TP2 + ["--context-parallel-size", "2", "--sequence-parallel"]),
    "ep2-pp2-moe": (4, PP2 + ["--expert-model-parallel-size", "2"] + MOE),
    "fsdp2-dp2": (2, ["--use-torch-fsdp2"]),
}
CHECKPOINTED = ("one-process", "ep2-pp2-moe")


def _hex(x):
    return None if x is None else float(x).hex()


def _train(argv, world, iters):
    """Train until iteration ``iters`` (of a run configured for ``ITERS + RESUME_ITERS``)."""
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.parallel import groups
    from megatronish.training import pretrain as training

    groups.destroy_model_parallel()
    cfg = configs_from_args(parse_args(BASE + argv + ["--train-iters", str(ITERS + RESUME_ITERS)]), world)
    run, state = training.setup(cfg)
    losses, norms = [], []
    while state.iteration < iters:
        result = training.train_step(run, state)
        losses.append(_hex(result.loss))
        norms.append(_hex(result.grad_norm))
    run.checkpointer.finish(state)  # the final save under --save (no-op without it)
    return {"first_iteration": iters - len(losses) + 1, "losses": losses, "grad_norms": norms}


def _worker(rank, world, name, flags, ckpt_dir):
    out = {"train": _train(flags, world, ITERS)}
    if ckpt_dir is not None:
        path = os.path.join(ckpt_dir, name)
        if not os.path.exists(os.path.join(path, "latest_checkpointed_iteration.txt")):
            _train(flags + ["--save", path], world, ITERS)
        out["resumed"] = _train(flags + ["--load", path], world, ITERS + RESUME_ITERS)
    return out if rank == 0 else None


def fingerprint(ckpt_dir):
    from megatronish.testing import run_distributed

    out = {}
    for name, (world, flags) in LAYOUTS.items():
        print(f"fingerprint: {name} ({world} ranks)", file=sys.stderr, flush=True)
        out[name] = run_distributed(_worker, world, name, flags, ckpt_dir if name in CHECKPOINTED else None,
                                    timeout=900)[0]
    return out


def _differences(old, new, where=""):
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(old.keys() | new.keys()):
            if k not in old or k not in new:
                yield f"{where}/{k}: only in {'new' if k not in old else 'old'}"
            else:
                yield from _differences(old[k], new[k], f"{where}/{k}")
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            yield from _differences(a, b, f"{where}[{i}]")
    elif old != new:
        yield f"{where}: {old} -> {new}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="write the fingerprint (JSON) here")
    p.add_argument("--ckpt-dir", help="checkpoints of the CHECKPOINTED layouts: saved when absent, then loaded")
    p.add_argument("--compare", metavar="OLD.json", help="report every value that differs from this fingerprint")
    args = p.parse_args(argv)
    result = {"iters": ITERS, "resume_iters": RESUME_ITERS, "layouts": fingerprint(args.ckpt_dir)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"wrote {args.out}")
    if args.compare:
        with open(args.compare) as f:
            diffs = list(_differences(json.load(f), result))
        print("\n".join(diffs) if diffs else f"identical to {args.compare}, bit for bit")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
