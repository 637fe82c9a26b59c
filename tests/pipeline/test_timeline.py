"""Pipeline timelines (megatron/pipeline/timeline.py): the unit-cost replay of a static schedule
has the schedule's textbook length, and every message is one send -> receive arrow."""
import pytest

from megatron.pipeline import instructions as I
from megatron.pipeline.timeline import add_flows, unit_replay
from megatron.planner.schedule.static import build_static_plans

SHORT = {I.ForwardPass: "F", I.BackwardPass: "B", I.BackwardInput: "B", I.BackwardWeight: "W"}


def _events(plans):
    """The trace events the executor would write for `plans` (timestamps: instruction order)."""
    out = []
    for plan in plans:
        for k, ins in enumerate(plan.instructions):
            compute = type(ins) in SHORT
            out.append({"name": f"{SHORT.get(type(ins), type(ins).__name__)}{ins.microbatch}",
                        "cat": "compute" if compute else "comm", "ph": "X", "pid": plan.rank,
                        "tid": 0 if compute else 1, "ts": float(k), "dur": 0.0,
                        "args": {"stage": ins.stage, "microbatch": ins.microbatch, "type": type(ins).__name__,
                                 "peer": getattr(ins, "peer", -1)}})
    return out


def _makespan(events):
    return max(e["ts"] + e["dur"] for e in events) / 1e3


@pytest.mark.parametrize("schedule,m,p,units", [
    # 1F1B and GPipe: (m + p - 1) (F + B) with F 1, B 2 (B here is input + weight gradient)
    ("1f1b", 8, 4, (8 + 4 - 1) * 3), ("gpipe", 8, 4, (8 + 4 - 1) * 3), ("1f1b", 4, 2, (4 + 2 - 1) * 3),
])
def test_unit_replay_has_the_schedules_length(schedule, m, p, units):
    plans = build_static_plans(schedule, m, p, 1, [((1, 4),)] * m, ((4, 1, 8),))
    replay = unit_replay(_events(plans), p)
    assert _makespan(replay) == pytest.approx(units)
    # a stage's forward of a micro-batch starts only after the previous stage's
    fwd = {(e["pid"], e["args"]["microbatch"]): e["ts"] for e in replay if e["args"]["type"] == "ForwardPass"}
    assert all(fwd[(r, mb)] >= fwd[(r - 1, mb)] + 1e3 for r, mb in fwd if r > 0)


def test_zero_bubble_h1_is_shorter_than_1f1b():
    """ZB-H1 (Qi et al. 2023) splits B into input (1) and weight (1) gradients and defers W into
    the bubbles: shorter than 1F1B's 33 units. (Its paper's bubble, (p - 1)(F + B - W), would give
    27; this schedule's replay gives 30: it does not defer the last stages' W in the cool-down.)"""
    plans = build_static_plans("zb-h1", 8, 4, 1, [((1, 4),)] * 8, ((4, 1, 8),))
    assert _makespan(unit_replay(_events(plans), 4)) < (8 + 4 - 1) * 3


def test_every_message_is_one_flow():
    plans = build_static_plans("1f1b", 4, 3, 1, [((1, 4),)] * 4, ((4, 1, 8),))
    events = _events(plans)
    flows = [e for e in add_flows(events, 3) if e["ph"] in ("s", "f")]
    sends = [e for e in events if e["args"]["type"] in ("SendActivationStart", "SendGradStart")]
    assert len(flows) == 2 * len(sends) == 2 * (2 * 4 * 2)  # 2 links x 4 micro-batches x (activation, gradient)
    by_id = {}
    for f in flows:
        by_id.setdefault(f["id"], {})[f["ph"]] = f
    assert all(abs(pair["s"]["pid"] - pair["f"]["pid"]) == 1 for pair in by_id.values())
