"""Stages with their own TP / DP sizes: the plan pass (megatron/planner/passes/layout.py), the
validator's batch-split rules and the plan format's version 4."""
import dataclasses

import pytest

from megatron.pipeline import instructions as I
from megatron.pipeline.validator import PlanValidationError, validate_plans
from megatron.planner.passes.layout import split_plans
from megatron.planner.schedule.static import build_static_plans

LAYOUTS = [((2, 1), (1, 2)), ((1, 2), (2, 1)), ((1, 1), (2, 1)), ((1, 2), (1, 1), (2, 1)),
           ((1, 4), (2, 2)), ((2, 2), (1, 4), (4, 1))]


def world_plans(layouts, m=4, b=4, seq=16, hidden=32, schedule="1f1b"):
    plans = build_static_plans(schedule, m, len(layouts), 1, [((b, seq),)] * m,
                               lambda mb, st: ((seq, b, hidden),), recompute="none", dtype="float32", iteration=3)
    return split_plans(plans, layouts)


@pytest.mark.parametrize("layouts", LAYOUTS)
def test_split_plans_validate_and_round_trip(layouts):
    plans = world_plans(layouts)
    validate_plans(plans)
    assert [p.rank for p in plans] == list(range(sum(t * d for t, d in layouts)))
    for p in plans:
        data = p.serialize()
        assert data[4] == 4  # format version 4: batch splits
        assert I.ExecutionPlan.deserialize(data) == p


def test_receivers_assemble_their_rows_from_every_overlapping_sender():
    # stage 0: TP2 x DP1 (ranks 0, 1), stage 1: TP1 x DP2 (ranks 2, 3); micro-batch of 4 rows
    plans = world_plans(((2, 1), (1, 2)))
    recv = [i for i in plans[2].instructions if isinstance(i, I.RecvActivationStart) and i.microbatch == 0]
    assert [(i.peer, i.batch_slice, i.buffer_shapes) for i in recv] == [(0, (0, 2), ((16, 2, 32),))]
    sends = [i for i in plans[0].instructions if isinstance(i, I.SendActivationStart) and i.microbatch == 0]
    assert [(i.peer, i.batch_slice) for i in sends] == [(2, (0, 2)), (3, (2, 2))]
    # TP rank 1 of stage 0 sends nothing (stage 1 has one TP rank), but receives the gradient
    assert not [i for i in plans[1].instructions if isinstance(i, I.SendActivationStart)]
    grads = [i for i in plans[1].instructions if isinstance(i, I.RecvGradStart) and i.microbatch == 0]
    assert [(i.peer, i.batch_slice) for i in grads] == [(2, (0, 2)), (3, (2, 2))]
    loads = [i for i in plans[3].instructions if isinstance(i, I.LoadInput)]
    assert loads[0].buffer_shapes == ((2, 16),) and plans[3].batch_split == (1, 2)


def _drop(plans, rank, pred):
    p = plans[rank]
    plans[rank] = dataclasses.replace(p, instructions=[i for i in p.instructions if not pred(i)])


def _edit(plans, rank, pred, **changes):
    p = plans[rank]
    plans[rank] = dataclasses.replace(p, instructions=[dataclasses.replace(i, **changes) if pred(i) else i
                                                       for i in p.instructions])


def first_recv_piece(i):
    return isinstance(i, (I.RecvActivationStart, I.RecvActivationFinish)) and i.microbatch == 0 and i.peer == 1


def test_validator_rejects_bad_batch_splits():
    base = world_plans(((1, 2), (1, 1)))  # stage 1 (rank 2) assembles rows 0-1 from rank 0, 2-3 from rank 1
    validate_plans(base)

    plans = list(base)  # a missing piece on both ends: the buffer is read before all rows arrived
    _drop(plans, 2, first_recv_piece)
    _drop(plans, 1, lambda i: isinstance(i, (I.SendActivationStart, I.SendActivationFinish)) and i.microbatch == 0)
    with pytest.raises(PlanValidationError, match="read before its receive is finished"):
        validate_plans(plans)

    plans = list(base)  # overlapping pieces
    _edit(plans, 2, first_recv_piece, batch_slice=(1, 2))
    with pytest.raises(PlanValidationError, match="overlap|does not match"):
        validate_plans(plans)

    plans = list(base)  # sender and receiver disagree on the rows
    _edit(plans, 1, lambda i: isinstance(i, (I.SendActivationStart, I.SendActivationFinish)) and i.microbatch == 0,
          batch_slice=(3, 1))
    with pytest.raises(PlanValidationError, match="does not match"):
        validate_plans(plans)

    plans = list(base)  # rows outside the sender's part of the micro-batch (both ends agree)
    _edit(plans, 0, lambda i: isinstance(i, (I.SendActivationStart, I.SendActivationFinish)) and i.microbatch == 0,
          batch_slice=(2, 2))
    _edit(plans, 2, lambda i: isinstance(i, (I.RecvActivationStart, I.RecvActivationFinish)) and i.microbatch == 0
          and i.peer == 0, batch_slice=(2, 2))
    with pytest.raises(PlanValidationError, match="not inside this rank's rows"):
        validate_plans(plans)

    plans = list(base)  # a stage whose parts do not cover the micro-batch
    plans[1] = dataclasses.replace(plans[1], batch_split=(0, 2))
    with pytest.raises(PlanValidationError, match="cover every part"):
        validate_plans(plans)

    plans = list(base)  # one plan without a split
    plans[2] = dataclasses.replace(plans[2], batch_split=())
    with pytest.raises(PlanValidationError, match="all plans or none"):
        validate_plans(plans)

    plans = list(base)  # compressed pieces on one end only (both ends compressed is valid)
    grads = lambda i: isinstance(i, (I.SendGradStart, I.SendGradFinish, I.RecvGradStart,  # noqa: E731
                                     I.RecvGradFinish))
    _edit(plans, 0, grads, compress_rank=2)
    with pytest.raises(PlanValidationError, match="does not match"):
        validate_plans(plans)
    for r in (1, 2):
        _edit(plans, r, grads, compress_rank=2)
    validate_plans(plans)


def test_micro_batch_must_divide_over_every_stage_dp():
    plans = build_static_plans("1f1b", 2, 2, 1, [((3, 8),)] * 2, lambda mb, st: ((8, 3, 4),),
                               recompute="none", dtype="float32", iteration=1)
    with pytest.raises(ValueError, match="3 rows.*data-parallel size 2"):
        split_plans(plans, ((1, 2), (1, 1)))


def test_older_formats_cannot_carry_batch_splits():
    plan = world_plans(((1, 2), (1, 1)))[0]
    with pytest.raises(ValueError, match="cannot carry batch splits"):
        I._encode_plan(plan, version=3)
