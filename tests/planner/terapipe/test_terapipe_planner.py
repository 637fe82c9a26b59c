"""TeraPipe planner: the slicing DP equals brute force, the latency regression recovers known
coefficients, emitted plans pass the validator (and round-trip), bad slice plans are refused."""
import dataclasses
import itertools
import random

import numpy as np
import pytest

from megatron.pipeline import instructions as I
from megatron.pipeline.validator import PlanValidationError, validate_plans
from megatron.planner.terapipe.lowering import (brute_force_slices, build_terapipe_plans, parse_slices, pipeline_score,
                                       plan_batch, plan_slices, slice_memory_mb, uniform_slices)
from megatron.planner.terapipe.latency import SliceLatencyModel, fit_context, from_cost_model


def _t(rng):
    a, b, c, d = (rng.uniform(0.1, 2.0) for _ in range(4))
    e = rng.uniform(0, 0.01)
    return lambda l, ctx: a + b * l + c * l * l / 64 + d * e * l * ctx


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("seq_len,stages", [(48, 2), (64, 4), (72, 8), (61, 3)])
def test_dp_equals_brute_force(seed, seq_len, stages):
    t = _t(random.Random(seed * 100 + seq_len))
    dp = plan_slices(seq_len, stages, t)
    bf = brute_force_slices(seq_len, stages, t)
    assert dp.score == pytest.approx(bf.score, rel=1e-12)
    assert sum(dp.slices) == seq_len
    assert dp.score == pytest.approx(pipeline_score([t(l, c) for l, c in
                                                      zip(dp.slices, np.cumsum([0] + dp.slices[:-1]))], stages))


def test_dp_respects_memory_limit():
    # With GPipe order every slice's K/V copy is alive at the end of the forwards, so more
    # slices need more memory; the limit rules out the unconstrained optimum.
    t = _t(random.Random(7))
    mem = lambda s: slice_memory_mb(s, 1, 2, 64, 64, 4) <= 0.8  # noqa: E731
    free = plan_slices(64, 4, t)
    assert not mem(free.slices)
    dp = plan_slices(64, 4, t, mem_ok=mem)
    bf = brute_force_slices(64, 4, t, mem_ok=mem)
    assert mem(dp.slices)
    assert bf.score <= dp.score + 1e-12 and dp.score < pipeline_score([t(64, 0)], 4)
    assert dp.score >= free.score
    with pytest.raises(ValueError, match="memory limit"):
        plan_slices(64, 4, t, mem_ok=lambda s: False)


def test_dp_early_exit_and_prefers_shorter_late_slices():
    # attention-heavy cost: later slices (more context) should be shorter
    t = lambda l, c: 8 + l + 0.004 * l * (l + c)  # noqa: E731
    sp = plan_slices(256, 8, t)
    assert len(sp.slices) > 1 and sp.slices[-1] < sp.slices[0]
    caps = len({t(b - a, a) for a in range(0, 256, 8) for b in range(a + 8, 257, 8)})
    assert sp.t_max_tried < caps  # stopped early
    assert sp.score < pipeline_score([t(256, 0)], 8)


def test_batch_dimension_matches_brute_force():
    t = lambda b, l, c: 1.0 + b * l * 0.1 + b * l * c * 0.001  # noqa: E731
    for K in (2, 4):
        b, sp = plan_batch(4, 32, K, t)
        # brute force: every micro-batch size and every slicing, scored over the whole iteration
        best = min(pipeline_score(
            [t(bb, l, c) for _ in range(4 // bb) for l, c in zip(s.slices, np.cumsum([0] + s.slices[:-1]))], K)
            for bb in (1, 2, 4)
            for s in [brute_force_slices(32, 1 + (K - 1) / (4 // bb), lambda l, c, bb=bb: t(bb, l, c))])
        assert sp.score == pytest.approx(best)
        units = [t(b, l, c) for _ in range(4 // b) for l, c in zip(sp.slices, np.cumsum([0] + sp.slices[:-1]))]
        assert sp.score == pytest.approx(pipeline_score(units, K))


def test_uniform_and_parse():
    assert uniform_slices(64, 3) == [24, 24, 16]
    assert uniform_slices(10, 3) == [4, 3, 3]
    assert parse_slices("auto", 64) is None
    assert parse_slices("4", 64) == [16] * 4
    assert parse_slices("1,15,48", 64) == [1, 15, 48]
    with pytest.raises(ValueError, match="--terapipe-slices"):
        parse_slices("8,8", 64)
    with pytest.raises(ValueError, match="--terapipe-slices"):
        parse_slices("x", 64)


def test_regression_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    true = (0.03, 0.002, 4e-5)
    pts = [(b, l, c, true[0] * b * l + true[1] * b * c + true[2] * b * l * c + rng.normal(0, 1e-4))
           for b in (1, 2, 4) for l in (8, 32, 64, 128) for c in (16, 64, 256, 512)]
    got = fit_context(pts)
    np.testing.assert_allclose(got, true, rtol=2e-2)


def test_latency_model_roundtrip_and_a100_derivation(tmp_path):
    from megatron.planner.cost.cost_model import CostModel
    m = from_cost_model(CostModel.load("cost_models/gpt_6.7b_a100.json"))
    assert m.coef[2] > 0
    # context-free part is the table itself; a slice over context costs more
    assert m.layer_ms(1, 512, 0) == pytest.approx(5.78 + 9.65, rel=0.1) or m.layer_ms(1, 512, 0) > 0
    assert m.layer_ms(1, 256, 1792) > m.layer_ms(1, 256, 0)
    m.save(tmp_path / "m.json")
    m2 = SliceLatencyModel.load(tmp_path / "m.json")
    assert m2.stage_ms(2, 256, 512, 4) == pytest.approx(m.stage_ms(2, 256, 512, 4))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="--terapipe-cost-model"):
        SliceLatencyModel.load(tmp_path / "bad.json")


def _plans(pp=2, slicings=((4, 1, 11), (16,), (3, 13)), b=2):
    shapes = [((b, sum(s)),) for s in slicings]
    return build_terapipe_plans([list(s) for s in slicings], shapes, pp, 8, validate=False)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_emitted_plans_validate_and_round_trip(pp):
    rng = random.Random(pp)
    for _ in range(5):
        slicings = []
        for _ in range(rng.randint(1, 3)):
            s = rng.randint(2, 24)
            cuts = sorted(rng.sample(range(1, s), rng.randint(0, min(4, s - 1))))
            slicings.append([b - a for a, b in zip([0] + cuts, cuts + [s])])
        plans = build_terapipe_plans(slicings, [((1, sum(s)),) for s in slicings], pp, 8)  # validates
        for p in plans:
            data = p.serialize()
            assert int.from_bytes(data[4:6], "little") == 3
            q = I.ExecutionPlan.deserialize(data)
            assert q.instructions == p.instructions
            assert all(ins.token_slice for ins in q.instructions if hasattr(ins, "token_slice"))


def test_unsliced_plans_keep_format_version_2():
    from megatron.planner.schedule.static import build_static_plans
    plans = build_static_plans("1f1b", 3, 2, 1, [((2, 16),)] * 3, ((16, 2, 8),))
    assert all(int.from_bytes(p.serialize()[4:6], "little") == 2 for p in plans)


def _mutate(plans, rank, pred, **changes):
    plans = [dataclasses.replace(p, instructions=list(p.instructions)) for p in plans]
    p = plans[rank]
    for i, ins in enumerate(p.instructions):
        if pred(ins):
            p.instructions[i] = dataclasses.replace(ins, **changes)
    return plans


def test_validator_rejects_bad_slices():
    good = _plans()
    validate_plans(good)
    # a unit whose slice differs between its instructions
    bad = _mutate(good, 1, lambda i: type(i) is I.ForwardPass and i.microbatch == 1, token_slice=(0, 4, 2))
    with pytest.raises(PlanValidationError, match="token_slice"):
        validate_plans(bad)
    # slicing that leaves a gap (shape and slice agree, tiling does not)
    plans = build_terapipe_plans([[4, 1, 11]], [((2, 16),)], 2, 8, validate=False)
    bad = [dataclasses.replace(p, microbatch_shapes=(((2, 4),), ((2, 2),), ((2, 11),))) for p in plans]
    bad = _mutate(bad, 0, lambda i: getattr(i, "microbatch", -1) == 1 and hasattr(i, "token_slice"),
                  token_slice=(0, 4, 2))
    bad = _mutate(bad, 1, lambda i: getattr(i, "microbatch", -1) == 1 and hasattr(i, "token_slice"),
                  token_slice=(0, 4, 2))
    with pytest.raises(PlanValidationError, match="overlap|gap"):
        validate_plans(bad)
    # a slice missing its attribute
    bad = _mutate(good, 0, lambda i: type(i) is I.BackwardPass and i.microbatch == 0, token_slice=())
    with pytest.raises(PlanValidationError, match="no token_slice"):
        validate_plans(bad)


def test_validator_rejects_wrong_slice_order():
    plans = build_terapipe_plans([[4, 4, 8]], [((1, 16),)], 1, 8, validate=False)
    ins = plans[0].instructions
    fwd = [i for i, x in enumerate(ins) if type(x) is I.ForwardPass]
    bwd = [i for i, x in enumerate(ins) if type(x) is I.BackwardPass]
    swapped = list(ins)
    swapped[bwd[0]], swapped[bwd[1]] = ins[bwd[1]], ins[bwd[0]]  # backward of slice 1 before slice 2
    with pytest.raises(PlanValidationError, match="last forwarded slice|descending"):
        validate_plans([dataclasses.replace(plans[0], instructions=swapped)])
    swapped = list(ins)
    swapped[fwd[0]], swapped[fwd[1]] = ins[fwd[1]], ins[fwd[0]]
    with pytest.raises(PlanValidationError):
        validate_plans([dataclasses.replace(plans[0], instructions=swapped)])


def test_vectorised_and_thinned_caps_agree_with_exact():
    t = lambda l, c: 8 + l + 0.004 * l * (l + c)  # noqa: E731
    exact = plan_slices(512, 8, t)
    vec = plan_slices(512, 8, t, vectorized=True)
    assert vec.slices == exact.slices
    thin = plan_slices(512, 8, t, vectorized=True, cap_tolerance=0.01)
    assert thin.t_max_tried < exact.t_max_tried
    assert thin.score <= exact.score * 1.01


def test_cpp_slicing_dp_equals_numpy():
    """The C++ loop of the slicing DP gives the numpy version's f and arg exactly (ties too)."""
    import numpy as np
    from megatron.planner.terapipe import lowering as T
    from megatron.planner.dynapipe.native import cpp as _cpp
    if _cpp is None:
        pytest.skip("megatron.planner.dynapipe.partition_cpp is not built (pip install -e .)")
    rng = np.random.default_rng(5)
    for P in (1, 2, 9, 120):
        cost = np.round(rng.uniform(1, 10, (P, P)), 1)  # rounded: many ties
        cost[np.tril_indices(P)] = np.inf
        cost[rng.random((P, P)) < 0.2] = np.inf
        caps = np.sort(rng.uniform(0, 12, 11))
        f1, a1 = T._dp_for_caps(cost, caps)
        f2, a2 = T._dp_for_caps_numpy(cost, caps)
        assert np.array_equal(f1, f2) and np.array_equal(a1, a2)


def test_memory_model_follows_recompute():
    # full recompute keeps each layer's input and the K/V (cache, own k/v, earlier slices' leaf);
    # selective drops only the attention probabilities
    s, b, layers, h, kv, heads = [16, 16, 32], 2, 3, 64, 32, 4
    none, sel, full = (slice_memory_mb(s, b, layers, h, kv, heads, recompute=r) for r in ("none", "selective", "full"))
    ctx = np.cumsum(s)
    want_full = layers * b * sum(ln * h * 4 + 2 * kv * (c + ln) * 4 for ln, c in zip(s, ctx)) / 2 ** 20
    probs = layers * b * sum(heads * ln * c * 4 for ln, c in zip(s, ctx)) / 2 ** 20
    assert full == pytest.approx(want_full) and none - sel == pytest.approx(probs)
    assert full < sel < none
