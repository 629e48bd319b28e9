"""``--recompute-modules``: each module recomputed gives bitwise the loss and every gradient of the same model
without recompute (fp32, dropout on, so the RNG replay shows), and the saved activations drop by what the module
keeps no more (measured with the saved-tensor hooks; ``mlp`` and ``layernorm`` against the memory report's
formula). The flag's error lines are Megatron-LM's rules.

A tiny GPT model of two layers, one process; the parallel case (MLA at TP 2 + SP with ``mla_up_proj core_attn
layernorm mlp``) is ``tests/distributed/test_mla_parity.py``'s ``tp2-sp-recompute-modules``.
"""
import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.config import gpt2, llama
from megatronish.errors import ConfigError
from megatronish.model.gpt import GPTModel
from megatronish.parallel.random import set_random_seed
from megatronish.training.memory import SavedActivationCounter, activation_bytes_per_layer

S, B, H, A, F, L = 16, 2, 32, 4, 64, 2
SHAPE = dict(num_layers=L, hidden_size=H, num_attention_heads=A, vocab_size=64, seq_length=S,
             ffn_hidden_size=F, attention_dropout=0.1, hidden_dropout=0.1)
MLA = dict(multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6, qk_layernorm=True)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_grouped_gemm=True,
           moe_shared_expert_intermediate_size=24, moe_router_load_balancing_type="aux_loss",
           moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall")
MODELS = {"gpt": lambda **kw: gpt2(**SHAPE, **kw),
          "llama": lambda **kw: llama(**SHAPE, **kw),
          "mla": lambda **kw: llama(**SHAPE, **MLA, **kw),
          "moe": lambda **kw: llama(**SHAPE, **MOE, **kw)}


def _run(model: str, modules):
    """Loss, gradients (name -> tensor) and the saved-activation peak of one forward and backward."""
    rec = {} if modules is None else dict(recompute_granularity="selective", recompute_modules=tuple(modules))
    cfg = MODELS[model](**rec)
    set_random_seed(3)
    m = GPTModel(cfg).train()
    m.init_parameters(5)
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    set_random_seed(9)  # the dropout masks
    with SavedActivationCounter(m.parameters()) as counter:
        loss = m(tokens, labels=tokens.roll(-1, 1)).mean()
    loss.backward()
    assert counter.current == 0  # everything saved (recipes and kept inputs included) released by backward
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, counter.peak


def _same(a, b, exact=True):
    """Bitwise; ``exact=False`` for RMSNorm under ``layernorm``: its composite backward gives the residual's
    gradient several terms whose sum order the recompute changes (measured: 1 ulp, 2e-8 at most)."""
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name, g in a[1].items():
        assert g is not None, name
        if exact:
            assert torch.equal(g, b[1][name]), name
        else:
            torch.testing.assert_close(b[1][name], g, rtol=1e-5, atol=1e-8, msg=name)


def _formula_drop(modules, swiglu=False):
    """What the formula saves per layer with ``modules``, in fp32 bytes (it counts 16-bit activations)."""
    def per_layer(mods):
        return activation_bytes_per_layer(S, B, H, A, recompute="selective", recompute_modules=mods,
                                          ffn_hidden_size=F, swiglu=swiglu)
    return 2 * (per_layer(()) - per_layer(modules))


CASES = {  # name: (model, modules, what it drops beyond the formula per layer in fp32 bytes, or None: not modelled)
    "mlp": ("gpt", ["mlp"], 0),
    # the two norms' statistics (mean and rstd, fp32 per token each) are not in the formula
    "layernorm": ("gpt", ["layernorm"], 2 * 2 * S * B * 4),
    # RMSNorm on CPU (composite) keeps rstd and x * rstd, SwiGLU silu(gate) (a CPU deviation of memory.py)
    "layernorm+mlp swiglu": ("llama", ["layernorm", "mlp"], 2 * S * B * 4 * (1 + H) + S * B * F * 4),
    "core_attn": ("gpt", ["core_attn"], None),
    "mla_up_proj": ("mla", ["mla_up_proj"], None),
    "mla_up_proj+core_attn": ("mla", ["mla_up_proj", "core_attn"], None),
    "moe_act": ("moe", ["moe_act"], None),
    "shared_experts": ("moe", ["shared_experts"], None),
    "moe": ("moe", ["moe"], None),
    "all": ("moe", ["core_attn", "moe_act", "layernorm", "mlp", "shared_experts"], None),
}


@pytest.fixture(scope="module")
def no_recompute():
    """model -> its run without recompute (made once per model)."""
    runs = {}

    def get(model):
        if model not in runs:
            runs[model] = _run(model, None)
        return runs[model]
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_module_recompute_is_exact_and_saves_memory(case, no_recompute):
    model, modules, beyond = CASES[case]
    base = no_recompute(model)
    rec = _run(model, modules)
    _same(base, rec, exact=model == "gpt" or "layernorm" not in modules)
    drop = base[2] - rec[2]
    assert drop > 0, case
    if beyond is not None:
        assert drop == L * (_formula_drop(modules, swiglu=model == "llama") + beyond), (case, drop)


def _errors(*flags):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--vocab-size", "64", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
            "--lr", "1e-3"]
    try:
        cfg = configs_from_args(parse_args(base + list(flags)), 1)
    except ConfigError as e:
        return str(e)
    return cfg.model.recompute


def test_flag_and_error_lines():
    r = _errors("--recompute-granularity", "selective")
    assert r.recompute_modules is None and r.recomputes("core_attn") and not r.recomputes("mlp")
    r = _errors("--recompute-activations", "--recompute-modules", "mlp", "layernorm")
    assert r.recompute_modules == ("mlp", "layernorm") and not r.recomputes("core_attn") and r.recomputes("mlp")
    # Megatron-LM's older --moe-layer-recompute: selective recompute with moe added
    assert _errors("--moe-layer-recompute").recompute_modules == ("core_attn", "moe")
    assert _errors("--moe-layer-recompute", "--recompute-granularity", "selective", "--recompute-modules",
                   "mlp").recompute_modules == ("mlp", "moe")
    # moe and shared_experts without experts are ignored, as in Megatron-LM
    assert _errors("--recompute-granularity", "selective", "--recompute-modules", "moe", "shared_experts").recomputes(
        "moe")
    for flags, line in [
        (["--recompute-modules", "mlp"], "--recompute-modules needs --recompute-granularity selective"),
        (["--moe-layer-recompute", "--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1"], "--moe-layer-recompute (selective recompute of the MoE layers) does not go"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
          "--recompute-modules", "mlp"], "--recompute-modules needs --recompute-granularity selective"),
        (["--recompute-granularity", "selective", "--recompute-modules", "attn"],
         "--recompute-modules 'attn': choose from core_attn moe_act layernorm mla_up_proj mlp moe shared_experts"),
        (["--recompute-granularity", "selective", "--recompute-modules", "mhc"],
         "--recompute-modules mhc: recomputes a part of hyper-connections, which megatronish does not have"),
        (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
         "--recompute-modules mla_up_proj needs --multi-latent-attention"),
        (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
         "--recompute-modules moe_act needs --num-experts with --moe-grouped-gemm"),
    ]:
        err = _errors(*flags)
        assert isinstance(err, str) and line in err, (flags, err)


def test_output_recompute_twice_through_a_retained_graph():
    """The discarded output is recomputed for each backward through a retained graph, bitwise as kept."""
    from megatronish.model.recompute import discard_output

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def grads(enabled):
        y, block = discard_output(enabled, lambda t: torch.nn.functional.layer_norm(t, (8,)), x)
        with block:
            z = (y @ w).tanh().sum()
        out = []
        for retain in (True, False):
            z.backward(retain_graph=retain)
            out += [x.grad, w.grad]
            x.grad = w.grad = None
        return out

    for kept, recomputed in zip(grads(False), grads(True)):
        assert torch.equal(kept, recomputed)
