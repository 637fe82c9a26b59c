"""The first and last stage's extra memory: embedding, head and loss (issue 30.2)."""
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.cost.cost_model import CostModel
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
from megatron.planner.cost.stage_memory import compose, post_formula, pre_formula

CM = Path(__file__).resolve().parents[3] / "cost_models"


@pytest.mark.parametrize("component,formula", [("preprocess", pre_formula), ("postprocess", post_formula)])
def test_formulas_match_the_profiled_columns(component, formula):
    """The analytic terms the A100 tables get reproduce what the profiler measured on CPU (fp32)."""
    cm = CostModel.load(CM / "cpu_tiny_gpt.json")
    g = cm.profile(1, "none").components[component]
    mbs, seq = np.meshgrid(*g.axes, indexing="ij")
    h, v = cm.model["hidden_size"], 4096
    stored, peak = formula(mbs, seq, h, v, 4.0)
    np.testing.assert_allclose(stored / 1e6, g.values["stored_mb"], rtol=0.05)
    np.testing.assert_allclose(peak / 1e6, g.values["peak_mb"], rtol=0.05)


def test_compose_stacks_stored_before_each_peak():
    st, pk = compose([(1.0, 5.0), (10.0, 12.0), (3.0, 4.0)])
    assert st == 14.0 and pk == max(5.0, 1 + 12.0, 11 + 4.0)


def test_a100_last_stage_charges_the_fp32_softmax():
    """GPT-6.7B: the loss keeps 4 x s x b x V/tp bytes (about 412 MB per 2048 tokens at TP 1)."""
    cfg = DynaPipeConfig(cost_model_path=str(CM / "gpt_6.7b_a100.json"), hidden_size=4096, num_layers=32,
                         pipeline_parallel=4, tensor_parallel=1)
    p = DynaPipePlanner(cfg)
    sc = p.stage_costs("full", np.array([1.0]), np.array([2048.0]))
    layer = p.cm.layer("encoder", 1, "full", 1.0, 2048.0)["stored_mb"] * 8
    extra_last = sc["stored"][3, 0] - float(layer)
    assert extra_last == pytest.approx((4 * 50304 + 2 * 4096 * 2 + 17) * 2048 / 1e6, rel=1e-9)
    assert 412 < extra_last < 450
    assert sc["stored"][1, 0] == pytest.approx(float(layer), rel=1e-12)  # middle stages: layers only
    # the head runs with the layers' activations stored: its fp32 logits, shifted logits and
    # exponentials (12 bytes per vocabulary entry) plus the 16-bit logits on top of them
    head_peak = (2 * 4096 * 2 + 17 + 50304 * 14) * 2048 / 1e6
    assert sc["peak"][3, 0] == pytest.approx(float(layer) + head_peak, rel=1e-9)
    assert sc["peak"][3, 0] > sc["peak"][1, 0]


def test_simulated_peak_of_the_last_stage_holds_the_loss():
    """The simulator and the 1F1B schedule see the head's memory through the stage costs."""
    from megatron.planner.schedule.schedules import one_f_one_b
    from megatron.planner.schedule.simulator import PipelineCosts, simulate
    cfg = DynaPipeConfig(cost_model_path=str(CM / "gpt_6.7b_a100.json"), hidden_size=4096, num_layers=32,
                         pipeline_parallel=4, tensor_parallel=1)
    p = DynaPipePlanner(cfg)
    sc = p.stage_costs("full", np.full(4, 1.0), np.full(4, 2048.0))
    costs = PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], np.array(sc["comm"]))
    res = simulate(costs, one_f_one_b(4, list(range(4))))
    # the last stage runs one micro-batch at a time under 1F1B: its peak is one stage peak,
    # which now includes the fp32 logits and softmax of 2048 x 50304 entries
    assert res.peak_memory[3] == pytest.approx(float(sc["peak"][3, 0]), rel=1e-9)
    assert res.peak_memory[3] > 2048 * 50304 * 12 / 1e6
