"""Aceso's iterative bottleneck alleviation, and the Megatron uniform grid, under one PerfModel.

A search state is (global micro-batch, stage boundaries in layer units, TP and DP per stage).
Recompute is not a move: after every change each stage gets the cheapest recompute set that
fits its memory (ops ordered by activation MB saved per ms of recompute, a binary search on
how many of them), as Aceso's ``check_recompute`` does.

One trial = one state evaluated by the model; a budget in trials makes the search
deterministic. Per stage count:

1. seeds: the "balance" start (equal layers, GPUs doubled round-robin, TP first, smallest
   micro-batch), the best uniform grid point with that many stages, and the two best
   two-size layouts (``search_local.two_level_seeds``: k stages of 2g GPUs, the rest g,
   stage cuts rebalanced);
2. a multi-hop step: find the bottleneck (largest per-micro-batch time, or the stage furthest
   over the memory limit), split its time into compute / recompute / p2p, order the
   primitives by which share dominates, apply them in that order and take the first that
   lowers the iteration time; if none does, recurse from the best few results up to
   ``max_hops`` moves deep;
3. when a step finds nothing, restart from the best not-yet-started state within
   ``restart_ratio`` of the best one; stop when none is left, the budget is spent, or (with
   ``patience_trials``) once restarts have run that many trials without improving the best,
   or (``prune_ratio``, one process) once this stage count is that far behind the best
   other stage count searched before it (search_all runs them best grid seed first); one
   three times that far behind also stops its deep step after ``prune_after`` trials.

Then the best stage count's result gets a final polish (``search_local.polish``: every stage
a target for every primitive, resource changes followed by a min-max re-cut of the stages).

Legality: every stage has a power-of-two GPU count, the counts sum to the cluster, a stage
never straddles a node (larger ones start on a node boundary), TP is within a node and
profiled, and micro-batch / DP is a profiled micro-batch size.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.aceso.model import PerfModel, Plan, Prediction, Stage
from megatron.aceso.search_local import polish, two_level_seeds
from megatron.aceso.search_moves import Primitives

State = Tuple[int, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]  # mbs, bounds, tps, dps
INF = float("inf")


class BudgetExhausted(Exception):
    pass


def unit_starts(pm: PerfModel) -> List[int]:
    """Op indices where a stage may start: each layer's first op (moved back over an embedding
    that feeds it), plus 0 and the end. The first layer stays with the model's head ops."""
    names = pm.db.op_names
    starts = [0]
    seen = set()
    for i, o in enumerate(pm.ops):
        if o.layer < 0 or o.layer in seen:
            continue
        seen.add(o.layer)
        if i == 0 or pm.ops[i - 1].layer == o.layer:
            continue
        j = i
        while j > 0 and pm.ops[j - 1].layer < 0 and "embedding" in names[pm.ops[j - 1].row]:
            j -= 1
        if j > 0:
            starts.append(j)
    starts = sorted(set(starts))
    # the first layer's start is a legal cut only if something other than head ops precedes it
    first_layer = next(i for i, o in enumerate(pm.ops) if o.layer >= 0)
    starts = [s for s in starts if s == 0 or s > first_layer]
    return starts + [pm.num_ops]


@dataclass
class Evaluated:
    state: State
    key: Tuple[int, float]          # (0, iteration ms) if it fits, else (1, MB over the limit)
    plan: Optional[Plan] = None
    pred: Optional[Prediction] = None


@dataclass
class SearchResult:
    num_stages: int
    best: Optional[Evaluated]
    trials: int
    seconds: float
    hops_accepted: int = 0
    restarts: int = 0


class Searcher(Primitives):
    def __init__(self, pm: PerfModel, num_gpus: int, global_batch: int, *,
                 max_hops: int = 7, width: int = 2, restart_ratio: float = 1.2,
                 budget_trials: Optional[int] = None, budget_seconds: Optional[float] = None,
                 runnable: bool = False, granularity: str = "layer",
                 max_micro_batch: Optional[int] = None, patience_trials: Optional[int] = None,
                 polish: bool = False, prune_ratio: Optional[float] = 1.05,
                 two_level: bool = True):
        self.pm = pm
        self.G = num_gpus
        self.gbs = global_batch
        if granularity not in ("layer", "op"):
            raise ValueError(f"granularity must be 'layer' or 'op', got {granularity!r}")
        if granularity == "op" and runnable:
            raise ValueError("stage cuts inside layers (granularity 'op') cannot run: drop --runnable "
                             "or search by layer")
        # 'op': stage cuts anywhere, as Aceso; priced by the model, but --aceso-config runs
        # layer cuts only
        self.granularity = granularity
        self.units = unit_starts(pm) if granularity == "layer" else list(range(pm.num_ops + 1))
        self.U = len(self.units) - 1
        self.gpn = min(pm.gpus_per_node, num_gpus)
        self.tps = [t for t in pm.db.tp_values if t <= self.gpn]
        self.mbs_local = pm.db.mbs_values
        self.max_hops, self.width, self.restart_ratio = max_hops, width, restart_ratio
        self.budget_trials, self.budget_seconds = budget_trials, budget_seconds
        # the paper's space: pipeline micro-batch sizes up to 8 (Aceso's --micro-batch-size 1 2 4 8)
        self.max_micro_batch = max_micro_batch
        # convergence stop: after a restart, give up once this many trials brought no gain
        self.patience_trials = patience_trials
        # run(): end with a best-improvement local search over every stage (search_local.polish);
        # search_all polishes only its best results instead
        self.polish = polish
        self.prune_ratio = prune_ratio
        # extra starts: stages of two sizes, rebalanced (search_local.two_level_seeds)
        self.two_level_seeds = two_level
        self.prune_after = 300
        self._hopeless_ms: Optional[float] = None
        self._run_trials = 0
        # what --aceso-config runs: stage cuts on layer boundaries, recompute of layer ops only
        self.runnable = runnable
        self.cache: Dict[State, Evaluated] = {}
        self._fit_cache: Dict[tuple, Tuple[Tuple[int, ...], float]] = {}
        self._rec_ms: Dict[tuple, float] = {}  # recompute ms of a fit (search_local)
        self.trials = 0
        self.t0 = time.perf_counter()
        # recompute candidates, ranked once per (local mbs, tp): MB saved per ms recomputed
        self._order_cache: Dict[Tuple[int, int], List[int]] = {}

    # ------------------------------------------------------------------ legality
    def legal(self, st: State) -> bool:
        mbs, bounds, tps, dps = st
        if self.gbs % mbs or (self.max_micro_batch is not None and mbs > self.max_micro_batch):
            return False
        r = 0
        for tp, dp in zip(tps, dps):
            g = tp * dp
            if g & (g - 1) or tp not in self.tps or mbs % dp or (mbs // dp) not in self.mbs_local:
                return False
            if g <= self.gpn:
                if r // self.gpn != (r + g - 1) // self.gpn:
                    return False
            elif r % self.gpn:
                return False
            r += g
        if r != self.G:
            return False
        return all(bounds[i] < bounds[i + 1] for i in range(len(bounds) - 1))

    # ------------------------------------------------------------------ recompute fit
    def _rank_ops(self, mbs_local: int, tp: int) -> List[int]:
        key = (mbs_local, tp)
        order = self._order_cache.get(key)
        if order is None:
            a = self.pm.arrays(mbs_local, tp)
            idx = [i for i in range(self.pm.num_ops) if a.act[i] > a.inp[i] * 0.5 and a.fwd[i] > 0
                   and (not self.runnable or self.pm.ops[i].layer >= 0)]
            order = sorted(idx, key=lambda i: (-(a.act[i] / a.fwd[i]), i))
            self._order_cache[key] = order
        return order

    def fit_recompute(self, mbs: int, start: int, end: int, tp: int, dp: int, s: int, S: int,
                      M: int) -> Tuple[Tuple[int, ...], float]:
        """Cheapest recompute flags that fit; returns (flags, memory MB) — the least memory
        reachable when nothing fits."""
        key = (mbs, start, end, tp, dp, min(S - s, M))
        hit = self._fit_cache.get(key)
        if hit is not None:
            return hit
        pm = self.pm
        limit = pm.memory_limit_mb
        base = Stage(start, end, tp, dp)
        mem0 = pm.stage_memory_mb(mbs, base, s, S, M)
        if mem0 <= limit:
            res = ((), mem0)
        else:
            cand = [i for i in self._rank_ops(mbs // dp, tp) if start <= i < end]

            def mem_of(k):
                fl = [0] * (end - start)
                for i in cand[:k]:
                    fl[i - start] = 1
                t = tuple(fl)
                return t, pm.stage_memory_mb(mbs, Stage(start, end, tp, dp, t), s, S, M)

            lo, hi = 1, len(cand)
            flags_hi, mem_hi = mem_of(hi)
            if mem_hi > limit:
                # not monotone in general: take the least memory among a few prefixes
                best = (flags_hi, mem_hi)
                for k in (hi // 4, hi // 2, 3 * hi // 4):
                    f, m_ = mem_of(k)
                    if m_ < best[1]:
                        best = (f, m_)
                res = best
            else:
                best = (flags_hi, mem_hi)
                while lo < hi:
                    mid = (lo + hi) // 2
                    f, m_ = mem_of(mid)
                    if m_ <= limit:
                        hi, best = mid, (f, m_)
                    else:
                        lo = mid + 1
                res = best
        self._fit_cache[key] = res
        return res

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, st: State) -> Evaluated:
        ev = self.cache.get(st)
        if ev is not None:
            return ev
        if self.budget_trials is not None and self.trials >= self.budget_trials:
            raise BudgetExhausted
        if self.budget_seconds is not None and time.perf_counter() - self.t0 > self.budget_seconds:
            raise BudgetExhausted
        self.trials += 1
        mbs, bounds, tps, dps = st
        S = len(tps)
        M = self.gbs // mbs
        stages, excess = [], 0.0
        for s in range(S):
            a, b = self.units[bounds[s]], self.units[bounds[s + 1]]
            flags, mem = self.fit_recompute(mbs, a, b, tps[s], dps[s], s, S, M)
            excess = max(excess, mem - self.pm.memory_limit_mb)
            stages.append(Stage(a, b, tps[s], dps[s], flags))
        plan = Plan(self.pm.spec.key, mbs, self.gbs, stages)
        pred = self.pm.predict(plan)
        key = (0, pred.iteration_ms) if excess <= 0 else (1, excess)
        ev = Evaluated(st, key, plan, pred)
        self.cache[st] = ev
        return ev

    # ------------------------------------------------------------------ starts
    def balance_state(self, S: int) -> Optional[State]:
        if S > self.G or S > self.U:
            return None
        base = 1 << int(math.floor(math.log2(self.G / S)))
        gpus = [base] * S
        rem = self.G - base * S
        i = 0
        while rem > 0:
            rem -= gpus[i]
            gpus[i] *= 2
            i += 1
        gpus.sort(reverse=True)
        bounds = tuple(round(k * self.U / S) for k in range(S + 1))
        tps = tuple(max(t for t in self.tps if t <= g) for g in gpus)
        dps = tuple(g // t for g, t in zip(gpus, tps))
        for m in self.mbs_local:
            st = (m * max(dps), bounds, tps, dps)
            if self.legal(st):
                return st
        return None

    def grid_states(self, S: int) -> List[State]:
        """Megatron's uniform grid with S stages: equal layers, one (tp, dp) everywhere."""
        out = []
        if self.G % S or self.U % S:
            return out
        g = self.G // S
        bounds = tuple(k * (self.U // S) for k in range(S + 1))
        for tp in self.tps:
            if g % tp:
                continue
            dp = g // tp
            for m in self.mbs_local:
                st = (m * dp, bounds, (tp,) * S, (dp,) * S)
                if self.legal(st):
                    out.append(st)
        return out

    # ------------------------------------------------------------------ primitives
    def neighbours(self, ev: Evaluated) -> List[State]:
        mbs, bounds, tps, dps = ev.state
        S = len(tps)
        pred = ev.pred
        if ev.key[0]:  # out of memory: the stage furthest over the limit
            b = max(range(S), key=lambda i: pred.stages[i].memory_mb)
            dominant = "memory"
        else:
            b = pred.bottleneck
            c = pred.stages[b]
            shares = {"compute": c.fwd_ms + c.bwd_ms, "recompute": c.recompute_ms,
                      "comm": c.p2p_fwd_ms + c.p2p_bwd_ms}
            dominant = "recompute" if shares["recompute"] > 0.15 * c.time_ms else (
                "comm" if shares["comm"] > 0.25 * c.time_ms else "compute")
        moves = {
            "move": self._move(ev.state, b),
            "inc_dp": self._grow(ev.state, b, "dp"),
            "inc_tp": self._grow(ev.state, b, "tp"),
            "dec_dp": self._shrink(ev.state, b, "dp"),
            "dec_tp": self._shrink(ev.state, b, "tp"),
            "swap": self._swap(ev.state, b),
            "inc_mbs": self._mbs(ev.state, 2),
            "dec_mbs": self._mbs(ev.state, 0.5),
        }
        order = {
            "memory": ["move", "inc_dp", "inc_tp", "dec_mbs", "swap", "dec_dp", "dec_tp", "inc_mbs"],
            "recompute": ["inc_dp", "inc_tp", "move", "dec_mbs", "swap", "inc_mbs", "dec_dp", "dec_tp"],
            "comm": ["swap", "dec_tp", "inc_mbs", "move", "inc_dp", "dec_dp", "inc_tp", "dec_mbs"],
            "compute": ["move", "inc_dp", "inc_tp", "inc_mbs", "swap", "dec_mbs", "dec_dp", "dec_tp"],
        }[dominant]
        out, seen = [], set()
        for name in order:
            for st in moves[name]:
                if st not in seen and st != ev.state and self.legal(st):
                    seen.add(st)
                    out.append(st)
        return out

    # ------------------------------------------------------------------ driver
    def _hop(self, ev: Evaluated, target: Tuple[int, float], depth: int,
             path: set) -> Optional[Evaluated]:
        """Depth-first multi-hop: first neighbour better than ``target`` wins."""
        if self._hopeless_ms is not None and self.trials - self._run_trials >= self.prune_after \
                and target[1] > self._hopeless_ms:
            raise BudgetExhausted  # far behind another stage count: not worth the deep step
        cands = []
        for st in self.neighbours(ev):
            if st in path:
                continue
            n = self.evaluate(st)
            if n.key < target:
                return n
            cands.append(n)
        if depth >= self.max_hops:
            return None
        cands.sort(key=lambda e: e.key)
        for n in cands[: self.width]:
            path.add(n.state)
            r = self._hop(n, target, depth + 1, path)
            if r is not None:
                return r
        return None

    def run(self, S: int, seeds: Sequence[Evaluated] = (),
             incumbent_ms: Optional[float] = None) -> SearchResult:
        """Search with S stages. ``seeds`` are already-evaluated plans (the grid point): the
        search starts from them too, and keeps their recompute choice where it is better
        than the greedy fit, so the result is never worse than a seed. ``incumbent_ms``: the
        best time another stage count reached; no restarts once this one is ``prune_ratio``
        behind it (restarts rarely gain more than a few per cent), and after ``prune_after``
        trials no deep step from a state three times that far behind."""
        self.t0 = time.perf_counter()
        self._run_trials = self.trials
        self._hopeless_ms = None
        if incumbent_ms is not None and self.prune_ratio is not None:
            self._hopeless_ms = incumbent_ms * (1 + 3 * (self.prune_ratio - 1))
        best: Optional[Evaluated] = None
        started: set = set()
        hops = restarts = 0
        gained_at = 0  # trial count at the last improvement of the best
        try:
            starts = [e for e in seeds if e is not None and self.legal(e.state)]
            for seed in starts:
                own = self.evaluate(seed.state)
                if seed.key < own.key:
                    self.cache[seed.state] = seed
            bal = self.balance_state(S)
            extra = two_level_seeds(self, S) if self.two_level_seeds else []
            for st in [e.state for e in starts] + ([bal] if bal is not None else []) + extra:
                ev = self.evaluate(st)
                if best is None or ev.key < best.key:
                    best = ev
            cur = best
            while cur is not None:
                started.add(cur.state)
                nxt = self._hop(cur, cur.key, 1, {cur.state})
                if nxt is not None:
                    hops += 1
                    cur = nxt
                    if cur.key < best.key:
                        best = cur
                        gained_at = self.trials
                    continue
                if incumbent_ms is not None and self.prune_ratio is not None and \
                        (best.key[0] or best.key[1] > incumbent_ms * self.prune_ratio):
                    break  # hopeless against the other stage counts
                if self.patience_trials is not None and restarts and \
                        self.trials - gained_at >= self.patience_trials:
                    break  # converged: a restart brought no gain in patience_trials trials
                # restart from the best unexplored state near the best
                pool = [e for e in self.cache.values()
                        if e.state not in started and len(e.state[2]) == S and e.key[0] == best.key[0]
                        and e.key[1] <= best.key[1] * self.restart_ratio]
                if not pool:
                    break
                cur = min(pool, key=lambda e: (e.key, e.state))
                restarts += 1
            if best is not None and self.polish:
                best = polish(self, best, self.evaluate, self.stage_moves)
        except BudgetExhausted:
            pass
        return SearchResult(S, best, self.trials, time.perf_counter() - self.t0, hops, restarts)


def best_grid(pm: PerfModel, num_gpus: int, global_batch: int,
              recompute_modes: Sequence[str] = ("none", "full"),
              max_micro_batch: Optional[int] = None) -> Tuple[Optional[Evaluated], int]:
    """Best Megatron uniform configuration (pp, tp, dp, micro-batch, full recompute on/off)."""
    srch = Searcher(pm, num_gpus, global_batch, max_micro_batch=max_micro_batch)
    best, n = None, 0
    for S in range(1, min(num_gpus, srch.U) + 1):
        for st in srch.grid_states(S):
            for mode in recompute_modes:
                ev = _grid_eval(srch, st, mode)
                n += 1
                if ev is not None and (best is None or ev.key < best.key):
                    best = ev
    return best, n


def refit_recompute(pm: PerfModel, plan: Plan) -> Prediction:
    """``plan``'s layout (stage ops, TP, DP, micro-batch) with each stage's recompute chosen by
    this model's fit (the least recompute that fits): how another planner's configuration is
    compared here when its own recompute choice does not fit this memory model."""
    srch = Searcher(pm, plan.num_gpus, plan.global_batch)
    S, M = len(plan.stages), plan.global_batch // plan.micro_batch
    stages = [Stage(st.start, st.end, st.tp, st.dp,
                    srch.fit_recompute(plan.micro_batch, st.start, st.end, st.tp, st.dp, s, S, M)[0])
              for s, st in enumerate(plan.stages)]
    return pm.predict(Plan(plan.model, plan.micro_batch, plan.global_batch, stages))


def _grid_eval(srch: Searcher, st: State, mode: str) -> Optional[Evaluated]:
    mbs, bounds, tps, dps = st
    pm = srch.pm
    S = len(tps)
    stages = []
    for s in range(S):
        a, b = srch.units[bounds[s]], srch.units[bounds[s + 1]]
        flags = ()
        if mode == "full":  # Megatron checkpoints every transformer layer
            flags = tuple(1 if pm.ops[i].layer >= 0 else 0 for i in range(a, b))
        stages.append(Stage(a, b, tps[s], dps[s], flags))
    plan = Plan(pm.spec.key, mbs, srch.gbs, stages)
    pred = pm.predict(plan)
    if not pred.fits:
        return None
    return Evaluated(st, (0, pred.iteration_ms), plan, pred)


def _search_one(args, incumbent_ms=None):
    pm, G, gbs, S, kw, seeds = args
    return Searcher(pm, G, gbs, **kw).run(S, seeds, incumbent_ms)


def search_all(pm: PerfModel, num_gpus: int, global_batch: int, *,
               budget_trials: Optional[int] = None, budget_seconds: Optional[float] = None,
               max_stages: int = 16, jobs: int = 1, progress=None, polish_top: int = 1,
               **kw) -> List[SearchResult]:
    """One search per stage count (in ``jobs`` processes), each seeded with the best grid point
    of that stage count, then the final polish of the best ``polish_top`` results. Returns the
    results sorted best first."""
    probe = Searcher(pm, num_gpus, global_batch,  # the grid cuts by layer
                     max_micro_batch=kw.get("max_micro_batch"))
    counts = list(range(1, min(num_gpus, probe.U, max_stages) + 1))
    tasks = []
    for S in counts:
        seeds = []
        gbest = None
        for st in probe.grid_states(S):
            for mode in ("none", "full"):
                ev = _grid_eval(probe, st, mode)
                if ev is not None and (gbest is None or ev.key < gbest.key):
                    gbest = ev
        if gbest is not None:
            if kw.get("granularity", "layer") == "op":  # the same plan, cuts as op indices
                mbs, bounds, tps, dps = gbest.state
                gbest = Evaluated((mbs, tuple(probe.units[b] for b in bounds), tps, dps),
                                  gbest.key, gbest.plan, gbest.pred)
            seeds.append(gbest)
        tasks.append((pm, num_gpus, global_batch, S,
                      dict(budget_trials=budget_trials, budget_seconds=budget_seconds, **kw), seeds))
    # most promising stage counts first (by their grid seed), so the pruning bound is tight early
    tasks.sort(key=lambda t: (t[5][0].key if t[5] else (2, 0.0), t[3]))
    if jobs > 1:
        with mp.get_context("fork").Pool(jobs) as pool:
            results = []
            for r in pool.imap(_search_one, tasks):
                results.append(r)
                if progress:
                    progress(r)
    else:
        results = []
        for t in tasks:
            fit = [x.best.key[1] for x in results if x.best is not None and x.best.key[0] == 0]
            r = _search_one(t, min(fit) if fit else None)  # one process: prune against the best
            results.append(r)
            if progress:
                progress(r)
    results = [r for r in results if r.best is not None]
    results.sort(key=lambda r: (r.best.key, r.num_stages))
    # the final polish (every stage a target, resource changes rebalanced) is costly at op
    # granularity, so only the best ``polish_top`` stage counts get it
    for r in results[:polish_top]:
        left = None if budget_trials is None else budget_trials - r.trials
        if r.best.key[0] or (left is not None and left <= 0):
            continue
        srch = Searcher(pm, num_gpus, global_batch, budget_trials=left,
                        budget_seconds=budget_seconds, **kw)
        t0 = time.perf_counter()
        try:
            r.best = polish(srch, r.best, srch.evaluate, srch.stage_moves)
        except BudgetExhausted:
            pass
        r.trials += srch.trials
        r.seconds += time.perf_counter() - t0
    results.sort(key=lambda r: (r.best.key, r.num_stages))
    return results
