"""The zero-bubble planner takes W from the table's measured halves when every piece of the
pipeline has them, and derives it (with a note) when the table has none (the A100 tables)."""
import warnings
from pathlib import Path

import numpy as np

from megatron.planner.cost.cost_model import CostModel, Grid
from megatron.planner.schedule.simulator import PipelineCosts
from megatron.planner.schedule.zb_search import planned_split
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner

CM = Path(__file__).resolve().parents[3] / "cost_models"


def _with_halves(cm, share):
    """The table with B / W columns splitting each backward at `share` (test input, not data)."""
    for (tp, rc), prof in cm._profiles.items():
        for comp, g in prof.components.items():
            if comp in ("encoder", "postprocess"):
                bwd = g.values["backward_ms"]
                prof.components[comp] = Grid(g.axes, dict(g.values, input_grad_ms=bwd * (1 - share[comp]),
                                                          weight_grad_ms=bwd * share[comp]))
    return cm


def _zb_planner(cm, a=4):
    c = DynaPipeConfig(cost_model_path="(in memory)", model_kind=cm.kind, hidden_size=cm.model["hidden_size"],
                       num_layers=6, pipeline_parallel=3, layers_per_stage=2, memory_limit_mb=1e12,
                       activation_bytes=a, num_attention_heads=cm.model["num_attention_heads"],
                       schedules=("1f1b", "zb"))
    return DynaPipePlanner(c, cm)


def test_measured_halves_set_w_per_stage_and_survive_a_save():
    cm = _with_halves(CostModel.load(CM / "cpu_tiny_gpt.json"), {"encoder": 0.4, "postprocess": 0.25})
    cm = CostModel.from_dict(cm.to_dict())  # the columns round-trip through the file format
    p = _zb_planner(cm)
    mbs, seq = np.array([2.0, 4.0]), np.array([64.0, 128.0])
    sc = p.stage_costs("none", mbs, seq)
    assert "wgrad" in sc
    np.testing.assert_allclose(sc["wgrad"][0], sc["bwd"][0])  # no input pass on the first stage
    np.testing.assert_allclose(sc["wgrad"][1], 0.4 * sc["bwd"][1], rtol=1e-3)  # layers only (4-digit file)
    lay = cm.layer("encoder", 1, "none", mbs, seq)["backward_ms"]
    head = cm.postprocess(1, "none", mbs, seq)["backward_ms"]
    expect = (0.4 * 2 * lay + 0.25 * head) / (2 * lay + head)
    np.testing.assert_allclose(sc["wgrad"][2] / sc["bwd"][2], expect, rtol=1e-3)
    costs = PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], sc["comm"], wgrad=sc["wgrad"])
    assert planned_split(p, costs, seq) is costs  # measured: nothing derived
    assert "wgrad" not in p.stage_costs("full", mbs, seq)  # recompute walks the graph again: no split


def test_tables_without_halves_load_and_derive_w_with_a_note():
    for name, a in (("gpt_6.7b_a100.json", 2),):
        cm = CostModel.load(CM / name)
        p = _zb_planner(cm, a)
        seq = np.array([64.0])
        sc = p.stage_costs("none", np.array([1.0]), seq)
        assert "wgrad" not in sc
        costs = PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], sc["comm"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the note is once per table per process
            out = planned_split(p, costs, seq)
        assert out.wgrad is not None and np.all(out.wgrad <= 0.5 * sc["bwd"] + 1e-12)
        from megatron.planner.cost import wpass_time
        assert cm.name in wpass_time._noted  # the note was given


def test_the_shipped_cpu_table_carries_measured_halves():
    """cpu_tiny_gpt.json was given B/W columns on an idle machine: the planner uses them, and the
    layers' W share falls as attention (in B only) grows with the sequence."""
    cm = CostModel.load(CM / "cpu_tiny_gpt.json")
    p = _zb_planner(cm)
    assert "wgrad" in p.stage_costs("none", np.array([1.0]), np.array([64.0]))
    mbs, seq = np.array([4.0, 4.0]), np.array([32.0, 512.0])
    g = cm.layer("encoder", 1, "none", mbs, seq)
    share = g["weight_grad_ms"] / (g["input_grad_ms"] + g["weight_grad_ms"])
    assert 0.0 < share[1] < share[0] < 1.0


def test_split_columns_add_the_halves_to_a_table_without_them():
    from megatron.config.core import ModelConfig
    from megatron.profiling.profiler import ProfileSpec, run_profile
    from megatron.profiling.split_columns import add_split_columns
    model = ModelConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256, num_layers=2,
                        seq_length=32)
    cm = run_profile(ProfileSpec(model=model, tps=[1], micro_batch_sizes=[1], seq_lengths=[16, 32], layers=2,
                                 warmup=0, iters=1, recompute=["none"]))
    doc = cm.to_dict()  # a table as the A100 ones: no halves
    for prof in doc["profiles"]:
        for g in prof["components"].values():
            g.pop("input_grad_ms", None), g.pop("weight_grad_ms", None)
    bare = CostModel.from_dict(doc)
    assert "weight_grad_ms" not in bare.layer("encoder", 1, "none", 1, 16)
    got = add_split_columns(bare, iters=1, warmup=0, log=lambda s: None)
    for comp in ("encoder", "postprocess"):
        q = CostModel.from_dict(got.to_dict())._grid(1, "none", comp)(1, 32)
        assert float(q["input_grad_ms"]) > 0 and float(q["weight_grad_ms"]) > 0
