"""Expert-parallel parameters in the project's `torch` checkpoint format.

DP rank 0 writes each (TP, PP) file, but with EP > 1 it holds only its EP rank's experts. So
before a save every rank gathers, over its EP group, the full [num_experts, ...] expert weights
and their Adam moments (collective), and the file holds all experts in global order; a load
takes this rank's slice. The file is therefore the same at every EP size, and a run resumes at
another one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _expert_entries(trainer):
    """[(stage id, state-dict name, param)] of the expert-parallel parameters."""
    return [(sid, name, p) for sid, m in trainer.stages.items() for name, p in m.named_parameters()
            if getattr(p, "expert_parallel", False)]


def _param_index(trainer) -> dict:
    """id(param) -> its index in the torch optimizer's state_dict (param_groups order)."""
    opt = getattr(trainer.optimizer, "optimizer", None)
    if opt is None:
        return {}
    return {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=0)


def gather_experts(trainer, model: dict, opt_state: dict) -> None:
    """Every rank (collective over its EP group): replace, in the state about to be saved, each
    expert weight and its Adam moments by the EP group's full tensor."""
    ps = trainer.ps
    if ps.ep_size == 1:
        return
    index = _param_index(trainer)
    states = (opt_state or {}).get("optimizer", {}).get("state", {})
    for sid, name, p in _expert_entries(trainer):
        model[sid][name] = _gather(p, ps.ep_group)
        i = index.get(id(p))
        if i in states:
            st = dict(states[i])  # the optimizer's own dict: never change it in place
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    st[k] = _gather(st[k], ps.ep_group)
            states[i] = st


def slice_experts(trainer, state: dict) -> None:
    """After a load: keep this rank's experts of the full tensors the file holds."""
    ps = trainer.ps
    index = _param_index(trainer)
    opt = state.get("optimizer") or {}
    # the distributed optimizer's state is a list of this rank's flat shards, nothing per expert
    # (it is refused with EP > 1, so its shards already hold this rank's experts)
    states = opt.get("optimizer", {}).get("state", {}) if isinstance(opt, dict) else {}
    for sid, name, p in _expert_entries(trainer):
        n = p.shape[0]
        lo = ps.ep_rank * n

        def cut(t):
            if t.shape[0] != n * ps.ep_size:
                raise ValueError(f"{name}: the checkpoint holds {t.shape[0]} experts, this run {n * ps.ep_size}")
            return t[lo:lo + n]

        sd = state["model"][sid]
        if name in sd:
            sd[name] = cut(sd[name])
        i = index.get(id(p))
        if i in states:
            for k in ("exp_avg", "exp_avg_sq"):
                if k in states[i]:
                    states[i][k] = cut(states[i][k])
