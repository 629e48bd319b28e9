"""Multi-token prediction trains in TP 2 (with sequence parallelism, and with --calculate-per-token-loss), PP 2
(the depths and a copy of the word embedding on the last stage; tied and untied output layer) and CP 2 (the token,
label and loss-mask shifts cross the load-balanced chunks; every --cp-comm-type, alone and with TP 2 + SP or PP 2)
and with the depths on a stage of their own before the loss's (``Et|t|mm|L`` at PP 2 x VP 2, untied; ``Ett||mm|L``
under ZBV, tied, after an empty stage) exactly as one process: the losses and every parameter's reduced
gradient of 3 iterations (fp32, rtol 1e-5; same seed, no weight copying). SGD with an active gradient clip, so a
wrong reduction shows again in the next iteration. Evaluation reports each depth's loss: on the first training
batch it equals the training step's numbers in every layout, and the validation and test lines and records carry
them."""
import contextlib
import io
import json

import pytest

from megatronish.arguments import configs_from_args, parse_args
from megatronish.parallel import groups
from megatronish.testing import assert_parity, global_tensors, run_distributed
from megatronish.training import pretrain as training
from megatronish.training.evaluate import evaluate

ITERS = 3
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "96", "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer",
        "--mock-data", "--global-batch-size", "8", "--micro-batch-size", "2", "--train-iters", str(ITERS),
        "--optimizer", "sgd", "--lr", "0.3", "--lr-decay-style", "constant", "--clip-grad", "0.5",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "1", "--log-interval", "100",
        "--seed", "7", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
UNTIED, PER_TOKEN = ["--untie-embeddings-and-output-weights"], ["--calculate-per-token-loss"]
MODELS = {"untied": UNTIED, "tied": [], "untied-per-token": UNTIED + PER_TOKEN}
TP2, PP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"], ["--pipeline-model-parallel-size", "2"]
LAYOUT = "--pipeline-model-parallel-layout"
CP2 = ["--context-parallel-size", "2"]  # chunks 0, 3 and 1, 2 of 4: every shift crosses a rank boundary
CASES = {"tp2-sp": (TP2, "untied"), "tp2-sp-per-token": (TP2, "untied-per-token"), "pp2": (PP2, "untied"),
         "pp2-tied": (PP2, "tied"), "cp2": (CP2, "untied"),
         # one type per layer: the depths take the first layers' (allgather, a2a)
         "cp2-allgather-a2a-tied": (CP2 + ["--cp-comm-type", "allgather", "a2a"], "tied"),
         "cp2-a2a+p2p-per-token": (CP2 + ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                                          "1", "2"], "untied-per-token"),
         # a standalone MTP stage (Megatron-LM's DeepSeek-V3 layout in small): the depths on stage 2, the loss on 3
         "pp2-vp2-mtp-stage": (PP2 + [LAYOUT, "Et|t|mm|L"], "untied"),
         # in a V (rank 0: E and L, rank 1: an empty stage then the depths), tied: three copies on two ranks
         "pp2-zbv-mtp-stage-tied": (PP2 + [LAYOUT, "Ett||mm|L", "--pipeline-schedule", "zbv"], "tied")}
CASES4 = {"cp2-tp2-sp": (CP2 + TP2, "untied"), "cp2-pp2-tied": (CP2 + PP2, "tied")}  # world 4


class _GradientRecorder:
    """Stands in for the optimizer's step: records every parameter's reduced gradient (global, numpy: it travels
    through a pipe) before clipping and the update, then steps."""

    def __init__(self, run):
        self.run, self.step, self.grads = run, run.optimizer.step, []

    def __call__(self):
        tensors = global_tensors(self.run.models, self.run.parallel, grads=True, optimizer=self.run.optimizer)
        self.grads.append({name: t.numpy() for name, t in tensors.items()})
        return self.step()


def _train(argv, world):
    groups.destroy_model_parallel()
    run, state = training.setup(configs_from_args(parse_args(BASE + argv), world))
    run.optimizer.step = recorder = _GradientRecorder(run)
    details = {}  # evaluated on the training split from its start: the first step's batch
    evaluated = [evaluate(run, state, run.train_ds, details)] + [details["mtp"][f"mtp_{k} loss"] for k in (1, 2)]
    steps = [training.train_step(run, state) for _ in range(ITERS)]
    depths = [[s.mtp[f"mtp_{k} loss"] for k in (1, 2)] for s in steps]  # each depth's reported loss
    return {"losses": [s.loss for s in steps], "depths": depths, "grads": recorder.grads, "eval": evaluated}


def _worker(rank, world, cases, metrics=None):
    out = {name: _train(argv, world) for name, argv in cases.items()}
    if metrics is not None:  # the log line, the validation and test lines and the metrics file carry each depth's
        groups.destroy_model_parallel()
        with contextlib.redirect_stdout(io.StringIO()) as log:
            training.pretrain(configs_from_args(parse_args(BASE + ["--log-interval", "1", "--metrics-file",
                                                                   metrics]), world))
        out["log"] = log.getvalue()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The one-process runs by model, and each layout's run with its reference."""
    metrics = str(tmp_path_factory.mktemp("mtp") / "metrics.jsonl")
    refs = run_distributed(_worker, 1, MODELS, metrics)[0]
    refs["metrics"] = [json.loads(line) for line in open(metrics)]
    refs["validation lines"] = [line for line in refs.pop("log").splitlines() if "validation loss at" in line]
    got = run_distributed(_worker, 2, {n: flags + MODELS[m] for n, (flags, m) in CASES.items()}, timeout=600)[0]
    got.update(run_distributed(_worker, 4, {n: flags + MODELS[m] for n, (flags, m) in CASES4.items()},
                               timeout=600)[0])
    return refs, {name: (refs[model], got[name]) for name, (_, model) in {**CASES, **CASES4}.items()}


@pytest.mark.parametrize("name", sorted({**CASES, **CASES4}))
def test_layout_equals_one_process(results, name):
    ref, out = results[1][name]
    assert_parity(out["losses"], ref["losses"], f"{name} losses")
    assert_parity(out["depths"], ref["depths"], f"{name} MTP depths' losses")
    # evaluation of the first step's batch: the step's loss and depth losses
    assert_parity(out["eval"], [out["losses"][0]] + out["depths"][0], f"{name} evaluation")
    assert [sorted(g) for g in out["grads"]] == [sorted(g) for g in ref["grads"]], f"{name}: parameter names differ"
    for it, param in ((i, p) for i in range(ITERS) for p in ref["grads"][i]):
        assert_parity(out["grads"][it][param], ref["grads"][it][param],
                      f"{name} iteration {it + 1} gradient of {param}")


def test_depth_losses_are_logged(results):
    records = results[0]["metrics"]
    train = [r for r in records if "split" not in r]
    assert len(train) == ITERS and all(r["mtp_1_loss"] > 0 and r["mtp_2_loss"] > 0 for r in train)
    evaluated = {r["split"]: r for r in records if "split" in r}  # at the end: validation, then test
    assert sorted(evaluated) == ["test", "valid"]
    lines = results[0]["validation lines"]
    assert len(lines) == 2 and "on test set" in lines[1]
    for line, split in zip(lines, ("valid", "test")):
        r = evaluated[split]
        assert r["mtp_1_loss"] > 0 and r["mtp_2_loss"] > 0 and r["mtp_1_loss"] != r["lm_loss"]
        for k in (1, 2):
            assert f"| mtp_{k} loss value: {r[f'mtp_{k}_loss']:.6E} |" in line, line


def test_reference_learns_and_every_depth_gets_gradient(results):
    for variant, ref in ((v, r) for v, r in results[0].items() if v in MODELS):
        assert ref["losses"][-1] < ref["losses"][0], (variant, ref["losses"])
        g = ref["grads"][0]
        depth = [n for n in g if n.startswith("mtp.layers.1.")]
        assert depth and all(abs(g[n]).sum() > 0 for n in depth), variant
