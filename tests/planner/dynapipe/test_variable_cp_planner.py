"""The CP size chosen per micro-batch (megatron/planner/dynapipe/variable_cp.py): the plan's lanes
(one per rank of DP x CP) run every sample once, each micro-batch on the c consecutive CP indices of
one nested sub-group, in one total order (no deadlock); the choice is priced with cp_cost at each
size and never predicts slower than the static CP group; the plan survives the plan service's wire."""
import numpy as np
import pytest

from megatron.planner.dynapipe.config import DynaPipeConfig
from megatron.planner.dynapipe.variable_cp import VariableCPPlanner
from megatron.planner.service import wire
from megatron.planner.service.worker import check_covers


def _cfg(cp, sizes, dp=1, memory=400.0, pp=1):
    return DynaPipeConfig(cost_model_path="cost_models/cpu_tiny_gpt.json", model_kind="gpt", hidden_size=32,
                          num_layers=4, pipeline_parallel=pp, data_parallel=dp, memory_limit_mb=memory,
                          pad_multiple=2 * cp, context_parallel=cp, cp_sizes=sizes, num_attention_heads=4,
                          bandwidth_gbps=DynaPipeConfig.bandwidth_gbps * cp)


def _lengths(n=40, seed=0):
    rng = np.random.RandomState(seed)
    return [int(x) for x in np.clip(rng.lognormal(3.0, 0.8, n).astype(int), 3, 64)]


@pytest.mark.parametrize("cp,sizes,dp,memory,pp", [(2, (1, 2), 1, 48.0, 1), (4, (1, 2, 4), 2, 48.0, 1),
                                                   (4, (1, 4), 1, 400.0, 1), (2, (1, 2), 1, 40.0, 2)])
def test_lanes_cover_the_batch_with_nested_subgroups_in_one_order(cp, sizes, dp, memory, pp):
    lengths = _lengths()
    plan = VariableCPPlanner(_cfg(cp, sizes, dp, memory, pp)).plan(lengths, iteration=3)
    assert len(plan.groups) == dp * cp
    check_covers(plan, 3, len(lengths))
    where = {}  # micro-batch (its samples) -> [(lane, index in sub-group, size, position)]
    for lane, g in enumerate(plan.groups):
        assert len(g.plans) == pp and len(g.microbatches) == len(g.cp) >= 1
        for pos, (mb, (c, j)) in enumerate(zip(g.microbatches, g.cp)):
            where.setdefault(tuple(mb), []).append((lane, j, c, pos))
            (b, s), = g.shapes[pos]
            assert b == len(mb) and s % (2 * c) == 0
    for mb, runs in where.items():
        c = runs[0][2]
        lanes = sorted(r[0] for r in runs)
        assert c in sizes and len(runs) == c and sorted(r[1] for r in runs) == list(range(c))
        d, first = divmod(lanes[0], cp)
        assert first % c == 0 and lanes == list(range(lanes[0], lanes[0] + c))  # one nested sub-group
    # one total order: two micro-batches sharing two lanes run in the same order on both
    pos = {(lane, mb): p for mb, runs in where.items() for lane, _, _, p in runs}
    for a in where:
        for b in where:
            shared = [lane for lane, *_ in where[a] if (lane, b) in pos]
            if a != b and len(shared) > 1:
                assert len({pos[(lane, a)] < pos[(lane, b)] for lane in shared}) == 1


def test_choice_is_priced_per_size_and_never_slower_than_static():
    pl = VariableCPPlanner(_cfg(2, (1, 2), memory=40.0))
    lengths = _lengths()
    plan = pl.plan(lengths)
    static = VariableCPPlanner(_cfg(2, (2,), memory=40.0)).plan(lengths)
    assert {c for g in static.groups for c, _ in g.cp} == {2}
    assert plan.makespan_ms < static.makespan_ms
    sizes = {c for g in plan.groups for c, _ in g.cp}
    assert sizes == {1, 2}  # under 40 MB the longest fit only on the CP group, the short run alone
    # what each size costs is cp_cost's: CP 2 halves the tokens but adds the exchange
    costs, seqs = pl.costs("none", [[0, 1], [2]], pl.static._pad(np.asarray(lengths)))
    assert (costs[2][0] < costs[1][0]).all() and (costs[2][2] < costs[1][2]).all()
    # long micro-batches get the larger size: sizes never decrease with length
    for g in plan.groups:
        for (c1, _), s1 in zip(g.cp, g.shapes):
            for (c2, _), s2 in zip(g.cp, g.shapes):
                if s1[0][1] > s2[0][1]:
                    assert c1 >= c2


def test_plan_survives_the_wire():
    plan = VariableCPPlanner(_cfg(2, (1, 2), memory=48.0)).plan(_lengths(), iteration=5)
    head, blobs = wire._dynapipe_to_json(plan)
    back = wire._dynapipe_from_json(head, blobs)
    assert [g.cp for g in back.groups] == [g.cp for g in plan.groups]
    assert [g.microbatches for g in back.groups] == [g.microbatches for g in plan.groups]
    head["groups"][0]["cp"][0] = [2, 2]  # index outside its sub-group
    with pytest.raises(ValueError, match="cp must hold"):
        wire._dynapipe_from_json(head, blobs)


def test_pipelines_run_all_forwards_then_all_backwards_in_one_order():
    plan = VariableCPPlanner(_cfg(2, (1, 2), memory=40.0, pp=2)).plan(_lengths())
    for g in plan.groups:
        n = len(g.microbatches)
        for st, ops in enumerate(g.compute_orders):
            assert [(o.kind, o.microbatch, o.stage) for o in ops] == \
                [("F", k, st) for k in range(n)] + [("B", k, st) for k in range(n)]
