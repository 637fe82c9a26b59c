"""Event-driven simulation of a pipeline iteration.

Input: per-stage, per-micro-batch costs (`PipelineCosts`) and, per rank, the order in which
it runs its forward (F) and backward (B) passes. Each rank has one compute stream; every
directed rank pair has one link that carries one transfer at a time (activations forward,
gradients backward). An op starts when its rank is free and its inputs have arrived:
F(mb, s) needs F(mb, s-1)'s output, B(mb, s) needs B(mb, s+1)'s gradient and F(mb, s).

Activation memory per rank: a forward keeps `stored[s, mb]` until the matching backward
ends; while an op runs, `transient[s, mb]` more is live (working set above what is kept).
Memory counts activations only; model states are subtracted from the device limit by the
caller. The result carries per-op times, the memory trace and a Chrome-trace export.

Split backward (zero-bubble): an order may run I(mb, s) (input gradient: B's dependencies,
takes ``bwd - wgrad``, sends the gradient) and later W(mb, s) (weight gradient: after its I on
the same rank, takes ``wgrad``, sends nothing) instead of B(mb, s). I frees
``stored - wstored``; the deferred W state ``wstored`` lives until W ends.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.pipeline.lowering import ComputeOp


class SimulationError(RuntimeError):
    pass


@dataclass
class PipelineCosts:
    """All arrays are (num_stages, num_microbatches); times in ms, memory in MB.

    `comm[s, mb]` is the transfer time of stage s's output activation to stage s+1 (the
    gradient that comes back has the same size, so the same time); the last row is unused.
    `grad_comm[s, mb]`, when given, is the time of that gradient instead (compressed
    backpropagation makes it smaller); with `grad_comm_epilogue_only` it applies only to the
    gradients a rank sends after its last forward, the messages the plan pass compresses.
    """

    fwd: np.ndarray
    bwd: np.ndarray
    stored: np.ndarray
    transient: np.ndarray
    comm: np.ndarray
    grad_comm: Optional[np.ndarray] = None
    grad_comm_epilogue_only: bool = False
    # Split backward: W's share of `bwd` (ms) and the memory the deferred W state keeps from I
    # to W (MB; None = `stored`, what the executor keeps: the whole graph).
    wgrad: Optional[np.ndarray] = None
    wstored: Optional[np.ndarray] = None

    def __post_init__(self):
        shapes = {np.shape(a) for a in (self.fwd, self.bwd, self.stored, self.transient, self.comm)}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"PipelineCosts arrays must share one (stages, microbatches) shape, got {shapes}")

    @property
    def num_stages(self) -> int:
        return self.fwd.shape[0]

    @property
    def num_microbatches(self) -> int:
        return self.fwd.shape[1]

    def subset(self, mbs: Sequence[int]) -> "PipelineCosts":
        idx = np.asarray(mbs, dtype=np.int64)
        pick = lambda a: None if a is None else a[:, idx]  # noqa: E731
        return PipelineCosts(*(a[:, idx] for a in (self.fwd, self.bwd, self.stored, self.transient, self.comm)),
                             grad_comm=pick(self.grad_comm), grad_comm_epilogue_only=self.grad_comm_epilogue_only,
                             wgrad=pick(self.wgrad), wstored=pick(self.wstored))


@dataclass
class SimResult:
    makespan: float
    start: Dict[ComputeOp, float]
    end: Dict[ComputeOp, float]
    peak_memory: List[float]  # per rank
    memory_trace: List[List[Tuple[float, float]]]  # per rank: (time, MB) after each change
    orders: List[List[ComputeOp]]  # per rank
    comm: List[Tuple[str, int, int, int, int, float, float]] = field(default_factory=list)

    def chrome_trace(self) -> dict:
        """Chrome/Perfetto trace: one row per rank; memory as counters; transfers as slices."""
        ev = []
        for op, t0 in self.start.items():
            rank = next(r for r, order in enumerate(self.orders) if op in order)
            ev.append({"name": f"{op.kind}{op.microbatch}", "cat": "compute", "ph": "X", "pid": rank,
                       "tid": 0, "ts": t0 * 1e3, "dur": (self.end[op] - t0) * 1e3,
                       "args": {"stage": op.stage, "microbatch": op.microbatch}})
        for kind, mb, stage, src, dst, t0, t1 in self.comm:
            ev.append({"name": f"{kind}{mb}", "cat": "comm", "ph": "X", "pid": src, "tid": 1,
                       "ts": t0 * 1e3, "dur": (t1 - t0) * 1e3, "args": {"to_rank": dst, "stage": stage}})
        for rank, trace in enumerate(self.memory_trace):
            for t, mem in trace:
                ev.append({"name": "activation MB", "ph": "C", "pid": rank, "ts": t * 1e3, "args": {"MB": mem}})
        for rank in range(len(self.orders)):
            ev.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"pipeline rank {rank}"}})
        return {"traceEvents": ev, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


def simulate(costs: PipelineCosts, orders: Sequence[Sequence[ComputeOp]],
             stage_to_rank: Optional[Sequence[int]] = None) -> SimResult:
    """Replay fixed per-rank op orders; raises SimulationError on a dependency deadlock."""
    S = costs.num_stages
    stage_to_rank = list(range(S)) if stage_to_rank is None else list(stage_to_rank)
    R = len(orders)
    fwd, bwd, stored, trans, comm = (a.tolist() for a in
                                     (costs.fwd, costs.bwd, costs.stored, costs.transient, costs.comm))
    gcomm = comm if costs.grad_comm is None else costs.grad_comm.tolist()
    wgrad = None if costs.wgrad is None else costs.wgrad.tolist()
    wstored = stored if costs.wstored is None else costs.wstored.tolist()
    # Index in each rank's order after which its gradient sends count as the epilogue.
    last_f = [max((i for i, o in enumerate(order) if o[0] == "F"), default=-1)
              if costs.grad_comm_epilogue_only else -1 for order in orders]
    arrival: Dict[ComputeOp, float] = {}  # when an op's input from another stage is available here
    start: Dict[ComputeOp, float] = {}
    end: Dict[ComputeOp, float] = {}
    link_free: Dict[Tuple[int, int], float] = {}
    transfers = []
    free_at = [0.0] * R
    mem = [0.0] * R
    peak = [0.0] * R
    trace: List[List[Tuple[float, float]]] = [[(0.0, 0.0)] for _ in range(R)]
    ptr = [0] * R
    remaining = sum(len(o) for o in orders)

    def send(kind, mb, s_from, s_to, t_ready, position=0):
        src, dst = stage_to_rank[s_from], stage_to_rank[s_to]
        consumer = ComputeOp(kind, mb, s_to)  # a gradient arrives for "B" (or the "I" that replaces it)
        if src == dst:
            arrival[consumer] = t_ready
            return
        table = gcomm if kind == "B" and position > last_f[src] else comm
        dur = table[min(s_from, s_to)][mb]
        t0 = max(t_ready, link_free.get((src, dst), 0.0))
        link_free[(src, dst)] = t0 + dur
        arrival[consumer] = t0 + dur
        transfers.append(("act" if kind == "F" else "grad", mb, s_from, src, dst, t0, t0 + dur))

    while remaining:
        progressed = False
        for r in range(R):
            order = orders[r]
            while ptr[r] < len(order):
                op = order[ptr[r]]
                kind, mb, s = op
                if kind == "F":
                    if s > 0 and op not in arrival:
                        break
                    ready = arrival.get(op, 0.0)
                elif kind == "W":
                    i_op = ComputeOp("I", mb, s)
                    if i_op not in end:
                        if i_op not in order:
                            raise SimulationError(f"{op} on rank {r} has no I({mb}, {s}) on that rank")
                        break
                    ready = end[i_op]
                else:
                    f_op, g_op = ComputeOp("F", mb, s), ComputeOp("B", mb, s)
                    if f_op not in end or (s < S - 1 and g_op not in arrival):
                        break
                    ready = max(end[f_op], arrival.get(g_op, 0.0))
                t0 = max(free_at[r], ready)
                if kind == "F":
                    t1 = t0 + fwd[s][mb]
                    hi = mem[r] + stored[s][mb] + trans[s][mb]
                    mem[r] += stored[s][mb]
                elif kind == "B":
                    t1 = t0 + bwd[s][mb]
                    hi = mem[r] + trans[s][mb]
                    mem[r] -= stored[s][mb]
                else:
                    if wgrad is None:
                        raise SimulationError(f"{op}: a split backward needs PipelineCosts.wgrad")
                    w = wgrad[s][mb]
                    t1 = t0 + (bwd[s][mb] - w if kind == "I" else w)
                    hi = mem[r] + trans[s][mb]
                    mem[r] -= stored[s][mb] - wstored[s][mb] if kind == "I" else wstored[s][mb]
                peak[r] = max(peak[r], hi)
                trace[r].append((t0, hi))
                trace[r].append((t1, mem[r]))
                start[op], end[op] = t0, t1
                free_at[r] = t1
                if kind == "F" and s < S - 1:
                    send("F", mb, s, s + 1, t1)
                elif kind in ("B", "I") and s > 0:
                    send("B", mb, s, s - 1, t1, ptr[r])
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            heads = {r: orders[r][ptr[r]] for r in range(R) if ptr[r] < len(orders[r])}
            raise SimulationError(f"schedule deadlocks: every rank waits; next ops per rank: {heads}")
    makespan = max(end.values()) if end else 0.0
    return SimResult(makespan, start, end, peak, trace, [list(o) for o in orders], transfers)


def check_dependencies(result: SimResult, costs: PipelineCosts, stage_to_rank=None) -> None:
    """Assert-style re-check used by tests: every op starts after its inputs are complete."""
    S = costs.num_stages
    for op, t0 in result.start.items():
        kind, mb, s = op
        if kind == "F" and s > 0 and t0 < result.end[ComputeOp("F", mb, s - 1)] - 1e-9:
            raise SimulationError(f"{op} starts before F({mb},{s - 1}) ends")
        if kind in ("B", "I"):
            if t0 < result.end[ComputeOp("F", mb, s)] - 1e-9:
                raise SimulationError(f"{op} starts before its forward ends")
            nxt = ComputeOp("B", mb, s + 1) if ComputeOp("B", mb, s + 1) in result.end else ComputeOp("I", mb, s + 1)
            if s < S - 1 and t0 < result.end[nxt] - 1e-9:
                raise SimulationError(f"{op} starts before {nxt} ends")
        if kind == "W" and t0 < result.end[ComputeOp("I", mb, s)] - 1e-9:
            raise SimulationError(f"{op} starts before its I ends")
