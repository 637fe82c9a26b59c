"""Fused embedding synchronisation (Optimus-CC's `--emb-comm-opt`).

Without it the tied word-embedding gradient is reduced twice: summed over data parallelism
with every other gradient, then summed between the first and the last pipeline stage. Both
are sums, so one all-reduce over the first- and last-stage ranks of *all* DP replicas gives
the same result with one collective on the critical path instead of two.

The group is built per tensor-parallel rank: with a vocabulary-parallel embedding each TP
rank holds a different vocabulary shard, and summing across TP ranks (one group spanning
them, as the published code does) would add unrelated rows together.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.parallel_state import ParallelState, global_rank


def fused_embedding_group_ranks(tp: int, dp: int, pp: int) -> List[List[int]]:
    """One rank list per TP rank: the first and last pipeline stage of every DP replica."""
    groups = []
    for t in range(tp):
        ranks = set()
        for d in range(dp):
            ranks.add(global_rank(t, d, 0, tp, dp))
            ranks.add(global_rank(t, d, pp - 1, tp, dp))
        groups.append(sorted(ranks))
    return groups


def build_fused_embedding_group(ps: ParallelState) -> Optional[object]:
    """Collective: every rank calls it (torch creates groups in the same order everywhere)."""
    mine = None
    if not dist.is_initialized() or ps.world_size == 1 or ps.stage_layouts:
        # Stages with their own TP/DP sizes: their tied-embedding sync (core/distributed.py,
        # allreduce_resharded_embedding_grads) already is this fused sync, over every replica.
        return None
    for ranks in fused_embedding_group_ranks(ps.tp_size, ps.dp_size, ps.pp_size):
        g = dist.new_group(ranks, timeout=ps.timeout)
        if ps.rank in ranks:
            mine = g
    return mine


def fused_embedding_all_reduce(tied_params: List[nn.Parameter], group) -> int:
    """Sum the tied embedding gradients over first/last stages x DP; returns payload bytes."""
    if group is None or not tied_params:
        return 0
    grads = []
    for p in tied_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0]
    dist.all_reduce(flat, group=group)
    if len(grads) > 1:
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
    return flat.numel() * flat.element_size()


def build_embedding_reducer(cfg, ps: ParallelState, fused_group=None):
    """--emb-grad-comp: the low-rank reducer of data_parallel.py run over the tied-embedding
    group: the fused group of --emb-comm-opt (first and last stage of every DP replica, per TP
    rank) or the plain first/last-stage group. Ranks outside the group get a reducer that does
    nothing (its group is None). The gradients are sums over the group, as uncompressed."""
    import math
    from megatron.compression.data_parallel import PowerSGDReducer
    c = cfg.compression
    # Stages with their own TP/DP sizes: the group holds every rank of the first and the last
    # stage, and the reducer sees the vocabulary-wide, zero-padded buffers of the re-split sync
    # (`resharded_embedding_reduce`).
    group = fused_group if c.emb_comm_opt and not ps.stage_layouts else ps.embedding_group
    size = dist.get_world_size(group) if group is not None else 1
    warmup = math.ceil(cfg.training.train_iters * c.emb_grad_comp_warm_up)
    return PowerSGDReducer(c.emb_grad_comp_rank, c.emb_use_error_feedback, warmup, True, group, size,
                           seed=cfg.training.seed, method=c.emb_grad_comp_type, kind="emb", stage=ps.pp_rank)


def resharded_embedding_reduce(reducer, tied_params: List[nn.Parameter], ps: ParallelState, vocab_rows: int,
                               iteration: int) -> int:
    """--emb-grad-comp when the first and last stage have their own TP/DP sizes: every rank
    places its vocabulary shard's gradient at its rows of a zero [vocab_rows, h] buffer and the
    low-rank reducer sums those over both stages' ranks (a sum of padded buffers is the full
    gradient, so the compressed result is that of the whole tied gradient); each rank keeps its
    rows. Returns the payload bytes."""
    from megatron.core.distributed import allreduce_resharded_embedding_grads
    return allreduce_resharded_embedding_grads(tied_params, ps.embedding_group, ps.tp_rank, vocab_rows,
                                               reduce=lambda fulls: reducer.reduce_grads(fulls, iteration)[0])
