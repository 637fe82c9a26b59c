"""DynaPipe with the split backward: the "zb" schedule of `schedules.search`.

DynaPipe's micro-batches differ in size, so a 1F1B or wait-free order leaves bubbles of
different lengths on every stage. With the backward split into its input gradient (I, what
the previous stage waits for) and its weight gradient (W, what nobody waits for), the W of a
micro-batch can move into any later bubble of its stage. The "zb" candidate runs the greedy
rules of `megatron.planner.schedule.zero_bubble` (I first, then F while it fits, then the oldest W) on
the micro-batches' own costs, in the order being searched, with DynaPipe's memory limit as the
admission test: a forward starts only if the stage's kept activations (each kept until its W:
the weight store, `PipelineCosts.wstored`, planner/cost/wpass_memory.py) plus its working set stay under
the limit. The simulator then times the orders (links and all), and `search` keeps it only if
it beats the 1F1B / adaptive candidates of the same search: a plan with a split backward is
never slower than the best one without.

The W time: where the cost model has the profiler's measured halves (``input_grad_ms`` /
``weight_grad_ms``, planner/cost/wpass_time.py) the stage costs carry W already. The published
A100 tables time whole backward passes only, so there the split is derived (with a note):
the weight-gradient GEMMs repeat the forward GEMMs' FLOPs, so
``W = fwd * gemm_share`` with ``gemm_share = 6h / (6h + s)`` per transformer layer (forward
FLOPs per token: ``24 h^2`` in the QKV / projection / MLP GEMMs, ``4 s h`` in attention scores
and values, which have no weights), capped at half of the backward. `w_share` prints itself.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megatron.pipeline.lowering import ComputeOp
from megatron.planner.schedule.simulator import PipelineCosts, SimulationError, simulate


def gemm_share(hidden: int, seq) -> np.ndarray:
    """Fraction of a transformer layer's forward FLOPs in weight GEMMs, per sequence length."""
    seq = np.asarray(seq, dtype=float)
    return 6.0 * hidden / (6.0 * hidden + seq)


def derive_wgrad(fwd: np.ndarray, bwd: np.ndarray, hidden: int, seq) -> np.ndarray:
    """W time per (stage, micro-batch) from whole-backward tables: ``fwd * gemm_share`` (capped
    at bwd / 2). `seq` broadcasts against fwd (per micro-batch, or per stage and micro-batch)."""
    return np.minimum(np.asarray(fwd, float) * gemm_share(hidden, seq), 0.5 * np.asarray(bwd, float))


def w_share_text(hidden: int) -> str:
    return (f"W = fwd x 6h/(6h+s) (weight-GEMM share of the forward FLOPs, h={hidden}: "
            f"{gemm_share(hidden, 512):.2f} of fwd at s=512, {gemm_share(hidden, 2048):.2f} at s=2048), "
            "capped at bwd/2; I = bwd - W")


def planned_split(planner, costs: PipelineCosts, enc, dec=None) -> PipelineCosts:
    """`costs` with the derived W share when the planner searches the "zb" schedule (each
    stage's sequence: the decoder's on T5 decoder stages), else `costs` unchanged."""
    if costs is None or "zb" not in planner.cfg.schedules:
        return costs
    if costs.wgrad is not None:  # measured halves (planner/cost/wpass_time.py): nothing to derive
        return costs
    from megatron.planner.cost.wpass_time import note_derived
    note_derived(planner.cm.name)
    enc = np.asarray(enc, float)
    seq = np.stack([np.asarray(dec, float) if dec is not None and any(c == "decoder" for c, _ in comps) else enc
                    for comps in planner.layout])
    return with_split(costs, derive_wgrad(costs.fwd, costs.bwd, planner.cfg.hidden_size, seq))


def with_split(costs: PipelineCosts, wgrad: np.ndarray) -> PipelineCosts:
    return PipelineCosts(costs.fwd, costs.bwd, costs.stored, costs.transient, costs.comm, grad_comm=costs.grad_comm,
                         grad_comm_epilogue_only=costs.grad_comm_epilogue_only, wgrad=np.asarray(wgrad, float),
                         wstored=costs.wstored)


def zb_candidate(costs: PipelineCosts, order: Sequence[int], mem_limit: Sequence[float],
                 cut: float = float("inf")) -> Optional[tuple]:
    """(makespan, per-stage ops) of the split-backward schedule for `order`, or None when it
    does not fit `mem_limit`, deadlocks, or does not end before `cut`. One stage per rank."""
    from megatron.planner.schedule.zero_bubble import greedy_zb_orders
    if costs.wgrad is None:
        return None
    S, K = costs.num_stages, costs.num_microbatches
    fwd, bwd, w = costs.fwd, costs.bwd, costs.wgrad
    stored, trans = costs.stored, costs.transient
    limit = np.asarray(mem_limit, dtype=float) + 1e-9
    mem = [0.0] * S

    def admit(r, mb, s):
        return mem[r] + stored[s, mb] + trans[s, mb] <= limit[s]

    def on_op(r, kind, mb, s):
        if kind == "F":
            mem[r] += stored[s, mb]
        elif kind in ("W", "B"):
            mem[r] -= stored[s, mb]

    def cost(kind, mb, s):
        return {"F": fwd[s, mb], "B": bwd[s, mb], "I": bwd[s, mb] - w[s, mb], "W": w[s, mb]}[kind]

    try:
        orders = greedy_zb_orders(K, list(range(S)), [2 * K] * S, cost=cost,
                                  comm=lambda mb, s: float(costs.comm[s, mb]), op_cls=ComputeOp, order=order,
                                  admit=admit, on_op=on_op)
    except ValueError:
        return None  # some micro-batch never fits next to what its stage keeps
    try:
        res = simulate(costs, orders)
    except SimulationError:
        return None
    if res.makespan >= cut or any(p > lim for p, lim in zip(res.peak_memory, limit)):
        return None
    return res.makespan, orders
