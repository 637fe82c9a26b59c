"""Megatron-Core MoE GPT checkpoints (`--num-experts`): expert names, expert-parallel rank folders
and the MoE settings a run must match. Used by `megatron_legacy` (torch format) and `mcore_dist`
(torch_dist); the names are core_v0.9.0's, checked against files its own code wrote
(tests/fixtures/megatron/mcore_moe_*).

- torch format: one file per (TP, PP, EP) rank, folder `mp_rank_TT[_PPP][_EEE]`, where `_EEE`
  appears iff EP > 1 (so `mp_rank_00_001` is PP rank 1 or EP rank 1: the file's args decide).
  SequentialMLP experts are `decoder.layers.N.mlp.experts.local_experts.J.linear_fc1.weight`
  ([gate; up] when gated) and `linear_fc2.weight`, J the EP rank's local index: global expert
  = ep_rank * E / EP + J. The router is `mlp.router.weight` [E, H]; dense weights repeat in
  every EP file.
- torch_dist: `decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, 2F, H] (the global
  expert axis after the layer axis; all expert implementations save to it).

This project holds each layer's experts stacked, `mlp.experts.weight1` [E, 2F, H] and
`weight2` [E, H, F] (megatron/models/moe/experts.py): the same per-expert layout, so reading is
a rename and a stack. Experts sharded over TP (a Megatron MoE run with TP > 1) are refused with
one line: not read yet, for want of a fixture (core_v0.9.0's MoE with TP needs sequence
parallelism, which its local spec's torch LayerNorm refuses; apex or TE, i.e. a GPU build, has it).
"""
from __future__ import annotations

import os
import re
from typing import Dict, Optional, Tuple

import torch

from megatron import safe_paths
from megatron.checkpointing.megatron_base import MegatronCheckpointError

RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_FILES = ("model_optim_rng.pt", "model_rng.pt")

# Megatron-Core MoE layer names (after `decoder.layers.N.`) -> ours; `local.{g}` is an
# intermediate per-expert name (global index g) that `stack_experts` stacks.
_NAMES = [("mlp.router.weight", "mlp.router.weight"), ("mlp.router.expert_bias", "mlp.router.expert_bias")]
for _i, _w in (("1", "weight"), ("2", "weight"), ("1", "bias"), ("2", "bias")):
    _NAMES.append((f"mlp.experts.experts.linear_fc{_i}.{_w}", f"mlp.experts.{_w}{_i}"))
_LOCAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.(weight|bias)$")
_STACK = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.local\.(\d+)\.(weight|bias)([12])$")


def core_name(rest: str) -> Optional[str]:
    """Our name for a Megatron-Core MoE layer parameter (None: not an MoE name)."""
    for a, b in _NAMES:
        if rest == a:
            return b
    m = _LOCAL.match(rest)
    if m:
        return f"mlp.experts.local.{m.group(1)}.{m.group(3)}{m.group(2)}"
    return None


def rank_files(it_dir: str, load_args) -> Dict[Tuple[int, int, int], str]:
    """{(tp rank, pp rank, ep rank): model file} of one iteration folder. A folder with one
    suffix is read as PP unless the file's args say EP > 1 and PP 1 (`load_args(path)`)."""
    raw = {}
    for sub in sorted(os.listdir(it_dir)):
        m = RANK_DIR.match(sub)
        if not m:
            continue
        for name in _FILES:
            path = os.path.join(it_dir, sub, name)
            if os.path.lexists(path):  # a link (rank folder or file) or a special file is refused here
                safe_paths.regular_file(it_dir, os.path.join(sub, name), "rank file")
                raw[tuple(None if g is None else int(g) for g in m.groups())] = path
                break
    if any(k[2] is not None for k in raw):
        return {(t, a or 0, b or 0): p for (t, a, b), p in raw.items()}
    if any(k[1] is not None for k in raw):
        try:
            args = load_args(raw[min(raw, key=lambda k: (k[0], k[1] or 0))])
        except Exception:  # noqa: BLE001 - read as PP; loading that file again reports what is wrong with it
            args = None
        if int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1 and \
                int(getattr(args, "pipeline_model_parallel_size", 1) or 1) == 1:
            return {(t, 0, a or 0): p for (t, a, _), p in raw.items()}
    return {(t, a or 0, 0): p for (t, a, _), p in raw.items()}


def merge_ep(models: Dict[Tuple[int, int, int], list], args, it_dir: str) -> Dict[Tuple[int, int], list]:
    """{(tp, pp, ep): [stage model dicts]} -> {(tp, pp): [stage model dicts]} holding every expert
    under its global index (the dense weights from EP rank 0; every EP file repeats them)."""
    ep = max(e for _, _, e in models) + 1
    if ep == 1:
        return {(t, p): v for (t, p, _), v in models.items()}
    experts = int(getattr(args, "num_experts", 0) or 0)
    if experts % ep:
        raise MegatronCheckpointError(f"{it_dir}: {ep} expert-parallel rank folders, but args.num_experts is "
                                      f"{experts}")
    local = experts // ep
    out = {}
    for (t, p, e), chunks in sorted(models.items()):
        base = out.setdefault((t, p), [dict() for _ in chunks])
        for c, model in enumerate(chunks):
            for k, v in model.items():
                m = re.match(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$", k)
                if m:
                    base[c][f"{m.group(1)}{e * local + int(m.group(2))}{m.group(3)}"] = v
                elif e == 0:
                    base[c][k] = v
    return out


def stack_experts(full: Dict[str, torch.Tensor], args, tp: int, where: str) -> Dict[str, torch.Tensor]:
    """Per-expert tensors (`local.{g}`, torch format) stacked into our [E, ...] expert weights."""
    parts: Dict[Tuple[str, str], Dict[int, torch.Tensor]] = {}
    out = {}
    for k, v in full.items():
        m = _STACK.match(k)
        if m:
            parts.setdefault((m.group(1), m.group(3) + m.group(4)), {})[int(m.group(2))] = v
        else:
            out[k] = v
    if parts and tp > 1:
        raise MegatronCheckpointError(f"{where}: a Megatron MoE checkpoint with TP {tp} (experts sharded over TP) is "
                                      f"not read yet; convert it to TP 1 with Megatron-LM's tools/checkpoint first")
    experts = int(getattr(args, "num_experts", 0) or 0)
    for (prefix, name), by_e in parts.items():
        if sorted(by_e) != list(range(experts)):
            raise MegatronCheckpointError(f"{where}: {prefix}.{name}: experts {sorted(by_e)[:8]} found, "
                                          f"args.num_experts is {experts}")
        out[f"{prefix}.{name}"] = torch.stack([by_e[g] for g in range(experts)])
    return out


def model_fields(args) -> dict:
    """This project's MoE settings from Megatron's args ({} for a dense model)."""
    a = vars(args)
    if not a.get("num_experts"):
        return {}
    return dict(num_experts=a["num_experts"], router_topk=a.get("moe_router_topk", 2),
                router_pre_softmax=bool(a.get("moe_router_pre_softmax")),
                ffn_hidden_size=a.get("moe_ffn_hidden_size") or None, layer_freq=a.get("moe_layer_freq", 1),
                shared_expert_intermediate_size=a.get("moe_shared_expert_intermediate_size") or None,
                router_score_function=a.get("moe_router_score_function", "softmax"))


_FLAGS = {"num_experts": "--num-experts", "router_topk": "--moe-router-topk",
          "router_pre_softmax": "--moe-router-pre-softmax", "layer_freq": "--moe-layer-freq",
          "shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
          "router_score_function": "--moe-router-score-function"}


def mismatches(args, moe) -> list:
    """The MoE flags where this run (`cfg.model.moe`, None = dense) differs from Megatron's args."""
    theirs = model_fields(args)
    if not theirs:
        return [] if moe is None else [f"--num-experts: checkpoint is dense, this run has {moe.num_experts}"]
    if moe is None:
        return [f"--num-experts: checkpoint has {theirs['num_experts']}, this run is dense"]
    out = []
    for k, flag in _FLAGS.items():
        mine = getattr(moe, k)
        if k == "ffn_hidden_size" or mine == theirs[k]:
            continue
        out.append(f"{flag}: checkpoint has {theirs[k]}, this run has {mine}")
    return out


def slice_expert(key: str, t: torch.Tensor, p: torch.Tensor, ps) -> torch.Tensor:
    """The full [E, ...] expert tensor of `key` cut to this EP rank's experts (p is [E/EP, ...])."""
    if getattr(p, "expert_parallel", False) and t.dim() == p.dim() and t.shape[0] == p.shape[0] * ps.ep_size:
        n = p.shape[0]
        return t[ps.ep_rank * n:(ps.ep_rank + 1) * n]
    return t
