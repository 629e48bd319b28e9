"""Document masking (``--reset-attention-mask --reset-position-ids --eod-mask-loss``, Megatron's GPTDataset
semantics): attention never crosses an end-of-document token and positions restart after it.

- One process = a per-document reference: the packed sequence's per-token losses equal each document run on its
  own (GPT-2 with learned positions, Llama with RoPE).
- From a corpus of many short documents through ``pretrain()``: every context-parallel comm type gives the losses,
  grad norms and parameters of one process with the same masks (4 SGD iterations, rtol 1e-5), and the masks
  change the run (it is not the causal one).
"""
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatronish.arguments import configs_from_args, parse_args
from megatronish.config import gpt2, llama
from megatronish.data.gpt_dataset import document_ids
from megatronish.data.indexed_dataset import IndexedDatasetBuilder, get_idx_path
from megatronish.model import GPTModel
from megatronish.parallel.init import gather_to_global
from megatronish.parallel.random import set_random_seed
from megatronish.testing import run_distributed
from megatronish.training.pretrain import pretrain

V = 95  # NullTokenizer --vocab-size 95: ids 0..94, eod 95
EOD = V


@pytest.mark.parametrize("flavor", ["gpt2", "llama"])
def test_packed_documents_equal_each_document_alone(flavor):
    make = gpt2 if flavor == "gpt2" else llama
    cfg = make(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V + 1, seq_length=32,
               attention_dropout=0.0, hidden_dropout=0.0)
    set_random_seed(3)
    model = GPTModel(cfg).eval()
    model.init_parameters(3)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 1, 7, 10]  # each ends with eod; 32 tokens in all
    docs = [torch.cat([torch.randint(0, V, (n - 1,), generator=g), torch.tensor([EOD])]) for n in lengths]
    packed = torch.cat(docs)
    labels = torch.cat([packed[1:], torch.tensor([0])])
    ids = document_ids(packed, EOD)
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        loss = model(packed[None], position_ids=positions[None], labels=labels[None], document_ids=ids[None])[0]
        start = 0
        for n, doc in zip(lengths, docs):
            alone = model(doc[None], labels=labels[None, start:start + n])[0]
            torch.testing.assert_close(loss[start:start + n], alone, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{flavor} document at {start}: {m}")
            start += n
        causal = model(packed[None], position_ids=positions[None], labels=labels[None])[0]
    assert not torch.allclose(causal, loss, rtol=1e-3), "the document mask must change the later documents"


def test_document_ids_follow_megatrons_mask():
    tokens = torch.tensor([4, 7, EOD, 3, EOD, EOD, 1, 2])
    assert document_ids(tokens, EOD).tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    # Megatron: attention_mask[i+1:, :i+1] = 0 for each eod at i  <=>  same document id (and causal)
    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    for i in torch.nonzero(tokens == EOD).flatten().tolist():
        mask[i + 1:, : i + 1] = False
    ids = document_ids(tokens, EOD)
    assert torch.equal(mask, (ids[:, None] == ids[None, :]) & torch.tril(torch.ones(8, 8, dtype=torch.bool)))


# ------------------------------------------------------------------ through pretrain, on a corpus of short documents
def _corpus(prefix):
    rng = np.random.default_rng(7)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(400):
        n = int(rng.integers(2, 14))
        builder.add_document(np.append(rng.integers(0, V, n - 1), EOD), [n])
    builder.finalize(get_idx_path(prefix))


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(V),
        "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "0.5",
        "--optimizer", "sgd", "--sgd-momentum", "0", "--clip-grad", "1.0", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1", "--seed", "5", "--split", "100,0,0"]
MASKS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2"]


def _run(rank, world, cases, prefix, tmp):
    out = {}
    for name, argv in cases.items():
        metrics = os.path.join(tmp, f"{name}-{rank}.jsonl")
        result = pretrain(configs_from_args(parse_args(BASE + argv + [
            "--data-path", prefix, "--data-cache-path", os.path.join(tmp, "cache"), "--metrics-file", metrics]),
            world))
        state, ctx = result.state, result.context
        params = {n: gather_to_global(p.detach(), p.desc, ctx.parallel.tp_group).numpy()
                  for m in ctx.models for n, p in m.named_global_parameters()}
        norms = [json.loads(line)["grad_norm"] for line in open(metrics)] if os.path.exists(metrics) else None
        both = [None] * world
        dist.all_gather_object(both, (params, norms))
        merged = {k: v for p, _ in both for k, v in p.items()}
        out[name] = ([loss for _, loss in state.history], next(n for _, n in both if n is not None), merged)
    return out


def _same(got, ref, what):
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} losses: {m}")
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(ref[1]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} grad norms: {m}")
    for n, p in got[2].items():
        torch.testing.assert_close(torch.from_numpy(p), torch.from_numpy(ref[2][n]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {n}: {m}")


def test_every_cp_comm_type_equals_one_process_with_the_same_masks(tmp_path):
    prefix = str(tmp_path / "short_docs")
    _corpus(prefix)
    tmp = str(tmp_path)
    for flavor, extra in (("gpt2", []), ("llama", LLAMA)):
        ref = run_distributed(_run, 1, {"masked": MASKS + extra, "causal": extra}, prefix, tmp)[0]
        assert not np.allclose(ref["masked"][0], ref["causal"][0], rtol=1e-3), "the masks must change the run"
        cp2 = {t: MASKS + extra + ["--context-parallel-size", "2", "--cp-comm-type", t]
               for t in ("p2p", "a2a", "allgather")}
        for name, got in run_distributed(_run, 2, cp2, prefix, tmp)[0].items():
            _same(got, ref["masked"], f"{flavor} CP2 {name}")
        cp4 = {"a2a+p2p": MASKS + extra + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                           "--hierarchical-context-parallel-sizes", "2", "2"]}
        for name, got in run_distributed(_run, 4, cp4, prefix, tmp)[0].items():
            _same(got, ref["masked"], f"{flavor} CP4 {name}")
