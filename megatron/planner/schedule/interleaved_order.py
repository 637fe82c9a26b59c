"""The op order of interleaved 1F1B for any number of micro-batches, shared by the static
schedule (`static.interleaved_orders`) and DynaPipe on virtual stages (`dynapipe_interleaved`).

Megatron's `forward_backward_pipelining_with_interleaving` needs the number of micro-batches to
be a multiple of PP: micro-batches go in groups of PP through chunk 0, 1, ..., v-1 of a rank,
backwards mirror that with the chunks reversed. Here a remainder joins the last group (a short
last group of its own deadlocks the steady state for some PP, v, m), whose size G then replaces
PP in the warm-up count; with m a multiple of PP the order is exactly Megatron's. No deadlock
was found for PP <= 8, v <= 4, up to 41 micro-batches (tests/planner/dynapipe/test_dynapipe_interleaved.py
and tests/planner/schedule/test_static.py simulate them). Imports nothing from the package: the callers
pass their own op type.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, TypeVar

T = TypeVar("T")


def warmup_forwards(pp: int, v: int, rank: int, group: int = 0) -> int:
    """Chunk forwards rank `rank` runs before its first backward in interleaved 1F1B with
    micro-batch groups of at most `group` (default PP): Megatron's 2 (PP - r - 1) + (v - 1) PP."""
    return (pp - rank - 1) * 2 + (v - 1) * (group or pp)


def microbatch_groups(pp: int, order: Sequence[int]) -> List[List[int]]:
    """Groups of PP consecutive micro-batches of `order`; a remainder joins the last group
    (a short last group of its own deadlocks the steady state for some PP, v, m)."""
    K = len(order)
    cuts = list(range(0, max(K - K % pp, 1), pp)) + [K] if K > pp else [0, K]
    return [list(order[a:b]) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def interleaved_op_orders(pp: int, v: int, order: Sequence[int], make_op: Callable[[str, int, int], T],
                          extra_warmup: int = 0) -> List[List[T]]:
    """Per-rank op orders of interleaved 1F1B for micro-batches run in `order` (any count);
    ``make_op(kind, microbatch, stage)`` builds one op, chunk c of rank r being stage c * PP + r.

    Rank r's forward sequence: for each group of micro-batches (`microbatch_groups`), chunk 0
    of the group, then chunk 1, ...; its backward sequence: the same groups with the chunks
    reversed. Rank r runs `warmup_forwards(pp, v, r, largest group)` forwards (every forward
    when there is one group: Megatron's m == PP case), then one forward / one backward, then
    drains. `extra_warmup`: that many more forwards first on every rank (all forwards first
    never deadlocks)."""
    groups = microbatch_groups(pp, order)
    G = max(len(g) for g in groups)
    orders = []
    for r in range(pp):
        fwd = [make_op("F", mb, c * pp + r) for g in groups for c in range(v) for mb in g]
        bwd = [make_op("B", mb, c * pp + r) for g in groups for c in reversed(range(v)) for mb in g]
        total = len(fwd)
        warm = total if len(groups) == 1 else min(warmup_forwards(pp, v, r, G) + extra_warmup, total)
        ops = fwd[:warm]
        for k in range(total - warm):
            ops += [fwd[warm + k], bwd[k]]
        ops += bwd[total - warm:]
        orders.append(ops)
    return orders
