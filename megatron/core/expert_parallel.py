"""Expert-parallel process groups, in Megatron-Core's rank order ("MoE parallel folding").

Experts are not tensor-parallel here (expert TP = 1, Megatron-Core's recommendation for
fine-grained MoE). Inside one pipeline stage the dense layout numbers its ranks
``i = dp * (cp * tp) + cp * tp + tp``; the expert layout numbers the same ranks
``i = ep + EP * edp`` (Megatron's RankGenerator(tp=1, ep=EP, dp=EDP, pp=PP), order tp-cp-ep-dp-pp
with ETP 1). So an EP group is EP consecutive ranks of a stage -- TP peers first, then DP -- and
an expert-data-parallel (EDP) group holds the stage's ranks with the same ``ep`` index: the ranks
whose copies of the same experts saw other tokens, over which their gradients are summed.
"""
from __future__ import annotations

from typing import List

import torch.distributed as dist

from megatron.core.parallel_state import ParallelState


def expert_groups_layout(world: int, pp: int, ep: int):
    """([EP group ranks], [EDP group ranks]) for every stage, in creation order."""
    stage = world // pp
    if stage % ep:
        raise ValueError(f"--expert-model-parallel-size ({ep}) must divide the {stage} ranks of a pipeline stage")
    ep_groups: List[List[int]] = []
    edp_groups: List[List[int]] = []
    for p in range(pp):
        base = p * stage
        for d in range(stage // ep):
            ep_groups.append([base + d * ep + e for e in range(ep)])
        for e in range(ep):
            edp_groups.append([base + d * ep + e for d in range(stage // ep)])
    return ep_groups, edp_groups


def add_expert_groups(st: ParallelState, ep: int) -> ParallelState:
    """Create the EP and EDP groups (every rank creates every group, in the same order)."""
    st.ep_size = ep
    if not dist.is_initialized():
        if ep != 1:
            raise RuntimeError("--expert-model-parallel-size > 1 needs an initialised process group")
        return st
    ep_groups, edp_groups = expert_groups_layout(st.world_size, st.pp_size, ep)
    for ranks in ep_groups:
        g = dist.new_group(ranks, timeout=st.timeout)
        if st.rank in ranks:
            st.ep_group, st.ep_global_ranks, st.ep_rank = g, ranks, ranks.index(st.rank)
    for ranks in edp_groups:
        g = dist.new_group(ranks, timeout=st.timeout)
        if st.rank in ranks:
            st.edp_group, st.edp_size, st.edp_rank = g, len(ranks), ranks.index(st.rank)
    if ep == 1:
        st.ep_group = None  # one rank: every expert collective is the identity
    return st
