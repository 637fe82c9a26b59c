"""Zero-bubble schedules on micro-batches fixed before scheduling: the ZB-H1 / ZB-V baselines DynaPipe with the
split backward is compared against (benchmarks/bench_planner.py --zero-bubble).

Two batchings, as the other baselines (`megatron.planner.dynapipe.baselines`), each at the best
micro-batch size and recompute level that fit: `zb_fixed_time`, unpacked samples in data order,
each micro-batch padded to its longest; `zb_packed_time`, what a torchtitan or Megatron-Core
user runs: the data path's next-fit packed rows (`packed.next_fit`, `--pack-dataset`) with
per-document attention (THD / `cu_seqlens`: attention priced on sum l_i^2), `b` rows per
micro-batch in data order, contiguous blocks per DP group. The schedule is `zero_bubble`'s
greedy on the micro-batches' costs with the W share derived
from the whole-backward table (`zb_search.derive_wgrad`). ZB-H1 keeps up to p graphs on
every rank (1F1B's peak, `kept_limits`); ZB-V cuts each table stage into two half-stage chunks (half its time, memory
and W; the boundary inside a stage moves the same activation as the stage's own) placed in a
V, each rank bounded by the smallest activation memory any stage leaves (its model states are
those of two half stages). Both admit a forward only while the rank's kept graphs leave room
for it (as DynaPipe's "zb" does) and are checked against the memory limit in simulation.
"""
from __future__ import annotations

import numpy as np

from megatron.planner.dynapipe import packed
from megatron.planner.dynapipe.baselines import SIZES, group_costs, microbatch_shapes, split_groups
from megatron.pipeline.lowering import ComputeOp
from megatron.planner.schedule.simulator import PipelineCosts, simulate
from megatron.planner.schedule.zb_search import derive_wgrad, with_split
from megatron.planner.schedule.zero_bubble import V_SCHEDULES, greedy_zb_orders, kept_limits, stage_to_rank_of


def _split_costs(planner, kind, shapes, rc):
    costs = group_costs(planner, kind, shapes, rc)
    if costs is None:
        return None
    enc = np.array([s[1] for s in shapes], float)
    dec = enc if kind == "gpt" else np.array([s[2] for s in shapes], float)
    seq = np.stack([dec if any(c == "decoder" for c, _ in comps) else enc for comps in planner.layout])
    return with_split(costs, derive_wgrad(costs.fwd, costs.bwd, planner.cfg.hidden_size, seq))


def _v_chunks(c: PipelineCosts) -> PipelineCosts:
    half = lambda a: np.repeat(a, 2, axis=0) / 2.0  # noqa: E731  chunk 2k, 2k+1 = halves of stage k
    comm = np.repeat(c.comm, 2, axis=0)
    return PipelineCosts(half(c.fwd), half(c.bwd), half(c.stored), half(c.transient), comm,
                         wgrad=half(c.wgrad))


def zb_group_time(costs: PipelineCosts, schedule: str, available) -> float:
    """Simulated makespan of one group's micro-batches under `schedule`, inf if over memory."""
    S0, m = costs.num_stages, costs.num_microbatches
    if schedule in V_SCHEDULES:
        costs = _v_chunks(costs)
        limit = [float(np.min(available))] * S0
    else:
        limit = list(available)
    s2r = stage_to_rank_of(schedule, S0)
    f, b, w, comm = costs.fwd, costs.bwd, costs.wgrad, costs.comm
    cost = lambda k, mb, s: {"F": f[s, mb], "B": b[s, mb], "I": b[s, mb] - w[s, mb], "W": w[s, mb]}[k]  # noqa: E731
    stored, trans = costs.stored, costs.transient
    mem = [0.0] * S0

    # On a V a rank also runs a later chunk: its first-chunk forwards leave room for one of
    # those, or they could fill the memory with graphs that wait for it (a deadlock).
    later = {s: max((t for t in range(s + 1, len(s2r)) if s2r[t] == s2r[s]), default=None) for s in range(len(s2r))}
    reserve = [0.0 if later[s] is None else float((stored[later[s]] + trans[later[s]]).max()) for s in range(len(s2r))]

    def admit(r, mb, s):  # a forward starts only if the rank's kept graphs leave room for it
        return mem[r] + stored[s, mb] + trans[s, mb] + reserve[s] <= limit[r] + 1e-9

    def on_op(r, kind, mb, s):
        mem[r] += stored[s, mb] if kind == "F" else -stored[s, mb] if kind in ("W", "B") else 0.0

    try:
        orders = greedy_zb_orders(m, s2r, kept_limits(schedule, S0, m), cost=cost,
                                  comm=lambda mb, s: float(comm[s, mb]), op_cls=ComputeOp, admit=admit, on_op=on_op)
    except ValueError:
        return np.inf
    res = simulate(costs, orders, s2r)
    if any(p > a + 1e-9 for p, a in zip(res.peak_memory, limit)):
        return np.inf
    return res.makespan


def _best_time(planner, schedule: str, candidates):
    """(best iteration ms, size, recompute) over `candidates`: (size, micro-batch groups, costs_of)
    with costs_of(group, recompute) -> the group's split costs, or None when they do not fit."""
    rcs = [r for r in planner.cfg.recompute_levels if planner.cm.has(planner.cfg.tensor_parallel, r)]
    best = (np.inf, None, None)
    for b, groups, costs_of in candidates:
        for rc in rcs:
            makespan = 0.0
            for g in groups:
                costs = costs_of(g, rc)
                makespan = max(makespan, np.inf if costs is None else zb_group_time(costs, schedule, planner.available))
                if not np.isfinite(makespan):
                    break
            t = planner.iteration_ms(makespan) if np.isfinite(makespan) else np.inf
            if t < best[0]:
                best = (t, b, rc)
    return best


def zb_fixed_time(planner, kind, batch, max_len, schedule: str, sizes=SIZES):
    """(best iteration ms, micro-batch size, recompute) of `schedule` on fixed micro-batches."""
    def candidates():
        for b in sizes:
            groups = split_groups(microbatch_shapes(planner, kind, "fixed", batch, max_len, b),
                                  planner.cfg.data_parallel)
            if groups is not None:
                yield b, groups, lambda shapes, rc: _split_costs(planner, kind, shapes, rc)
    return _best_time(planner, schedule, candidates())


def zb_packed_time(planner, kind, batch, max_len, schedule: str, sizes=SIZES):
    """(best iteration ms, rows per micro-batch, recompute) of `schedule` on packed rows with
    per-document attention (see the module docstring)."""
    rows = packed.next_fit(kind, batch, max_len)

    def candidates():
        for b in sizes:
            mbs = [rows[k:k + b] for k in range(0, len(rows), b)]
            groups = packed.contiguous_groups(len(mbs), planner.cfg.data_parallel)
            if groups is None:
                continue
            sh = packed.shapes_of(planner, kind, batch, max_len, mbs)
            yield b, groups, lambda g, rc, sh=sh: _packed_costs(planner, sh, g, rc)
    return _best_time(planner, schedule, candidates())


def _packed_costs(planner, sh, g, rc):
    costs = packed.pipeline_costs(planner, rc, sh, g)
    if costs is not None and costs.wgrad is None:  # a planner without "zb": derive W here
        dec = None if sh.dec is None else sh.dec[g]
        seq = np.stack([dec if any(c == "decoder" for c, _ in comps) else sh.enc[g] for comps in planner.layout])
        costs = with_split(costs, derive_wgrad(costs.fwd, costs.bwd, planner.cfg.hidden_size, seq))
    return costs
