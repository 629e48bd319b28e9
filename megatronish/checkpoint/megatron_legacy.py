"""Megatron-LM's legacy checkpoints (``--ckpt-format torch``): ``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/
model_optim_rng.pt``, one file per TP rank ``TT``, PP stage ``PPP`` (when PP > 1) and EP rank ``EEE`` (when
EP > 1; Megatron's ``get_checkpoint_name``), each a ``torch.save`` of ``{"model": local state dict, "args",
"iteration", "checkpoint_version", "optimizer", "opt_param_scheduler", "rng_state"}``; layer numbers are local to
the stage. Read without running pickled code (:func:`.megatron_pickle.safe_load`).

The TP files of a stage are merged into our global tensors (:func:`.megatron_format.tp_split`). Experts: the
file of EP rank ``e`` holds its local experts ``e * E/EP + j`` as ``local_experts.<j>.linear_fc1.weight``
(SequentialMLP), ``linear_fc1.weight<j>`` (TEGroupedMLP) or the columns of ``weight1`` / ``weight2`` (GroupedMLP:
``[h, local * rows]`` / ``[local * cols, h]``, each expert transposed), split over expert tensor parallelism:
expert-TP rank ``t % ETP`` of TP rank ``t`` (``--expert-tensor-parallel-size``, Megatron's default TP). With
expert parallelism folded into TP (ETP < TP) only some ``(TT, EEE)`` pairs exist; every expert-TP x EP piece and
every TP rank must be found in some file of each stage.
"""
from __future__ import annotations

import os
import re

import torch

from .dcp_io import CheckpointError
from .megatron_names import (
    ALT_KEYS,
    EXPERT_SPLIT,
    LAYER_KEYS,
    MLA_DOWN,
    MTP_LAYER_NAMES,
    layer_suffix,
    split_layer,
    split_mtp,
    stored_arg,
    tp_split,
)
from .megatron_pickle import safe_load

LEGACY_FILE = "model_optim_rng.pt"
# a key of an MTP depth's transformer layer (on the last stage): depth, suffix
_MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(?:" + "|".join(MTP_LAYER_NAMES) + r")\.(.+)$")


def legacy_files(iter_dir: str) -> dict[tuple[int, ...], str]:
    """``{(tp rank, *the 3-digit numbers): path}`` of a legacy iteration directory's ``mp_rank_TT[_PPP][_EEE]``
    (empty when it is not one; which number is the PP stage and which the EP rank the args tell)."""
    out = {}
    if not os.path.isdir(iter_dir):
        return out
    for d in os.listdir(iter_dir):
        m = re.fullmatch(r"mp_rank_(\d{2})((?:_\d{3}){0,2})", d)
        if m:
            out[(int(m.group(1)), *(int(x) for x in m.group(2).split("_")[1:]))] = os.path.join(iter_dir, d,
                                                                                                 LEGACY_FILE)
    return out


_EXPERT_NAMES = (re.compile(r"^mlp\.experts\.local_experts\.\d+\.(linear_fc[12])\.weight$"),
                 re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight\d+$"))
_GROUPED = {"mlp.experts.weight1": "linear_fc1", "mlp.experts.weight2": "linear_fc2"}


def _ours_suffix(suffix: str, inverse: dict) -> str | None:
    """Our per-layer suffix of a legacy file's local one (None: not a model tensor we know)."""
    for pattern in _EXPERT_NAMES:
        m = pattern.match(suffix)
        if m:
            return f"mlp.experts.{m.group(1)}.weight"
    if suffix in _GROUPED:
        return f"mlp.experts.{_GROUPED[suffix]}.weight"
    if suffix.startswith(("mlp.router.", "mlp.shared_experts.")):
        return suffix
    return inverse.get(suffix)


class Legacy:
    """A legacy iteration directory: TP (and EP) files merged, PP stages' local layer numbers made global. Files
    are opened memory-mapped one pipeline stage at a time."""

    def __init__(self, iter_dir: str):
        self.iter_dir = iter_dir
        raw = legacy_files(iter_dir)
        first = raw[min(raw)]
        if not os.path.isfile(first):
            raise CheckpointError(f"missing checkpoint file {first}")
        self._stage, self._sds = None, None
        head = self._load(first)
        self.args = head.get("args")
        self.where = first
        self.common = {k: v for k, v in head.items() if not k.startswith("model")}
        arg = lambda name: int(stored_arg(self.args, name, 1) or 1)  # noqa: E731
        self.tp, self.pp, self.ep = (arg("tensor_model_parallel_size"), arg("pipeline_model_parallel_size"),
                                     arg("expert_model_parallel_size"))
        self.etp = int(stored_arg(self.args, "expert_tensor_parallel_size") or self.tp)
        self.num_experts = int(stored_arg(self.args, "num_experts") or 0)
        if "model" not in head:
            chunks = sorted(k for k in head if k.startswith("model"))
            raise CheckpointError(f"{first} holds model chunks {chunks} (virtual pipeline stages); convert it to "
                                  "torch_dist or save without --num-layers-per-virtual-pipeline-stage")
        self.files = {}  # (tp, pp, ep) -> path
        for (t, *rest), path in raw.items():
            p = rest.pop(0) if rest and self.pp > 1 else 0
            e = rest.pop(0) if rest and self.ep > 1 else 0
            self.files[(t, p, e)] = path
        self._check_files()
        layers = int(stored_arg(self.args, "num_layers"))
        if any(stored_arg(self.args, f"decoder_{end}_pipeline_num_layers") for end in ("first", "last")):
            raise CheckpointError(f"{first}: uneven pipeline stages (--decoder-first/last-pipeline-num-layers) are "
                                  "not supported by the legacy reader")
        if layers % self.pp:
            raise CheckpointError(f"{first}: {layers} layers do not split evenly over {self.pp} pipeline stages")
        self.per_stage = layers // self.pp
        self.swiglu = bool(stored_arg(self.args, "swiglu", False))

    def _file_name(self, t: int, p: int, e: int) -> str:
        name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "") + (f"_{e:03d}" if self.ep > 1 else "")
        return os.path.join(self.iter_dir, name, LEGACY_FILE)

    def _check_files(self) -> None:
        """Every TP rank and every expert-TP x EP piece of each stage in some existing file."""
        if self.tp % self.etp:
            raise CheckpointError(f"{self.where}: expert tensor-parallel size {self.etp} does not divide the "
                                  f"tensor-parallel size {self.tp}; this reader cannot place the experts")
        promise = f"the args say TP {self.tp} x PP {self.pp}" + (f" x EP {self.ep}" if self.ep > 1 else "")
        for p in range(self.pp):
            have = [k for k, path in self.files.items() if k[1] == p and os.path.isfile(path)]
            for t in range(self.tp):
                if not any(k[0] == t for k in have):
                    raise CheckpointError(f"missing checkpoint file {self._file_name(t, p, t % self.ep)} ({promise})")
            for e in range(self.ep):
                for x in range(self.etp):
                    if not any(k[2] == e and k[0] % self.etp == x for k in have):
                        raise CheckpointError(f"missing checkpoint file {self._file_name(x, p, e)} ({promise}, "
                                              f"expert TP {self.etp})")

    def _load(self, path: str) -> dict:
        if not os.path.isfile(path):
            raise CheckpointError(f"missing checkpoint file {path}")
        obj = safe_load(path, path)
        if not isinstance(obj, dict):
            raise CheckpointError(f"{path} does not hold a dict")
        return obj

    @property
    def iteration(self) -> int:
        return int(self.common.get("iteration") or 0)

    def _stage_sds(self, stage: int) -> dict[tuple[int, int], dict]:
        """``{(tp rank, ep rank): local state dict}`` of the files of pipeline stage ``stage``."""
        if self._stage != stage:
            self._sds = None
            self._sds = {(t, e): self._load(path)["model"] for (t, p, e), path in sorted(self.files.items())
                         if p == stage}
            self._stage = stage
        return self._sds

    def _of_tp(self, sds: dict, t: int) -> tuple[int, int]:
        return min(k for k in sds if k[0] == t)

    def _local(self, name: str) -> tuple[int, list[str], str]:
        """(stage, the key prefixes that may hold it, its suffix) of our global ``name``: a decoder layer's
        (``decoder.layers.<local>.``), an MTP depth's transformer layer's (under either of megatron-core's names),
        or a tensor outside the layers (prefix ``""``)."""
        layer, suffix = split_layer(name)
        if layer is not None:
            stage, local = divmod(layer, self.per_stage)
            return stage, [f"decoder.layers.{local}."], suffix
        depth, inner = split_mtp(name)
        if depth is not None:
            return self.pp - 1, [f"mtp.layers.{depth}.{n}." for n in MTP_LAYER_NAMES], inner
        return (0 if name.startswith("embedding.") else self.pp - 1), [""], name

    def names(self) -> list[str]:
        """Our global names of every model tensor in the files (extra states dropped)."""
        out = {}
        inverse = {}
        for ours, key in LAYER_KEYS.items():
            inverse[key] = ours
            inverse[ALT_KEYS.get(ours, ours)] = ours
        for stage in range(self.pp):
            sds = self._stage_sds(stage)
            at = self._of_tp(sds, 0)
            for k, v in sds[at].items():
                if k.endswith("_extra_state") or not isinstance(v, torch.Tensor):
                    continue
                layer, suffix = split_layer(k)
                mtp = _MTP_KEY.match(k)
                if k == "output_layer.weight" and not stored_arg(self.args, "untie_embeddings_and_output_weights"):
                    continue  # the last stage's copy of the tied word embedding
                if layer is None and not mtp:
                    out[k] = None
                    continue
                ours = _ours_suffix(mtp.group(2) if mtp else suffix, inverse)
                if ours is None:
                    raise CheckpointError(f"{self.files[(at[0], stage, at[1])]}: unexpected tensor {k!r}")
                out[f"mtp.layers.{mtp.group(1)}.mtp_model_layer.{ours}" if mtp else
                    f"decoder.layers.{stage * self.per_stage + layer}.{ours}"] = None
        return list(out)

    def shape(self, name: str) -> tuple[int, ...] | None:
        try:
            if layer_suffix(name) in EXPERT_SPLIT:
                piece = self._expert_piece(name, 0, 0)
                dim = EXPERT_SPLIT[layer_suffix(name)]
                return (self.num_experts, *(n * (self.etp if d == dim else 1) for d, n in enumerate(piece.shape)))
            parts = self._parts(name)
        except CheckpointError:
            return None
        shape = list(parts[0].shape)
        split = self._split(name, parts[0])
        if split is not None:
            shape[split[0]] *= self.tp
        return tuple(shape)

    def dtype(self, name: str) -> torch.dtype:
        if layer_suffix(name) in EXPERT_SPLIT:
            return self._expert_piece(name, 0, 0).dtype
        return self._parts(name)[0].dtype

    def _parts(self, name: str) -> list[torch.Tensor]:
        """The TP ranks' local tensors of our global ``name`` (memory-mapped)."""
        stage, prefixes, suffix = self._local(name)
        sds = self._stage_sds(stage)
        cands = [p + s for p in prefixes for s in dict.fromkeys((suffix, ALT_KEYS.get(suffix, suffix),
                                                                  LAYER_KEYS.get(suffix, suffix)))]
        at = [self._of_tp(sds, t) for t in range(self.tp)]
        key = next((c for c in cands if c in sds[at[0]]), None)
        if key is None:
            raise CheckpointError(f"{self.files[(at[0][0], stage, at[0][1])]}: no tensor {cands[0]!r} (needed for "
                                  f"{name})")
        parts = []
        for t, e in at:
            if not isinstance(sds[(t, e)].get(key), torch.Tensor):
                raise CheckpointError(f"{self.files[(t, stage, e)]}: no tensor {key!r} (needed for {name})")
            parts.append(sds[(t, e)][key])
        return parts

    def _expert_piece(self, name: str, expert: int, etp_rank: int) -> torch.Tensor:
        """Global expert ``expert``'s block of our ``name`` held by expert-TP rank ``etp_rank``
        (``[rows, cols]`` in our per-expert layout)."""
        stage, prefixes, suffix = self._local(name)
        sds = self._stage_sds(stage)
        if not self.num_experts or self.num_experts % self.ep:
            raise CheckpointError(f"{self.where}: --num-experts {self.num_experts} does not split over expert "
                                  f"parallelism {self.ep}")
        n_local = self.num_experts // self.ep
        e, j = divmod(expert, n_local)
        at = min(k for k in sds if k[1] == e and k[0] % self.etp == etp_rank)
        sd = sds[at]
        which = suffix.split(".")[2]  # linear_fc1 | linear_fc2
        bases = [f"{p}mlp.experts." for p in prefixes]
        for key in (f"{b}{form}" for b in bases for form in (f"local_experts.{j}.{which}.weight",
                                                             f"{which}.weight{j}")):
            if isinstance(sd.get(key), torch.Tensor):
                return sd[key]
        grouped_name = "weight1" if which == "linear_fc1" else "weight2"
        grouped = next((sd[b + grouped_name] for b in bases if isinstance(sd.get(b + grouped_name), torch.Tensor)),
                       None)
        base = bases[0]
        if grouped is not None:
            h = int(stored_arg(self.args, "hidden_size"))
            if which == "linear_fc1":  # [h, local * rows]: expert j's [h, rows], transposed
                return grouped.view(n_local, h, -1)[j].t()
            return grouped.view(n_local, -1, h)[j].t()  # [local * cols, h]: expert j's [cols, h], transposed
        raise CheckpointError(f"{self.files[(at[0], stage, at[1])]}: no weights of local expert {j} for {name} "
                              f"({base}local_experts.{j}.{which}.weight, {base}{which}.weight{j} or GroupedMLP's "
                              "weight1/weight2)")

    def _split(self, name: str, part: torch.Tensor) -> tuple[int, int] | None:
        """:func:`tp_split` of ``name`` in these files; None for an MLA down-projection each file holds whole (the
        Transformer Engine spec's, duplicated over TP)."""
        rows = MLA_DOWN.get(layer_suffix(name))
        if rows is not None and part.size(0) == sum(int(stored_arg(self.args, a) or 0) for a in rows):
            return None
        return tp_split(name, self.swiglu)

    def read(self, name: str) -> torch.Tensor:
        suffix = layer_suffix(name)
        if suffix in EXPERT_SPLIT:
            stride = 2 if self.swiglu and suffix == "mlp.experts.linear_fc1.weight" else 1
            return torch.stack([_merge([self._expert_piece(name, g, x) for x in range(self.etp)],
                                       (EXPERT_SPLIT[suffix], stride)) for g in range(self.num_experts)])
        parts = self._parts(name)
        return _merge(parts, self._split(name, parts[0]))


def _merge(parts: list[torch.Tensor], split: tuple[int, int] | None) -> torch.Tensor:
    """TP pieces put together along ``split`` (``(dim, stride)``; stride 2: each piece is ``[gate_t; up_t]``)."""
    if split is None or len(parts) == 1:
        return parts[0].clone()
    dim, stride = split
    blocks = [p.chunk(stride, dim) for p in parts]
    return torch.cat([blocks[t][k] for k in range(stride) for t in range(len(parts))], dim)
