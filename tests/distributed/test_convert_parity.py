"""Tiny Hugging Face GPT-2, Llama (GQA), Mistral, Qwen2 (q/k/v biases; tied and untied) and Qwen3 (q/k norm,
head_dim 16) converted to our global tensors and loaded at TP 2 x PP 2 (4 ranks):
the pipeline, run stage by stage, gives transformers' logits (fp32, rtol 1e-5; logits near zero to 1e-5 of the
largest). Every rank builds the same HF model from the same seed and takes its slices of the converted tensors
(``split_global`` with each parameter's ``TensorDesc``)."""
import torch
import torch.distributed as dist

from megatronish.convert import hf_state_dict_to_ours, load_into_model, model_config_from_hf
from megatronish.convert.tiny import tiny_hf_model
from megatronish.model.build import build_model_chunks
from megatronish.parallel import groups
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.mappings import gather_from_tensor_model_parallel_region
from megatronish.testing import assert_parity, run_distributed

V, B, S = 100, 2, 16
# name -> (architecture, tiny_hf_model overrides)
DENSE = {"gpt2": ("GPT2LMHeadModel", {}), "llama": ("LlamaForCausalLM", {}), "mistral": ("MistralForCausalLM", {}),
         "qwen2": ("Qwen2ForCausalLM", {}), "qwen2_tied": ("Qwen2ForCausalLM", {"tied": True}),
         "qwen3": ("Qwen3ForCausalLM", {})}


def _worker(rank, world):
    ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, tp=2, pp=2))
    tp, tp_rank = 2, groups.get_tensor_model_parallel_rank()
    out = {}
    for name, (arch, over) in DENSE.items():
        hf = tiny_hf_model(arch, vocab=V, **over)
        cfg, a = model_config_from_hf(hf.config.to_dict())
        tensors = hf_state_dict_to_ours(hf.state_dict(), cfg, a, tp=tp)
        (model,) = build_model_chunks(cfg, ctx)
        load_into_model(model, tensors, tp_rank, tp)
        logits, ref = _two_stage_logits(model, ctx, hf, cfg.hidden_size)
        if logits is not None:
            out[name] = (logits - ref).abs().max().item()
            assert_parity(logits, ref, f"{name} logits at TP 2 x PP 2", rtol=1e-5)
    return out


def _two_stage_logits(model, ctx, hf, hidden):
    """Run a two-stage pipeline on fixed tokens: ``(logits, transformers' logits)`` on the last stage (the
    vocabulary gathered over TP), ``(None, None)`` on the first."""
    model.eval()
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        if ctx.pp_rank == 0:
            dist.send(model(ids).contiguous(), groups.get_pipeline_model_parallel_next_rank())
            return None, None
        x = torch.empty(S, B, hidden)
        dist.recv(x, groups.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(x)
        return gather_from_tensor_model_parallel_region(model(ids), ctx.tp_group)[..., :V], hf(input_ids=ids).logits


def test_hf_logits_at_tp2_pp2():
    results = run_distributed(_worker, 4)
    last = [r for r in results if r]
    assert len(last) == 2 and all(set(r) == set(DENSE) for r in last)
    print("max |logits - transformers'|:", last[0])


# ---- mixture of experts: converted checkpoints loaded by pretrain at EP 2 x PP 2 --------------------------------

MOE_V, MOE_S = 100, 16
MOE_COMMON = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
              "--num-query-groups", "4", "--seq-length", str(MOE_S), "--max-position-embeddings", "32",
              "--vocab-size", str(MOE_V - 1), "--tokenizer-type", "NullTokenizer", "--mock-data",
              "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--position-embedding-type", "rope",
              "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
              "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--lr", "1e-3", "--seed", "7", "--train-iters", "1", "--eval-iters", "1",
              "--log-interval", "1000", "--finetune", "--skip-train", "--num-experts", "4", "--moe-router-topk", "2",
              "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# Each family's flags, as the converter maps its config.json (tiny_hf_model's settings; docs/convert.md).
MOE_FAMILIES = {
    "MixtralForCausalLM": (dict(), ["--ffn-hidden-size", "48"]),
    "Qwen3MoeForCausalLM": (dict(mlp_only_layers=[2]), [
        "--qk-layernorm", "--kv-channels", "16", "--ffn-hidden-size", "96", "--moe-ffn-hidden-size", "32",
        "--moe-layer-freq", "[1,1,0,1]"]),
    "Qwen2MoeForCausalLM": (dict(), [
        "--add-qkv-bias", "--ffn-hidden-size", "96", "--moe-ffn-hidden-size", "32", "--moe-router-pre-softmax",
        "--moe-shared-expert-intermediate-size", "40", "--moe-shared-expert-gate"]),
}


def _moe_worker(rank, world, models):
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.data.mock import MockGPTDataset
    from megatronish.data.sampler import collate
    from megatronish.training.pretrain import pretrain

    out = {}
    for arch, (hf, ours) in models.items():
        groups.destroy_model_parallel()
        cfg = configs_from_args(parse_args(MOE_COMMON + MOE_FAMILIES[arch][1] + ["--load", ours]), world)
        state = pretrain(cfg).state
        (_, loss), = state.valid_history
        start = state.valid_consumed_samples - cfg.train.global_batch_size
        ds = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed + 1)
        batch = collate([ds[i] for i in range(start, start + cfg.train.global_batch_size)])
        with torch.no_grad():  # transformers' loss on the same validation samples
            logits = hf(input_ids=batch["tokens"].long()).logits
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, MOE_V), batch["labels"].long().reshape(-1))
        out[arch] = (loss, ref.item())
    return out


def test_moe_hf_loss_at_ep2_pp2(tmp_path):
    """Mixtral, Qwen3-MoE (with a dense layer) and Qwen2-MoE (shared expert, q/k/v biases, Qwen's
    unrenormalised top-k) from transformers, saved as published (per-expert files), converted to our checkpoint
    by tools/checkpoint/convert.py's code and evaluated by ``pretrain`` at EP 2 x PP 2 (4 ranks): the evaluation
    loss equals transformers' loss on the same tokens (fp32, rtol 1e-5). The models are built and converted
    before the ranks fork."""
    from megatronish.tools import convert_checkpoint

    models = {}
    for arch, (over, _) in MOE_FAMILIES.items():
        hf_dir, ours = str(tmp_path / arch / "hf"), str(tmp_path / arch / "ours")
        hf = tiny_hf_model(arch, vocab=MOE_V, **over)
        hf.save_pretrained(hf_dir)
        convert_checkpoint.main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatronish",
                                 "--load-dir", hf_dir, "--save-dir", ours])
        models[arch] = (hf, ours)
    results = run_distributed(_moe_worker, 4, models, timeout=600)
    for res in results:
        assert set(res) == set(MOE_FAMILIES)
        for arch, (ours, ref) in res.items():
            assert abs(ours - ref) <= 1e-5 * abs(ref), (arch, ours, ref)


# ---- DeepSeek-V3 (multi-latent attention, YaRN, DeepSeek's MoE) at TP 2 x PP 2 x EP 2 ------------------------------

DEEPSEEK = {"q_lora_yarn_groups": {},  # tiny_hf_model's DeepSeek-V3: q latent, YaRN, group-limited top-4, shared
            "full_q_rope_top2": dict(q_lora_rank=None, first_k_dense_replace=2, n_group=1, topk_group=1,
                                     num_experts_per_tok=2, n_shared_experts=1,
                                     rope_parameters=dict(rope_type="default", rope_theta=10000.0))}


def _deepseek_worker(rank, world, models):
    ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, tp=2, pp=2, ep=2))
    out = {}
    for name, hf in models.items():
        cfg, a = model_config_from_hf(hf.config.to_dict())
        (model,) = build_model_chunks(cfg, ctx)
        load_into_model(model, hf_state_dict_to_ours(hf.state_dict(), cfg, a, tp=2), parallel=ctx)
        logits, ref = _two_stage_logits(model, ctx, hf, cfg.hidden_size)
        if logits is not None:
            out[name] = (logits - ref).abs().max().item()
            assert_parity(logits, ref, f"DeepSeek-V3 {name} logits at TP 2 x PP 2 x EP 2", rtol=1e-5)
    return out


def test_deepseek_v3_logits_at_tp2_pp2_ep2():
    """transformers' DeepseekV3ForCausalLM (MLA with and without the query latent, YaRN and plain RoPE, a first
    dense layer, sigmoid routing with the expert bias, group-limited top-k, shared experts) converted and loaded
    at TP 2 x PP 2 x EP 2 (8 ranks): transformers' logits (fp32, rtol 1e-5)."""
    models = {name: tiny_hf_model("DeepseekV3ForCausalLM", vocab=V, **over) for name, over in DEEPSEEK.items()}
    results = run_distributed(_deepseek_worker, 8, models, timeout=600)
    last = [r for r in results if r]
    assert len(last) == 4 and all(set(r) == set(DEEPSEEK) for r in last)
    print("max |logits - transformers'|:", last[0])
