"""--sequence-parallel on stages with their own TP/DP sizes: a stage of TP > 1 splits the
sequence over its TP ranks, and the stage boundary re-splits blocks of rows x tokens when
TP or DP changes (megatron/planner/passes/layout.py). Exact: parity with the single-process run."""
import pytest

from megatron.pipeline import instructions as I
from megatron.pipeline.validator import validate_plans
from megatron.planner.passes.layout import split_plans
from megatron.planner.schedule.static import build_static_plans
from tests.aceso.test_hetero_grads import DP2_TP2, TP2_DP2, check, hetero_run
from tests.dist_harness import run_distributed
from tests.parity_utils import run_layout

pytestmark = pytest.mark.parity

ITERS = 2


def _plans(layout, b=4, s=16, h=8, m=3):
    shapes = [((b, s),)] * m
    base = build_static_plans("1f1b", m, len(layout), 1, shapes, lambda mb, stage: ((s, b, h),))
    return split_plans(base, layout, sequence_parallel=True)


@pytest.mark.parametrize("layout", [((4, 1), (2, 2)), ((2, 2), (1, 1), (4, 1)), ((1, 4), (2, 1))])
def test_blocks_of_rows_and_tokens_tile_every_receive(layout):
    plans = _plans(layout)
    validate_plans(plans)  # pieces disjoint and covering each receive buffer, both ends agree
    first = plans[0]
    tp0 = layout[0][0]
    fwd = [i for i in first.instructions if type(i).__name__ == "ForwardPass"][0]
    assert fwd.output_shapes == ((16 // tp0, 4 // layout[0][1], 8),)
    if tp0 > 1:
        assert first.batch_split == (0, layout[0][1], 0, tp0)
    sends = {i.peer: i.batch_slice for i in first.instructions if type(i).__name__ == "SendActivationStart"
             and i.microbatch == 0}
    assert all(len(sl) == 4 for sl in sends.values()), sends
    for p in plans:  # the wire format carries both 4-entry attributes
        assert I.ExecutionPlan.deserialize(p.serialize()) == p


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, dict(iters=ITERS))


@pytest.mark.parametrize("world,kw", [(4, TP2_DP2), (4, DP2_TP2),
                                      (6, dict(pp=2, stage_parallel=[[4, 1], [2, 1]], stage_layers=[2, 2]))],
                         ids=["tp2-dp2", "dp2-tp2", "tp4-tp2"])
def test_sequence_parallel_stages_match_single_process(reference, world, kw):
    outs = run_distributed(hetero_run, world, dict(kw, iters=ITERS), **{"model.sequence_parallel": True})
    check(reference, outs)


def test_terapipe_slices_on_sequence_parallel_stages_match_single_process(reference):
    """--terapipe with fixed 2 slices on TP2xDP1 | TP1xDP2 with --sequence-parallel: the slices
    are lowered whole (TeraPipe's seq_split = 1) and the layout pass cuts each stage's tokens at
    that stage's own TP, as for 1F1B; cutting by the configured TP as well would halve them twice
    on the TP2 stage and give the TP1 stage half a slice."""
    outs = run_distributed(hetero_run, 4, dict(TP2_DP2, iters=ITERS), **{
        "model.sequence_parallel": True, "terapipe.enabled": True, "terapipe.slices": "2"})
    check(reference, outs)


def test_terapipe_slice_lengths_must_split_over_every_stage_tp():
    """TP3 | TP2 stages with --sequence-parallel: each slice is cut at each stage's TP, so fixed
    lengths are multiples of lcm(3, 2) = 6 (9,15 splits over TP3 only)."""
    import dataclasses

    from megatron.config.core import ConfigError, TeraPipeConfig
    from tests.parity_utils import tiny_config
    cfg = tiny_config(world=5, pp=2, stage_parallel=[[3, 1], [2, 1]], stage_layers=[2, 2], seq=24, hidden=36, heads=6,
                      arch=dict(sequence_parallel=True))
    assert dataclasses.replace(cfg, terapipe=TeraPipeConfig(enabled=True, slices="18,6")).terapipe.enabled
    with pytest.raises(ConfigError, match=r"TP ranks \(2/3\).*multiples of 6"):
        dataclasses.replace(cfg, terapipe=TeraPipeConfig(enabled=True, slices="9,15"))
