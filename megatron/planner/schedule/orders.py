"""1F1B, the one order every planner builds on (Megatron's
`forward_backward_pipelining_without_interleaving`): stage s runs S - s - 1 warm-up forwards,
then alternates one forward and one backward, then runs the remaining backwards."""
from __future__ import annotations

from typing import List, Optional, Sequence

from megatron.pipeline.lowering import ComputeOp


def one_f_one_b(num_stages: int, order: Sequence[int], inflight: Optional[int] = None) -> List[List[ComputeOp]]:
    """Per-stage op orders of 1F1B for micro-batches run in `order`. `inflight` caps the
    micro-batches between their forward and backward on a stage (DynaPipe's sliced search
    trades bubbles for memory with it); None is Megatron's cap, S - s."""
    order = list(order)
    k = len(order)
    out = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, k) if inflight is None else min(num_stages - s - 1, inflight - 1, k)
        ops = [ComputeOp("F", order[i], s) for i in range(warm)]
        for i in range(k - warm):
            ops += [ComputeOp("F", order[warm + i], s), ComputeOp("B", order[i], s)]
        ops += [ComputeOp("B", order[i], s) for i in range(k - warm, k)]
        out.append(ops)
    return out
