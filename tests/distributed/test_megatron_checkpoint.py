"""Megatron-LM checkpoints in and out, against megatron-core itself (installed with the dev extra).

One group of 4 forked gloo ranks: megatron-core builds its GPTModel (local layer spec) at TP 2 x PP 2 for a
Llama-style, a GPT-2-style and a DeepSeek-style multi-latent-attention model (and at TP 2 x PP 2 x EP 2 for a
Llama-style mixture-of-experts model and a DeepSeek-V3-style one, MLA + MoE with the first layer dense, which our
loader also reads at TP 1 x EP 4) and saves it with its own
``dist_checkpointing.save`` (with its FP32
optimizer's state for the Llama model) and in Megatron's legacy per-rank files; ``pretrain``'s set-up loads
them at TP 2 x PP 2 (every local tensor equal to megatron-core's; Adam moments, step, iteration, consumed samples
too); our ``--saver megatron`` output (from the torch_dist and from the legacy checkpoints) loads back into
megatron-core's model with ``dist_checkpointing.load``, every tensor equal (the multi-latent-attention model is
checked this far, and for ``--use-checkpoint-args``); the Llama and GPT-2 torch_dist checkpoints also load
at TP 1 x DP 4 with the distributed optimizer (global tensors and Adam moments equal to megatron-core's pieces put
together), and one more training iteration from the loaded Llama checkpoint gives the same loss and parameters at
both layouts. In this process: both formats converted to ours and to HF (transformers' loss equals our loss on
the same tokens), HF -> ``--saver megatron`` -> ours, ``--use-checkpoint-args``, and the bad inputs, one line
each. A second group of 2 ranks: megatron-core's bf16 run with its Float16 and its distributed optimizer
(``fully_reshardable``), loaded by ours with ``--bf16`` at TP 2 and at DP 2 with the distributed optimizer."""
import os
import random
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatronish.checkpoint import CheckpointError
from megatronish.testing import run_distributed
from support import megatron_core_support as mcs

TP, PP, ITER = 2, 2, 7
FULL = ("llama", "gpt2")  # the flavors also checked at TP 1, through HF and for the bad inputs


@pytest.fixture(scope="module", autouse=True)
def _megatron_core():
    mcs.require_checkpointing()  # a skip saying why without it; under CI a failure


def _ours(flavor, load, extra=(), tp=TP, pp=PP):
    from megatronish.arguments import configs_from_args, parse_args
    from megatronish.parallel import groups
    from megatronish.training.pretrain import setup

    groups.destroy_model_parallel()
    argv = mcs.our_flags(flavor) + ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "5",
                                    "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
                                    "--mock-data", "--eval-iters", "0", "--attention-dropout", "0",
                                    "--hidden-dropout", "0", "--tensor-model-parallel-size", str(tp),
                                    "--pipeline-model-parallel-size", str(pp), "--load", load, *extra]
    cfg = configs_from_args(parse_args(argv), dist.get_world_size())
    run, state = setup(cfg)
    tensors = {}
    for m in run.models:
        for name, p in m.named_global_parameters():
            tensors[name] = p.detach().clone()
    return run, state, tensors


def _cli(argv):
    from megatronish.tools.convert_checkpoint import parse, run

    run(parse(argv))


def _worker(rank, world, root):
    mcs.patch_for_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ep = 1
    out = {}
    for flavor in mcs.FLAVORS:
        if mcs.FLAVORS[flavor].get("ep", 1) != ep or not out:  # expert parallelism folded into TP (ETP 1)
            ep = mcs.FLAVORS[flavor].get("ep", 1)
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(TP, PP, expert_model_parallel_size=ep,
                                         expert_tensor_parallel_size=1 if ep > 1 else None)
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        out["coords"] = (tp_rank, pp_rank)
        model = mcs.build_gpt(flavor, TP, PP, seed=1)
        sd = {"model": mcs.sharded_state_dict(model), "iteration": ITER, "checkpoint_version": 3.0,
              "args": mcs.megatron_args(flavor, TP, PP, consumed_train_samples=ITER * 2)}
        opt = None
        if flavor == "llama":
            opt = mcs.fp32_optimizer(model)
            sd["optimizer"] = opt.sharded_state_dict(sd["model"])
            sd["opt_param_scheduler"] = {"max_lr": 1e-2, "min_lr": 1e-3, "lr_warmup_steps": 0, "num_steps": ITER * 2,
                                         "lr_decay_steps": 20, "lr_decay_style": "cosine", "start_wd": 0.01,
                                         "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 20}
        dist_dir = os.path.join(root, flavor, "torch_dist")
        if rank == 0:
            os.makedirs(os.path.join(dist_dir, f"iter_{ITER:07d}"))
        dist.barrier()
        dist_checkpointing.save(sd, os.path.join(dist_dir, f"iter_{ITER:07d}"))
        # Megatron's legacy save: torch.save of the local state dict with args, iteration and RNG states, in
        # get_checkpoint_name's mp_rank_TT_PPP[_EEE] (the EP rank appended with expert parallelism)
        legacy_dir = os.path.join(root, flavor, "legacy")
        rank_dir = os.path.join(legacy_dir, f"iter_{ITER:07d}", f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
                                + (f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else ""))
        os.makedirs(rank_dir, exist_ok=True)
        torch.save({"model": model.state_dict(), "args": mcs.megatron_args(flavor, TP, PP), "iteration": ITER,
                    "checkpoint_version": 3.0,
                    "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                   "torch_rng_state": torch.get_rng_state()}]},
                   os.path.join(rank_dir, "model_optim_rng.pt"))
        if rank == 0:
            mcs.write_tracker(dist_dir, ITER)
            mcs.write_tracker(legacy_dir, ITER)
        dist.barrier()
        ref = mcs.local_tensors(model)
        res = {"ref": ref}
        if opt is not None:
            by_id = {id(p): n for n, p in zip(ref, model.parameters())}
            res["ref_exp_avg"] = {by_id[id(p)]: st["exp_avg"].clone() for p, st in opt.optimizer.state.items()}
            res["ref_step"] = int(next(iter(opt.optimizer.state.values()))["step"])
        # ours at TP 2 x PP 2, from the torch_dist (with the optimizer when stored) and from the legacy files
        extra = () if opt is not None else ("--no-load-optim",)
        run_, state, res["ours"] = _ours(flavor, dist_dir, extra)
        res["state"] = (state.iteration, state.consumed_samples)
        if opt is not None:
            params = {id(p): n for m in run_.models for n, p in m.named_global_parameters()}
            res["ours_exp_avg"] = {params[id(p)]: st["exp_avg"].clone()
                                   for p, st in run_.optimizer.sharded_param_state()}
            res["ours_step"] = run_.optimizer.scalar_state_dict()["step"]
            res["lr"] = run_.scheduler.num_steps
            res["continued"] = _continue(run_, state)
        _, _, res["ours_legacy"] = _ours(flavor, legacy_dir, ("--no-load-optim",))
        if ep > 1:  # ours at TP 1 x PP 1 x EP 4 (DP 4): one expert per rank, the rest whole
            _, _, res["ours_ep4"] = _ours(flavor, dist_dir, ("--no-load-optim", "--expert-model-parallel-size", "4"),
                                          tp=1, pp=1)
        if flavor not in FULL:
            res.update(_save_back(root, flavor, rank))
            out[flavor] = res
            continue
        # ours at TP 1 (4 data-parallel ranks, distributed optimizer): every rank holds the global tensors
        run_, state, res["ours_tp1"] = _ours(flavor, dist_dir, ("--use-distributed-optimizer",) + extra, tp=1,
                                             pp=1)
        if opt is not None:
            params = {id(p): n for m in run_.models for n, p in m.named_global_parameters()}
            res["ours_tp1_exp_avg"] = {params[id(p)]: st["exp_avg"].clone()
                                       for p, st in run_.optimizer.sharded_param_state()}
            res["continued_tp1"] = _continue(run_, state)
        res.update(_save_back(root, flavor, rank))
        out[flavor] = res
    return _convert(out, lambda t: t.numpy().copy() if isinstance(t, torch.Tensor) else t)


def _save_back(root, flavor, rank):
    """Our --saver megatron, from both sources, loaded back into megatron-core's own model: its local tensors."""
    from megatron.core import dist_checkpointing

    res = {}
    for src in ("torch_dist", "legacy"):
        target = os.path.join(root, flavor, f"to_megatron_{src}")
        if rank == 0:
            _cli(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir",
                  os.path.join(root, flavor, src), "--save-dir", target, "--target-tensor-parallel-size", str(TP),
                  "--target-pipeline-parallel-size", str(PP)])
        dist.barrier()
        fresh = mcs.build_gpt(flavor, TP, PP, seed=2)
        loaded = dist_checkpointing.load({"model": mcs.sharded_state_dict(fresh)}, os.path.join(target, "release"))
        fresh.load_state_dict(loaded["model"])
        res[f"back_{src}"] = mcs.local_tensors(fresh)
    return res


def _continue(run, state):
    """One more training iteration from the loaded state: (iteration, consumed samples, loss, the parameters)."""
    from megatronish.training.pretrain import train_step

    loss = train_step(run, state).loss
    params = {n: p.detach().clone() for m in run.models for n, p in m.named_global_parameters()}
    return {"at": torch.tensor([state.iteration, state.consumed_samples]), "loss": torch.tensor(loss),
            "params": params}


def _convert(obj, fn):
    """Tensors as numpy arrays on the way back (the pipe would pass torch tensors as file descriptors of shared
    memory, which a worker that exits right away cannot serve), and back to tensors."""
    if isinstance(obj, dict):
        return {k: _convert(v, fn) for k, v in obj.items()}
    return fn(obj)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron"))
    per_rank = run_distributed(_worker, TP * PP, root, timeout=600)
    return root, [_convert(r, lambda a: torch.from_numpy(a) if isinstance(a, np.ndarray) else a) for r in per_rank]


def _compare(a, b, what):
    assert a.keys() == b.keys() or set(a) <= set(b), (what, sorted(set(a) ^ set(b)))
    for name in a:
        assert torch.equal(a[name], b[name]), (what, name)


@pytest.mark.parametrize("flavor", list(mcs.FLAVORS))
def test_loads_at_tp2_pp2_and_saves_back(results, flavor):
    _, per_rank = results
    for r in per_rank:
        res = r[flavor]
        ref = _whole_down_projections(per_rank, r, flavor)
        if not mcs.FLAVORS[flavor]["untie"] and not any(k.startswith("embedding.") for k in ref):
            ref.pop("output_layer.weight", None)  # megatron-core's tied copy on the last stage (not saved)
        if mcs.FLAVORS[flavor].get("mtp_num_layers") and r["coords"][1] == PP - 1:  # the MTP depth is compared
            assert "mtp.layers.0.eh_proj.weight" in ref and any(".mtp_model_layer.mlp.experts." in k for k in ref)
        ours = {k: v for k, v in res["ours"].items() if k in ref}
        assert set(ours) == set(ref), sorted(set(ours) ^ set(ref))
        _compare(ref, ours, "torch_dist at TP2xPP2")
        _compare(ref, {k: v for k, v in res["ours_legacy"].items() if k in ref}, "legacy at TP2xPP2")
        _compare(res["ref"], res["back_torch_dist"], "--saver megatron from torch_dist")
        _compare(res["ref"], res["back_legacy"], "--saver megatron from legacy")
        assert res["state"] == (ITER, ITER * 2)  # iteration and consumed samples from the stored args
        if flavor == "llama":
            assert res["ours_step"] == res["ref_step"] == 1
            assert res["lr"] == ITER * 2
            _compare(res["ref_exp_avg"], res["ours_exp_avg"], "Adam exp_avg")


@pytest.mark.parametrize("flavor", [f for f in mcs.FLAVORS if mcs.FLAVORS[f].get("ep", 1) > 1])
def test_moe_loads_at_ep4(results, flavor):
    """A mixture-of-experts checkpoint saved at TP 2 x PP 2 x EP 2 loads at TP 1 x PP 1 x EP 4: each rank's one
    expert, and every other tensor whole, equal to megatron-core's pieces put together."""
    _, per_rank = results
    ref = _global_reference(per_rank, flavor)
    for rank, r in enumerate(per_rank):
        got = r[flavor]["ours_ep4"]
        want = {k: v[rank:rank + 1] if ".experts.linear_fc" in k else v for k, v in ref.items()}
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        _compare(want, got, "torch_dist at TP1 x EP4")


def _whole_down_projections(per_rank, r, flavor):
    """megatron-core's local tensors of rank ``r`` in our layout: multi-latent attention's down-projections, split
    by rows over TP in megatron-core's local spec and whole on every TP rank in ours, put together from its stage's
    TP ranks."""
    ref = dict(r[flavor]["ref"])
    stage = sorted((q for q in per_rank if q["coords"][1] == r["coords"][1]), key=lambda q: q["coords"][0])
    for name in ref:
        if name.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
            ref[name] = torch.cat([q[flavor]["ref"][name] for q in stage])
    return ref


def _global_reference(per_rank, flavor, what="ref"):
    """megatron-core's TP pieces put together (the fused [gate; up] of each rank split and re-stacked)."""
    from megatronish.checkpoint.megatron_names import EXPERT_SPLIT, layer_suffix, tp_split

    pieces = {}
    for r in per_rank:
        tp_rank, _ = r["coords"]
        for name, t in r[flavor][what].items():
            pieces.setdefault(name, {})[tp_rank] = t
    out = {}
    for name, by_rank in pieces.items():
        split = tp_split(name, mcs.FLAVORS[flavor]["swiglu"])
        if layer_suffix(name) in EXPERT_SPLIT:  # whole experts, EP rank = TP rank (EP folded into TP)
            split = (0, 1)
        if name == "output_layer.weight" and not mcs.FLAVORS[flavor]["untie"]:
            continue
        if split is None:
            out[name] = by_rank[0]
            continue
        dim, stride = split
        blocks = [by_rank[t].chunk(stride, dim) for t in range(TP)]
        out[name] = torch.cat([blocks[t][k] for k in range(stride) for t in range(TP)], dim)
    return out


@pytest.mark.parametrize("flavor", FULL)
def test_tp1_and_hf_loss(results, flavor, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatronish.checkpoint.offline import iter_model_tensors
    from megatronish.config import ModelConfig
    from megatronish.convert.core import load_into_model
    from megatronish.model.gpt import GPTModel

    root, per_rank = results
    ref = _global_reference(per_rank, flavor)
    f = mcs.FLAVORS[flavor]
    for r in per_rank:  # --load at TP 1 (DP 4, distributed optimizer): the global tensors on every rank
        got = r[flavor]["ours_tp1"]
        assert set(got) == set(ref), sorted(set(got) ^ set(ref))
        _compare(ref, got, "torch_dist at TP1")
        if flavor == "llama":
            _compare(_global_reference(per_rank, flavor, "ref_exp_avg"), r[flavor]["ours_tp1_exp_avg"],
                     "Adam exp_avg at TP1 with the distributed optimizer")
    if flavor == "llama":  # training continues alike at both layouts (the loaded Adam state drives the update)
        tp1 = per_rank[0][flavor]["continued_tp1"]
        assert tp1["at"].tolist() == [ITER + 1, ITER * 2 + 4]
        for r in per_rank:
            cont = r[flavor]["continued"]
            assert cont["at"].tolist() == [ITER + 1, ITER * 2 + 4]
            torch.testing.assert_close(cont["loss"], tp1["loss"], rtol=1e-5, atol=0)
            r[flavor]["after"] = {k: v for k, v in cont["params"].items() if k in r[flavor]["ref"]}
        after = _global_reference(per_rank, flavor, "after")
        for name, t in after.items():
            assert not torch.equal(t, ref[name]), name  # the step changed it
            torch.testing.assert_close(t, tp1["params"][name], rtol=1e-5, atol=1e-6, msg=name)
    for src in ("torch_dist", "legacy"):
        mine = tmp_path / f"mine_{src}"
        _cli(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatronish", "--load-dir",
              os.path.join(root, flavor, src), "--save-dir", str(mine)])
        got = dict(iter_model_tensors(str(mine)))
        assert set(got) == set(ref), sorted(set(got) ^ set(ref))
        for name in ref:
            assert torch.equal(got[name], ref[name]), (src, name)
    hf_dir = tmp_path / "hf"
    _cli(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir",
          os.path.join(root, flavor, "torch_dist"), "--save-dir", str(hf_dir)])
    # HF -> Megatron (what a Megatron-LM user loads) -> ours: the same tensors
    _cli(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir", str(hf_dir), "--save-dir",
          str(tmp_path / "hf_to_megatron"), "--target-tensor-parallel-size", "2", "--make-vocab-size-divisible-by",
          str(mcs.DIVISIBLE)])
    _cli(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatronish", "--load-dir",
          str(tmp_path / "hf_to_megatron"), "--save-dir", str(tmp_path / "round"), "--true-vocab-size",
          str(mcs.VOCAB + 1)])
    back = dict(iter_model_tensors(str(tmp_path / "round")))
    assert set(back) == set(ref)
    for name in ref:
        assert torch.equal(back[name][: mcs.VOCAB + 1], ref[name][: mcs.VOCAB + 1]), name
    cfg = ModelConfig.from_flat(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        num_query_groups=f["num_query_groups"], ffn_hidden_size=f["ffn_hidden_size"], swiglu=f["swiglu"],
        normalization=f["normalization"], position_embedding_type=f["position_embedding_type"],
        add_bias_linear=f["add_bias_linear"], untie_embeddings_and_output_weights=f["untie"],
        vocab_size=mcs.VOCAB + 1, seq_length=mcs.SEQ, max_position_embeddings=mcs.MAX_POS,
        make_vocab_size_divisible_by=mcs.DIVISIBLE, attention_dropout=0.0, hidden_dropout=0.0)
    ours = GPTModel(cfg).eval()
    load_into_model(ours, ref)
    tokens = torch.randint(0, mcs.VOCAB + 1, (2, mcs.SEQ + 1), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hf_loss = hf(tokens[:, :-1], labels=tokens[:, :-1]).loss
        logits = ours(tokens[:, :-1])
    logits = logits[..., : mcs.VOCAB + 1]
    our_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                 tokens[:, 1:-1].reshape(-1))
    torch.testing.assert_close(our_loss, hf_loss, rtol=1e-5, atol=0)


def test_mla_norms_written_under_both_names(results, tmp_path):
    """Our --saver megatron output of the multi-latent-attention model holds its norms under both megatron-core
    specs' names (the local spec's loaded back above; the Transformer Engine spec's fused ``layer_norm_weight``),
    and our loader reads it, through the Transformer Engine names, to megatron-core's tensors."""
    from megatronish.checkpoint.megatron_format import TorchDist
    from megatronish.checkpoint.offline import iter_model_tensors

    root, per_rank = results
    written = os.path.join(root, "mla", "to_megatron_torch_dist")
    ck = TorchDist(os.path.join(written, "release"))
    for ours, te in (("pre_mlp_layernorm", "mlp.linear_fc1"), ("self_attention.q_layernorm",
                                                               "self_attention.linear_q_up_proj"),
                     ("self_attention.kv_layernorm", "self_attention.linear_kv_up_proj")):
        both = {f"decoder.layers.{ours}.weight", f"decoder.layers.{te}.layer_norm_weight"}
        assert both <= set(ck.tensor_keys) and not both & set(ck.model_keys()) - {ck.key_of(
            f"decoder.layers.0.{ours}.weight")[0]}, ours
        assert ck.key_of(f"decoder.layers.0.{ours}.weight")[0] == f"decoder.layers.{te}.layer_norm_weight"
    _cli(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatronish", "--load-dir", written,
          "--save-dir", str(tmp_path / "mine")])
    got = dict(iter_model_tensors(str(tmp_path / "mine")))
    ref = _global_reference(per_rank, "mla")
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_mtp_written_under_both_names(results):
    """Our --saver megatron output stores the MTP depth's transformer layer under both of megatron-core's names
    (``transformer_layer``, loaded back above, and the later ``mtp_model_layer``), tensors and ``_extra_state``
    objects alike; our reader takes the second as an alias."""
    from megatronish.checkpoint.megatron_format import TorchDist

    root, _ = results
    ck = TorchDist(os.path.join(root, "mla-moe", "to_megatron_torch_dist", "release"))
    keys = ck.md.state_dict_metadata
    old = [k for k in keys if k.startswith("mtp.layers.0.transformer_layer.")]
    assert any(k.endswith("._extra_state/shard_0_4") for k in old) and any(".experts.experts." in k for k in old)
    for k in old:
        new = k.replace(".transformer_layer.", ".mtp_model_layer.")
        assert new in keys and getattr(keys[new], "size", None) == getattr(keys[k], "size", None), k
    assert not [k for k in ck.model_keys() if ".mtp_model_layer." in k]


def test_bad_inputs(results, tmp_path, capsys):
    from megatronish.convert.hf_config import ConvertError

    root, _ = results

    def conv(load):
        _cli(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatronish", "--load-dir", load,
              "--save-dir", str(tmp_path / "out")])

    # a missing shard
    broken = tmp_path / "missing_shard"
    shutil.copytree(os.path.join(root, "gpt2", "torch_dist"), broken)
    victim = sorted(p for p in os.listdir(broken / f"iter_{ITER:07d}") if p.endswith(".distcp"))[0]
    os.remove(broken / f"iter_{ITER:07d}" / victim)
    with pytest.raises(ConvertError, match=victim):
        conv(str(broken))
    # a missing legacy rank file
    broken = tmp_path / "missing_rank"
    shutil.copytree(os.path.join(root, "gpt2", "legacy"), broken)
    shutil.rmtree(broken / f"iter_{ITER:07d}" / "mp_rank_01_001")
    with pytest.raises(ConvertError, match="mp_rank_01_001"):
        conv(str(broken))
    # a format we cannot read, named
    other = tmp_path / "zarr" / "iter_0000001"
    other.mkdir(parents=True)
    (other / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    with pytest.raises(ConvertError, match="'zarr'"):
        conv(str(other))
    # the command line's entry: exit status 2 and one line
    from megatronish.tools.convert_checkpoint import main

    with pytest.raises(SystemExit) as stop:
        main(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir", str(other),
              "--save-dir", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "'zarr'" in err, err
    # an unpickling allow-list miss
    bad = tmp_path / "bad" / "iter_0000001" / "mp_rank_00"
    bad.mkdir(parents=True)
    torch.save({"model": {}, "args": None, "hook": os.getcwd}, bad / "model_optim_rng.pt")
    with pytest.raises(ConvertError, match="refusing to unpickle"):
        conv(str(bad.parent))


def test_shape_flags_contradict(results, tmp_path):
    """--load of a Megatron checkpoint whose stored args differ from the run's flags: one line naming the flag.
    Without stored args (megatron-core's dist_checkpointing used alone) the tensors' shapes are checked one by one,
    and a checkpoint that fits loads as with args."""
    root, per_rank = results
    no_args = tmp_path / "no_args"
    shutil.copytree(os.path.join(root, "gpt2", "torch_dist"), no_args)
    torch.save({"iteration": ITER, "checkpoint_version": 3.0}, no_args / f"iter_{ITER:07d}" / "common.pt")

    def attempt(*args):
        try:
            _ours(*args)
        except CheckpointError as e:
            return str(e)
        return None

    def worker(rank, world):
        wide = ("--no-load-optim", "--hidden-size", "64", "--num-attention-heads", "8")
        _, _, loaded = _ours("gpt2", str(no_args), ("--no-load-optim",))
        return (attempt("llama", os.path.join(root, "llama", "torch_dist"), wide),
                attempt("gpt2", os.path.join(root, "gpt2", "torch_dist")),  # no optimizer state stored
                attempt("gpt2", str(no_args), wide),
                _convert(loaded, lambda t: t.numpy().copy()))

    for r, (shape, optim, no_args_shape, loaded) in zip(per_rank, run_distributed(worker, TP * PP)):
        assert shape and shape.startswith("--hidden-size: checkpoint") and "\n" not in shape, shape
        assert optim and "has no optimizer state 'optimizer.state.exp_avg." in optim and optim.endswith(
            "pass --no-load-optim"), optim
        assert no_args_shape and no_args_shape.startswith("checkpoint tensor '") and "global shape" in no_args_shape
        _compare(r["gpt2"]["ours"], {k: torch.from_numpy(v) for k, v in loaded.items()}, "without stored args")


def _worker_bf16(rank, world, root):
    """megatron-core's bf16 Llama run on 2 DP ranks after one Adam step, saved by ``dist_checkpointing.save`` with
    its Float16OptimizerWithFloat16Params (``optimizer.state.fp32_param``) and with its DistributedOptimizer
    (``fully_reshardable``: ``optimizer.state.param``); ours with ``--bf16`` loads each at TP 2 (plain optimizer)
    and at DP 2 (distributed optimizer). Every local model tensor, fp32 main parameter and Adam moment equals
    megatron-core's (the Float16 optimizer's tensors, which its distributed optimizer's step must reproduce)."""
    mcs.patch_for_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatronish.parallel.init import split_global, split_ranks

    ps.initialize_model_parallel(1, 1)
    ref, dirs, checked = None, {}, []
    for kind in ("fp32_param", "distributed"):
        model, opt = mcs.bf16_adam_step("llama", kind == "distributed", seed=3)
        names = dict(zip((id(p) for p in model.parameters()), mcs.local_tensors(model)))
        params = {names[id(p)]: p.detach().clone() for p in model.parameters()}
        if ref is None:
            (inner,) = opt.chained_optimizers
            main = {names[id(p)]: m for g, mg in zip(inner.float16_groups, inner.fp32_from_float16_groups)
                    for p, m in zip(g, mg)}
            ref = {"": params, "main_param": {n: m.detach().clone() for n, m in main.items()}}
            for key in ("exp_avg", "exp_avg_sq"):
                ref[key] = {n: inner.optimizer.state[m][key].clone() for n, m in main.items()}
            ref_step = {int(st["step"]) for st in inner.optimizer.state.values()}
        else:  # the same step: megatron-core's two optimizers agree
            for name, t in params.items():
                assert torch.equal(t, ref[""][name]), ("megatron-core's optimizers disagree", name)
        msd = model.sharded_state_dict()
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"} if kind == "distributed" else None
        with mcs.cpu_as_cuda():
            osd = opt.sharded_state_dict(msd, metadata=metadata)
        dirs[kind] = os.path.join(root, f"bf16_{kind}")
        it_dir = os.path.join(dirs[kind], f"iter_{ITER:07d}")
        if rank == 0:
            os.makedirs(it_dir)
        dist.barrier()
        dist_checkpointing.save({"model": msd, "optimizer": osd, "iteration": ITER, "checkpoint_version": 3.0,
                                 "args": mcs.megatron_args("llama", 1, 1, consumed_train_samples=ITER * 2)}, it_dir)
        if rank == 0:
            mcs.write_tracker(dirs[kind], ITER)
        dist.barrier()
    assert ref_step == {1}, ref_step
    for kind, load in dirs.items():
        for tp, extra in ((2, ()), (1, ("--use-distributed-optimizer",))):
            run_, state, _ = _ours("llama", load, ("--bf16",) + extra, tp=tp, pp=1)
            where = (kind, f"TP {tp}", extra)
            assert (state.iteration, state.consumed_samples) == (ITER, ITER * 2), where
            assert run_.optimizer.scalar_state_dict()["step"] == 1, where
            mine = {id(p): (n, p) for m in run_.models for n, p in m.named_global_parameters()}
            for name, p in mine.values():
                assert p.dtype == torch.bfloat16, (where, name, p.dtype)
            state_of = run_.optimizer.sharded_param_state()
            assert len(state_of) == len(mine), where
            for p, st in state_of:
                name, _ = mine[id(p)]
                assert set(st) == {"main_param", "exp_avg", "exp_avg_sq"}, (where, sorted(st))
                for key, t in [("", p.detach()), *st.items()]:
                    want = split_global(p.desc, ref[key][name], *split_ranks(p.desc, run_.parallel))
                    assert t.dtype == want.dtype and torch.equal(t, want), (where, key or "param", name)
            checked.append(where)
    return checked


def test_bf16_main_params_and_distributed_optimizer_state(tmp_path):
    """A bf16 Megatron run's fp32 main parameters (Float16OptimizerWithFloat16Params' ``fp32_param``) and its
    distributed optimizer's ``fully_reshardable`` state (``param``, ``exp_avg``, ``exp_avg_sq``) load at another
    layout, with or without our distributed optimizer."""
    per_rank = run_distributed(_worker_bf16, 2, str(tmp_path), timeout=600)
    assert all(len(checked) == 4 for checked in per_rank), per_rank


@pytest.mark.parametrize("flavor", ["llama", "mla", "moe", "mla-moe"])
@pytest.mark.parametrize("source", ["torch_dist", "legacy"])
def test_use_checkpoint_args(results, source, flavor):
    """--use-checkpoint-args takes the model shape (and the NullTokenizer vocabulary) from Megatron's stored args;
    for multi-latent attention also its ranks and head sizes, the latents' norms and the YaRN settings; for mixture
    of experts the experts, their sizes, the dense layers, the routing and the shared expert."""
    from megatronish.arguments import configs_from_args, parse_args

    root, _ = results
    argv = ["--use-checkpoint-args", "--load", os.path.join(root, flavor, source), "--micro-batch-size", "1",
            "--mock-data", "--train-iters", "1", "--lr", "1e-3", "--no-load-optim"]
    model = configs_from_args(parse_args(argv), 1).model
    f = mcs.FLAVORS[flavor]
    a = model.attention
    assert (a.multi_latent_attention, a.qk_layernorm) == (("mla" in f,) * 2)
    for name, value in f.get("mla", {}).items():
        assert getattr(a, name) == value, (name, getattr(a, name), value)
    assert model.moe.num_experts == f.get("moe", {}).get("num_experts")
    assert (model.mtp_num_layers, model.mtp_loss_scaling_factor) == (f.get("mtp_num_layers"),
                                                                      f.get("mtp_loss_scaling_factor", 0.1))
    for name, value in f.get("moe", {}).items():
        assert getattr(model.moe, name) == value, (name, getattr(model.moe, name), value)
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.num_query_groups,
            model.ffn_hidden_size, model.swiglu, model.normalization, model.attention.position_embedding_type,
            model.add_bias_linear, model.untie_embeddings_and_output_weights, model.vocab_size,
            model.max_position_embeddings) == (
        f["num_layers"], f["hidden_size"], f["num_attention_heads"], f["num_query_groups"], f["ffn_hidden_size"],
        True, "RMSNorm", "rope", False, True, mcs.VOCAB + 1, mcs.MAX_POS)
