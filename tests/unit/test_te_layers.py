"""``--transformer-impl transformer_engine`` without a GPU: the flag's one-line error, nothing imported from
Transformer Engine at import time, and the wiring of ``precision/te_layers.py`` against a stand-in
``transformer_engine`` package injected into ``sys.modules``. The stand-in follows TE's documented API
(``pytorch.Linear(in, out, bias=, params_dtype=, device=)`` reading ``self.weight``, ``pytorch.autocast``,
``common.recipe.DelayedScaling`` / ``Float8CurrentScaling`` / ``MXFP8BlockScaling``, ``Format``) and computes a
plain ``F.linear``, so what is checked is our side: names, parameters and gradients unchanged, the recipe mapped
from Megatron's flags, autocast entered per call. TE's own numerics are checked on a GPU (scripts/device_check.sh)."""
import contextlib
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatronish.config import llama
from megatronish.errors import ConfigError
from megatronish.model.build import build_model_chunks
from megatronish.parallel.context import ParallelContext
from megatronish.parallel.random import set_random_seed
from megatronish.precision.fp8 import check_transformer_impl


def test_transformer_engine_flag_is_one_clear_error_without_cuda():
    with pytest.raises(ConfigError) as e:
        check_transformer_impl("transformer_engine")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("--transformer-impl transformer_engine needs Transformer Engine with CUDA")
    assert "--transformer-impl local" in msg
    assert check_transformer_impl("local") == "local"


def test_no_transformer_engine_import_at_module_import():
    code = ("import sys, megatronish.precision.te_layers, megatronish.tools.env, megatronish.tools.device_check, "
            "megatronish.training.pretrain; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('transformer_engine', 'apex', 'flash_attn')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- a stand-in transformer_engine ---------------------------------------------------------------------------
class _Recipe:
    def __init__(self, **kw):
        self.kw = kw


def _fake_te(calls):
    class Linear(torch.nn.Module):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__()
            assert device == "meta" and bias is False
            self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))

        def forward(self, x):
            calls.append(("linear", tuple(self.weight.shape)))
            return F.linear(x, self.weight)

    @contextlib.contextmanager
    def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
        calls.append(("autocast", enabled, recipe, amax_reduction_group))
        yield

    @contextlib.contextmanager
    def activation_recompute_forward(activation_recompute=False, recompute_phase=False):
        calls.append(("recompute_region", activation_recompute, recompute_phase))
        yield
        calls.append(("recompute_region_end",))

    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.Linear, pt.autocast = Linear, autocast
    dist = types.ModuleType("transformer_engine.pytorch.distributed")
    dist.activation_recompute_forward = activation_recompute_forward
    pt.distributed = dist
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
    for name in ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling"):
        setattr(recipe, name, type(name, (_Recipe,), {}))
    te.pytorch, te.common, common.recipe = pt, common, recipe
    return {"transformer_engine": te, "transformer_engine.pytorch": pt, "transformer_engine.common": common,
            "transformer_engine.common.recipe": recipe, "transformer_engine.pytorch.distributed": dist}


@pytest.fixture
def fake_te(monkeypatch):
    from megatronish import device

    calls = []
    for name, mod in _fake_te(calls).items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(device, "cuda_available", lambda: True)  # TE's import check asks for CUDA
    return calls


def _model(**recompute):
    cfg = llama(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                vocab_size=64, seq_length=8, max_position_embeddings=8, **recompute)
    set_random_seed(3, 0, 0)
    (m,) = build_model_chunks(cfg, ParallelContext.single(), device="cpu")
    m.init_parameters(3)
    return m


def _loss_and_grads(m, autocast=None):
    ids = torch.arange(16).view(2, 8) % 64
    with autocast() if autocast else contextlib.nullcontext():
        loss = m(ids, labels=(ids + 1) % 64).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_te_layers_keep_names_parameters_and_gradients(fake_te, monkeypatch):
    from megatronish.precision import te_layers

    ref = _model()
    want_loss, want_grads = _loss_and_grads(ref)
    m = _model()
    names = {n: (tuple(p.shape), p.desc) for n, p in m.named_parameters()}
    params = dict(m.named_parameters())
    with monkeypatch.context() as cuda:  # TE's import check sees CUDA; the model itself runs on CPU
        cuda.setenv("MEGATRONISH_DEVICE", "cuda")
        mgr = te_layers.enable_te(m, "hybrid", "delayed", margin=1, amax_history_len=16, amax_compute_algo="max")
    # 2 layers x (qkv, proj, fc1, fc2), global names; the TE modules are outside the model's tree
    assert sorted(mgr.linears) == sorted(f"decoder.layers.{i}.{s}" for i in range(2) for s in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))
    assert {n: (tuple(p.shape), p.desc) for n, p in m.named_parameters()} == names
    assert not any(type(x).__name__ == "Linear" and x.__module__ == __name__ for x in m.modules())
    for name, lin in mgr.linears.items():
        assert lin.fp8.module.weight is params[f"{name}.weight"] is lin.weight
    r = mgr.recipe
    assert type(r).__name__ == "DelayedScaling"
    assert r.kw == dict(margin=1, fp8_format="HYBRID", amax_history_len=16, amax_compute_algo="max")
    loss, grads = _loss_and_grads(m, mgr.autocast)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7, msg=n)
    linear_calls = [c for c in fake_te if c[0] == "linear"]
    assert len(linear_calls) == 8  # every linear of both layers ran through TE
    autocasts = [c for c in fake_te if c[0] == "autocast"]
    assert len(autocasts) == 1 and autocasts[0][1:] == (True, r, None)  # the forward's one region, none a call
    assert not any(lin.fp8.in_region for lin in mgr.linears.values())  # the region ended with the forward
    fake_te.clear()  # the training forward step enters the region (as its backward runs after it)
    from megatronish.training.step import in_region

    step = in_region(lambda data, model: (model(next(data), labels=(next(data) + 1) % 64).mean(), None), mgr.autocast)
    ids = torch.arange(16).view(2, 8) % 64
    step(iter([ids, ids]), m)[0].backward()
    assert [c[0] for c in fake_te].count("autocast") == 1 and [c[0] for c in fake_te].count("linear") == 8
    fake_te.clear()  # outside a region (generation, recompute's second forward): each call its own autocast
    _loss_and_grads(m)
    assert [c[1:] for c in fake_te if c[0] == "autocast"] == [(True, r, None)] * 8
    assert mgr.state_dict()["recipe"]["fp8_recipe"] == "delayed"


def _same_through_te(build, monkeypatch, calls):
    """A model from ``build()`` run without TE, and another run through the stand-in TE (delayed FP8 recipe) in the
    forward's region: the same loss and gradients. Returns the TE manager; ``calls`` holds the TE run's calls."""
    from megatronish.precision import te_layers

    want_loss, want_grads = _loss_and_grads(build())
    m = build()
    with monkeypatch.context() as cuda:
        cuda.setenv("MEGATRONISH_DEVICE", "cuda")
        mgr = te_layers.enable_te(m, "hybrid", "delayed")
    calls.clear()
    loss, grads = _loss_and_grads(m, mgr.autocast)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7, msg=n)
    return mgr


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective", recompute_modules=("mlp",)),
], ids=["full", "selective-mlp"])
def test_te_recompute_enters_te_recompute_phases(fake_te, monkeypatch, recompute):
    """Recompute under TE: the checkpointed first forward runs in TE's activation-recompute region (its FP8
    modules keep their scales), the recomputed forward in its recompute phase and in one autocast of the recipe
    with the hooked linears inside it (none opens its own), as TE's own checkpoint does; gradients unchanged."""
    mgr = _same_through_te(lambda: _model(**recompute), monkeypatch, fake_te)
    kinds = [c[0] for c in fake_te]
    linears_per_call = 4 if recompute["recompute_granularity"] == "full" else 2  # a layer, or its MLP
    region = ["recompute_region", *["linear"] * linears_per_call, "recompute_region_end"]
    first, second = ("recompute_region", True, False), ("recompute_region", True, True)
    # forward: the run's region, then per layer its checkpoint's region around its linears (attention's outside
    # the selective MLP checkpoint); backward, last layer first: the recompute phase, its autocast, its linears
    if recompute["recompute_granularity"] == "full":
        assert kinds == ["autocast", *region, *region, "recompute_region", "autocast", *["linear"] * 4,
                         "recompute_region_end", "recompute_region", "autocast", *["linear"] * 4,
                         "recompute_region_end"], kinds
    else:
        assert kinds == ["autocast", "linear", "linear", *region, "linear", "linear", *region,
                         "recompute_region", "autocast", "linear", "linear", "recompute_region_end",
                         "recompute_region", "autocast", "linear", "linear", "recompute_region_end"], kinds
    assert [c for c in fake_te if c[0] == "recompute_region"] == [first, first, second, second]
    assert all(c[1:] == (True, mgr.recipe, None) for c in fake_te if c[0] == "autocast")
    assert not any(lin.fp8.in_region for lin in mgr.linears.values())


def test_te_mla_up_projection_recompute_enters_te_recompute_phases(fake_te, monkeypatch):
    """``--recompute-modules mla_up_proj`` (the output-discarding recompute) under TE: the up-projections' first run
    in TE's activation-recompute region, their rerun in its recompute phase inside one autocast, gradients
    unchanged."""
    def model():
        cfg = llama(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=64,
                    seq_length=8, max_position_embeddings=8, multi_latent_attention=True, q_lora_rank=16,
                    kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8,
                    recompute_granularity="selective", recompute_modules=("mla_up_proj",))
        set_random_seed(3, 0, 0)
        (m,) = build_model_chunks(cfg, ParallelContext.single(), device="cpu")
        m.init_parameters(3)
        return m

    _same_through_te(model, monkeypatch, fake_te)
    regions = [c for c in fake_te if c[0] == "recompute_region"]
    assert regions == [("recompute_region", True, False)] * 2 + [("recompute_region", True, True)] * 2
    kinds = [c[0] for c in fake_te]
    first_rerun = kinds.index("recompute_region", kinds.index("recompute_region", kinds.index("recompute_region") + 1)
                              + 1)
    # each rerun: its phase, its autocast, the two up-projections (query and key/value) and nothing else
    assert kinds[first_rerun:first_rerun + 5] == ["recompute_region", "autocast", "linear", "linear",
                                                  "recompute_region_end"], kinds
    assert kinds.count("autocast") == 3


def test_te_recipes_map_megatron_flags(fake_te, monkeypatch):
    from megatronish.precision import te_layers

    monkeypatch.setenv("MEGATRONISH_DEVICE", "cuda")
    assert te_layers.te_recipe(None) is None  # no --fp8-format: TE's GEMMs in the parameters' dtype
    cur = te_layers.te_recipe("e4m3", "tensorwise")
    assert type(cur).__name__ == "Float8CurrentScaling" and cur.kw == {"fp8_format": "E4M3"}
    mx = te_layers.te_recipe("hybrid", "mxfp8")
    assert type(mx).__name__ == "MXFP8BlockScaling" and mx.kw == {"fp8_format": "E4M3"}
    with pytest.raises(ConfigError, match="--fp8-recipe 'blockwise' with --transformer-impl transformer_engine"):
        te_layers.te_recipe("hybrid", "blockwise")


def test_pretrain_uses_te_layers_for_the_flag(fake_te, monkeypatch):

    from megatronish.training.initialize import enable_fp8_linears

    m = _model()
    cfg = m.config.replace(transformer_impl="transformer_engine")
    with monkeypatch.context() as cuda:
        cuda.setenv("MEGATRONISH_DEVICE", "cuda")
        mgr = enable_fp8_linears([m], cfg)  # no --fp8-format: TE layers in the parameters' precision
    assert type(mgr).__name__ == "TeManager" and mgr.recipe is None and len(mgr.linears) == 8
    _loss_and_grads(m)
    assert [c for c in fake_te if c[0] == "autocast"][0][1] is False


def _train_one_step(rank, world, calls, argv):
    """One training step set up from ``argv`` in a process of its own (set-up starts a process group); the kinds
    of the stand-in TE's calls during the step."""
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.training import pretrain as training

    run, state = training.setup(configs_from_args(parse_args(argv), world))
    calls.clear()
    training.train_step(run, state)
    return [c[0] for c in calls]


def test_training_step_runs_each_forward_in_one_te_region(fake_te, monkeypatch):
    """``--transformer-impl transformer_engine`` through the training set-up: the forward step enters TE's
    autocast once a microbatch and the linears run inside it (2 microbatches x 8 linears, 2 autocasts)."""
    from megatronish.precision import fp8, te_layers
    from megatronish.testing import run_distributed
    from megatronish.training import initialize

    # the run itself stays on the CPU: TE's CUDA checks (arguments, set-up, import) see the stand-in
    for module in (fp8, initialize):
        monkeypatch.setattr(module, "check_transformer_impl", lambda impl: impl)
    monkeypatch.setattr(te_layers, "import_te", lambda: sys.modules["transformer_engine.pytorch"])
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
            "--max-position-embeddings", "8", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
            "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1",
            "--lr", "1e-3", "--eval-iters", "0", "--transformer-impl", "transformer_engine"]
    kinds = run_distributed(_train_one_step, 1, fake_te, argv)[0]
    assert kinds.count("linear") == 16 and kinds.count("autocast") == 2, kinds
    assert kinds[0] == "autocast" and kinds[9] == "autocast"  # each microbatch: its region, then its 8 linears
