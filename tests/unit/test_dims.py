"""ParallelDims: rank layout, group lists against a brute force, and config validation."""

import dataclasses
import itertools
import random
from collections import defaultdict

import pytest

from megatronish.parallel.dims import ConfigError, DegreeError, ParallelDims, masked_rank_groups
from megatronish.parallel_config import parallel_dims, validate_model


# ---------------------------------------------------------------- independent brute force
def formula_rank(d, tp, cp, dp, pp):
    return tp + cp * d.tp + dp * d.tp * d.cp + pp * d.tp * d.cp * d.dp


def formula_expert_rank(d, etp, ep, edp, pp):
    """Megatron's expert rank generator: etp fastest, then ep, then expert-dp, inside each pipeline stage."""
    return etp + ep * d.expert_tp + edp * d.expert_tp * d.ep + pp * d.tp * d.cp * d.dp


def formula_coords(d, rank):
    """Invert the layout formulas by search over the whole grids (independent of ParallelDims.coords)."""
    out = {}
    for tp, cp, dp, pp in itertools.product(range(d.tp), range(d.cp), range(d.dp), range(d.pp)):
        if formula_rank(d, tp, cp, dp, pp) == rank:
            out.update(tp=tp, cp=cp, dp=dp, pp=pp)
    for etp, ep, edp, pp in itertools.product(range(d.expert_tp), range(d.ep), range(d.expert_dp), range(d.pp)):
        if formula_expert_rank(d, etp, ep, edp, pp) == rank:
            assert out["pp"] == pp
            out.update(etp=etp, ep=ep, edp=edp)
    assert len(out) == 7, rank
    return out


# For each group kind: the coordinates that must be equal inside one group (everything else varies).
FIXED = {
    "tp": lambda c, d: (c["cp"], c["dp"], c["pp"]),
    "pp": lambda c, d: (c["tp"], c["cp"], c["dp"]),
    "dp": lambda c, d: (c["tp"], c["cp"], c["pp"]),
    "dp_cp": lambda c, d: (c["tp"], c["pp"]),
    "cp": lambda c, d: (c["tp"], c["dp"], c["pp"]),
    "mp": lambda c, d: (c["dp"], c["cp"]),
    "tp_dp": lambda c, d: (c["cp"], c["pp"]),
    "tp_dp_cp": lambda c, d: (c["pp"],),
    "tp_cp": lambda c, d: (c["dp"], c["pp"]),
    "ep": lambda c, d: (c["etp"], c["edp"], c["pp"]),
    "expert_dp": lambda c, d: (c["etp"], c["ep"], c["pp"]),
    "etp": lambda c, d: (c["ep"], c["edp"], c["pp"]),
    "tp_ep": lambda c, d: (c["edp"], c["pp"]),
    "expert_mp": lambda c, d: (c["edp"],),
}


def degree(d, kind):
    return {"tp": d.tp, "pp": d.pp, "dp": d.dp, "dp_cp": d.dp * d.cp, "cp": d.cp, "mp": d.tp * d.pp,
            "tp_dp": d.tp * d.dp, "tp_dp_cp": d.tp * d.dp * d.cp, "tp_cp": d.tp * d.cp, "ep": d.ep,
            "expert_dp": d.tp * d.cp * d.dp // (d.expert_tp * d.ep), "etp": d.expert_tp,
            "tp_ep": d.expert_tp * d.ep, "expert_mp": d.expert_tp * d.ep * d.pp}[kind]


def brute_groups(d, kind):
    buckets = defaultdict(list)
    for r in range(d.world_size):
        buckets[FIXED[kind](formula_coords(d, r), d)].append(r)
    return sorted((sorted(g) for g in buckets.values()), key=lambda g: g[0])


def brute_pp_group(d, rank):
    c = formula_coords(d, rank)
    return [formula_rank(d, c["tp"], c["cp"], c["dp"], p) for p in range(d.pp)]


def random_configs(n, seed=0):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        tp, cp, pp, dp = (rng.choice([1, 1, 2, 3, 4]) for _ in range(4))
        etp = rng.choice([None, None, 1, 2, 4])
        etp = etp if etp is None or (tp * cp * dp) % etp == 0 else None
        stage = tp * cp * dp // (tp if etp is None else etp)
        ep = rng.choice([e for e in (1, 2, 3, 4) if stage % e == 0])
        vp = rng.choice([1, 2, 3]) if pp > 1 else 1
        out.append(dict(world_size=tp * cp * pp * dp, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, vp=vp,
                        tie_embeddings=rng.random() < 0.5))
    return out


CONFIGS = random_configs(60) + [dict(world_size=16, tp=2, pp=4), dict(world_size=16, tp=2, cp=2, pp=2),
                                dict(world_size=1), dict(world_size=8, ep=8), dict(world_size=24, tp=2, pp=3, ep=2),
                                dict(world_size=8, tp=2, pp=2, ep=2, etp=1), dict(world_size=8, tp=4, ep=2, etp=2)]


def cfg_id(c):
    return "-".join(f"{k}{v}" for k, v in c.items() if k != "tie_embeddings" and v is not None)


# ---------------------------------------------------------------- the Megatron-LM docstring example
class TestDocstringExample:
    """16 ranks, TP 2, PP 4 (so DP 2), from the initialize_model_parallel docstring."""

    d = ParallelDims(world_size=16, tp=2, pp=4)

    def test_degrees(self):
        assert (self.d.tp, self.d.pp, self.d.dp, self.d.cp) == (2, 4, 2, 1)

    def test_tp_groups(self):
        assert self.d.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]

    def test_dp_groups(self):
        assert self.d.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
        assert self.d.dp_cp_groups() == self.d.dp_groups()  # CP 1

    def test_pp_groups(self):
        assert self.d.pp_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]

    def test_model_parallel_groups(self):
        assert self.d.mp_groups() == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]

    def test_tensor_and_data_groups(self):
        assert self.d.tp_dp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]

    def test_embedding_groups_tied(self):
        assert self.d.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]
        assert self.d.group_of("embedding", 13) == [1, 13]
        assert self.d.group_of("embedding", 5) == []  # middle stage

    def test_embedding_groups_untied(self):
        u = ParallelDims(world_size=16, tp=2, pp=4, tie_embeddings=False)
        assert u.embedding_groups() == [[0], [1], [2], [3]]
        assert u.group_of("embedding", 12) == []

    def test_position_embedding_groups(self):
        assert self.d.position_embedding_groups() == [[0], [1], [2], [3]]

    def test_embedding_pp1_is_single_rank(self):
        d = ParallelDims(world_size=4, tp=2)
        assert d.embedding_groups() == [[0], [1], [2], [3]]

    def test_coords(self):
        assert self.d.coords(13) == dict(tp=1, cp=0, dp=0, pp=3, etp=1, ep=0, edp=0)
        assert self.d.coords(6) == dict(tp=0, cp=0, dp=1, pp=1, etp=0, ep=0, edp=1)
        assert self.d.rank_of(tp=1, dp=1, pp=2) == 11


# ---------------------------------------------------------------- context parallel example
class TestContextParallel:
    d = ParallelDims(world_size=16, tp=2, cp=2, pp=2)

    def test_degrees(self):
        assert self.d.dp == 2

    @pytest.mark.parametrize("kind", ["cp", "dp", "dp_cp", "tp_cp", "tp_dp_cp", "mp"])
    def test_against_brute_force(self, kind):
        assert self.d.groups(kind) == brute_groups(self.d, kind)

    def test_explicit(self):
        # rank = tp + 2*cp + 4*dp + 8*pp
        assert self.d.cp_groups()[:3] == [[0, 2], [1, 3], [4, 6]]
        assert self.d.dp_groups()[:3] == [[0, 4], [1, 5], [2, 6]]
        assert self.d.dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_two_level_cp_groups():
    d = ParallelDims(world_size=16, tp=2, cp=4, cp_inner=2)  # rank = tp + 2*cp + 8*dp; cp = inner + 2*outer
    assert (d.cp_inner, d.cp_outer, d.dp) == (2, 2, 2)
    assert d.cp_inner_groups()[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.cp_outer_groups()[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for cp_group in d.cp_groups():  # inside every CP group: adjacent blocks (all-to-all) and strided rings
        assert all(cp_group[o * 2:(o + 1) * 2] in d.groups("cp_inner") for o in range(2))
        assert all(cp_group[i::2] in d.groups("cp_outer") for i in range(2))
    for kind in ("cp_inner", "cp_outer"):
        assert sorted(r for g in d.groups(kind) for r in g) == list(range(16))
    one_level = ParallelDims(world_size=8, cp=4)
    assert one_level.cp_outer is None and one_level.groups("cp_inner") == one_level.groups("cp_outer") == []
    assert one_level.group_of("cp_outer", 0) == []
    assert ParallelDims.GROUP_KINDS[-2:] == ("cp_inner", "cp_outer")  # appended: earlier kinds keep their order


# ---------------------------------------------------------------- random layouts
@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
def test_rank_coords_round_trip(cfg):
    d = ParallelDims(**cfg)
    assert d.tp * d.cp * d.dp * d.pp == d.world_size
    for r in range(d.world_size):
        c = d.coords(r)
        assert c == formula_coords(d, r)
        assert d.rank_of(tp=c["tp"], cp=c["cp"], dp=c["dp"], pp=c["pp"]) == r
    with pytest.raises(ValueError):
        d.coords(d.world_size)
    with pytest.raises(ValueError):
        d.rank_of(tp=d.tp)


@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
def test_groups_partition_and_match_brute_force(cfg):
    d = ParallelDims(**cfg)
    for kind in FIXED:
        groups = d.groups(kind)
        assert groups == brute_groups(d, kind), kind
        assert all(len(g) == degree(d, kind) for g in groups), kind
        assert sorted(r for g in groups for r in g) == list(range(d.world_size)), kind
        assert all(isinstance(r, int) for g in groups for r in g)
        for r in range(d.world_size):
            assert r in d.group_of(kind, r)


@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
def test_pipeline_and_embedding(cfg):
    d = ParallelDims(**cfg)
    for r in range(d.world_size):
        ring = brute_pp_group(d, r)
        assert d.group_of("pp", r) == ring
        i = ring.index(r)
        expected = [ring[0], ring[-1]] if d.tie_embeddings and d.pp > 1 else [ring[0]]
        assert d.group_of("embedding", r) == (expected if r in expected else [])
        assert d.group_of("position_embedding", r) == ([ring[0]] if i == 0 else [])
    assert len(d.embedding_groups()) == len(d.position_embedding_groups()) == d.world_size // d.pp


def test_ep_groups_explicit():
    # world 8, DP 8, EP 4: experts spread over dp % 4; expert-DP pairs dp and dp + 4.
    d = ParallelDims(world_size=8, ep=4)
    assert d.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d.expert_dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.coords(6)["ep"] == 2
    # TP 2 with expert-TP 1: expert parallelism spans the tensor-parallel pair (Megatron's expert grid).
    d = ParallelDims(world_size=8, tp=2, ep=4, etp=1)
    assert d.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d.etp_groups() == [[r] for r in range(8)]
    assert d.expert_dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # expert-TP = TP, CP 1: the classic layout, experts inside data parallelism (dp = ep + EP * edp).
    d = ParallelDims(world_size=8, tp=2, ep=2)
    for r in range(8):
        c = d.coords(r)
        assert (c["etp"], c["ep"], c["edp"]) == (c["tp"], c["dp"] % 2, c["dp"] // 2)


def test_virtual_stage_layer_ranges():
    d = ParallelDims(world_size=4, pp=4, vp=2)
    # Megatron docstring: 16 layers, PP 4, VP 2 -> GPU0 [1,2][9,10], GPU1 [3,4][11,12], ... (1-based)
    assert [list(d.layer_range(16, 0, c)) for c in (0, 1)] == [[0, 1], [8, 9]]
    assert [list(d.layer_range(16, 3, c)) for c in (0, 1)] == [[6, 7], [14, 15]]


def test_masked_rank_groups_generic():
    assert masked_rank_groups([2, 3], [True, False]) == [[0, 1], [2, 3], [4, 5]]
    assert masked_rank_groups([2, 3], [False, True]) == [[0, 2, 4], [1, 3, 5]]
    assert masked_rank_groups([2, 3], [False, False]) == [[r] for r in range(6)]
    assert masked_rank_groups([2, 3], [True, True]) == [list(range(6))]


def test_unknown_group_kind():
    with pytest.raises(ValueError, match="unknown group kind"):
        ParallelDims(world_size=2).group_of("bogus", 0)


def test_value_object():
    a, b = ParallelDims(world_size=8, tp=2), ParallelDims(world_size=8, tp=2)
    assert a == b and hash(a) == hash(b)
    assert ParallelDims.order == "tp-cp-ep-dp-pp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tp = 4  # frozen
    assert "dp 4" in a.describe()


# ---------------------------------------------------------------- invalid configurations
@pytest.mark.parametrize("kwargs, flags", [
    (dict(world_size=16, tp=3, pp=2), ["--tensor-model-parallel-size 3", "--pipeline-model-parallel-size 2",
                                       "world size 16"]),
    (dict(world_size=12, tp=2, cp=4), ["--context-parallel-size 4", "world size 12"]),
    (dict(world_size=8, tp=0), ["--tensor-model-parallel-size"]),
    (dict(world_size=8, pp=-1), ["--pipeline-model-parallel-size"]),
    (dict(world_size=8, cp=1.0), ["--context-parallel-size"]),
    (dict(world_size=0), ["world size"]),
    (dict(world_size=8, vp=2), ["--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
                                "--pipeline-model-parallel-size"]),
    (dict(world_size=12, tp=2, ep=4, etp=2), ["--expert-model-parallel-size 4",
                                              "--expert-tensor-parallel-size 2", "12 ranks of a pipeline stage"]),
    (dict(world_size=4, tp=2, ep=3, etp=1), ["--expert-model-parallel-size 3", "4 ranks"]),
    (dict(world_size=4, etp=0), ["--expert-tensor-parallel-size"]),
    (dict(world_size=8, cp=4, cp_inner=3), ["--hierarchical-context-parallel-sizes 3", "--context-parallel-size 4"]),
    (dict(world_size=8, cp=4, cp_inner=0), ["--hierarchical-context-parallel-sizes"]),
])
def test_invalid_degrees(kwargs, flags):
    with pytest.raises(DegreeError) as plain:  # parallel/ states the numbers only
        ParallelDims(**kwargs)
    assert "--" not in str(plain.value) and isinstance(plain.value, ValueError)
    with pytest.raises(ConfigError) as e:  # config names the flags
        parallel_dims(**kwargs)
    for flag in flags:
        assert flag in str(e.value)
    assert isinstance(e.value, ValueError)


GOOD_MODEL = dict(num_layers=8, num_attention_heads=8, num_query_groups=4, seq_length=64, sequence_parallel=True,
                  hidden_size=64, ffn_hidden_size=256)


@pytest.mark.parametrize("dims, override, flags", [
    (dict(world_size=4, tp=4), dict(num_attention_heads=6, num_query_groups=None, hidden_size=None),
     ["--num-attention-heads 6", "--tensor-model-parallel-size 4"]),
    (dict(world_size=4, tp=4), dict(num_query_groups=2), ["--num-query-groups 2", "--tensor-model-parallel-size 4"]),
    (dict(world_size=2, tp=2), dict(num_query_groups=3, num_attention_heads=8), ["--num-query-groups 3"]),
    (dict(world_size=1), dict(num_attention_heads=8, num_query_groups=3), ["--num-attention-heads 8",
                                                                           "--num-query-groups 3"]),
    (dict(world_size=4, tp=4), dict(seq_length=66), ["--seq-length 66", "--tensor-model-parallel-size 4",
                                                     "--sequence-parallel"]),
    (dict(world_size=8, tp=2, cp=2), dict(seq_length=66), ["--seq-length 66", "--context-parallel-size 2"]),
    (dict(world_size=8, tp=2, cp=4), dict(seq_length=20, sequence_parallel=False), ["--seq-length 20",
                                                                                    "--context-parallel-size 4"]),
    (dict(world_size=3, pp=3), dict(), ["--num-layers 8", "--pipeline-model-parallel-size 3"]),
    (dict(world_size=4, pp=4, vp=3), dict(num_layers=16), ["--num-layers 16", "--pipeline-model-parallel-size 4",
                                                           "--num-virtual-stages-per-pipeline-rank"]),
    (dict(world_size=4, tp=4), dict(ffn_hidden_size=250), ["--ffn-hidden-size 250",
                                                           "--tensor-model-parallel-size 4"]),
    (dict(world_size=1), dict(hidden_size=60), ["--hidden-size 60", "--num-attention-heads 8"]),
    (dict(world_size=1), dict(num_layers=0), ["--num-layers"]),
])
def test_invalid_model(dims, override, flags):
    with pytest.raises(ConfigError) as e:
        validate_model(ParallelDims(**dims), **{**GOOD_MODEL, **override})
    for flag in flags:
        assert flag in str(e.value)


@pytest.mark.parametrize("dims", [dict(world_size=1), dict(world_size=4, tp=4), dict(world_size=8, tp=2, pp=4, vp=2),
                                  dict(world_size=16, tp=2, cp=2, pp=2, vp=2), dict(world_size=8, tp=2, cp=4)])
def test_valid_model(dims):
    validate_model(ParallelDims(**dims), **GOOD_MODEL)


def test_sequence_parallel_at_tp1_is_a_noop():
    # Megatron-LM turns --sequence-parallel off at TP 1 (RunConfig.sequence_parallel is False there), so an odd
    # sequence length is fine.
    validate_model(ParallelDims(world_size=2, pp=2), num_layers=2, num_attention_heads=2, seq_length=7,
                   sequence_parallel=False)


def test_sequence_parallel_with_cp_needs_tp_times_cp():
    # seq 20 passes the 2*CP = 4 chunk check, but its 10 tokens per CP rank do not split over TP 4.
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        validate_model(ParallelDims(world_size=8, tp=4, cp=2), num_layers=1, num_attention_heads=4, seq_length=20,
                       sequence_parallel=True)
    validate_model(ParallelDims(world_size=8, tp=4, cp=2), num_layers=1, num_attention_heads=4, seq_length=24,
                   sequence_parallel=True)
