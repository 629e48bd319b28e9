"""``--torch-compile``: compiled transformer layers and loss train as eager does. One small model (CPU compiles
take about a minute): FSDP2 at DP 2 with compiled layers against the eager one-process run, 3 iterations, losses and
every gradient within rtol 1e-5 (measured: equal to ~1e-6). Without a compiler the run stays eager, with one
warning."""
import io
from contextlib import redirect_stdout

import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel import groups
from megatronish.testing import assert_parity, global_tensors, run_distributed
from megatronish.training import compile as compile_mod
from megatronish.training import pretrain as training

ITERS = 3
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "96", "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--train-iters", str(ITERS), "--optimizer", "sgd", "--lr", "0.3",
        "--lr-decay-style", "constant", "--clip-grad", "0.5", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-iters", "0", "--log-interval", "100", "--seed", "11", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--disable-bias-linear"]


def _train(argv, world):
    groups.destroy_model_parallel()
    run, state = training.setup(configs_from_args(parse_args(BASE + argv), world))
    grads, losses = [], []
    step = run.optimizer.step

    def step_and_record():
        grads.append({k: v.numpy() for k, v in global_tensors(run.models, run.parallel, grads=True).items()})
        return step()

    run.optimizer.step = step_and_record
    for _ in range(ITERS):
        losses.append(training.train_step(run, state).loss)
    compiled = sum("compile" in repr(layer.forward).lower() or hasattr(layer.forward, "_torchdynamo_orig_callable")
                   for m in run.models for layer in m.decoder.layers)
    return {"losses": losses, "grads": grads, "compiled": compiled}


def _worker(rank, world, argv):
    log = io.StringIO()
    with redirect_stdout(log):
        r = _train(argv, world)
    return dict(r, log=log.getvalue()) if rank == 0 else None


def test_compiled_fsdp2_equals_eager_one_process():
    ref = run_distributed(_worker, 1, [])[0]
    got = run_distributed(_worker, 2, ["--use-torch-fsdp2", "--torch-compile"], timeout=900)[0]
    assert ref["compiled"] == 0 and got["compiled"] == 2
    assert got["log"].count("torch.compile: 2 transformer layers and the loss compiled in") == 1, got["log"]
    assert_parity(got["losses"], ref["losses"], "compiled losses")
    for it, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        assert sorted(g) == sorted(r)
        for name in r:
            assert_parity(g[name], r[name], f"iteration {it + 1} gradient of {name}")


def test_no_compiler_warns_and_stays_eager(monkeypatch):
    monkeypatch.setattr(compile_mod.shutil, "which", lambda name: None)
    lines = []
    compiler = compile_mod.Compiler("cpu", print_fn=lines.append)
    layer = torch.nn.Linear(2, 2)
    forward = layer.forward

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([layer])

    compiler.apply([Model()])
    assert layer.forward == forward
    assert len(lines) == 1 and lines[0].startswith("WARNING: --torch-compile: inductor's CPU backend needs a C++ "
                                                   "compiler") and lines[0].endswith("running eager"), lines
