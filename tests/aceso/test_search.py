"""Search properties on the shipped 4-GPU GPT-1.3B database, with small trial budgets."""
import os

import pytest

from megatron.aceso.__main__ import main
from megatron.aceso.config import load_plan
from megatron.aceso.db import SHIPPED_DIR, OpDatabase
from megatron.aceso.model import PerfModel, get_model_spec
from megatron.aceso.search import Searcher, best_grid, search_all, unit_starts

MINI = os.path.join(SHIPPED_DIR, "miniset")


@pytest.fixture(scope="module")
def pm():
    spec = get_model_spec("gpt-1.3b")
    return PerfModel(OpDatabase(MINI, "gpt", "1_3B"), spec, memory_limit_mb=12 * 1024)


def _legal(plan, G, gpn, pm):
    r = 0
    for st in plan.stages:
        g = st.gpus
        assert g & (g - 1) == 0 and st.tp <= gpn
        assert r // gpn == (r + g - 1) // gpn or r % gpn == 0
        assert plan.micro_batch % st.dp == 0 and pm.db.has(plan.micro_batch // st.dp, st.tp)
        r += g
    assert r == G
    assert plan.stages[0].start == 0 and plan.stages[-1].end == pm.num_ops
    for a, b in zip(plan.stages, plan.stages[1:]):
        assert a.end == b.start


def test_units_are_layers(pm):
    u = unit_starts(pm)
    assert len(u) == 25 and u[0] == 0 and u[1] == 1 + 13 and u[-1] == pm.num_ops


def test_search_beats_grid_is_legal_fits_and_is_deterministic(pm):
    grid, n = best_grid(pm, 4, 512)
    assert n > 0 and grid.pred.fits
    runs = [search_all(pm, 4, 512, budget_trials=60, max_stages=4) for _ in range(2)]
    best = runs[0][0].best
    assert best.key[0] == 0 and best.pred.fits
    assert best.key[1] <= grid.key[1]
    assert best.key[1] < grid.key[1] * 0.95  # it does find something better than uniform
    _legal(best.plan, 4, 8, pm)
    # the prediction is the model's prediction of the plan itself
    assert pm.predict(best.plan).iteration_ms == pytest.approx(best.key[1])
    assert [(r.num_stages, r.best.state, r.trials) for r in runs[0]] == \
           [(r.num_stages, r.best.state, r.trials) for r in runs[1]]
    assert all(r.trials <= 60 for r in runs[0])


def test_recompute_fit_is_minimal(pm):
    s = Searcher(pm, 4, 512)
    a, b = s.units[0], s.units[6]
    flags, mem = s.fit_recompute(1, a, b, 1, 1, 0, 4, 512)
    assert mem <= pm.memory_limit_mb and 0 < sum(flags) < b - a
    # one recomputed op fewer (the last one added) no longer fits
    order = [i for i in s._rank_ops(1, 1) if a <= i < b]
    k = sum(flags)
    assert {i - a for i in order[:k]} == {j for j, f in enumerate(flags) if f}
    fewer = [0] * (b - a)
    for i in order[: k - 1]:
        fewer[i - a] = 1
    from megatron.aceso.model import Stage
    assert pm.stage_memory_mb(1, Stage(a, b, 1, 1, tuple(fewer)), 0, 4, 512) > pm.memory_limit_mb


def test_cli_search_writes_configs_and_predict_reads_them(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert main(["search", "--db", MINI, "--model", "gpt-1.3b", "--gpus", "4", "--memory-gb", "12",
                 "--global-batch", "512", "--budget-trials", "40", "--max-stages", "4",
                 "--out-dir", out]) == 0
    text = capsys.readouterr().out
    assert "stages  4:" in text and "speed-up" in text
    plan = load_plan(os.path.join(out, "best.json"), 315)
    assert plan.num_gpus == 4
    assert main(["predict", os.path.join(out, "best.json"), "--db", MINI, "--memory-gb", "12"]) == 0
    assert "fits" in capsys.readouterr().out


def test_profiled_tiny_gpt_search_to_runnable_config(tmp_path):
    """Profile our GPT on CPU, search with one TP/DP size for all stages, and load the result
    with --aceso-config's translation (stage layers and recompute modes agree with the plan)."""
    import shutil

    from megatron.aceso.config import save_plan
    from megatron.aceso.model import ModelSpec
    from megatron.aceso.profiler import profile_gpt
    from megatron.aceso.runtime import load_gpt_layout
    from megatron.config.core import ModelConfig

    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                      vocab_size=101, make_vocab_size_divisible_by=8)
    root = str(tmp_path / "db")
    profile_gpt(cfg, root, size="tiny", mbs_values=(1, 2), repeats=1)
    for fn in os.listdir(MINI):  # p2p and collectives from the shipped set (borrowed by name)
        if fn.startswith(("p2p_", "prim_gpt_1_3B_all_reduce")):
            shutil.copy(os.path.join(MINI, fn), root)
    spec = ModelSpec("gpt", "tiny", (4,), 32, 16, 8)
    db = OpDatabase(root, "gpt", "tiny")
    assert db.borrowed_collectives == "gpt_1_3B"
    base = PerfModel(db, spec, memory_limit_mb=1e6)
    full_stage = base.stage_memory_mb(2, __import__("megatron.aceso.model", fromlist=["Stage"]).Stage(
        0, base.num_ops, 1, 1), 0, 1, 4)
    pm = PerfModel(db, spec, memory_limit_mb=full_stage * 0.9)  # one GPU cannot hold it all
    res = search_all(pm, 2, 8, budget_trials=40, runnable=True)
    best = next(r for r in res if r.best.key[0] == 0).best
    plan = best.plan
    assert len({(s.tp, s.dp) for s in plan.stages}) == 1
    path = str(tmp_path / "best.json")
    save_plan(path, plan, spec)
    lay = load_gpt_layout(path, 4, plan.num_gpus)
    per_stage = [len({pm.ops[i].layer for i in range(s.start, s.end) if pm.ops[i].layer >= 0})
                 for s in plan.stages]
    assert lay.stage_layers == per_stage and lay.pp == len(plan.stages)
    rec = [i for s in plan.stages for i, f in zip(range(s.start, s.end), s.flags()) if f]
    recomputed_layers = {pm.ops[i].layer for i in rec}
    assert {j for j, m in enumerate(lay.recompute_layers) if m != "none"} == recomputed_layers


def test_op_granularity_cuts_anywhere_and_is_never_worse_than_grid(pm):
    grid, _ = best_grid(pm, 4, 512)
    res = search_all(pm, 4, 512, budget_trials=60, max_stages=4, granularity="op")
    best = res[0].best
    assert best.pred.fits and best.key[1] <= grid.key[1]
    _legal(best.plan, 4, 8, pm)
    with pytest.raises(ValueError, match="cannot run"):
        Searcher(pm, 4, 512, runnable=True, granularity="op")


def test_paper_space_and_convergence_stop(pm):
    """--paper: pipeline micro-batch <= 8 in the search and the grid; a patience stop ends the
    search after restarts stop paying, deterministically, never worse than the grid seed."""
    grid, _ = best_grid(pm, 4, 512, max_micro_batch=8)
    assert grid.plan.micro_batch <= 8
    runs = [search_all(pm, 4, 512, max_stages=4, max_micro_batch=8, patience_trials=20) for _ in range(2)]
    for r in runs[0]:
        assert r.best.plan.micro_batch <= 8
    assert [(r.best.state, r.trials) for r in runs[0]] == [(r.best.state, r.trials) for r in runs[1]]
    assert runs[0][0].best.key <= grid.key
    longer = search_all(pm, 4, 512, max_stages=4, max_micro_batch=8, patience_trials=200)
    assert sum(r.trials for r in longer) >= sum(r.trials for r in runs[0])


def test_rebalance_minimises_the_slowest_stage_and_polish_is_a_local_optimum(pm):
    from megatron.aceso.search_local import _StageTimes, polish, rebalance
    s = Searcher(pm, 4, 512, granularity="op")
    st = (1, (0, 40, 80, 200, s.U), (1, 1, 1, 1), (1, 1, 1, 1))  # badly cut
    assert s.legal(st)
    rb = rebalance(s, st)
    assert rb is not None and rb[0] == st[0] and rb[2:] == st[2:]
    times = _StageTimes(s, 1, st[2], st[3])

    def slowest(bounds):
        return max(times.time(k, bounds[k], bounds[k + 1]) for k in range(4))

    best = slowest(rb[1])
    assert best < slowest(st[1])
    # no single cut moved by one op lowers the slowest stage by more than the search tolerance
    for k in range(1, 4):
        for d in (-1, 1):
            nb = list(rb[1])
            nb[k] += d
            if nb[k - 1] < nb[k] < nb[k + 1]:
                assert slowest(nb) >= best * (1 - 1e-3)
    # the rebalanced state is what the model prices: every stage within the threshold found
    ev = s.evaluate(rb)
    assert ev.key[0] == 0 and max(c.time_ms for c in ev.pred.stages) == pytest.approx(best)
    # polish never loses and ends where no stage's primitive improves any more
    start = s.evaluate(st)
    out = polish(s, start, s.evaluate, s.stage_moves)
    assert out.key <= ev.key and out.key <= start.key
    for k in range(len(out.state[2])):
        for n in s.stage_moves(out.state, k):
            assert s.evaluate(n).key >= out.key


def test_two_level_seeds_are_legal_two_sized_and_rebalanced(pm):
    from megatron.aceso.search_local import rebalance, two_level_seeds
    s = Searcher(pm, 4, 512, granularity="op")
    seeds = two_level_seeds(s, 3, top=2)
    assert len(seeds) == 2
    for st in seeds:
        assert s.legal(st)
        gpus = [t * d for t, d in zip(st[2], st[3])]
        assert sorted(gpus) == [1, 1, 2]
        assert rebalance(s, st) is None  # already the min-max cut for its resources
    assert two_level_seeds(s, 4) == [] and two_level_seeds(s, 1) == []  # one size only
