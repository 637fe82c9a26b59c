"""MoE layers priced from a dense table (megatron/planner/cost/moe_cost.py) and the
expert-load-aware pairing (megatron/planner/dynapipe/expert_load.py)."""
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.cost.cost_model import CostModel
from megatron.planner.cost.moe_cost import MoECostModel, MoEPricing, busiest_rank_tokens, dispatch_ms, mlp_share
from megatron.planner.dynapipe import expert_load as el
from megatron.planner.dynapipe.config import DynaPipeConfig
from megatron.planner.dynapipe.planner import DynaPipePlanner

ROOT = Path(__file__).resolve().parents[3]
A100 = CostModel.load(ROOT / "cost_models" / "gpt_6.7b_a100.json")
CPU = ROOT / "cost_models" / "cpu_tiny_gpt.json"


def test_one_expert_of_the_dense_width_is_the_dense_layer_plus_its_router():
    # E = 1, k = 1, EP 1: the MLP share is replaced by itself on the same tokens; only the
    # router's h x 1 GEMM (1 / (2 ffn) of the MLP's FLOPs) is added
    m = MoECostModel(A100, MoEPricing(num_experts=1, topk=1))
    mbs, seq = np.array([1, 4, 16]), np.array([2048, 512, 128])
    d, x = A100.layer("encoder", 1, "full", mbs, seq), m.layer("encoder", 1, "full", mbs, seq)
    phi = mlp_share(4096, 16384, seq, False)
    for k in ("forward_ms", "backward_ms"):
        np.testing.assert_allclose(x[k], d[k] * (1 + phi / (2 * 16384)), rtol=1e-9)
    np.testing.assert_allclose(x["stored_mb"], d["stored_mb"])  # full recompute keeps only the input


def test_busiest_rank_decides_and_capacity_caps_it():
    t = np.array([4096.0])
    base = MoEPricing(num_experts=8, topk=2, ep=8)
    assert busiest_rank_tokens(base, t)[0] == 2 * 4096  # each rank receives T k on average
    times = [MoECostModel(A100, MoEPricing(num_experts=8, topk=2, ep=8, skew=s)).layer("encoder", 1, "none", 2, 2048)
             ["forward_ms"][()] for s in (1, 2, 4)]
    assert times[0] < times[1] < times[2]
    cap = MoEPricing(num_experts=8, topk=2, ep=8, skew=4, capacity_factor=1.0)
    assert busiest_rank_tokens(cap, t)[0] == 8 * np.ceil(4096 * 2 / 8)  # E x capacity
    pad = MoEPricing(num_experts=8, topk=2, ep=8, skew=1, capacity_factor=1.5, pad_to_capacity=True)
    assert busiest_rank_tokens(pad, t)[0] == 8 * np.ceil(4096 * 2 / 8 * 1.5)


def test_dispatch_volumes():
    h, t = 4096, np.array([1000.0])
    a2a = MoEPricing(num_experts=8, topk=2, ep=4, a2a_gbps=50, a2a_latency_ms=0.0, skew=3)
    # the busiest rank receives 3 x T k tokens, all but the 1/EP of them from other ranks
    assert dispatch_ms(a2a, h, t)[0] == pytest.approx(3 * 1000 * 2 * h * 2 * 3 / 4 / 50e6)
    ag = MoEPricing(num_experts=8, topk=2, ep=4, dispatcher="allgather", a2a_gbps=50, a2a_latency_ms=0.0)
    assert dispatch_ms(ag, h, t)[0] == pytest.approx(1000 * h * 2 * 3 / 50e6)  # the other 3 ranks' tokens
    assert dispatch_ms(MoEPricing(num_experts=8, ep=1), h, t)[0] == 0.0


def test_memory_and_parameters():
    m = MoECostModel(A100, MoEPricing(num_experts=8, topk=2, expert_ffn=16384, ep=2))
    d, x = A100.layer("encoder", 1, "none", 2, 1024), m.layer("encoder", 1, "none", 2, 1024)
    # two experts' activations per token instead of one MLP's, plus routing buffers
    assert x["stored_mb"] > d["stored_mb"] + 2 * 1024 * 16384 * 2 * 2 / 1e6
    assert x["peak_mb"] - d["peak_mb"] == pytest.approx(x["stored_mb"] - d["stored_mb"])
    # 4 local experts of the dense MLP's size replace it: +3 MLPs of 2 h ffn 16-bit parameters
    assert m.param_mb("encoder", 1) - A100.param_mb("encoder", 1) == pytest.approx(
        (3 * 2 * 4096 * 16384 + 4096 * 8) * 2 / 1e6)
    half = MoECostModel(A100, MoEPricing(num_experts=8, topk=2, expert_ffn=16384, ep=2, layer_fraction=0.5))
    y = half.layer("encoder", 1, "none", 2, 1024)
    assert y["forward_ms"] == pytest.approx((d["forward_ms"] + x["forward_ms"]) / 2)


def test_dynapipe_plans_a_moe_model():
    def cfg(moe):
        return DynaPipeConfig(cost_model_path=str(CPU), model_kind="gpt", hidden_size=64, num_layers=4,
                              pipeline_parallel=2, data_parallel=2, memory_limit_mb=1e5, moe=moe)
    lengths = [int(x) for x in np.random.default_rng(0).integers(16, 200, 40)]
    dense = DynaPipePlanner(cfg(None)).plan(lengths)
    moe = DynaPipePlanner(cfg(MoEPricing(num_experts=8, topk=2, expert_ffn=512, ep=1, activation_bytes=4)))
    plan = moe.plan(lengths)  # lowered and validated (deadlocks, shapes)
    assert plan.makespan_ms > dense.makespan_ms  # twice the MLP FLOPs per token
    assert sorted(i for g in plan.groups for mb in g.microbatches for i in mb) == list(range(40))
    assert all(len(g.plans) == 2 for g in plan.groups)


def test_pairing_balances_the_busiest_rank():
    # 4 samples per task; task 0 routes to rank 0's experts, task 1 to rank 1's
    lengths = np.array([100] * 8)
    rt = el.class_routing(lengths, [0] * 4 + [1] * 4, np.array([[3, 3, 0, 0], [0, 0, 5, 5]]), topk=2)
    groups = [[[0], [1], [4], [5]], [[2], [3], [6], [7]]]  # the same task meets itself at every step
    blind = el.step_loads(groups, rt, 2)
    assert (blind.max(1) == 400).all()  # one rank gets both micro-batches' 2 x 100 x 2 pairs
    aware = el.pair_by_load(groups, rt, 2)
    assert (el.step_loads(aware, rt, 2).max(1) == 200).all()
    assert sorted(map(tuple, aware[1])) == sorted(map(tuple, groups[1])) and aware[0] == groups[0]
    cm = MoECostModel(CostModel.load(CPU), MoEPricing(num_experts=4, topk=2, ep=2, activation_bytes=4))
    assert el.predict_ms(cm, aware, rt, 2) < el.predict_ms(cm, groups, rt, 2)
    # blind pricing cannot tell the two pairings apart
    assert el.predict_ms(cm, aware, rt, 2, load_aware=False) == pytest.approx(
        el.predict_ms(cm, groups, rt, 2, load_aware=False))


def test_padding_is_routed_too():
    # a 100-token task-0 sample and a 20-token task-1 sample in one micro-batch: padded to 100
    like = el.class_routing([100, 20], [0, 1], np.array([[1, 0], [0, 1]]), topk=1)
    np.testing.assert_allclose(el.rank_tokens(like, [0, 1], 2), [100, 100])  # padding repeats the sample
    pad = el.class_routing([100, 20], [0, 1], np.array([[1, 0], [0, 1]]), topk=1, pad_counts=[7, 0])
    np.testing.assert_allclose(el.rank_tokens(pad, [0, 1], 2), [180, 20])  # pad tokens all go to expert 0
    np.testing.assert_allclose(el.rank_tokens(pad, [1], 2), [0, 20])  # alone: no padding


def test_equal_counts_splits_the_largest_micro_batch():
    got = el.equal_counts([[[0, 1, 2, 3]], [[4], [5], [6]]])
    assert got[0] == [[0], [1], [2, 3]] and got[1] == [[4], [5], [6]]
    with pytest.raises(ValueError, match="same number"):
        el.step_loads([[[0]], [[1], [2]]], np.ones((3, 4)), 2)
    with pytest.raises(ValueError, match="single-sample"):
        el.equal_counts([[[0]], [[1], [2]]])


def test_moe_flags_reach_the_planner():
    from megatron.cli.arguments import parse_args
    from megatron.training.supervised import dynapipe_planner_config
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--data-path", "x",
            "--targets-data-path", "y", "--dynapipe", "--dynapipe-cost-model", "cost_models/cpu_tiny_gpt.json",
            "--dynapipe-cost-model-any", "--tokenizer-type", "NullTokenizer", "--vocab-size", "97",
            "--pipeline-model-parallel-size", "2", "--tokens-per-global-batch", "600"]

    class PS:
        pp_size, dp_size, tp_size, cp_size, stage_layouts = 2, 1, 1, 1, ()
    assert dynapipe_planner_config(parse_args(base, world_size=2), PS).moe is None
    moe = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-layer-freq", "2",
           "--moe-token-dispatcher-type", "alltoall", "--swiglu"]
    p = dynapipe_planner_config(parse_args(base + moe, world_size=2), PS).moe
    assert (p.num_experts, p.topk, p.expert_ffn, p.layer_fraction, p.dispatcher, p.gated, p.ep) == \
        (8, 2, 48, 0.5, "alltoall", True, 1)
