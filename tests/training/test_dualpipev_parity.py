"""--pipeline-schedule dualpipev trains like one process and like 1F1B: losses, gradients and
parameters within the repository's float64 parity bounds. It runs zb-v's V placement (rank r
holds stages r and 2 PP - 1 - r) with DualPipeV's order and memory cap; as on zb-v the tied
embedding's two uses share rank 0 (one weight, accumulated by two W passes), so its sums run in
another order than 1F1B's: parity bounds, not bit equality."""
import pytest

from megatron.planner.schedule.static import build_static_plans
from megatron.planner.schedule.zero_bubble import kept_limits
from megatron.pipeline.validator import validate_plans
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout

TIMEOUT = 300.0  # a loaded 2-core machine: PP4 runs 4 ranks on 2 cores


@pytest.mark.parity
@pytest.mark.parametrize("pp", [2, 4])
def test_dualpipev_matches_single_process_and_1f1b(pp):
    # 2 PP micro-batches of 2 samples: the least torch's ScheduleDualPipeV accepts
    kw = dict(layers=2 * pp, gbs=2 * (2 * pp))
    single = run_distributed(run_layout, 1, kw)
    got = run_distributed(run_layout, pp, dict(kw, pp=pp, schedule="dualpipev"), timeout_s=TIMEOUT)
    assert_parity(single, got)
    ref = run_distributed(run_layout, pp, dict(kw, pp=pp), timeout_s=TIMEOUT)
    assert_parity(ref, got)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 3)])
def test_dualpipev_plans_keep_its_cap_on_the_v(pp, m):
    plans = build_static_plans("dualpipev", m, pp, 2, [((2, 4),)] * m, ((4, 2, 8),))
    assert [p.assigned_stages for p in plans] == [(r, 2 * pp - 1 - r) for r in range(pp)]
    validate_plans(plans, max_kept=kept_limits("dualpipev", pp, m))
