"""Zero-bubble schedules on multi-task data: fixed-size micro-batches padded to their own
lengths and packed rows give micro-batches of different shapes and counts every iteration;
zb-h1 trains bit for bit like 1F1B on them (GPT and T5), zb-v within the parity bounds."""
import dataclasses

import pytest

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity
from tests.training.test_dynapipe_training import multitask  # noqa: F401 (the data fixture)
from tests.training.test_zero_bubble_parity import _exact

pytestmark = pytest.mark.parity


def _train(rank, world, kind, data, mode, mbs, tokens, schedule):
    import megatron.planner.schedule.fixed as training  # where FixedBatchPlanner builds its plans
    import tests.training.test_dynapipe_training as td
    orig_cfg, orig_build, built = td._cfg, training.build_static_plans, []

    def cfg(*a, **k):
        c = orig_cfg(*a, **dict(k, iters=3))
        c.data.dynapipe_cost_model = None
        c.training.micro_batch_size = c.training.global_batch_size = mbs
        c.data.tokens_per_global_batch = tokens
        return dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, pipeline_schedule=schedule))

    def build(schedule, m, *a, **k):
        built.append((schedule, m))
        return orig_build(schedule, m, *a, **k)
    td._cfg, training.build_static_plans = cfg, build
    try:
        return dict(td._train(rank, world, kind, data, mode, pp=2), built=built)
    finally:
        td._cfg, training.build_static_plans = orig_cfg, orig_build


@pytest.mark.parametrize("mode,mbs,tokens", [("packing", 2, 480), ("fixed", 3, 600)])
def test_gpt_multitask_zero_bubble_pp2(multitask, mode, mbs, tokens):  # noqa: F811
    ref = run_distributed(_train, 2, "gpt", multitask, mode, mbs, tokens, "1f1b")
    for schedule in ("zb-h1", "zb-v"):
        outs = run_distributed(_train, 2, "gpt", multitask, mode, mbs, tokens, schedule)
        assert {b[0] for o in outs for b in o["built"]} == {schedule}
        assert len({b[1] for o in outs for b in o["built"]}) > 1 or mode == "packing"
        if schedule == "zb-h1":
            _exact(ref, outs)
        assert_parity(ref, outs)


def test_t5_multitask_zb_h1_pp2(multitask):  # noqa: F811
    ref = run_distributed(_train, 2, "t5", multitask, "fixed", 3, 600, "1f1b")
    outs = run_distributed(_train, 2, "t5", multitask, "fixed", 3, 600, "zb-h1")
    assert {b[0] for o in outs for b in o["built"]} == {"zb-h1"}
    for a, b in zip(ref, outs):
        assert repr(a["loss"]) == repr(b["loss"]) and repr(a["grad_norm"]) == repr(b["grad_norm"])
