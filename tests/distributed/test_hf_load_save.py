"""Training from and into Hugging Face directories (docs/convert.md, "Training from and into Hugging Face").

``--load <HF dir>``: a random Qwen3 and a random Mixtral written by ``save_pretrained`` (sharded; the GPT-2
tokenizer.json beside them, so no tokenizer flag is given) are loaded at TP 2 x PP 2 (Mixtral: with EP 2,
expert TP 1) and trained 12 iterations; every iteration's loss equals transformers' model trained by
``torch.optim.AdamW`` on the same samples (fp32, rtol 1e-5; the reference of tests/support/hf_training.py). Each
rank reads about a quarter of the tensor bytes (its own blocks), never the whole file set.

``--save-hf``: a run at TP 2 x PP 2 x DP 2 (8 ranks) writes the HF directory from every rank; its tensors are
bitwise those of ``tools/checkpoint/convert.py --saver hf`` of the checkpoint the same run saved, the DP replicas
write nothing, and transformers' greedy ``generate`` on it equals our generator's tokens loading that directory at
TP 2 x PP 2.
"""
import json
import os
import shutil

import pytest
import torch

from megatronish.arguments import configs_from_args, parse_args
from megatronish.convert import hf_save
from megatronish.convert.hf_io import HFReader
from megatronish.parallel import groups
from megatronish.testing import run_distributed
from megatronish.training import pretrain as training
from megatronish.training.data_wiring import build_file_datasets
from support.hf_training import GBS, ITERS, SEQ, corpus, hf_adamw_losses, schedule_flags
from support.tokenizer_files import make_hf_tokenizer_json

TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {"qwen3": TP2PP2, "mixtral": TP2PP2 + ["--expert-model-parallel-size", "2",
                                                 "--expert-tensor-parallel-size", "1"]}
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
    for kind in LAYOUTS:
        hf = _hf_model(kind)
        dirs[kind] = str(root / kind)
        hf.save_pretrained(dirs[kind], max_shard_size="100KB")  # sharded, with model.safetensors.index.json
        shutil.copy(tokenizer, dirs[kind])  # the directory's tokenizer: no tokenizer flag needed
        if samples is None:
            train = build_file_datasets(configs_from_args(parse_args(_argv(dirs[kind], prefix, [])), 1))[0]
            samples = [train[i] for i in range(ITERS * GBS)]
        want[kind] = hf_adamw_losses(hf, samples)
    return root, prefix, dirs, want


def _train_worker(rank, world, cases):
    """Each case's losses and the bytes this rank read from the HF files."""
    read = [0]
    original = HFReader.read

    def counted(self, name, index):
        t = original(self, name, index)
        read[0] += t.numel() * t.element_size()
        return t

    HFReader.read = counted
    out = {}
    for name, argv in cases.items():
        groups.destroy_model_parallel()
        read[0] = 0
        run, state = training.setup(configs_from_args(parse_args(argv), world))
        loaded = read[0]
        out[name] = ([training.train_step(run, state).loss for _ in range(ITERS)], loaded)
    return out


def _tensor_bytes(hf_dir):
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    return index["metadata"]["total_size"]


def test_load_hf_directory_trains_like_transformers(setup):
    root, prefix, dirs, want = setup
    cases = {kind: _argv(dirs[kind], prefix, layout) for kind, layout in LAYOUTS.items()}
    results = run_distributed(_train_worker, 4, cases, timeout=600)
    for kind in cases:
        losses = results[0][kind][0]
        assert all(r[kind][0] == losses for r in results), f"{kind}: ranks disagree"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want[kind]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{kind}: losses {losses} against transformers' {want[kind]}: {m}")
        total = _tensor_bytes(dirs[kind])
        for rank, r in enumerate(results):
            share = r[kind][1] / total
            # a quarter each, plus the norms every TP rank reads in full
            assert 0.2 < share < 0.3, f"{kind}: rank {rank} read {r[kind][1]} of {total} tensor bytes ({share:.2f})"


def _save_worker(rank, world, argv):
    written = [0]
    original = hf_save._Files.write

    def counted(self, name, index, t):
        written[0] += t.numel() * t.element_size()
        return original(self, name, index, t)

    hf_save._Files.write = counted
    result = training.pretrain(configs_from_args(parse_args(argv), world))
    ctx = result.context.parallel
    return written[0], ctx.dp_rank


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
    ours, out = str(root / "ours"), str(root / "hf_out")
    argv = _argv(dirs["qwen3"], prefix, TP2PP2) + ["--train-iters", "2", "--lr-warmup-iters", "0", "--save", ours,
                                                   "--save-hf", out]
    results = run_distributed(_save_worker, 8, argv, timeout=600)
    export = os.path.join(out, "latest")
    assert os.path.realpath(export) == os.path.join(os.path.realpath(out), "iter_0000002")
    assert sum(w for w, _ in results) == _tensor_bytes(export)  # every byte written once
    assert all(w == 0 for w, dp in results if dp == 1)  # the data-parallel replicas wrote nothing
    assert all(os.path.isfile(os.path.join(export, f)) for f in ("config.json", "generation_config.json",
                                                                  "tokenizer.json"))

    convert_checkpoint.main(["--model-type", "GPT", "--loader", "megatronish", "--saver", "hf",
                             "--load-dir", ours, "--save-dir", str(root / "converted")])

    def tensors(d):
        files = [f for f in os.listdir(d) if f.endswith(".safetensors")]
        return {k: v for f in files for k, v in load_file(os.path.join(d, f)).items()}

    mine, theirs = tensors(export), tensors(str(root / "converted"))
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), k

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
