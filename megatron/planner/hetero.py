"""Pipeline stages with their own TP and DP sizes (Aceso's heterogeneous stages), as a plan pass.

Stage s runs on ``layouts[s] = (tp, dp)`` ranks: the contiguous global ranks starting at
`stage_rank_offsets(layouts)[s]`, in tp-dp order inside the stage. A pipeline micro-batch of
b rows is split over the stage's DP ranks: DP index i holds rows [i*b/dp, (i+1)*b/dp). The TP
ranks of one DP index hold the same rows (each has the whole hidden state between layers), so
between two stages only the batch dimension is re-split:

* forward: receiver (stage s+1, DP j, TP t) gets its rows from every DP rank of stage s whose
  rows overlap them, from TP index ``t % tp_s``;
* backward: receiver (stage s-1, DP i, TP t) gets the gradient of its rows from the
  overlapping DP ranks of stage s, from TP index ``t % tp_s``. (Every TP rank computes the
  same input gradient: the backward of the column-parallel linears all-reduces it.)

`split_plans` rewrites the per-stage plans of any static schedule (lowered for whole
micro-batches, one plan per stage) into one plan per global rank: shapes shrink to the rank's
rows, and each message becomes one piece per peer with `batch_slice` rows (see
megatron.pipeline.instructions). A gradient message marked compressed (Optimus-CC,
`compress_rank`) keeps its mark on every piece: each piece is a low-rank P/Q of its rows. The executor and validator do the rest; no new runtime.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

from megatron.core.parallel_state import stage_position, stage_rank_offsets
from megatron.pipeline import instructions as I

Layout = Tuple[Tuple[int, int], ...]

_SENDS = (I.SendActivationStart, I.SendActivationFinish, I.SendGradStart, I.SendGradFinish)
_ACTS = (I.SendActivationStart, I.SendActivationFinish, I.RecvActivationStart, I.RecvActivationFinish)


def _part(b: int, dp: int, index: int) -> Tuple[int, int]:
    n = b // dp
    return index * n, n


def _overlaps(b: int, mine: Tuple[int, int], dp_other: int):
    """(other DP index, first row, count) for every part of `dp_other` that overlaps rows `mine`."""
    lo, hi = mine[0], mine[0] + mine[1]
    out = []
    for j in range(dp_other):
        a, n = _part(b, dp_other, j)
        first, last = max(lo, a), min(hi, a + n)
        if first < last:
            out.append((j, first, last - first))
    return out


def _rows_dim(shapes, dim: int, rows: int):
    return tuple(tuple(s[:dim]) + (rows,) + tuple(s[dim + 1:]) for s in shapes)


def split_plans(plans: Sequence[I.ExecutionPlan], layouts: Layout) -> List[I.ExecutionPlan]:
    """One plan per global rank from one plan per stage (see the module docstring)."""
    layouts = tuple(tuple(x) for x in layouts)
    if len(plans) != len(layouts):
        raise ValueError(f"{len(plans)} stage plans for a layout of {len(layouts)} stages")
    offsets = stage_rank_offsets(layouts)
    world = sum(t * d for t, d in layouts)
    mb_rows = [shapes[0][0] for shapes in plans[0].microbatch_shapes]
    for mb, b in enumerate(mb_rows):
        for s, (tp, dp) in enumerate(layouts):
            if b % dp:
                raise ValueError(f"micro-batch {mb} has {b} rows, which stage {s}'s data-parallel size {dp} does "
                                 "not divide; the micro-batch size must be a multiple of every stage's DP size")
    out = []
    for g in range(world):
        stage, dp_index, tp_index = stage_position(layouts, g)
        base = plans[stage]
        if tuple(base.assigned_stages) != (stage,):
            raise ValueError(f"plan {stage} runs stages {base.assigned_stages}; stages with their own TP/DP sizes "
                             "need one stage per pipeline rank (no virtual stages)")
        tp, dp = layouts[stage]

        def rank_of(s, d, t):
            return offsets[s] + d * layouts[s][0] + t

        instrs = []
        for ins in base.instructions:
            b = mb_rows[ins.microbatch]
            mine = _part(b, dp, dp_index)
            if isinstance(ins, I.LoadInput):
                instrs.append(dataclasses.replace(ins, buffer_shapes=_rows_dim(ins.buffer_shapes, 0, mine[1])))
                continue
            if not isinstance(ins, I.CommInstruction):
                changes = {"buffer_shapes": _rows_dim(ins.buffer_shapes, 1, mine[1])}
                if hasattr(ins, "output_shapes"):
                    changes["output_shapes"] = _rows_dim(ins.output_shapes, 1, mine[1])
                instrs.append(dataclasses.replace(ins, **changes))
                continue
            if ins.token_slice:
                raise ValueError("stages with their own TP/DP sizes do not combine with token slices")
            other = ins.stage + 1 if isinstance(ins, _ACTS) else ins.stage - 1
            if isinstance(ins, _SENDS):  # this rank sends; ins.stage is its own stage
                tp_o, dp_o = layouts[other]
                peers = [(rank_of(other, j, t2), first, n) for j, first, n in _overlaps(b, mine, dp_o)
                         for t2 in range(tp_o) if t2 % tp == tp_index]
            else:  # this rank receives from stage ins.stage
                tp_o, dp_o = layouts[ins.stage]
                peers = [(rank_of(ins.stage, j, tp_index % tp_o), first, n) for j, first, n in _overlaps(b, mine, dp_o)]
            shapes = _rows_dim(ins.buffer_shapes, 1, mine[1])
            for peer, first, n in sorted(peers):
                instrs.append(dataclasses.replace(ins, peer=peer, buffer_shapes=shapes, batch_slice=(first, n)))
        out.append(dataclasses.replace(base, rank=g, num_ranks=world, instructions=instrs,
                                       batch_split=(dp_index, dp)))
    return out


def layout_pass(layouts: Layout):
    """`FixedBatchPlanner` plan pass for a heterogeneous stage layout."""
    return lambda plans: split_plans(plans, layouts)
