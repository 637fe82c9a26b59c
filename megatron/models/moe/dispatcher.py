"""Token dispatch to the experts and combine back (--moe-token-dispatcher-type).

Both dispatchers compute, for each of this rank's tokens t,  y_t = sum_e p_te * expert_e(x_t)
over the experts e of its routing map, wherever expert e lives:
* local (EP 1): permute the (token, expert) pairs expert-major, run the experts, scatter-add;
* alltoall: the same pairs, grouped by the EP rank owning the expert, go out with one
  all-to-all of uneven splits (the per-expert counts are exchanged first, one small all-to-all,
  and read on the host: the splits are Python ints), are re-sorted expert-major for the local
  experts, come back with the reverse all-to-all, are weighted and scatter-added locally;
* allgather: every EP rank gathers all EP ranks' tokens, probabilities and maps (padded to the
  longest rank), computes its local experts' weighted outputs for every token, and a
  reduce-scatter returns each rank the sum for its own tokens.
The probabilities multiply the expert outputs on the rank that owns the token (alltoall) or the
expert (allgather); both are the same sum, so both equal EP 1 up to summation order.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from megatron.core.comm_device import comm_tensor
from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region, group_size,
                                                    reduce_scatter_to_sequence_parallel_region)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, group, out_splits: List[int], in_splits: List[int]):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return _AllToAll.apply(g.contiguous(), ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def permute(x, probs, rmap):
    """(token index, expert index, prob) of every routed pair, expert-major then token order."""
    expert_idx, token_idx = rmap.t().nonzero(as_tuple=True)
    return token_idx, expert_idx, probs.t()[expert_idx, token_idx]


def combine(out, token_idx, pair_probs, num_tokens: int):
    y = out * pair_probs.unsqueeze(-1).to(out.dtype)
    return torch.zeros((num_tokens, out.shape[-1]), dtype=out.dtype, device=out.device).index_add(0, token_idx, y)


class LocalDispatcher:
    def __init__(self, num_experts: int, **_):
        self.num_experts = num_experts

    def __call__(self, x, probs, rmap, experts):
        token_idx, _, pair_probs = permute(x, probs, rmap)
        counts = rmap.sum(0).tolist()
        out = experts(x.index_select(0, token_idx), counts)
        self.last_counts = counts
        return combine(out, token_idx, pair_probs, x.shape[0])


class AllToAllDispatcher:
    def __init__(self, num_experts: int, ep_group, ep_rank: int):
        self.ep_group, self.ep_rank = ep_group, ep_rank
        self.ep = group_size(ep_group)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep

    def __call__(self, x, probs, rmap, experts):
        ep, nl = self.ep, self.num_local
        token_idx, _, pair_probs = permute(x, probs, rmap)
        counts = rmap.sum(0).to(torch.int64)  # [E], expert-major matches the pair order
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.ep_group)  # [EP source, local expert]
        send_n, recv_n = counts.view(ep, nl).tolist(), recv.view(ep, nl).tolist()
        in_splits, out_splits = [sum(r) for r in send_n], [sum(r) for r in recv_n]
        tokens = _AllToAll.apply(x.index_select(0, token_idx), self.ep_group, out_splits, in_splits)
        # received: source-rank-major, then local expert -> local-expert-major for the experts
        starts, at = [], 0
        for r in range(ep):
            row = []
            for j in range(nl):
                row.append(at)
                at += recv_n[r][j]
            starts.append(row)
        order = [i for j in range(nl) for r in range(ep) for i in range(starts[r][j], starts[r][j] + recv_n[r][j])]
        order_t = torch.tensor(order, dtype=torch.long, device=x.device)
        per_expert = [sum(recv_n[r][j] for r in range(ep)) for j in range(nl)]
        out = experts(tokens.index_select(0, order_t), per_expert)
        back = torch.empty_like(out).index_copy(0, order_t, out)  # undo the sort
        out = _AllToAll.apply(back, self.ep_group, in_splits, out_splits)
        self.last_counts = counts.tolist()
        return combine(out, token_idx, pair_probs, x.shape[0])


class AllGatherDispatcher:
    def __init__(self, num_experts: int, ep_group, ep_rank: int):
        self.ep_group, self.ep_rank = ep_group, ep_rank
        self.ep = group_size(ep_group)
        self.num_local = num_experts // self.ep

    def __call__(self, x, probs, rmap, experts):
        n = comm_tensor([x.shape[0]], self.ep_group, dtype=torch.int64)  # on the group's device (NCCL)
        sizes = [torch.empty_like(n) for _ in range(self.ep)]
        dist.all_gather(sizes, n, group=self.ep_group)
        t_max = max(int(s) for s in sizes)
        pad = t_max - x.shape[0]

        def gather(t):
            if pad:
                t = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))])
            return gather_from_sequence_parallel_region(t, self.ep_group)

        all_x, all_p = gather(x), gather(probs)
        with torch.no_grad():
            all_map = gather(rmap.to(probs.dtype)) > 0
        lo = self.ep_rank * self.num_local
        sl = slice(lo, lo + self.num_local)
        token_idx, _, pair_probs = permute(all_x, all_p[:, sl], all_map[:, sl])
        counts = all_map[:, sl].sum(0).tolist()
        out = experts(all_x.index_select(0, token_idx), counts)
        y = reduce_scatter_to_sequence_parallel_region(combine(out, token_idx, pair_probs, all_x.shape[0]),
                                                       self.ep_group)
        self.last_counts = rmap.sum(0).tolist()
        return y[:x.shape[0]]


def build_dispatcher(moe, ep_group, ep_rank: int):
    if group_size(ep_group) == 1:
        return LocalDispatcher(moe.num_experts)
    cls = AllToAllDispatcher if moe.token_dispatcher_type == "alltoall" else AllGatherDispatcher
    return cls(moe.num_experts, ep_group, ep_rank)
