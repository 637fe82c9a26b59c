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

With --sequence-parallel a stage of TP > 1 also splits the sequence: TP index t holds tokens
[t*S/tp, (t+1)*S/tp) of its rows ([S/tp, b/dp, h] between layers), and its input gradient is
that block's only. A message then carries a block of rows x tokens: every receiver gets each
(row, token) of its block once, from the sender that holds it (if several TP ranks of the
sender hold it, TP index ``t % tp_s`` as above), so the sequence is re-split between stages of
different TP the way rows are between stages of different DP.

`split_plans` rewrites the per-stage plans of any static schedule (lowered for whole
micro-batches, one plan per stage) into one plan per global rank: shapes shrink to the rank's
rows (and tokens), and each message becomes one piece per peer with `batch_slice` rows (and
tokens) (see megatron.pipeline.instructions). A gradient message marked compressed
(Optimus-CC, `compress_rank`) keeps its mark on every piece: each piece is a low-rank P/Q of
its block. TeraPipe plans pass through unchanged in kind: a unit (one token slice of a
micro-batch) keeps its `token_slice`, and its messages gain `batch_slice` rows like any other;
rows and tokens are independent dimensions ([s, b, h] activations: tokens on 0, rows on 1).
The executor and validator do the rest; no new runtime.
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


def _local_shapes(shapes, rows: int, seq_parts: int):
    """[s, b, h] activation shapes of the whole micro-batch -> this rank's [s / seq_parts, rows, h]."""
    out = []
    for x in shapes:
        if x[0] % seq_parts:
            raise ValueError(f"--sequence-parallel: {x[0]} tokens do not split over a stage's TP size {seq_parts}")
        out.append((x[0] // seq_parts, rows) + tuple(x[2:]))
    return tuple(out)


def split_plans(plans: Sequence[I.ExecutionPlan], layouts: Layout,
                sequence_parallel: bool = False) -> List[I.ExecutionPlan]:
    """One plan per global rank from one plan per stage (see the module docstring).
    `sequence_parallel`: stages with TP > 1 also split the sequence (dimension 0) over their TP
    ranks; the base plans' activation shapes must then be the whole sequence."""
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
    # Sequence parts per stage: its TP size under sequence parallelism, else 1 (whole sequence).
    seq_parts = [tp if sequence_parallel else 1 for tp, _ in layouts]
    with_tokens = any(n > 1 for n in seq_parts)  # pieces then name their tokens too

    def rank_of(s, d, t):
        return offsets[s] + d * layouts[s][0] + t

    table: dict = {}

    def pieces(src: int, dst: int, b: int, S: int):
        """[(sender, receiver, batch_slice)] of one message from stage src to stage dst: each
        receiver gets each (row, token) of its block once, from the sender that holds it (of TP
        ranks holding the same block, TP index t % tp_src, as without sequence parallelism)."""
        key = (src, dst, b, S)
        if key not in table:
            (tp_s, dp_s), (tp_d, dp_d) = layouts[src], layouts[dst]
            out = []
            for j in range(dp_d):
                for t2 in range(tp_d):
                    toks = _part(S, seq_parts[dst], t2 if seq_parts[dst] > 1 else 0)
                    for i, first, n in _overlaps(b, _part(b, dp_d, j), dp_s):
                        if seq_parts[src] > 1:
                            senders = [(t, a, m) for t, a, m in _overlaps(S, toks, tp_s)]
                        else:
                            senders = [(t2 % tp_s, toks[0], toks[1])]
                        for t, a, m in senders:
                            sl = (first, n, a, m) if with_tokens else (first, n)
                            out.append((rank_of(src, i, t), rank_of(dst, j, t2), sl))
            table[key] = out
        return table[key]

    out = []
    for g in range(world):
        stage, dp_index, tp_index = stage_position(layouts, g)
        base = plans[stage]
        if tuple(base.assigned_stages) != (stage,):
            raise ValueError(f"plan {stage} runs stages {base.assigned_stages}; stages with their own TP/DP sizes "
                             "need one stage per pipeline rank (no virtual stages)")
        tp, dp = layouts[stage]
        instrs = []
        for ins in base.instructions:
            b = mb_rows[ins.microbatch]
            mine = _part(b, dp, dp_index)
            if isinstance(ins, I.LoadInput):
                shapes = tuple((mine[1],) + tuple(x[1:]) for x in ins.buffer_shapes)
                instrs.append(dataclasses.replace(ins, buffer_shapes=shapes))
                continue
            if not isinstance(ins, I.CommInstruction):
                changes = {"buffer_shapes": _local_shapes(ins.buffer_shapes, mine[1], seq_parts[stage])}
                if hasattr(ins, "output_shapes"):
                    changes["output_shapes"] = _local_shapes(ins.output_shapes, mine[1], seq_parts[stage])
                instrs.append(dataclasses.replace(ins, **changes))
                continue
            S = ins.buffer_shapes[0][0]
            src = ins.stage
            dst = ins.stage + 1 if isinstance(ins, _ACTS) else ins.stage - 1
            if isinstance(ins, _SENDS):  # this rank sends; ins.stage is its own stage
                peers = [(r, sl) for snd, r, sl in pieces(src, dst, b, S) if snd == g]
            else:  # this rank receives from stage ins.stage
                peers = [(snd, sl) for snd, r, sl in pieces(src, dst, b, S) if r == g]
            shapes = _local_shapes(ins.buffer_shapes, mine[1], seq_parts[stage])
            for peer, sl in sorted(peers):
                instrs.append(dataclasses.replace(ins, peer=peer, buffer_shapes=shapes, batch_slice=sl))
        split = (dp_index, dp) + ((tp_index, tp) if seq_parts[stage] > 1 else ())
        out.append(dataclasses.replace(base, rank=g, num_ranks=world, instructions=instrs, batch_split=split))
    return out


def layout_pass(layouts: Layout, sequence_parallel: bool = False):
    """`FixedBatchPlanner` plan pass for a heterogeneous stage layout."""
    return lambda plans: split_plans(plans, layouts, sequence_parallel)
