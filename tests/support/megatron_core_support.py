"""megatron-core on CPU for the checkpoint-compatibility tests: import it (or say why not), patch out the few CUDA
calls its checkpoint code makes, and build its ``GPTModel`` (local layer spec) for the model flavors.

Everything here runs inside a forked test worker; nothing of it is part of the package."""
from __future__ import annotations

import argparse
import contextlib
import os
import queue

import torch


def in_ci() -> bool:
    """True when the environment variable ``CI`` is set (to anything but ``0``/``false``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def unavailable(reason: str) -> None:
    """Skip the test for ``reason``; under CI fail it instead, in one line (megatron-core is the test's oracle)."""
    import pytest

    if in_ci():
        pytest.fail(f"{reason} (CI is set: the megatron-core oracle must run, not be skipped)", pytrace=False)
    pytest.skip(reason)


def import_or_skip(module: str = "megatron.core"):
    """``module`` imported; a skip (a failure under CI) naming the error when it does not import. Any exception
    counts (a broken install raises more than ImportError)."""
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as e:
        first = (str(e).splitlines() or [""])[0]
        unavailable(f"{module} is not importable ({type(e).__name__}: {first}); install the dev extra")


def require_checkpointing() -> None:
    """megatron-core's GPTModel and dist_checkpointing, or a skip (a failure under CI) saying why not."""
    for module in ("megatron.core.dist_checkpointing", "megatron.core.models.gpt.gpt_layer_specs",
                   "megatron.core.models.gpt.gpt_model"):
        import_or_skip(module)


def patch_for_cpu() -> None:
    """megatron-core's save/load on CPU with gloo, in this (forked, daemonic) worker only:

    * its file writer forks helper processes and collects their results through a multiprocessing Manager
      (spawned): the worker may have children, and the results go through an in-process queue (the save is
      synchronous, so producer and consumer are this process);
    * ``torch.cuda.synchronize`` / ``torch.cuda.current_device`` are called unconditionally (device ``cpu``), and
      the tied embedding's first all-reduce moves it with ``Tensor.cuda()`` (stays on CPU);
    * memory accounting needs psutil (reported as 0);
    * ``common.pt`` is read with ``torch.load``'s default ``weights_only=True``: ``argparse.Namespace`` is allowed
      (Megatron-LM's training code registers the same);
    * without Transformer Engine, megatron-core stands a ``MagicMock`` in for ``TELinear``, which multi-latent
      attention's constructor passes to ``isinstance`` when ``HAVE_TE`` (set there whenever its extension module
      imports, as it does without Transformer Engine): it is set False."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.transformer import multi_latent_attention

    mp.current_process()._config["daemon"] = False
    filesystem_async._results_queue = queue.Queue()
    filesystem_async._process_memory = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.serialization.add_safe_globals([argparse.Namespace])
    multi_latent_attention.HAVE_TE = False


@contextlib.contextmanager
def cpu_as_cuda():
    """megatron-core's DDP and 16-bit optimizers on CPU: their constructors accept parameters whose ``type()`` is
    ``torch.cuda.{BFloat16,Half,Float}Tensor`` only and make a few scalars with ``device='cuda'``. Inside this
    block a CPU tensor reports the CUDA type name and ``device='cuda'`` means the CPU."""
    type_of = torch.Tensor.type

    def fake_type(self, *a, **k):
        if a or k:
            return type_of(self, *a, **k)
        name = type_of(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    makers = {n: getattr(torch, n) for n in ("tensor", "zeros", "empty", "ones", "full")}

    def on_cpu(make):
        def wrapped(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return make(*a, **k)
        return wrapped

    torch.Tensor.type = fake_type
    for n, make in makers.items():
        setattr(torch, n, on_cpu(make))
    try:
        yield
    finally:
        torch.Tensor.type = type_of
        for n, make in makers.items():
            setattr(torch, n, make)


def bf16_adam_step(flavor: str, distributed: bool, seed: int, lr: float = 1e-2):
    """megatron-core's bf16 training state after one Adam step with random gradients, on one TP 1 x PP 1 rank of
    any DP size: its GPTModel in bf16 under its own ``DistributedDataParallel``, and ``get_megatron_optimizer``'s
    ``Float16OptimizerWithFloat16Params`` (fp32 main parameters) or, ``distributed``, its ``DistributedOptimizer``
    (no gradient clipping, so both take the same step). Returns ``(model, optimizer)``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build_gpt(flavor, 1, 1, seed=seed).to(torch.bfloat16)
    with cpu_as_cuda():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=True), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, bf16=True, clip_grad=0.0,
                                                     use_distributed_optimizer=distributed), [ddp])
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():  # the same gradients on every DP rank: no reduction is needed
        p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=gen))
    with cpu_as_cuda():
        ok, _, _ = opt.step()
    assert ok, "megatron-core's optimizer step was skipped"
    return model, opt


FLAVORS = {
    # Llama style: RMSNorm, RoPE, SwiGLU, GQA, no biases, untied output layer
    "llama": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                  swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                  untie=True),
    # GPT-2 style: LayerNorm, learned positions, GELU, biases, tied embeddings
    "gpt2": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                 swiglu=False, normalization="LayerNorm", position_embedding_type="learned_absolute",
                 add_bias_linear=True, untie=False),
    # DeepSeek-V3 style: multi-latent attention with a query low-rank projection, the latents' norms, YaRN RoPE
    "mla": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=48,
                swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                untie=True, mla=dict(q_lora_rank=12, kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4,
                                     v_head_dim=6, rope_type="yarn", rotary_scaling_factor=4.0, mscale_all_dim=1.0,
                                     yarn_original_max_position_embeddings=8)),
    # Llama style + mixture of experts in every layer (one stacked key per tensor): softmax top-2 routing and a
    # gated shared expert (Qwen2-MoE style); 4 experts over EP 2 folded into TP 2 (expert TP 1)
    "moe": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                untie=True, ep=2, moe=dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                                          moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)),
    # DeepSeek-V3 style: multi-latent attention, the first layer dense (layers stored one key each), sigmoid
    # scores with an expert bias, group-limited top-k, scaled weights, an ungated shared expert, one
    # multi-token-prediction depth (an MLA + MoE layer, on the last stage); EP 2
    "mla-moe": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=48,
                    swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                    untie=True, ep=2, mla=dict(q_lora_rank=12, kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4,
                                               v_head_dim=6, rope_type="rope"),
                    moe=dict(num_experts=4, moe_layer_freq=[0, 1, 1, 1], moe_router_topk=2, moe_ffn_hidden_size=16,
                             moe_shared_expert_intermediate_size=24, moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
                             moe_router_topk_scaling_factor=2.5),
                    mtp_num_layers=1, mtp_loss_scaling_factor=0.3),
}
VOCAB = 95  # NullTokenizer --vocab-size: 96 tokens with eod
SEQ = 16
MAX_POS = 32
DIVISIBLE = 64  # padded vocabulary 128 at TP 1 and 2


def our_flags(flavor: str) -> list[str]:
    f = FLAVORS[flavor]
    out = ["--num-layers", str(f["num_layers"]), "--hidden-size", str(f["hidden_size"]),
           "--num-attention-heads", str(f["num_attention_heads"]), "--ffn-hidden-size", str(f["ffn_hidden_size"]),
           "--normalization", f["normalization"], "--position-embedding-type", f["position_embedding_type"],
           "--seq-length", str(SEQ), "--max-position-embeddings", str(MAX_POS), "--tokenizer-type", "NullTokenizer",
           "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", str(DIVISIBLE)]
    if f["num_query_groups"] != f["num_attention_heads"]:
        out += ["--group-query-attention", "--num-query-groups", str(f["num_query_groups"])]
    if f["swiglu"]:
        out.append("--swiglu")
    if not f["add_bias_linear"]:
        out.append("--disable-bias-linear")
    if f["untie"]:
        out.append("--untie-embeddings-and-output-weights")
    if "mla" in f:
        out += ["--multi-latent-attention", "--qk-layernorm"]
        for name, value in f["mla"].items():
            out += ["--" + name.replace("_", "-"), str(value)]
    for name, value in f.get("moe", {}).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        else:
            out += [flag, str(value).replace(" ", "")]
    if f.get("mtp_num_layers"):
        out += ["--mtp-num-layers", str(f["mtp_num_layers"]), "--mtp-loss-scaling-factor",
                str(f["mtp_loss_scaling_factor"])]
    if "moe" in f:
        out.append("--sequence-parallel")  # (MoE with TP needs it, as in Megatron-LM)
    if f.get("ep", 1) > 1:
        out += ["--expert-model-parallel-size", str(f["ep"]), "--expert-tensor-parallel-size", "1"]
    return out


def megatron_args(flavor: str, tp: int, pp: int, **extra) -> argparse.Namespace:
    """The args Megatron-LM stores with a checkpoint of this model (the fields its loaders read)."""
    from megatron.core.transformer.enums import AttnBackend

    f = FLAVORS[flavor]
    gqa = f["num_query_groups"] != f["num_attention_heads"]
    mla = dict(multi_latent_attention=True, qk_layernorm=True, **f["mla"]) if "mla" in f else {}
    moe = {"num_experts": None}
    if "moe" in f:  # Megatron-LM's defaults, then the flavor's
        moe = dict(moe_layer_freq=1, moe_router_score_function="softmax", moe_router_pre_softmax=False,
                   moe_router_topk_scaling_factor=None, moe_router_num_groups=None, moe_router_group_topk=None,
                   moe_router_enable_expert_bias=False, moe_shared_expert_gate=False, moe_grouped_gemm=False,
                   sequence_parallel=True, expert_model_parallel_size=f.get("ep", 1), expert_tensor_parallel_size=1)
        moe.update(f["moe"])
    extra = {"qk_layernorm": False, "multi_latent_attention": False, "mtp_num_layers": f.get("mtp_num_layers"),
             "mtp_loss_scaling_factor": f.get("mtp_loss_scaling_factor", 0.1), **mla, **moe, **extra}
    return argparse.Namespace(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], ffn_hidden_size=f["ffn_hidden_size"],
        num_attention_heads=f["num_attention_heads"], group_query_attention=gqa,
        num_query_groups=f["num_query_groups"] if gqa else 1,
        kv_channels=f["hidden_size"] // f["num_attention_heads"], seq_length=SEQ, max_position_embeddings=MAX_POS,
        position_embedding_type=f["position_embedding_type"], rotary_base=10000, rotary_percent=1.0,
        normalization=f["normalization"], norm_epsilon=1e-5, swiglu=f["swiglu"], openai_gelu=False,
        untie_embeddings_and_output_weights=f["untie"], add_bias_linear=f["add_bias_linear"], add_qkv_bias=False,
        tokenizer_type="NullTokenizer", vocab_size=VOCAB, make_vocab_size_divisible_by=DIVISIBLE,
        padded_vocab_size=128, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=torch.float32, attention_backend=AttnBackend.auto, ckpt_format="torch_dist",
        init_method_std=0.02, **extra)


def build_gpt(flavor: str, tp: int, pp: int, seed: int):
    """megatron-core's GPTModel (local spec, CPU initialization) for this rank's pipeline stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    f = FLAVORS[flavor]
    # the same stream on every TP rank of a stage: replicated tensors agree, split ones are cut from one master
    torch.manual_seed(seed + 100 * ps.get_pipeline_model_parallel_rank())
    config, mla, moe = TransformerConfig, {}, {}
    if "mla" in f:
        m = f["mla"]
        config = MLATransformerConfig
        mla = dict(qk_layernorm=True, **{k: m[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                                           "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
                                                           "rotary_scaling_factor", "mscale_all_dim") if k in m})
        if "yarn_original_max_position_embeddings" in m:
            mla["original_max_position_embeddings"] = m["yarn_original_max_position_embeddings"]
    if "moe" in f:
        moe = dict(f["moe"], num_moe_experts=f["moe"]["num_experts"], expert_model_parallel_size=f.get("ep", 1),
                   expert_tensor_parallel_size=1)
        del moe["num_experts"]
    cfg = config(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"], ffn_hidden_size=f["ffn_hidden_size"],
        gated_linear_unit=f["swiglu"],
        activation_func=torch.nn.functional.silu if f["swiglu"] else torch.nn.functional.gelu,
        normalization=f["normalization"], add_bias_linear=f["add_bias_linear"], layernorm_epsilon=1e-5,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0,
        mtp_num_layers=f.get("mtp_num_layers"), mtp_loss_scaling_factor=f.get("mtp_loss_scaling_factor", 0.1),
        **mla, **moe)
    if moe:  # a spec per layer: dense where --moe-layer-freq says 0
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=f["normalization"])
        layer_specs = spec.layer_specs
    else:
        spec = get_gpt_layer_local_spec(normalization=f["normalization"], multi_latent_attention=bool(mla),
                                        qk_layernorm=bool(mla))
        layer_specs = [spec]
    if mla:
        for s in layer_specs:
            s.submodules.self_attention.submodules.core_attention = _mla_core_attention()
    # multi-token prediction: the decoder's last layer spec, on the last stage (None elsewhere)
    mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if cfg.mtp_num_layers else None
    model = GPTModel(cfg, spec, vocab_size=128,
                     max_sequence_length=MAX_POS, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), position_embedding_type=f["position_embedding_type"],
                     share_embeddings_and_output_weights=not f["untie"], mtp_block_spec=mtp)
    with torch.no_grad():  # norms start at 1/0, the expert bias at 0: make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.add_(torch.randn_like(b) * 0.1)
        # each EP rank initializes its experts from the same stream: make the experts of EP ranks differ
        gen = torch.Generator().manual_seed(seed + 1000 * ps.get_expert_model_parallel_rank())
        for name, p in model.named_parameters():
            if ".local_experts." in name:
                p.add_(torch.randn(p.shape, generator=gen))
    return model


def _mla_core_attention():
    """The local spec's ``DotProductAttention`` for multi-latent attention: megatron-core's MLA passes it the key and
    value head sizes (``k_channels``, ``v_channels``), which only Transformer Engine's attention takes; the local one
    (no parameters, no state) is built without them. The checkpoint tests never run the model forward."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CoreAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return CoreAttention


def fp32_optimizer(model, lr: float = 1e-2):
    """megatron-core's FP32Optimizer over torch Adam after one step with random gradients (its constructor's one
    CUDA tensor, the loss scale, is made on CPU)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    params = [p for p in model.parameters()]
    adam = torch.optim.Adam(params, lr=lr)
    for p in params:
        p.grad = torch.randn_like(p)
    adam.step()
    opt = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(opt, adam, OptimizerConfig(lr=lr), lambda o, c: None)
    opt._scale = torch.tensor([1.0])
    opt.is_stub_optimizer = False
    return opt


def sharded_state_dict(model) -> dict:
    """megatron-core's sharded state dict of ``model``; with multi-token prediction on a stage without the embedding,
    its copy of the word embedding is tied to the first stage's over the data-parallel group, which the metadata
    names."""
    from megatron.core import parallel_state as ps

    if getattr(model, "mtp_process", False):
        return model.sharded_state_dict(metadata={"dp_cp_group": ps.get_data_parallel_group(
            with_context_parallel=True)})
    return model.sharded_state_dict()


def layer_offset(model) -> int:
    return model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0


def local_tensors(model) -> dict[str, torch.Tensor]:
    """This rank's parameters (and the routers' expert bias, a buffer in megatron-core) under our global names
    (global layer numbers; an MTP depth's ``transformer_layer`` is our ``mtp_model_layer``), in megatron-core's
    parameter order; the tied output copy left out. The local experts' weights
    (``mlp.experts.local_experts.<i>.linear_fc1.weight``) are stacked as ours hold them
    (``mlp.experts.linear_fc1.weight``, local expert ``i`` at ``[i]``)."""
    off = layer_offset(model)
    out, experts = {}, {}
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n.endswith("expert_bias"))]
    for name, p in named:
        if name.startswith("decoder.layers."):
            parts = name.split(".", 3)
            name = f"decoder.layers.{int(parts[2]) + off}.{parts[3]}"
        elif name.startswith("mtp.layers."):
            head, _, tail = name.partition(".transformer_layer.")
            name = f"{head}.mtp_model_layer.{tail}" if tail else name
        head, sep, tail = name.partition(".experts.local_experts.")
        if sep:
            experts.setdefault(f"{head}.experts.{tail.split('.', 1)[1]}", []).append(p.detach().clone())
            continue
        out[name] = p.detach().clone()
    out.update({name: torch.stack(ts) for name, ts in experts.items()})
    return out


def write_tracker(root: str, iteration) -> None:
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
