"""Megatron checkpoint reading without megatron-core: the unpickling allow-list, the args we refuse, the formats we
name, and the legacy reader's TP merge of Megatron's per-rank layouts (fused [gate; up] per rank)."""
import argparse
import enum
import io
import json
import os
import shutil
import sys
import types

import numpy as np
import pytest
import torch

from megatronish.checkpoint.megatron_format import CheckpointError, detect, model_fields
from megatronish.checkpoint.megatron_legacy import Legacy
from megatronish.checkpoint.megatron_pickle import EnumValue, safe_load


def _pickled(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class RerunMode(str, enum.Enum):  # pickled under Megatron's name (megatron-core need not be installed to read it)
    DISABLED = "disabled"


RerunMode.__module__ = "megatron.core.rerun_state_machine"


def test_allow_list_reads_megatron_types_and_refuses_code(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.rerun_state_machine",
                        types.SimpleNamespace(RerunMode=RerunMode))  # for pickling it here
    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16)
    got = safe_load(_pickled({"args": args, "rng": np.random.get_state(), "w": torch.arange(3.0),
                              "rerun_state_machine": {"mode": RerunMode.DISABLED}}), "ckpt.pt")
    assert got["args"] == args and torch.equal(got["w"], torch.arange(3.0))
    assert got["rerun_state_machine"]["mode"].value == "disabled"
    with pytest.raises(CheckpointError, match=r"^evil\.pt holds a posix\.system object.*refusing to unpickle"):
        safe_load(_pickled({"x": os.system}), "evil.pt")
    assert EnumValue(3).value == 3


def test_args_we_cannot_represent_are_named():
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    assert model_fields(argparse.Namespace(**base), "common.pt")["hidden_size"] == 32
    moe = model_fields(argparse.Namespace(**base, num_experts=8, moe_layer_freq=(0, 1), moe_router_topk=2),
                       "common.pt")
    assert (moe["num_experts"], moe["moe_layer_freq"], moe["moe_router_topk"]) == (8, [0, 1], 2)
    with pytest.raises(CheckpointError, match="--qk-layernorm True"):
        model_fields(argparse.Namespace(**base, qk_layernorm=True), "common.pt")


def test_unreadable_format_is_named(tmp_path):
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match="format 'zarr'"):
        detect(str(tmp_path))
    assert detect(str(tmp_path / "nothing")) is None


def test_legacy_merges_tp_files_and_numbers_layers_globally(tmp_path):
    h, ffn, tp, pp = 4, 6, 2, 2
    args = argparse.Namespace(num_layers=2, hidden_size=h, num_attention_heads=2, ffn_hidden_size=ffn, swiglu=True,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              untie_embeddings_and_output_weights=True)
    g = torch.Generator().manual_seed(0)
    fc1 = {i: torch.randn(2 * ffn, h, generator=g) for i in range(2)}  # global [gate; up]
    fc2 = {i: torch.randn(h, ffn, generator=g) for i in range(2)}
    for t in range(tp):
        for p in range(pp):
            gate, up = fc1[p].chunk(2)
            part = ffn // tp
            model = {"decoder.layers.0.mlp.linear_fc1.weight": torch.cat([gate[t * part:(t + 1) * part],
                                                                          up[t * part:(t + 1) * part]]),
                     "decoder.layers.0.mlp.linear_fc2.weight": fc2[p][:, t * part:(t + 1) * part].clone(),
                     "decoder.layers.0.mlp.linear_fc1._extra_state": None}
            d = tmp_path / "iter_0000003" / f"mp_rank_{t:02d}_{p:03d}"
            d.mkdir(parents=True)
            torch.save({"model": model, "args": args, "iteration": 3}, d / "model_optim_rng.pt")
    ck = Legacy(str(tmp_path / "iter_0000003"))
    assert ck.iteration == 3
    assert ck.names() == [f"decoder.layers.{i}.mlp.linear_fc{k}.weight" for i in range(2) for k in (1, 2)]
    for i in range(2):
        assert torch.equal(ck.read(f"decoder.layers.{i}.mlp.linear_fc1.weight"), fc1[i])
        assert torch.equal(ck.read(f"decoder.layers.{i}.mlp.linear_fc2.weight"), fc2[i])


def test_legacy_mla_of_the_transformer_engine_spec(tmp_path):
    """Multi-latent attention as Megatron-LM's Transformer Engine spec saves it per TP rank: the down-projections
    whole in every file (duplicated), the up-projections split by heads, the latents' norms fused into the
    up-projections (``layer_norm_weight``); read as our global tensors, a local-spec file's row-split
    down-projection put together alike."""
    h, tp, q_rank, kv_rank, rope = 8, 2, 6, 4, 2
    args = argparse.Namespace(num_layers=1, hidden_size=h, num_attention_heads=2, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=1, multi_latent_attention=True, q_lora_rank=q_rank,
                              kv_lora_rank=kv_rank, qk_pos_emb_head_dim=rope, qk_layernorm=True)
    g = torch.Generator().manual_seed(0)
    ours = {"self_attention.linear_q_down_proj.weight": torch.randn(q_rank, h, generator=g),
            "self_attention.linear_kv_down_proj.weight": torch.randn(kv_rank + rope, h, generator=g),
            "self_attention.linear_q_up_proj.weight": torch.randn(10, q_rank, generator=g),
            "self_attention.q_layernorm.weight": torch.randn(q_rank, generator=g),
            "self_attention.kv_layernorm.weight": torch.randn(kv_rank, generator=g)}
    stored = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
              "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
    for t in range(tp):
        model = {f"decoder.layers.0.{stored.get(k, k)}": v.chunk(tp)[t].clone() if "up_proj" in k else v.clone()
                 for k, v in ours.items()}
        # the local spec splits the KV down-projection by rows: one file may hold it either way
        model["decoder.layers.0.self_attention.linear_kv_down_proj.weight"] = \
            ours["self_attention.linear_kv_down_proj.weight"].chunk(tp)[t].clone()
        d = tmp_path / "iter_0000001" / f"mp_rank_{t:02d}"
        d.mkdir(parents=True)
        torch.save({"model": model, "args": args, "iteration": 1}, d / "model_optim_rng.pt")
    ck = Legacy(str(tmp_path / "iter_0000001"))
    assert sorted(ck.names()) == sorted(f"decoder.layers.0.{k}" for k in ours)
    for k, v in ours.items():
        assert ck.shape(f"decoder.layers.0.{k}") == tuple(v.shape), k
        assert torch.equal(ck.read(f"decoder.layers.0.{k}"), v), k
    fields = model_fields(args, "common.pt")
    assert (fields["multi_latent_attention"], fields["q_lora_rank"], fields["qk_layernorm"]) == (True, q_rank, True)


def test_legacy_experts_of_grouped_modules_over_ep_and_expert_tp(tmp_path):
    """Experts as Megatron-LM's TEGroupedMLP (``linear_fc1.weight<j>``, layer 0) and legacy GroupedMLP
    (``weight1`` ``[h, local * 2F/t]`` / ``weight2`` ``[local * F/t, h]``, each expert transposed, layer 1) save them
    in ``mp_rank_TT_EEE`` files at TP 2 x EP 2 (expert TP = TP): read as our ``[E, 2F, h]`` / ``[E, h, F]``."""
    h, ffn, tp, ep, experts = 4, 6, 2, 2, 4
    args = argparse.Namespace(num_layers=2, hidden_size=h, num_attention_heads=2, ffn_hidden_size=8, swiglu=True,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                              expert_model_parallel_size=ep, num_experts=experts, moe_ffn_hidden_size=ffn)
    g = torch.Generator().manual_seed(0)
    fc1 = torch.randn(2, experts, 2 * ffn, h, generator=g)  # [layer, expert, [gate; up], h]
    fc2 = torch.randn(2, experts, h, ffn, generator=g)
    part, local = ffn // tp, experts // ep
    for t in range(tp):
        for e in range(ep):
            mine = range(e * local, (e + 1) * local)
            w1 = [torch.cat([fc1[:, x, :ffn][:, t * part:(t + 1) * part], fc1[:, x, ffn:][:, t * part:(t + 1) * part]],
                            1) for x in mine]  # each [layer, 2 part, h]
            w2 = [fc2[:, x, :, t * part:(t + 1) * part] for x in mine]  # each [layer, h, part]
            model = {f"decoder.layers.0.mlp.experts.linear_fc{k}.weight{j}": w[j][0].clone()
                     for k, w in ((1, w1), (2, w2)) for j in range(local)}
            model["decoder.layers.1.mlp.experts.weight1"] = torch.stack([w[1].t() for w in w1]).reshape(h, -1)
            model["decoder.layers.1.mlp.experts.weight2"] = torch.stack([w[1].t() for w in w2]).reshape(-1, h)
            model["decoder.layers.0.mlp.router.weight"] = torch.ones(experts, h)
            d = tmp_path / "iter_0000002" / f"mp_rank_{t:02d}_{e:03d}"
            d.mkdir(parents=True)
            torch.save({"model": model, "args": args, "iteration": 2}, d / "model_optim_rng.pt")
    ck = Legacy(str(tmp_path / "iter_0000002"))
    assert sorted(ck.names()) == sorted(["decoder.layers.0.mlp.router.weight"] + [
        f"decoder.layers.{i}.mlp.experts.linear_fc{k}.weight" for i in range(2) for k in (1, 2)])
    for i in range(2):
        for k, want in ((1, fc1[i]), (2, fc2[i])):
            name = f"decoder.layers.{i}.mlp.experts.linear_fc{k}.weight"
            assert ck.shape(name) == tuple(want.shape) and torch.equal(ck.read(name), want), name
    shutil.rmtree(tmp_path / "iter_0000002" / "mp_rank_01_001")
    with pytest.raises(CheckpointError, match="missing checkpoint file .*mp_rank_01_001"):
        Legacy(str(tmp_path / "iter_0000002"))


def test_torch_dist_norm_names_per_layer(tmp_path):
    """Layers stored one key each (megatron-core's non-homogeneous layers) with the Transformer Engine spec's
    pre-MLP norm fused in a dense layer and a module of its own in an MoE layer: each layer's tensor is found; a
    stacked second name that every layer also has under the first (our writer's) is an alias."""
    import torch.distributed.checkpoint as dcp

    from megatronish.checkpoint.megatron_format import TorchDist

    def write(d, tensors):
        d.mkdir()
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
        torch.save({"args": None, "iteration": 1}, d / "common.pt")
        (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        return TorchDist(str(d))

    dense, moe = torch.randn(4), torch.randn(4)
    ck = write(tmp_path / "mixed", {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight": dense,
                                    "decoder.layers.1.pre_mlp_layernorm.weight": moe})
    assert ck.key_of("decoder.layers.0.pre_mlp_layernorm.weight") == (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight", None)
    assert torch.equal(ck.read("decoder.layers.0.pre_mlp_layernorm.weight"), dense)
    assert torch.equal(ck.read("decoder.layers.1.pre_mlp_layernorm.weight"), moe)
    assert len(ck.model_keys()) == 2
    both = torch.randn(2, 4)
    ck = write(tmp_path / "both", {"decoder.layers.mlp.linear_fc1.layer_norm_weight": both,
                                   "decoder.layers.pre_mlp_layernorm.weight": both.clone()})
    assert ck.model_keys() == ["decoder.layers.mlp.linear_fc1.layer_norm_weight"]
    assert torch.equal(ck.read("decoder.layers.1.pre_mlp_layernorm.weight"), both[1])
    with pytest.raises(CheckpointError, match=r"one key each \('decoder\.layers\.1\.mlp\.experts\.experts\.3\..*"
                                              r"singleton_local_shards\); re-save it without that option$"):
        write(tmp_path / "singleton", {"decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight": torch.ones(2, 2)})


def test_mtp_layer_under_either_name(tmp_path):
    """A multi-token-prediction depth's transformer layer, which megatron-core names ``transformer_layer`` (0.16 and
    before) or ``mtp_model_layer``: read under either as ours (``mtp_model_layer``), in ``torch_dist`` (one key per
    tensor; the second name an alias where both are stored, as our writer stores them) and in legacy files on the
    last stage (``eh_proj`` split over TP along rows, the layer's fused ``[gate; up]`` per rank)."""
    import torch.distributed.checkpoint as dcp

    from megatronish.checkpoint.megatron_format import TorchDist

    g = torch.Generator().manual_seed(0)
    norm, eh = torch.randn(4, generator=g), torch.randn(4, 8, generator=g)
    for names in (("transformer_layer",), ("mtp_model_layer",), ("transformer_layer", "mtp_model_layer")):
        d = tmp_path / "_".join(names)
        d.mkdir()
        tensors = {f"mtp.layers.0.{n}.self_attention.linear_qkv.layer_norm_weight": norm.clone() for n in names}
        dcp.save({**tensors, "mtp.layers.0.eh_proj.weight": eh}, storage_writer=dcp.FileSystemWriter(str(d)),
                 no_dist=True)
        torch.save({"args": None, "iteration": 1}, d / "common.pt")
        (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        ck = TorchDist(str(d))
        name = "mtp.layers.0.mtp_model_layer.input_layernorm.weight"
        assert ck.key_of(name) == (f"mtp.layers.0.{names[0]}.self_attention.linear_qkv.layer_norm_weight", None)
        assert torch.equal(ck.read(name), norm) and torch.equal(ck.read("mtp.layers.0.eh_proj.weight"), eh)
        assert ck.model_keys() == sorted(["mtp.layers.0.eh_proj.weight", ck.key_of(name)[0]]), names
    h, ffn, tp, pp = 4, 6, 2, 2
    args = argparse.Namespace(num_layers=2, hidden_size=h, num_attention_heads=2, ffn_hidden_size=ffn, swiglu=True,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, mtp_num_layers=1,
                              mtp_loss_scaling_factor=0.3, untie_embeddings_and_output_weights=True)
    fc1, eh = torch.randn(2 * ffn, h, generator=g), torch.randn(h, 2 * h, generator=g)  # global [gate; up], eh_proj
    part = ffn // tp
    for t in range(tp):
        for p in range(pp):
            gate, up = fc1.chunk(2)
            model = {"decoder.layers.0.mlp.linear_fc2.weight": torch.ones(h, part)}
            if p == pp - 1:
                model.update({"mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight": torch.cat(
                    [gate[t * part:(t + 1) * part], up[t * part:(t + 1) * part]]),
                    "mtp.layers.0.eh_proj.weight": eh.chunk(tp)[t].clone(), "mtp.layers.0.enorm.weight": norm,
                    "mtp.layers.0.eh_proj._extra_state": None})
            d = tmp_path / "legacy" / f"mp_rank_{t:02d}_{p:03d}"
            d.mkdir(parents=True)
            torch.save({"model": model, "args": args, "iteration": 1}, d / "model_optim_rng.pt")
    ck = Legacy(str(tmp_path / "legacy"))
    assert sorted(n for n in ck.names() if n.startswith("mtp.")) == [
        "mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight",
        "mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight"]
    assert torch.equal(ck.read("mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight"), fc1)
    assert torch.equal(ck.read("mtp.layers.0.eh_proj.weight"), eh)
    assert torch.equal(ck.read("mtp.layers.0.enorm.weight"), norm)
    fields = model_fields(args, "common.pt")
    assert (fields["mtp_num_layers"], fields["mtp_loss_scaling_factor"]) == (1, 0.3)
