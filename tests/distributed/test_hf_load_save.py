"""Training from and into Hugging Face directories (docs/convert.md, "Training from and into Hugging Face").

``--load <HF dir>``: a random Qwen3, a random Mixtral and a random DeepSeek-V3 written by ``save_pretrained``
(sharded; the GPT-2 tokenizer.json beside them, so no tokenizer flag is given) are loaded at TP 2 x PP 2 (the MoE
models with EP 2, expert TP 1) and trained 12 iterations; every iteration's loss equals transformers' model trained
by ``torch.optim.AdamW`` on the same samples (fp32, rtol 1e-5; the reference of tests/support/hf_training.py).
Each rank reads about a quarter of the tensor bytes (its own blocks), never the whole file set.

The DeepSeek-V3 (multi-latent attention with the query latent, YaRN, a first dense layer, group-limited sigmoid
routing with the expert bias, kept fixed by ``--moe-router-bias-update-rate 0`` as transformers keeps it, shared
experts) is stored as DeepSeek publishes it: FP8 linear weights with 24 x 24 block scales (a rank's slices start
inside blocks) and one multi-token-prediction layer. Trained without ``--mtp-num-layers``, no MTP tensor is read;
transformers trains the model the FP8 files hold (their dequantized values). Loaded with ``--mtp-num-layers 1`` and
exported at once by ``--save-hf``'s writer, every tensor, the MTP layer's and its copies of the embedding and
output layer included, is bitwise the files' (FP8 weights: their full-tensor dequantization).

``--save-hf``: runs at TP 2 x PP 2 x DP 2 (8 ranks; Qwen3, and the DeepSeek-V3 with EP 2 and its MTP layer)
write the HF directory from every rank; its tensors are bitwise those of ``tools/checkpoint/convert.py --saver hf``
of the checkpoint the same run saved, the DP replicas write nothing, and transformers' greedy ``generate`` on the
Qwen3 equals our generator's tokens loading that directory at TP 2 x PP 2.
"""
import json
import math
import os
import shutil

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.convert import hf_save
from megatronish.convert.hf_deepseek import fp8_view
from megatronish.convert.hf_io import HFReader
from megatronish.convert.tiny import add_mtp_layers, tiny_hf_model
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training import pretrain as training
from megatronish.training.data_wiring import build_file_datasets
from support.hf_training import GBS, ITERS, SEQ, corpus, fp8_directory, hf_adamw_losses, schedule_flags
from support.tokenizer_files import make_hf_tokenizer_json

TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
EP2 = TP2PP2 + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
LAYOUTS = {"qwen3": TP2PP2, "mixtral": EP2, "deepseek": EP2 + ["--moe-router-bias-update-rate", "0"]}
DS, MTP_LAYER, FP8_BLOCK = "DeepseekV3ForCausalLM", "model.layers.4.", 24
PROMPTS, NEW = [[64, 268, 75], [121, 31, 25, 133, 286, 262, 108]], 8
V = 512  # the model's vocabulary; the tokenizer (tests/support/tokenizer_files.py) has fewer tokens


def _argv(hf_dir, prefix, layout):
    return ["--load", hf_dir, "--seq-length", str(SEQ), *schedule_flags(), "--data-path", prefix,
            "--split", "100,0,0", "--log-interval", "1000", "--eval-iters", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0"] + layout  # transformers trains without dropout


def _hf_model(kind):
    import transformers

    shape = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(5)
    if kind == "deepseek":  # tiny_hf_model's DeepSeek-V3 (8 experts, top-4 of the best 2 of 4 groups)
        return tiny_hf_model(DS, vocab=V, max_position_embeddings=SEQ, aux_loss_alpha=0.0,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                  original_max_position_embeddings=SEQ // 4, beta_fast=32.0,
                                                  beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8))
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=96, head_dim=16, **shape))
    # transformers adds Mixtral's load-balancing loss only with output_router_logits; ours would add it always
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0, **shape))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("hf_load_save")
    tokenizer = make_hf_tokenizer_json(str(root))
    prefix = corpus(root, ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer], lines=100)
    dirs, want, samples = {}, {}, None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the references' matrices are tiny: threads only add waiting on this shared CPU
    try:
        for kind in LAYOUTS:
            hf = _hf_model(kind)
            dirs[kind] = str(root / kind)
            hf.save_pretrained(dirs[kind], max_shard_size="100KB")  # sharded, with model.safetensors.index.json
            shutil.copy(tokenizer, dirs[kind])  # the directory's tokenizer: no tokenizer flag needed
            if kind == "deepseek":
                hf = _as_published(hf, dirs[kind], root / "deepseek_values")
            if samples is None:
                train = build_file_datasets(configs_from_args(parse_args(_argv(dirs[kind], prefix, [])), 1))[0]
                samples = [train[i] for i in range(ITERS * GBS)]
            want[kind] = hf_adamw_losses(hf, samples)
    finally:
        torch.set_num_threads(threads)
    return root, prefix, dirs, want


def _as_published(hf, path, values_dir):
    """The DeepSeek-V3 directory ``path`` rewritten as published (FP8 linear weights with block scales, one
    multi-token-prediction layer); returns transformers' model of the values the files now hold."""
    import transformers
    from safetensors.torch import load_file, save_file

    hf.save_pretrained(values_dir)
    values = load_file(os.path.join(values_dir, "model.safetensors"))
    values.update(fp8_directory(path, FP8_BLOCK))
    save_file(values, os.path.join(values_dir, "model.safetensors"), metadata={"format": "pt"})
    add_mtp_layers(path)
    return transformers.DeepseekV3ForCausalLM.from_pretrained(values_dir)


def _train_worker(rank, world, cases):
    """Each case's losses (none for an export case: the model written by ``--save-hf``'s writer right after
    loading), the bytes this rank read from the HF files and the names of the tensors it read."""
    read, names = [0], set()
    original = HFReader.read

    def counted(self, name, index):
        t = original(self, name, index)
        read[0] += t.numel() * t.element_size()
        names.add(name)
        return t

    HFReader.read = counted
    out = {}
    for name, (argv, export) in cases.items():
        groups.destroy_model_parallel()
        read[0] = 0
        names.clear()
        run, state = training.setup(configs_from_args(parse_args(argv), world))
        loaded = (read[0], sorted(names))
        if export:
            hf_save.export_hf(run.models, run.cfg, run.parallel, export, 0, source_dir=run.cfg.checkpoint.load)
            out[name] = ([], *loaded)
        else:
            out[name] = ([training.train_step(run, state).loss for _ in range(ITERS)], *loaded)
    return out


def _tensor_bytes(hf_dir, skip="-"):
    """The bytes of the directory's tensors but those whose name starts with ``skip``."""
    r = HFReader(hf_dir)
    return sum(math.prod(r.shape(n)) * r.dtype(n).itemsize for n in r.names() if not n.startswith(skip))


def test_load_hf_directory_trains_like_transformers(setup):
    root, prefix, dirs, want = setup
    export = str(root / "deepseek_export")
    cases = {kind: (_argv(dirs[kind], prefix, layout), None) for kind, layout in LAYOUTS.items()}
    cases["deepseek_mtp"] = (_argv(dirs["deepseek"], prefix, LAYOUTS["deepseek"] + ["--mtp-num-layers", "1"]),
                             export)
    results = run_distributed(_train_worker, 4, cases, timeout=600)
    for kind in LAYOUTS:
        losses = results[0][kind][0]
        assert all(r[kind][0] == losses for r in results), f"{kind}: ranks disagree"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want[kind]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{kind}: losses {losses} against transformers' {want[kind]}: {m}")
        total = _tensor_bytes(dirs[kind], skip=MTP_LAYER)  # the multi-token-prediction layer is not read
        for rank, r in enumerate(results):
            share = r[kind][1] / total
            # a quarter each, plus the norms (and MLA's down-projections) every TP rank reads in full
            assert 0.2 < share < 0.3, f"{kind}: rank {rank} read {r[kind][1]} of {total} tensor bytes ({share:.2f})"
    copies = {f"{MTP_LAYER}embed_tokens.weight", f"{MTP_LAYER}shared_head.head.weight"}
    for rank, r in enumerate(results):
        assert not any(n.startswith(MTP_LAYER) for n in r["deepseek"][2]), rank  # MTP not trained: not read
        assert any(n.endswith("_scale_inv") for n in r["deepseek"][2]), rank
        assert not copies & set(r["deepseek_mtp"][2]), rank  # our depth shares the embedding and output layer
    assert any(n.startswith(MTP_LAYER) for r in results for n in r["deepseek_mtp"][2])

    source, written = HFReader(dirs["deepseek"]), HFReader(os.path.join(export, "latest"))
    names, dequantized = fp8_view(source.names(), source.get, source.config)
    assert sorted(written.names()) == sorted(names) and copies < names
    for n in names:
        assert torch.equal(written.get(n), dequantized(n).float()), n
    config = json.load(open(os.path.join(export, "latest", "config.json")))
    assert config["num_nextn_predict_layers"] == 1 and "quantization_config" not in config


def _save_worker(rank, world, runs):
    """Each run's bytes this rank wrote into the HF files, and its data-parallel rank."""
    written = [0]
    original = hf_save._Files.write

    def counted(self, name, index, t):
        written[0] += t.numel() * t.element_size()
        return original(self, name, index, t)

    hf_save._Files.write = counted
    out = {}
    for name, argv in runs.items():
        groups.destroy_model_parallel()
        written[0] = 0
        result = training.pretrain(configs_from_args(parse_args(argv), world))
        out[name] = (written[0], result.context.parallel.dp_rank)
    return out


def _generate_worker(rank, world, hf_dir):
    from megatronish.inference import SamplingParams
    from megatronish.inference.setup import build_generation_parser, configs_for_generation, load_generator

    args = build_generation_parser("test", "test").parse_args(["--load", hf_dir, *TP2PP2])
    session = load_generator(configs_for_generation(args, world), args)
    return session.generator.generate(PROMPTS, NEW, SamplingParams(top_k=1), pad_id=0).tokens


def test_save_hf_from_every_rank_matches_convert_and_generates(setup):
    import transformers
    from safetensors.torch import load_file

    from megatronish.tools import convert_checkpoint

    root, prefix, dirs, _ = setup
    layouts = {"qwen3": TP2PP2, "deepseek": LAYOUTS["deepseek"] + ["--mtp-num-layers", "1"]}
    runs = {kind: _argv(dirs[kind], prefix, layout) + ["--train-iters", "2", "--lr-warmup-iters", "0", "--save",
                                                       str(root / f"ours_{kind}"), "--save-hf",
                                                       str(root / f"hf_out_{kind}")]
            for kind, layout in layouts.items()}
    results = run_distributed(_save_worker, 8, runs, timeout=600)

    def tensors(d):
        files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
        return {k: v for f in files for k, v in load_file(os.path.join(d, f)).items()}

    for kind in runs:
        out = str(root / f"hf_out_{kind}")
        export = os.path.join(out, "latest")
        assert os.path.realpath(export) == os.path.join(os.path.realpath(out), "iter_0000002")
        assert sum(r[kind][0] for r in results) == _tensor_bytes(export), kind  # every byte written once
        assert all(r[kind][0] == 0 for r in results if r[kind][1] == 1), kind  # the DP replicas wrote nothing
        assert all(os.path.isfile(os.path.join(export, f)) for f in ("config.json", "generation_config.json",
                                                                      "tokenizer.json"))
        converted = str(root / f"converted_{kind}")
        convert_checkpoint.main(["--model-type", "GPT", "--loader", "megatronish", "--saver", "hf",
                                 "--load-dir", str(root / f"ours_{kind}"), "--save-dir", converted])
        mine, theirs = tensors(export), tensors(converted)
        assert mine.keys() == theirs.keys(), kind
        for k in mine:
            assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), k
    assert {f"{MTP_LAYER}eh_proj.weight", f"{MTP_LAYER}shared_head.head.weight"} < mine.keys()  # the DeepSeek-V3's

    export = os.path.join(str(root / "hf_out_qwen3"), "latest")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    expected = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            expected.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist())
    generated = run_distributed(_generate_worker, 4, export, timeout=300)
    assert all(g == expected for g in generated), (generated[0], expected)
