"""DynaPipe on stages with their own TP/DP sizes (an Aceso layout): each stage is costed at its
own TP on its share of the micro-batch's rows, and the plans come out one per global rank."""
import numpy as np
import pytest

from megatron.pipeline.validator import validate_plans
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
from tests.planner.dynapipe.test_dynapipe import CM, lengths
from tests.planner.dynapipe.test_dynapipe import gpt_config as _gpt


def gpt_config(**kw):
    return _gpt(**{"num_layers": 10, "memory_limit_mb": 80000, **kw})


def test_stage_costs_follow_each_stage_tp_and_rows():
    """A micro-batch runs as rows padded to a multiple of every stage's DP (3 samples: 4 rows).
    Stage 0 (TP2, DP1, 4 layers) costs what a uniform TP2 pipeline's first stage of 4 layers
    costs on all of them; stage 1 (TP1, DP2, 6 layers + head) what a TP1 last stage costs on
    half of them."""
    hetero = DynaPipePlanner(gpt_config(pipeline_parallel=2, data_parallel=1, tensor_parallel=2,
                                        stage_parallel=((2, 1), (1, 2)), stage_layer_counts=(4, 6)))
    first = DynaPipePlanner(gpt_config(pipeline_parallel=2, data_parallel=1, tensor_parallel=2, layers_per_stage=4))
    last = DynaPipePlanner(gpt_config(pipeline_parallel=2, data_parallel=1, tensor_parallel=1, layers_per_stage=6))
    got = hetero.stage_costs("none", np.array([3.0, 4.0]), np.array([1024.0, 2048.0]))
    a = first.stage_costs("none", np.array([4.0, 4.0]), np.array([1024.0, 2048.0]))
    b = last.stage_costs("none", np.array([2.0, 2.0]), np.array([1024.0, 2048.0]))
    for k in ("fwd", "bwd", "stored", "peak"):
        np.testing.assert_allclose(got[k][0], a[k][0], rtol=1e-12)
        np.testing.assert_allclose(got[k][1], b[k][1], rtol=1e-12)
    assert not np.allclose(got["fwd"][0], b["fwd"][0])  # the stages really differ


def test_plans_are_one_per_global_rank_with_row_slices():
    cfg = gpt_config(pipeline_parallel=2, data_parallel=1, tensor_parallel=2,
                     stage_parallel=((2, 1), (1, 2)), stage_layer_counts=(4, 6))
    plan = DynaPipePlanner(cfg).plan(lengths(np.random.RandomState(3), 24, 2048))
    (group,) = plan.groups
    assert [p.batch_split for p in group.plans] == [(0, 1), (0, 1), (0, 2), (1, 2)]
    assert all(s[0][0] % 2 == 0 for s in group.shapes)  # every micro-batch splits over DP 2
    assert sum(len(m) for m in group.microbatches) == 24
    validate_plans(group.plans)


def test_stage_parallel_needs_one_pipeline():
    with pytest.raises(ValueError, match="one pipeline"):
        DynaPipeConfig(cost_model_path=str(CM / "gpt_6.7b_a100.json"), pipeline_parallel=2, data_parallel=2,
                       stage_parallel=((2, 1), (1, 2)))


def test_t5_explicit_stages_end_the_encoder_and_start_the_decoder_anywhere():
    """T5 layer counts over encoder-then-decoder layers: the half/half default is the special case."""
    from tests.planner.dynapipe.test_dynapipe import t5_config
    half = DynaPipePlanner(t5_config(pipeline_parallel=4))
    same = DynaPipePlanner(t5_config(pipeline_parallel=4, stage_layer_counts=(12, 12, 12, 12)))
    assert (same.split, same.enc_end) == (half.split, half.enc_end) == (2, 1)
    for k in ("fwd", "bwd", "stored", "peak", "comm"):
        np.testing.assert_array_equal(same.stage_costs("none", 2.0, 512.0, 128.0)[k],
                                      half.stage_costs("none", 2.0, 512.0, 128.0)[k])
    mixed = DynaPipePlanner(t5_config(pipeline_parallel=3, tensor_parallel=8, memory_limit_mb=80000,
                                      stage_layer_counts=(16, 16, 16)))
    assert mixed.layout == [[("encoder", 16)], [("encoder", 8), ("decoder", 8)], [("decoder", 16)]]
    assert (mixed.split, mixed.enc_end) == (1, 1)
