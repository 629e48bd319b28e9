"""Generation at TP 2, PP 2 and TP 2 x PP 2 (gloo ranks) from checkpoints: greedy continuations of a batch of
prompts of different lengths are token-identical to transformers' ``generate`` for a converted random GPT-2 and
Llama (GQA), with and without the KV cache, and the log-probs equal transformers' within 1e-5. The TP 2 x PP 2
run loads a converted (layout-free) checkpoint and saves it again from its four ranks; the TP 2 and PP 2 runs
load that one, so a checkpoint saved at one layout generates at another. A converted DeepSeek-V3-like model
(multi-latent attention with the query latent, YaRN; dense) generates transformers' greedy tokens and log-probs
at TP 2 from the latent cache, with and without ``--cache-mla-latents``' weight absorption; both TP ranks cache
the same whole latents."""
import argparse
import os

import pytest
import torch

from megatronish.checkpoint.manager import Checkpointer
from megatronish.checkpoint.offline import write_checkpoint
from megatronish.convert import hf_state_dict_to_ours, model_config_from_hf
from megatronish.convert.tiny import tiny_hf_model
from megatronish.inference import SamplingParams
from megatronish.inference.setup import build_generation_parser, configs_for_generation, load_generator
from megatronish.testing import run_distributed

V, NEW = 100, 8
ARCHS = ("GPT2LMHeadModel", "LlamaForCausalLM")
MLA = "DeepseekV3ForCausalLM"
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation")
    refs = {}
    for arch in ARCHS + (MLA,):  # the DeepSeek model dense (generation with MoE at TP 2 needs expert parallelism)
        hf = tiny_hf_model(arch, vocab=V, **(dict(first_k_dense_replace=4) if arch == MLA else {}))
        hf.generation_config.eos_token_id = None  # generate exactly NEW tokens
        cfg, a = model_config_from_hf(hf.config.to_dict())
        write_checkpoint(str(root / arch), None, hf_state_dict_to_ours(hf.state_dict(), cfg, a, tp=1),
                         {"model": cfg.flat()})
        seqs, lps = [], []
        with torch.no_grad():
            for p in PROMPTS:
                ids = torch.tensor([p])
                seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                  pad_token_id=0)[0]
                seqs.append(seq.tolist())
                lps.append(torch.log_softmax(hf(seq[None]).logits[0, :-1], -1).gather(-1, seq[1:, None])[:, 0])
        refs[arch] = (seqs, lps)
    return str(root), refs


def _session(load, tp, pp, save=None, extra=()):
    argv = ["--load", load, "--use-checkpoint-args", "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--inference-max-requests", "4", *extra]
    args = build_generation_parser("test", "test").parse_args(argv + (["--save", save] if save else []))
    world = int(os.environ["WORLD_SIZE"])
    cfg = configs_for_generation(args, world)
    return cfg, load_generator(cfg, args)


def _check(session, arch, refs):
    seqs, lps = refs[arch]
    for use_cache in (True, False):
        out = session.generator.generate(PROMPTS, NEW, SamplingParams(top_k=1), return_logprobs=True,
                                         use_cache=use_cache, pad_id=V - 1)
        assert out.tokens == seqs, (arch, use_cache, out.tokens, seqs)
        for i in range(len(PROMPTS)):
            torch.testing.assert_close(torch.tensor(out.logprobs[i]), lps[i], rtol=0, atol=1e-5,
                                       msg=lambda m: f"{arch} cache={use_cache}: {m}")
    # sampling with a seed gives the same tokens on every rank (they are broadcast from the last stage)
    return session.generator.generate(PROMPTS, NEW, SamplingParams(temperature=2.0, top_k=10, seed=3)).tokens


def _tp2_pp2(rank, world, root, refs):
    sampled = {}
    for arch in ARCHS:
        cfg, session = _session(os.path.join(root, arch), 2, 2, save=os.path.join(root, "resaved", arch))
        assert (session.parallel.tp_size, session.parallel.pp_size) == (2, 2)
        sampled[arch] = _check(session, arch, refs)
        Checkpointer(cfg, [session.generator.model], None, None, parallel=session.parallel).save(
            argparse.Namespace(iteration=1, consumed_samples=0, valid_consumed_samples=0))
    return sampled


def _tp2_then_pp2(rank, world, root, refs):
    sampled = {}
    for tp, pp in ((2, 1), (1, 2)):
        for arch in ARCHS:
            _, session = _session(os.path.join(root, "resaved", arch), tp, pp)
            sampled[(tp, pp, arch)] = _check(session, arch, refs)
    seqs, lps = refs[MLA]
    for absorb in (False, True):  # the latent cache at TP 2, up-projected per step or absorbed
        _, session = _session(os.path.join(root, MLA), 2, 1, extra=["--cache-mla-latents"] if absorb else [])
        out = session.generator.generate(PROMPTS, NEW, SamplingParams(top_k=1), return_logprobs=True, pad_id=V - 1)
        assert out.tokens == seqs, (absorb, out.tokens, seqs)
        for i in range(len(PROMPTS)):
            torch.testing.assert_close(torch.tensor(out.logprobs[i]), lps[i], rtol=0, atol=1e-5)
        cache, a = session.generator._cache, session.cfg.model.attention
        assert cache.absorb == absorb and cache.nbytes() == 4 * 4 * session.generator.max_sequence * (
            a.kv_lora_rank + a.qk_pos_emb_head_dim) * 4  # 4 layers x 4 sequences x positions, fp32
        sampled[("latents", absorb)] = [t.tolist() for t in cache.layer_cache(0).entries]  # equal on both ranks
    return sampled


def test_generation_at_tp_pp_layouts_matches_transformers(setup):
    root, refs = setup
    four = run_distributed(_tp2_pp2, 4, root, refs, timeout=300)
    assert all(r == four[0] for r in four)  # every rank holds the same sampled tokens
    two = run_distributed(_tp2_then_pp2, 2, root, refs, timeout=300)
    assert two[0] == two[1]
    for arch in ARCHS:  # the same seed samples the same tokens at every layout
        assert two[0][(2, 1, arch)] == two[0][(1, 2, arch)] == four[0][arch]
