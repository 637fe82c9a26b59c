import random

import pytest

from megatron.pipeline import instructions as I
from megatron.pipeline.instructions import ExecutionPlan
from megatron.pipeline.lowering import ComputeOp, lower_to_plans
from megatron.pipeline.validator import PlanValidationError, validate_plans
from megatron.planner.schedule.static import one_f_one_b_orders

F, B = "F", "B"


def _act(mb, stage):
    return ((4 + mb, 2, 8),)


def _peak_live_slots(plan):
    live, peak = set(), 0
    for x in plan.instructions:
        if type(x) is I.FreeBuffer:
            live -= set(x.buffer_ids)
        elif type(x) in (I.ForwardPass, I.BackwardPass):
            live |= set(x.output_buffer_ids)
        elif type(x) in (I.RecvActivationStart, I.RecvGradStart):
            live |= set(x.buffer_ids)
        peak = max(peak, len(live))
    return peak


def _random_orders(rng, num_mb, stage_to_rank):
    """A random global topological order of the F/B dependency graph, projected per rank:
    always deadlock-free, otherwise arbitrary (including out-of-order micro-batches)."""
    last = len(stage_to_rank) - 1
    done, ready = set(), {(F, mb, 0) for mb in range(num_mb)}
    orders = [[] for _ in range(max(stage_to_rank) + 1)]
    while ready:
        op = rng.choice(sorted(ready))
        ready.remove(op)
        done.add(op)
        kind, mb, s = op
        orders[stage_to_rank[s]].append(ComputeOp(kind, mb, s))
        nxt = ((F, mb, s + 1) if s < last else (B, mb, s)) if kind == F else \
            ((B, mb, s - 1) if s > 0 else None)
        if nxt:
            ready.add(nxt)
    return orders


def test_random_deadlock_free_orders_lower_to_valid_plans():
    rng = random.Random(1)
    for _ in range(40):
        num_ranks = rng.randint(1, 4)
        num_stages = rng.randint(num_ranks, 6)
        stage_to_rank = list(range(num_ranks)) + [rng.randrange(num_ranks)
                                                  for _ in range(num_stages - num_ranks)]
        rng.shuffle(stage_to_rank)
        num_mb = rng.randint(1, 5)
        orders = _random_orders(rng, num_mb, stage_to_rank)
        plans = lower_to_plans(orders, stage_to_rank, [((2, 4 + mb),) for mb in range(num_mb)],
                               _act)  # validates
        for plan in plans:
            assert plan.num_buffers == _peak_live_slots(plan)
            assert ExecutionPlan.deserialize(plan.serialize()) == plan


def test_consecutive_stages_on_one_rank_pass_slots_without_communication():
    stage_to_rank = [0, 0, 1, 1]
    orders = [[ComputeOp(F, 0, 0), ComputeOp(F, 0, 1), ComputeOp(B, 0, 1), ComputeOp(B, 0, 0)],
              [ComputeOp(F, 0, 2), ComputeOp(F, 0, 3), ComputeOp(B, 0, 3), ComputeOp(B, 0, 2)]]
    plans = lower_to_plans(orders, stage_to_rank, [((2, 4),)], _act)
    r0 = plans[0].instructions
    assert [type(x).__name__ for x in r0] == [
        "LoadInput", "ForwardPass", "ForwardPass", "FreeBuffer", "SendActivationStart",
        "SendActivationFinish", "FreeBuffer", "RecvGradStart", "RecvGradFinish",
        "BackwardPass", "FreeBuffer", "BackwardPass", "FreeBuffer"]
    f0, f1 = r0[1], r0[2]
    assert f0.buffer_ids == () and f1.buffer_ids == f0.output_buffer_ids
    b1, b0 = r0[9], r0[11]
    assert b0.buffer_ids == b1.output_buffer_ids and b0.output_buffer_ids == ()
    assert all(x.peer == 1 for x in r0 if isinstance(x, I.CommInstruction))
    assert plans[0].assigned_stages == (0, 1) and plans[1].assigned_stages == (2, 3)


def test_multi_tensor_stage_outputs_t5_like():
    # encoder stages 0-1 output one tensor; decoder stages 2-3 carry (encoder out, decoder hidden)
    def shapes(mb, s):
        return ((16, 2, 8),) if s < 1 else ((16, 2, 8), (6, 2, 8))

    orders, stage_to_rank = one_f_one_b_orders(3, 4), [0, 1, 2, 3]
    plans = lower_to_plans(orders, stage_to_rank, [((2, 16), (2, 6))] * 3, shapes)
    sends = [x for x in plans[1].instructions if type(x) is I.SendActivationStart]
    assert all(len(x.buffer_ids) == 2 and x.buffer_shapes == shapes(0, 1) for x in sends)
    grads = [x for x in plans[2].instructions if type(x) is I.SendGradStart]
    assert all(x.buffer_shapes == shapes(0, 1) for x in grads)
    loads = [x for x in plans[3].instructions if type(x) is I.LoadInput]
    assert [x.microbatch for x in loads] == [0, 1, 2]
    assert all(x.buffer_shapes == ((2, 16), (2, 6)) and x.stage == 3 for x in loads)
    for plan in plans:
        assert ExecutionPlan.deserialize(plan.serialize()) == plan


def test_receives_follow_sender_order_even_when_consumed_out_of_order():
    # rank 0 sends mb 0 then mb 1; rank 1 consumes mb 1 first: both receives are posted, in
    # the sender's order, before the first consumer.
    orders = [[ComputeOp(F, 0, 0), ComputeOp(F, 1, 0), ComputeOp(B, 1, 0), ComputeOp(B, 0, 0)],
              [ComputeOp(F, 1, 1), ComputeOp(B, 1, 1), ComputeOp(F, 0, 1), ComputeOp(B, 0, 1)]]
    plans = lower_to_plans(orders, [0, 1], [((2, 4),)] * 2, _act)
    r1 = plans[1].instructions
    kinds = [(type(x).__name__, x.microbatch) for x in r1[:4]]
    assert kinds == [("LoadInput", 1), ("RecvActivationStart", 0), ("RecvActivationStart", 1),
                     ("RecvActivationFinish", 1)]


def test_grad_sends_complete_early_and_slots_do_not_grow_with_micro_batches():
    peaks = {}
    for m in (8, 32):
        plans = lower_to_plans(one_f_one_b_orders(m, 4), [0, 1, 2, 3], [((2, 4),)] * m, _act)
        peaks[m] = [p.num_buffers for p in plans]
        last = plans[3].instructions
        finishes = [i for i, x in enumerate(last) if type(x) is I.SendGradFinish]
        assert finishes[0] < len(last) // 4  # not all deferred to the end of the iteration
    # 1F1B holds at most PP - r activations plus a couple of transient slots, whatever m is.
    assert peaks[8] == peaks[32] and max(peaks[32]) <= 5


def test_send_activation_finish_precedes_its_backward():
    plans = lower_to_plans(one_f_one_b_orders(5, 3), [0, 1, 2], [((2, 4),)] * 5, _act)
    for plan in plans[:-1]:
        ins = plan.instructions
        for mb in range(5):
            fin = next(i for i, x in enumerate(ins)
                       if type(x) is I.SendActivationFinish and x.microbatch == mb)
            bwd = next(i for i, x in enumerate(ins)
                       if type(x) is I.BackwardPass and x.microbatch == mb)
            assert fin < bwd


def test_bad_compute_orders_are_rejected_with_readable_errors():
    good = one_f_one_b_orders(2, 2)
    shapes = [((2, 4),)] * 2
    with pytest.raises(ValueError, match=r"stage 1 runs on rank 1"):
        lower_to_plans([good[0] + [ComputeOp(F, 0, 1)], good[1]], [0, 1], shapes, _act)
    with pytest.raises(ValueError, match=r"no rank runs B\(mb=1, stage=1\)"):
        lower_to_plans([good[0], good[1][:-1]], [0, 1], shapes, _act)
    with pytest.raises(ValueError, match="twice"):
        lower_to_plans([good[0] + good[0][:1], good[1]], [0, 1], shapes, _act)
    with pytest.raises(ValueError, match=r"F\(mb=0, stage=1\) is ordered before F\(mb=0, stage=0\)"):
        lower_to_plans([[ComputeOp(F, 0, 1), ComputeOp(F, 0, 0), ComputeOp(B, 0, 1),
                         ComputeOp(B, 0, 0)]], [0, 0], shapes[:1], _act)
    with pytest.raises(ValueError, match=r"X\(mb=0, stage=0\): kind must be 'F', 'B', 'I' or 'W'"):
        lower_to_plans([[ComputeOp("X", 0, 0)] + good[0], good[1]], [0, 1], shapes, _act)
    with pytest.raises(ValueError, match="is empty"):
        lower_to_plans(good, [0, 1], shapes, lambda mb, s: ())


def test_cyclic_order_is_a_validation_error_not_a_hang():
    orders = [[ComputeOp(F, 0, 0), ComputeOp(F, 1, 0), ComputeOp(B, 0, 0), ComputeOp(B, 1, 0)],
              [ComputeOp(F, 1, 1), ComputeOp(B, 1, 1), ComputeOp(F, 0, 1), ComputeOp(B, 0, 1)]]
    lower_to_plans(orders, [0, 1], [((2, 4),)] * 2, _act)  # fine: rank 0 sends both first
    orders[0] = [ComputeOp(F, 0, 0), ComputeOp(B, 0, 0), ComputeOp(F, 1, 0), ComputeOp(B, 1, 0)]
    with pytest.raises(PlanValidationError, match="deadlock"):
        lower_to_plans(orders, [0, 1], [((2, 4),)] * 2, _act)
    plans = lower_to_plans(orders, [0, 1], [((2, 4),)] * 2, _act, validate=False)
    with pytest.raises(PlanValidationError, match="deadlock"):
        validate_plans(plans)
