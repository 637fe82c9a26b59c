"""DynaPipe's micro-batches cut into TeraPipe token slices (megatron/planner/dynapipe/slicing.py):
slice costs, plan shape (units tagged like build_terapipe_plans, forwards ascending and
backwards descending per stage), the memory model, and the A100 wins it claims."""
from pathlib import Path

import numpy as np
import pytest

from megatron.pipeline import instructions as I
from megatron.planner.dynapipe import slicing as ds
from megatron.planner.schedule.orders import one_f_one_b
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner, PlanningError
from megatron.planner.terapipe.lowering import build_terapipe_plans, lower_sliced, slice_units

ROOT = Path(__file__).resolve().parents[3]
A100 = str(ROOT / "cost_models/gpt_6.7b_a100.json")
TINY = str(ROOT / "cost_models/cpu_tiny_gpt.json")


def _a100(pp=4, dp=2, token_slices=0, emit=False):
    return DynaPipePlanner(DynaPipeConfig(cost_model_path=A100, model_kind="gpt", hidden_size=4096, num_layers=32,
                                          pipeline_parallel=pp, data_parallel=dp, memory_limit_mb=36000,
                                          token_slices=token_slices, emit_plans=emit))


def _tiny(token_slices):
    return DynaPipePlanner(DynaPipeConfig(cost_model_path=TINY, model_kind="gpt", hidden_size=32, num_layers=4,
                                          pipeline_parallel=2, memory_limit_mb=400.0, token_slices=token_slices))


def test_slice_costs_one_slice_is_the_table_and_context_costs_more():
    pl = _a100()
    whole = pl.stage_costs("selective", 1, 4096)
    one = ds.slice_costs(pl, "selective", 1, 4096, 0)
    assert np.allclose(one["fwd"], whole["fwd"]) and np.allclose(one["bwd"], whole["bwd"])
    # the slice's K/V (cache + concatenated context) are held until its backward
    kv = 8 * ds.kv_cache_mb(pl, 1, 4096, 0)
    assert np.allclose(one["stored"], whole["stored"] + kv)
    late, early = ds.slice_costs(pl, "none", 1, 1024, 3072), ds.slice_costs(pl, "none", 1, 1024, 0)
    assert (late["fwd"] > early["fwd"]).all() and (late["bwd"] > early["bwd"]).all()
    assert (late["stored"] > early["stored"]).all()
    # four slices do about the work of the whole sequence (the table's dense s^2 split exactly)
    sl = [1024] * 4
    four = ds.slice_costs(pl, "none", 1, np.array(sl), np.array(ds.offsets(sl)))
    assert four["fwd"].sum(axis=1) == pytest.approx(pl.stage_costs("none", 1, 4096)["fwd"].ravel(), rel=0.15)


def test_lower_sliced_is_build_terapipe_plans():
    from megatron.pipeline.lowering import ComputeOp
    slicings, shapes = [[16, 8], [24]], [((2, 24),), ((2, 24),)]
    units = slice_units(slicings)
    orders = [[ComputeOp("F", u, r) for u in range(3)] + [ComputeOp("B", u, r) for u in (2, 1, 0)] for r in range(2)]
    a = build_terapipe_plans(slicings, shapes, 2, 32)
    b = lower_sliced(orders, units, [2, 2, 2], 32)
    assert [p.serialize() for p in a] == [p.serialize() for p in b]


@pytest.mark.parametrize("fixed", [2, 3])
def test_fixed_slices_plan_tags_every_unit(fixed):
    lengths = [64, 60, 40, 33, 30, 24, 17, 12, 9, 64, 50]
    plan = _tiny(fixed).plan(lengths)  # validate_plans ran: ascending forwards, descending backwards
    g = plan.groups[0]
    assert g.token_slices is not None
    per_mb = {}
    for m, off, ln in g.token_slices:
        per_mb.setdefault(m, []).append((off, ln))
    assert sorted(per_mb) == list(range(len(g.microbatches)))
    for m, parts in per_mb.items():
        L = g.shapes[m][0][1]
        assert [o for o, _ in parts] == list(np.cumsum([0] + [ln for _, ln in parts[:-1]]))
        assert sum(ln for _, ln in parts) == L
        assert len(parts) == min(fixed, max(1, L // ds.MIN_SLICE_TOKENS))
        assert all(ln % 8 == 0 for _, ln in parts)
    for p in g.plans:
        for ins in p.instructions:
            if isinstance(ins, (I.LoadInput, I.ForwardPass, I.BackwardPass)):
                assert tuple(ins.token_slice) == tuple(g.token_slices[ins.microbatch])
        # F(m) -> F(m, 1..k) and B(m) -> B(m, k..1) back to back on the stage
        ops = [(type(i).__name__[0], g.token_slices[i.microbatch]) for i in p.instructions
               if isinstance(i, (I.ForwardPass, I.BackwardPass))]
        for m, parts in per_mb.items():
            fw = [i for i, (k, u) in enumerate(ops) if k == "F" and u[0] == m]
            bw = [i for i, (k, u) in enumerate(ops) if k == "B" and u[0] == m]
            assert fw == list(range(fw[0], fw[0] + len(parts))) and bw == list(range(bw[0], bw[0] + len(parts)))
            assert [ops[i][1][1] for i in bw] == sorted((ops[i][1][1] for i in bw), reverse=True)
    assert all(pk <= av + 1e-6 for pk, av in zip(g.peak_memory_mb, _tiny(fixed).available))


def test_capped_1f1b_keeps_at_most_f_in_flight():
    for f in (1, 2, 4):
        for s, ops in enumerate(one_f_one_b(4, list(range(6)), inflight=f)):
            live = peak = 0
            for kind, _, _ in ops:
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert peak == min(f, 4 - s)


def _batch(max_len, seed):
    rng = np.random.default_rng(seed)
    out, used = [], 0
    while True:
        n = int(min(max_len, max(16, rng.lognormal(np.log(max_len / 6), 1.0))))
        if used + n > 65536:
            return out
        out.append(n)
        used += n


def test_auto_never_slower_and_wins_where_dynapipe_is_memory_bound():
    batch = _batch(8192, 3)
    base = _a100(8, 1).plan(batch, validate=False)
    sliced = _a100(8, 1, token_slices=-1).plan(batch, validate=False)
    assert sliced.makespan_ms <= base.makespan_ms
    assert sliced.groups[0].token_slices is not None and sliced.makespan_ms < 0.95 * base.makespan_ms
    assert all(pk <= av + 1e-6 for pk, av in zip(sliced.groups[0].peak_memory_mb, _a100(8, 1).available))


def test_past_the_table_only_slices_fit():
    batch = [9400, 6000, 3000] + [500] * 80  # past the table (8192 tokens)
    with pytest.raises(PlanningError):
        _a100(8, 1).plan(batch, validate=False)
    plan = _a100(8, 1, token_slices=-1).plan(batch, validate=False)
    assert max(ln for _, _, ln in plan.groups[0].token_slices) <= 8192


def _sliced_dynapipe_plans(rng):
    """Plans as plan_sliced lowers them: variable micro-batches, a capped 1F1B order, every
    F(m) / B(m) expanded into its slices."""
    from megatron.pipeline.lowering import ComputeOp
    pp, m = rng.choice([2, 3, 4]), rng.randint(1, 4)
    shapes = [(rng.randint(1, 3), 8 * rng.randint(1, 6)) for _ in range(m)]
    slicings = [ds.uniform_slices(L, rng.randint(1, L // 8)) for _, L in shapes]
    units, units_of, rows = [], [], []
    for k, ((b, _), sl) in enumerate(zip(shapes, slicings)):
        units_of.append(list(range(len(units), len(units) + len(sl))))
        units += [(k, off, ln) for off, ln in zip(ds.offsets(sl), sl)]
        rows += [b] * len(sl)
    orders = ds.expand(one_f_one_b(pp, list(range(m)), inflight=rng.randint(1, pp)), units_of)
    return lower_sliced([[ComputeOp(*o) for o in ops] for ops in orders], units, rows, 8)


def test_mutants_of_sliced_dynapipe_plans_rejected():
    """The validator refuses harmful mutants (tests/pipeline/test_plan_fuzz.py's) of plans
    carrying variable shapes and token slices at once."""
    import random

    from megatron.pipeline.validator import PlanValidationError, validate_plans
    from tests.pipeline.test_plan_fuzz import _mutate, _mutate_attribute
    rng, tried = random.Random(11), 0
    while tried < 150:
        plans = _sliced_dynapipe_plans(rng)
        validate_plans(plans)
        kind = (_mutate if tried % 2 else _mutate_attribute)(rng, plans)
        if kind is None:
            continue
        tried += 1
        with pytest.raises(PlanValidationError):
            validate_plans(plans)
            pytest.fail(f"mutant #{tried} ({kind}) was accepted")


def _tp_planner(tmp_path, sp, tp=3, token_slices=2):
    """GPT hidden 48 at TP `tp` (the CPU table copied for that TP); under SP lengths pad to
    lcm(8, TP), as the trainer pads them (supervised_training.pad_multiple)."""
    from tests.training.test_dynapipe_sequence_parallel import tp_cost_model
    return DynaPipePlanner(DynaPipeConfig(
        cost_model_path=tp_cost_model(tmp_path / f"cm{tp}.json", tp), model_kind="gpt", hidden_size=48,
        num_layers=4, pipeline_parallel=2, tensor_parallel=tp, sequence_parallel=sp, num_attention_heads=6,
        memory_limit_mb=400.0, token_slices=token_slices, pad_multiple=24 if sp else 8))


def test_sequence_parallel_prices_a_slices_dense_part_like_stage_costs(tmp_path):
    """SP shrinks what a slice stores per layer by DynaPipe's `sp_memory_factor` at the slice's
    length (through stage_costs); the attention to the context and the K/V cache live after
    the all-gather, split by heads either way, so they cost the same with and without SP."""
    sp, no = _tp_planner(tmp_path, True), _tp_planner(tmp_path, False)
    b, ln, c = np.array([1, 2, 2]), np.array([24, 48, 24]), np.array([0, 24, 48])
    got_sp, got_no = ds.slice_costs(sp, "none", b, ln, c), ds.slice_costs(no, "none", b, ln, c)
    assert np.allclose(got_sp["fwd"], got_no["fwd"]) and np.allclose(got_sp["bwd"], got_no["bwd"])
    assert (got_sp["stored"] < got_no["stored"]).all()
    dense_sp, dense_no = sp.stage_costs("none", b, ln), no.stage_costs("none", b, ln)
    assert np.allclose(got_sp["stored"] - got_no["stored"], dense_sp["stored"] - dense_no["stored"])
    assert np.allclose(ds.kv_cache_mb(sp, b, ln, c), ds.kv_cache_mb(no, b, ln, c))


@pytest.mark.parametrize("token_slices", [2, -1])
def test_sequence_parallel_slices_are_multiples_of_tp_and_messages_are_shards(tmp_path, token_slices):
    """TP 3 under SP: every slice is a multiple of lcm(8, 3) = 24 tokens (fixed N and auto's
    DP/uniform slicings), and the lowered stage messages are [l / 3, b, h], as TeraPipe's."""
    planner = _tp_planner(tmp_path, True, token_slices=token_slices)
    plan = planner.plan(np.random.default_rng(1).integers(20, 500, 24))  # long enough for auto to slice
    sliced = [g for g in plan.groups if g.token_slices]
    assert sliced and all(len(g.token_slices) > len(g.microbatches) for g in sliced)
    for g in sliced:
        assert all(ln % 24 == 0 and off % 24 == 0 for _, off, ln in g.token_slices)
        msgs = [(ins.token_slice, s) for p in g.plans for ins in p.instructions
                if isinstance(ins, I.ForwardPass) for s in ins.output_shapes]
        assert msgs and all(s == (sl[2] // 3, g.shapes[sl[0]][0][0], 48) for sl, s in msgs)
    for L in (24, 48, 96, 144):  # the auto candidates themselves
        for n in ds.AUTO_SLICES:
            assert all(x % 24 == 0 for x in ds.uniform_slicing(L, n, 4096, ds._grid(planner)))
        assert all(x % 24 == 0 for x in ds.dp_slicing(planner, "none", 2, L, 2.0, ds._cap(planner)))
