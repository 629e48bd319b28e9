#!/usr/bin/env python
"""How far ``--torch-compile`` moves the gradients, per parallel layout: each layout trains the small model of
``tests/distributed/test_torch_compile.py`` (2 layers, hidden 32, SwiGLU, RMSNorm, RoPE, SGD, 3 iterations) with
compiled layers and loss, and is compared with the eager one-process run from the same seed: whether the losses
are identical, and the largest gradient difference of any tensor in any iteration as a fraction of that tensor's
largest gradient (``max |g - g_eager| / max |g_eager|``), with the compile time rank 0 reports. The test checks
FSDP2 at DP 2 only (rtol 1e-5); this script measures the other layouts too. Forked gloo ranks on CPU.

    python benchmarks/bench_compile_parity.py [--layouts one fsdp2-dp2 tp2-sp-pp2-recompute tp2-sp-fsdp2]
"""
import argparse
import re

from megatronish.testing import repo_test_module, run_distributed

_TEST = repo_test_module("distributed/test_torch_compile.py")  # the test's own model and runs, not a copy
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {  # name: (world size, flags besides --torch-compile)
    "one": (1, []),
    "fsdp2-dp2": (2, ["--use-torch-fsdp2"]),
    "tp2-sp-pp2-recompute": (4, TP2_SP + ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                                          "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    "tp2-sp-fsdp2": (4, TP2_SP + ["--use-torch-fsdp2"]),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    a = p.parse_args()
    ref = run_distributed(_TEST._worker, 1, [])[0]  # rank 0's losses, global gradients of every iteration and log
    ref_losses, ref_grads = ref["losses"], ref["grads"]
    print(f"eager one process: losses {[f'{x:.6f}' for x in ref_losses]}")
    for name in a.layouts:
        world, flags = LAYOUTS[name]
        got = run_distributed(_TEST._worker, world, flags + ["--torch-compile"], timeout=1800)[0]
        losses, grads, log = got["losses"], got["grads"], got["log"]
        # the rows of the one-process model (TP pads the vocabulary further: those rows are not in the reference)
        worst = max(float(abs(g[k][tuple(slice(0, n) for n in r[k].shape)] - r[k]).max()
                          / max(abs(r[k]).max(), 1e-30)) for g, r in zip(grads, ref_grads) for k in r)
        took = re.search(r"compiled in ([0-9.]+) s", log)
        print(f"{name} ({world} processes): losses identical: {losses == ref_losses}; largest gradient difference "
              f"{worst:.1e} of the tensor's largest gradient; compile {took.group(1) if took else '?'} s (rank 0)")


if __name__ == "__main__":
    main()
