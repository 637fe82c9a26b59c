import dataclasses
from pathlib import Path

import numpy as np
import pytest

from megatron.pipeline.validator import validate_plans
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner, PlanningError, plan_batch
from megatron.planner.dynapipe.partitioner import objective, optimal_partition, order_by_length
from megatron.planner.schedule.simulator import PipelineCosts, simulate
from megatron.planner.cost.stage_memory import encoder_end_memory, postprocess_memory, preprocess_memory

CM = Path(__file__).resolve().parents[3] / "cost_models"


def gpt_config(**kw):
    base = dict(cost_model_path=str(CM / "gpt_6.7b_a100.json"), hidden_size=4096, num_layers=32,
                pipeline_parallel=4, data_parallel=2, memory_limit_mb=36000)
    base.update(kw)
    return DynaPipeConfig(**base)


def t5_config(**kw):
    base = dict(cost_model_path=str(CM / "t5_11b_a100.json"), model_kind="t5", hidden_size=1024,
                encoder_layers=24, decoder_layers=24, pipeline_parallel=4, data_parallel=2)
    base.update(kw)
    return DynaPipeConfig(**base)


def lengths(rng, n, hi):
    return np.minimum(hi, rng.lognormal(np.log(200), 1.0, n).astype(int) + 4).tolist()


def check_plan(plan, n_samples, planner, t5=False):
    seen = sorted(i for g in plan.groups for mb in g.microbatches for i in mb)
    assert seen == list(range(n_samples))  # every sample exactly once
    assert len(plan.groups) == planner.cfg.data_parallel
    for g in plan.groups:
        assert len(g.plans) == planner.S
        validate_plans(g.plans)
        assert all(p.recompute == plan.recompute for p in g.plans)
        # Activation memory stays under what the device has left after model states.
        assert all(p <= a + 1e-6 for p, a in zip(g.peak_memory_mb, planner.available))
        for shapes, mb in zip(g.shapes, g.microbatches):
            assert shapes[0][0] == len(mb) and len(shapes) == (2 if t5 else 1)
    assert plan.makespan_ms == max(g.makespan_ms for g in plan.groups) + planner.calibration.step_overhead_ms
    assert 0 < plan.padding_efficiency <= 1


@pytest.mark.parametrize("seed,hi", [(0, 512), (1, 2048), (2, 8192)])
def test_gpt_plans_are_valid(seed, hi):
    rng = np.random.default_rng(seed)
    lens = lengths(rng, 60, hi)
    planner = DynaPipePlanner(gpt_config())
    plan = planner.plan(lens, iteration=3)
    check_plan(plan, len(lens), planner)
    for g in plan.groups:
        for mb, shapes in zip(g.microbatches, g.shapes):
            assert shapes[0][1] == -(-max(lens[i] for i in mb) // 8) * 8  # padded to the longest, x8
    assert all(p.iteration == 3 for g in plan.groups for p in g.plans)


def test_t5_plans_are_valid():
    rng = np.random.default_rng(5)
    pairs = list(zip(lengths(rng, 50, 1024), (np.array(lengths(rng, 50, 256)) // 4 + 1).tolist()))
    planner = DynaPipePlanner(t5_config())
    plan = planner.plan(pairs)
    check_plan(plan, len(pairs), planner, t5=True)
    ep = plan.groups[0].plans[-1]
    # Decoder stages receive two tensors (decoder hidden, encoder output).
    recv = [i for i in ep.instructions if type(i).__name__ == "RecvActivationStart"]
    assert recv and all(len(i.buffer_shapes) == 2 for i in recv)


def test_partition_is_brute_force_optimal_end_to_end():
    rng = np.random.default_rng(11)
    planner = DynaPipePlanner(gpt_config(emit_plans=False))
    for _ in range(5):
        lens = np.array(lengths(rng, 9, 1024))
        order = order_by_length(lens)
        padded = (lens[order] + 7) // 8 * 8
        T = planner.segment_times("none", "1f1b", padded, None)
        p = optimal_partition(T, planner.S, 2)
        best = np.inf
        for mask in range(1 << 8):
            cuts = [0] + [i + 1 for i in range(8) if mask >> i & 1] + [9]
            times = [T[a, b - a - 1] if b - a <= T.shape[1] else np.inf for a, b in zip(cuts, cuts[1:])]
            if all(np.isfinite(times)):
                best = min(best, objective(times, planner.S, 2))
        assert p.objective == pytest.approx(best)


def test_micro_batches_respect_the_1f1b_memory_limit():
    rng = np.random.default_rng(2)
    planner = DynaPipePlanner(gpt_config(emit_plans=False, schedules=("1f1b",)))
    lens = lengths(rng, 120, 2048)
    plan = planner.plan(lens)
    assert not plan.memory_fallback
    S = planner.S
    for g in plan.groups:
        for mb in g.microbatches:
            L = -(-max(lens[i] for i in mb) // 8) * 8
            sc = planner.stage_costs(plan.recompute, np.array([len(mb)], float), np.array([L], float))
            need = (S - np.arange(S) - 1) * sc["stored"][:, 0] + sc["peak"][:, 0]
            assert (need <= planner.available + 1e-6).all()


def test_tighter_memory_forces_recompute_or_fallback():
    rng = np.random.default_rng(4)
    lens = lengths(rng, 80, 4096)
    loose = plan_batch(lens, gpt_config(emit_plans=False))
    tight = plan_batch(lens, gpt_config(emit_plans=False, memory_limit_mb=27000))
    levels = ["none", "selective", "full"]
    assert levels.index(tight.recompute) >= levels.index(loose.recompute) or tight.memory_fallback
    assert tight.makespan_ms >= loose.makespan_ms - 1e-6


def test_planning_failure_names_iteration():
    with pytest.raises(PlanningError, match="iteration 7"):
        plan_batch([100, 20000], gpt_config(emit_plans=False), iteration=7)  # 20000 is past the grid
    with pytest.raises(ValueError, match="do not split evenly"):
        gpt_config(num_layers=30).stage_layers()
    with pytest.raises(PlanningError, match="model states"):
        DynaPipePlanner(gpt_config(memory_limit_mb=10000))


def test_simulated_makespan_matches_replay():
    rng = np.random.default_rng(9)
    planner = DynaPipePlanner(gpt_config(emit_plans=False))
    plan = planner.plan(lengths(rng, 70, 2048))
    for g in plan.groups:
        mbs = np.array([len(m) for m in g.microbatches], float)
        L = np.array([s[0][1] for s in g.shapes], float)
        sc = planner.stage_costs(plan.recompute, mbs, L)
        costs = PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], np.array(sc["comm"]))
        from megatron.pipeline.lowering import ComputeOp
        orders = [[ComputeOp(*o) for o in ops] for ops in g.compute_orders]
        assert simulate(costs, orders).makespan == pytest.approx(g.makespan_ms)


def test_t5_segment_cache_and_order_are_exact_and_deterministic():
    from megatron.planner.dynapipe.partitioner import order_clustered
    rng = np.random.default_rng(12)
    pairs = np.stack([np.array(lengths(rng, 40, 1024)), np.array(lengths(rng, 40, 256)) // 4 + 1], axis=1)
    warm = DynaPipePlanner(t5_config(emit_plans=False))
    o = order_clustered(pairs)
    enc, dec = warm._pad(pairs[o, 0]), warm._pad(pairs[o, 1], 2)
    a = warm.segment_times("full", "1f1b", enc, dec)
    b = warm.segment_times("full", "1f1b", enc, dec)  # served from the shape cache
    fresh = DynaPipePlanner(t5_config(emit_plans=False)).segment_times("full", "1f1b", enc, dec)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, fresh)
    # Entry = cost model at (size, running max enc, running max dec).
    i, m = 3, 5
    sc = warm.stage_costs("full", np.array([m], float), np.array([enc[i:i + m].max()], float),
                          np.array([dec[i:i + m].max()], float))
    assert a[i, m - 1] == pytest.approx(float((sc["fwd"] + sc["bwd"]).max()))
    # Same plan twice (warm caches) and from a fresh planner.
    p1, p2 = warm.plan(pairs.tolist()), warm.plan(pairs.tolist())
    p3 = DynaPipePlanner(t5_config(emit_plans=False)).plan(pairs.tolist())
    assert [g.microbatches for g in p1.groups] == [g.microbatches for g in p2.groups] == [g.microbatches for g in p3.groups]
    assert p1.makespan_ms == p3.makespan_ms


def test_t5_partition_is_brute_force_optimal_on_clustered_order():
    from megatron.planner.dynapipe.partitioner import order_clustered
    rng = np.random.default_rng(13)
    planner = DynaPipePlanner(t5_config(emit_plans=False, tensor_parallel=2, data_parallel=1))
    for _ in range(4):
        pairs = np.stack([np.array(lengths(rng, 9, 1024)), np.array(lengths(rng, 9, 256)) // 3 + 1], axis=1)
        o = order_clustered(pairs)
        T = planner.segment_times("full", "1f1b", planner._pad(pairs[o, 0]), planner._pad(pairs[o, 1], 2))
        p = optimal_partition(T, planner.S, 1)
        best = np.inf
        for mask in range(1 << 8):
            cuts = [0] + [i + 1 for i in range(8) if mask >> i & 1] + [9]
            times = [T[a, b - a - 1] if b - a <= T.shape[1] else np.inf for a, b in zip(cuts, cuts[1:])]
            if all(np.isfinite(times)):
                best = min(best, objective(times, planner.S, 1))
        assert p.objective == pytest.approx(best)


def test_t5_decoder_stages_hold_the_encoder_output():
    planner = DynaPipePlanner(t5_config())
    tp, S = planner.cfg.tensor_parallel, planner.S
    mbs, enc, dec = np.array([2.0]), np.array([512.0]), np.array([128.0])
    sc = planner.stage_costs("none", mbs, enc, dec)
    for s, comps in enumerate(planner.layout):
        layers = sum(n * planner.cm.layer(comp, tp, "none", mbs, enc, dec)["stored_mb"] for comp, n in comps)
        held = 2 * 512 * 1024 * 2 / 1e6 if s >= S // 2 else 0.0  # [enc, b, h] in 16-bit
        # the embeddings (encoder on stage 0, decoder on the first decoder stage), head + loss last
        if s == 0:
            held += preprocess_memory(planner.cm, tp, "none", mbs, enc, 2)[0][0]
        if s == S // 2 - 1:  # the encoder-final norm
            held += encoder_end_memory(planner.cm, mbs, enc, 2)[0][0]
        if s == S // 2:
            held += preprocess_memory(planner.cm, tp, "none", mbs, dec, 2)[0][0]
        if s == S - 1:
            held += postprocess_memory(planner.cm, tp, "none", mbs, dec, 2)[0][0]
        assert sc["stored"][s, 0] == pytest.approx(layers[0] + held, rel=1e-12)


def test_model_state_memory_follows_the_distributed_optimizer_flag():
    """The trainer's bytes per parameter: fp32 weight + fp32 gradient (8) + Adam moments (8), or
    with --use-distributed-optimizer 8 + (moments + fp32 shard copy) / DP = 8 + 12 / DP."""
    from megatron.config.core import DataConfig, MegatronConfig, ModelConfig, ParallelConfig, TrainingConfig
    from megatron.core.parallel_state import ParallelState
    from megatron.training.supervised import dynapipe_planner_config

    def available(dist_opt):
        cfg = MegatronConfig(
            model=ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                              vocab_size=50257),
            parallel=ParallelConfig(world_size=8, pipeline_model_parallel_size=4),
            training=TrainingConfig(micro_batch_size=1, global_batch_size=2, use_distributed_optimizer=dist_opt),
            data=DataConfig(mock_data=True, dynapipe_cost_model=str(CM / "gpt_6.7b_a100.json"),
                            dynapipe_memory_limit=36000))
        pc = dynapipe_planner_config(cfg, ParallelState(pp_size=4, dp_size=2))
        planner = DynaPipePlanner(pc)
        params16 = [36000 - a for a in DynaPipePlanner(dataclasses.replace(pc, weight_grad_bytes_per_param=2.0,
                                                                           optimizer_bytes_per_param=0.0)).available]
        return planner.available, params16

    plain, p16 = available(False)
    sharded, _ = available(True)
    for a, b, mb16 in zip(plain, sharded, p16):  # mb16: 16-bit parameter MB of the stage
        assert 36000 - a == pytest.approx(mb16 * 16 / 2)           # 16 bytes per parameter
        assert 36000 - b == pytest.approx(mb16 * (8 + 12 / 2) / 2)  # 14 bytes per parameter at DP 2



def test_cost_model_without_the_runs_tp_is_named():
    cfg = DynaPipeConfig(cost_model_path="cost_models/cpu_tiny_gpt.json", hidden_size=32, num_layers=4,
                         pipeline_parallel=2, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"no profile for tensor-parallel size 2 \(it has TP \[1\]\)"):
        DynaPipePlanner(cfg)
