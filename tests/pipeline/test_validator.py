"""The validator must reject each kind of broken plan with a message that points at it."""
import dataclasses

import pytest

from megatron.pipeline import instructions as I
from megatron.pipeline.lowering import ComputeOp, lower_to_plans
from megatron.pipeline.validator import PlanValidationError, validate_plans
from megatron.planner.schedule.static import build_static_plans

ACT = ((4, 2, 8),)


def _plans(schedule="gpipe-fifo", m=2, pp=2):
    return build_static_plans(schedule, m, pp, 1, [((2, 4),)] * m, ACT)


def _index(plan, cls, mb, stage=None):
    return next(i for i, x in enumerate(plan.instructions)
                if type(x) is cls and x.microbatch == mb and (stage is None or x.stage == stage))


def _check(plans, *fragments):
    with pytest.raises(PlanValidationError) as err:
        validate_plans(plans)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


def test_lowered_plans_pass():
    validate_plans(_plans())


def test_swapped_send_order_names_rank_pair_and_both_instructions():
    plans = _plans()
    ins = plans[0].instructions  # Load0 F0 Send0 Load1 F1 Send1 ...
    send0 = ins.pop(_index(plans[0], I.SendActivationStart, 0))
    ins.insert(_index(plans[0], I.SendActivationStart, 1) + 1, send0)
    _check(plans, "rank 0 -> rank 1, message #0",
           "rank 0 instruction #4 SendActivationStart(mb=1", "RecvActivationStart(mb=0")


def test_wrong_shape_on_receiver_is_a_rank_pair_error():
    plans = _plans()
    wrong = (4, 2, 9)

    def fix(x):  # rank 1 consistently believes micro-batch 0 has a different shape
        if x.microbatch != 0 or isinstance(x, I.LoadInput):
            return x
        swap = lambda shapes: tuple(wrong if s == ACT[0] else s for s in shapes)  # noqa: E731
        out = {"buffer_shapes": swap(x.buffer_shapes)}
        if hasattr(x, "output_shapes"):
            out["output_shapes"] = swap(x.output_shapes)
        return dataclasses.replace(x, **out)

    plans[1].instructions = [fix(x) for x in plans[1].instructions]
    _check(plans, "rank 0 -> rank 1, message #0", "shapes=((4, 2, 8),)", "shapes=((4, 2, 9),)")


def test_missing_receive_is_reported_on_the_pair():
    plans = _plans()
    ins = plans[1].instructions
    del ins[_index(plans[1], I.RecvActivationStart, 1)]
    del ins[_index(plans[1], I.RecvActivationFinish, 1)]
    _check(plans, "rank 0 -> rank 1, message #1", "SendActivationStart(mb=1",
           "has no matching receive")


def test_missing_send_is_reported_on_the_pair():
    plans = _plans()
    del plans[1].instructions[_index(plans[1], I.SendGradStart, 1)]
    _check(plans, "rank 1 -> rank 0, message #1", "RecvGradStart(mb=1", "has no matching send")


def test_finish_without_start():
    plans = _plans()
    ins = plans[1].instructions
    i = _index(plans[1], I.RecvActivationStart, 0)
    ins[i], ins[i + 1] = ins[i + 1], ins[i]
    _check(plans, f"rank 1, instruction #{i} RecvActivationFinish(mb=0",
           "Finish without a matching Start")


def test_start_never_finished():
    plans = _plans()
    i = _index(plans[0], I.SendActivationFinish, 1)
    del plans[0].instructions[i:i + 2]  # the Finish and the FreeBuffer of its slot
    _check(plans, "rank 0, instruction #", "SendActivationStart(mb=1", "never finished")


def test_read_after_free():
    plans = _plans()
    ins = plans[1].instructions
    i = _index(plans[1], I.ForwardPass, 0)
    assert type(ins[i + 1]) is I.FreeBuffer
    ins[i], ins[i + 1] = ins[i + 1], ins[i]
    _check(plans, f"rank 1, instruction #{i + 1} ForwardPass(mb=0, stage=1",
           "read before it is written or after it was freed")


def test_free_during_in_flight_send_and_double_free():
    plans = _plans()
    ins = plans[0].instructions
    i = _index(plans[0], I.SendActivationFinish, 0)
    ins[i], ins[i + 1] = ins[i + 1], ins[i]
    _check(plans, "rank 0", "FreeBuffer(mb=0", "while a send from it is in flight")
    plans = _plans()
    ins = plans[0].instructions
    i = _index(plans[0], I.FreeBuffer, 0)
    ins.insert(i, ins[i])
    _check(plans, f"rank 0, instruction #{i + 1} FreeBuffer", "double free")


def test_overwriting_a_live_slot_and_leaking_a_slot():
    plans = _plans()
    ins = plans[0].instructions
    del ins[_index(plans[0], I.FreeBuffer, 0)]
    msg = _check(plans, "rank 0", "missing FreeBuffer")
    assert "slot" in msg


def test_backward_before_forward_and_input_not_received():
    plans = _plans(m=1)
    ins = plans[0].instructions
    b = ins.pop(_index(plans[0], I.BackwardPass, 0))
    ins.insert(1, b)
    _check(plans, "rank 0, instruction #1 BackwardPass(mb=0, stage=0", "before its forward")


def test_forward_reading_the_wrong_micro_batch():
    plans = _plans()
    p1 = plans[1]
    ins = p1.instructions
    # Post the receive of mb 1 early into slot 1 (valid), then let F(mb 0) read slot 1.
    recv = [ins.pop(_index(p1, cls, 1)) for cls in (I.RecvActivationStart,
                                                    I.RecvActivationFinish)]
    f0 = _index(p1, I.ForwardPass, 0)
    ins[f0:f0] = [dataclasses.replace(x, buffer_ids=(1,)) for x in recv]
    f1 = _index(p1, I.ForwardPass, 1)
    ins[f1] = dataclasses.replace(ins[f1], buffer_ids=(1,))
    ins[f1 + 1] = dataclasses.replace(ins[f1 + 1], buffer_ids=(1,))
    p1.num_buffers = 2
    validate_plans(plans)
    f0 = _index(p1, I.ForwardPass, 0)
    ins[f0] = dataclasses.replace(ins[f0], buffer_ids=(1,))
    _check(plans, f"rank 1, instruction #{f0} ForwardPass(mb=0, stage=1",
           "not received or produced", "holds the output of stage 0 of micro-batch 1")


def test_missing_forward_and_header_mismatches():
    plans = _plans()
    plans[1].instructions = [x for x in plans[1].instructions
                             if not (x.microbatch == 1 and not isinstance(x, I.CommInstruction)
                                     and type(x) is not I.FreeBuffer)]
    with pytest.raises(PlanValidationError):
        validate_plans(plans)
    plans = _plans()
    plans[1].iteration = 3
    _check(plans, "rank 0 and rank 1 disagree on iteration")
    plans = _plans()
    plans[1].dtype = "bfloat16"
    _check(plans, "disagree on dtype")
    plans = _plans()
    plans[1].assigned_stages = (0, 1)
    _check(plans, "stage 0 is assigned to two ranks: rank 0 and rank 1")
    plans = _plans()
    plans[1].assigned_stages = ()
    _check(plans, "stages [1] are assigned to no rank")
    _check(_plans()[:1], "one plan per rank")


def test_cyclic_wait_deadlock_lists_every_stuck_rank():
    # rank 0 wants B(0) (needs rank 1's B(0)), rank 1 first wants F(1) (needs rank 0's F(1)).
    orders = [[ComputeOp("F", 0, 0), ComputeOp("B", 0, 0), ComputeOp("F", 1, 0),
               ComputeOp("B", 1, 0)],
              [ComputeOp("F", 1, 1), ComputeOp("B", 1, 1), ComputeOp("F", 0, 1),
               ComputeOp("B", 0, 1)]]
    with pytest.raises(PlanValidationError) as err:
        lower_to_plans(orders, [0, 1], [((2, 4),)] * 2, lambda mb, s: ACT)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "rank 0 is stuck at instruction" in msg and "RecvGradFinish(mb=0, stage=1" in msg
    assert "rank 1 is stuck at instruction" in msg and "RecvActivationFinish(mb=1, stage=0" in msg


def _move_finish_after_start(plan, finish_cls, start_cls, mb):
    """Move a Send*Finish (and the FreeBuffer after it) to right after its Start."""
    ins = plan.instructions
    i = _index(plan, finish_cls, mb)
    assert type(ins[i + 1]) is I.FreeBuffer
    moved = ins[i:i + 2]
    del ins[i:i + 2]
    j = _index(plan, start_cls, mb) + 1
    ins[j:j] = moved


def test_eager_send_finish_alone_is_fine_but_two_of_them_form_a_cycle():
    plans = _plans("1f1b", m=2)
    # rank 1 waits for its grad send of mb 0 to be received before posting anything else.
    _move_finish_after_start(plans[1], I.SendGradFinish, I.SendGradStart, 0)
    validate_plans(plans)
    # rank 0 now also waits for its activation send of mb 1 before posting the receive of
    # that grad, while rank 1 posts the activation receive of mb 1 only after that grad.
    _move_finish_after_start(plans[0], I.SendActivationFinish, I.SendActivationStart, 1)
    _check(plans, "deadlock",
           "rank 0 is stuck at instruction", "SendActivationFinish(mb=1, stage=0",
           "waiting for rank 1 to post its receive",
           "rank 1 is stuck at instruction", "SendGradFinish(mb=0, stage=1",
           "waiting for rank 0 to post its receive")
