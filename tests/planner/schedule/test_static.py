import pytest

from megatron.pipeline.instructions import BackwardPass, ForwardPass
from megatron.pipeline.lowering import ComputeOp
from megatron.pipeline.validator import validate_plans
from megatron.planner.schedule.static import (
    SCHEDULES, analytic_bubble, build_static_plans, gpipe_orders, interleaved_orders,
    one_f_one_b_orders, stage_layer_split, static_orders,
)

ACT = ((4, 2, 8),)


def _configs():
    for schedule in SCHEDULES:
        for pp in (1, 2, 4):
            for m in (1, 3, 4, 8):
                # interleaved: micro-batch counts PP does not divide too (remainder in the last group)
                yield schedule, pp, m, 2 if schedule in ("interleaved", "zb-v", "dualpipev") else 1


@pytest.mark.parametrize("schedule,pp,m,v", list(_configs()))
def test_every_static_schedule_lowers_to_valid_plans(schedule, pp, m, v):
    plans = build_static_plans(schedule, m, pp, v, [((2, 4),)] * m, ACT)
    validate_plans(plans)
    if schedule in ("zb-v", "dualpipev"):  # rank r runs stages r and 2PP-1-r
        assert [p.assigned_stages for p in plans] == [tuple(sorted({r, 2 * pp - 1 - r})) for r in range(pp)]
    else:
        assert [p.assigned_stages for p in plans] == [tuple(range(r, pp * v, pp)) for r in range(pp)]


def _max_in_flight(plan):
    live = peak = 0
    for x in plan.instructions:
        live += (type(x) is ForwardPass) - (type(x) is BackwardPass)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 8), (4, 3), (4, 8)])
def test_1f1b_keeps_at_most_pp_minus_rank_forwards_in_flight(pp, m):
    plans = build_static_plans("1f1b", m, pp, 1, [((2, 4),)] * m, ACT)
    assert [_max_in_flight(p) for p in plans] == [min(pp - r, m) for r in range(pp)]
    gpipe = build_static_plans("gpipe", m, pp, 1, [((2, 4),)] * m, ACT)
    assert [_max_in_flight(p) for p in gpipe] == [m] * pp


def test_1f1b_order_matches_megatron():
    assert one_f_one_b_orders(4, 3)[0] == [
        ComputeOp("F", 0, 0), ComputeOp("F", 1, 0), ComputeOp("F", 2, 0), ComputeOp("B", 0, 0),
        ComputeOp("F", 3, 0), ComputeOp("B", 1, 0), ComputeOp("B", 2, 0), ComputeOp("B", 3, 0)]
    assert [str(op) for op in one_f_one_b_orders(2, 3)[2]] == [
        "F(mb=0, stage=2)", "B(mb=0, stage=2)", "F(mb=1, stage=2)", "B(mb=1, stage=2)"]


def test_gpipe_order():
    order = gpipe_orders(3, 2)[1]
    assert [(op.kind, op.microbatch, op.stage) for op in order] == [
        ("F", 0, 1), ("F", 1, 1), ("F", 2, 1), ("B", 2, 1), ("B", 1, 1), ("B", 0, 1)]
    fifo = gpipe_orders(3, 2, reverse_backward=False)[0]
    assert [op.microbatch for op in fifo if op.kind == "B"] == [0, 1, 2]


def _ops(text):
    out = []
    for item in text.split():
        kind, mb, stage = item[0], *item[1:].split(".")
        out.append(ComputeOp(kind, int(mb), int(stage)))
    return out


def test_interleaved_order_matches_megatron():
    # PP=2, v=2, m=4: rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 virtual forwards;
    # micro-batches go through chunk 0 then chunk 1 in groups of PP.
    orders = interleaved_orders(4, 2, 2)
    assert orders[0] == _ops("F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 "
                             "B2.2 B3.2 B2.0 B3.0")
    assert orders[1] == _ops("F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 "
                             "F3.3 B3.3 B2.1 B3.1")
    # m == PP: everything is warm-up (all forwards, then all backwards)
    assert [op.kind for op in interleaved_orders(2, 2, 2)[1]] == ["F"] * 4 + ["B"] * 4


@pytest.mark.parametrize("pp,v", [(2, 2), (2, 4), (3, 2), (4, 3)])
def test_interleaved_any_microbatch_count_lowers_to_deadlock_free_plans(pp, v):
    """Counts PP does not divide (packed rows, multi-task batches by tokens): the remainder joins
    the last group of PP; every rank runs each (micro-batch, chunk) once forward and once
    backward, and the validator finds no deadlock. Multiples of PP keep Megatron's order."""
    for m in range(1, 3 * pp + 2):
        plans = build_static_plans("interleaved", m, pp, v, [((2, 4),)] * m, ACT)
        orders = interleaved_orders(m, pp, v)
        for r, order in enumerate(orders):
            want = {(k, mb, c * pp + r) for k in "FB" for mb in range(m) for c in range(v)}
            assert len(order) == len(want) and {(o.kind, o.microbatch, o.stage) for o in order} == want
        assert len(plans) == pp
    # PP 2, v 2, m 3: one group of all three micro-batches, so every forward comes first
    assert [op.kind for op in interleaved_orders(3, 2, 2)[0]] == ["F"] * 6 + ["B"] * 6
    # PP 2, v 2, m 5: groups (0, 1), (2, 3, 4); rank 1 warms up with 2 * 0 + 1 * 3 forwards
    assert interleaved_orders(5, 2, 2)[1][:5] == _ops("F0.1 F1.1 F0.3 F1.3 B0.3")


def test_schedule_argument_errors():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        static_orders("zb-h9", 4, 2)
    with pytest.raises(ValueError, match="runs 2 model chunk"):
        static_orders("zb-v", 4, 2, 1)
    with pytest.raises(ValueError, match="interleaved"):
        static_orders("1f1b", 4, 2, 2)
    with pytest.raises(ValueError, match="micro-batch shapes"):
        build_static_plans("1f1b", 4, 2, 1, [((2, 4),)] * 3, ACT)


def test_stage_layer_split():
    assert stage_layer_split(24, 4) == [6] * 4
    assert stage_layer_split(8, 2, "3,5") == [3, 5]
    assert stage_layer_split(8, 2, [5, 3]) == [5, 3]
    with pytest.raises(ValueError, match="--num-layers 10 is not divisible.*--pipeline-stage-layers"):
        stage_layer_split(10, 4)
    with pytest.raises(ValueError, match="sums to 9 layers, but --num-layers is 8"):
        stage_layer_split(8, 2, "4,5")
    with pytest.raises(ValueError, match="has 3 entries but there are 2"):
        stage_layer_split(8, 2, "2,3,3")
    with pytest.raises(ValueError, match="comma-separated integers"):
        stage_layer_split(8, 2, "4;4")
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layer_split(8, 2, "0,8")


def _simulated_makespan(orders, stage_to_rank, t_f, t_b):
    """Event-driven replay of compute orders with zero-cost communication."""
    num_stages = len(stage_to_rank)
    chunks = num_stages // (max(stage_to_rank) + 1)
    done, clock, pos = {}, [0.0] * len(orders), [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                op = order[pos[r]]
                dep = (("F", op.microbatch, op.stage - 1) if op.stage > 0 else None) \
                    if op.kind == "F" else (("B", op.microbatch, op.stage + 1)
                                            if op.stage < num_stages - 1
                                            else ("F", op.microbatch, op.stage))
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done.get(dep, 0.0))
                clock[r] = start + (t_f if op.kind == "F" else t_b) / chunks
                done[(op.kind, op.microbatch, op.stage)] = clock[r]
                pos[r] += 1
                progress = True
    return max(clock)


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1),
                                             ("1f1b", 2, 3, 1), ("interleaved", 2, 4, 2),
                                             ("interleaved", 4, 8, 2), ("1f1b", 1, 5, 1)])
def test_analytic_bubble_matches_replay_of_the_schedule(schedule, pp, m, v):
    t_f, t_b = 1.0, 2.0
    orders, stage_to_rank = static_orders(schedule, m, pp, v)
    expected = analytic_bubble(schedule, pp, m, t_f, t_b, num_model_chunks=v)
    assert _simulated_makespan(orders, stage_to_rank, t_f, t_b) == pytest.approx(expected)


def test_analytic_bubble_formulas():
    assert analytic_bubble("1f1b", 4, 8, 1.0, 2.0) == 33.0
    assert analytic_bubble("gpipe", 1, 8, 1.0, 2.0) == 24.0
    assert analytic_bubble("interleaved", 4, 8, 1.0, 2.0, num_model_chunks=2) == 28.5
