"""Tiny Hugging Face GPT-2 and Llama (GQA) converted to our global tensors and loaded at TP 2 x PP 2 (4 ranks):
the pipeline, run stage by stage, gives transformers' logits (fp32, atol 1e-4). Every rank builds the same HF
model from the same seed and takes its slices of the converted tensors (``split_global`` with each
parameter's ``TensorDesc``)."""
import torch
import torch.distributed as dist

from megatronish.convert import hf_state_dict_to_ours, load_into_model, model_config_from_hf
from megatronish.convert.tiny import tiny_hf_model
from megatronish.model.build import build_model_chunks
from megatronish.parallel import groups
from megatronish.parallel.dims import ParallelDims
from megatronish.parallel.mappings import gather_from_tensor_model_parallel_region
from megatronish.testing import run_distributed

V, B, S = 100, 2, 16


def _worker(rank, world):
    ctx = groups.initialize_model_parallel(ParallelDims(world_size=world, tp=2, pp=2))
    tp, tp_rank = 2, groups.get_tensor_model_parallel_rank()
    pp_rank = groups.get_pipeline_model_parallel_rank()
    out = {}
    for arch in ("GPT2LMHeadModel", "LlamaForCausalLM"):
        hf = tiny_hf_model(arch, vocab=V)
        cfg, a = model_config_from_hf(hf.config.to_dict())
        tensors = hf_state_dict_to_ours(hf.state_dict(), cfg, a, tp=tp)
        (model,) = build_model_chunks(cfg, ctx)
        load_into_model(model, tensors, tp_rank, tp)
        model.eval()
        ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            if pp_rank == 0:
                dist.send(model(ids).contiguous(), groups.get_pipeline_model_parallel_next_rank())
            else:
                x = torch.empty(S, B, cfg.hidden_size)
                dist.recv(x, groups.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(x)
                logits = gather_from_tensor_model_parallel_region(model(ids), ctx.tp_group)[..., :V]
                ref = hf(input_ids=ids).logits
                out[a] = (logits - ref).abs().max().item()
                torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4, msg=lambda m: f"{a}: {m}")
    return out


def test_hf_logits_at_tp2_pp2():
    results = run_distributed(_worker, 4)
    last = [r for r in results if r]
    assert len(last) == 2 and all(set(r) == {"GPT2LMHeadModel", "LlamaForCausalLM"} for r in last)
