"""Two stronger neighbourhood moves for the Aceso search (``search.Searcher``):

* ``rebalance``: keep the micro-batch and each stage's TP and DP, and re-cut the stage
  boundaries so the slowest stage is as fast as possible (a min-max partition: a binary
  search on the stage-time threshold, each threshold checked by filling stages greedily from
  the front). A stage's time is the model's own per-stage time — compute, the recompute its
  memory fit needs at that pipeline position, and its point-to-point transfers — and a stage
  that cannot fit at any recompute is not allowed. Aceso's op-migration primitive moves a few
  ops per hop towards balance; this lands on it in one move, which is what makes a TP/DP or
  micro-batch change pay off at once instead of several hops later.
* ``polish``: a final local search from a result: every stage (not only the bottleneck) is a
  target for every primitive, each resource change is followed by a rebalance, and the best
  neighbour is taken while it lowers the iteration time.

Both only propose states; the searcher evaluates them (and counts them as trials).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

State = Tuple[int, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]
INF = float("inf")


class _StageTimes:
    """Per-stage time of units [a, b) at pipeline position s, for one (mbs, tps, dps)."""

    def __init__(self, srch, mbs: int, tps, dps):
        self.s, self.mbs, self.tps, self.dps = srch, mbs, tps, dps
        pm = srch.pm
        self.S = len(tps)
        self.M = srch.gbs // mbs
        self.arr = [pm.arrays(mbs // d, t) for t, d in zip(tps, dps)]
        self.first = [0]
        for t, d in zip(tps, dps):
            self.first.append(self.first[-1] + t * d)
        self.cache: Dict[Tuple[int, int, int], float] = {}

    def _p2p_in(self, s: int, a: int) -> float:
        # what stage s receives: the previous stage's whole boundary activation over its DP
        pm = self.s.pm
        full = self.arr[s - 1].out[a - 1] * self.dps[s - 1]
        inter = pm._inter(self.first[s - 1], self.first[s + 1])
        return pm.db.p2p_ms(full / self.dps[s], inter)

    def _p2p_out(self, s: int, b: int) -> float:
        pm = self.s.pm
        full = self.arr[s].out[b - 1] * self.dps[s]
        inter = pm._inter(self.first[s], self.first[s + 2])
        g = self.tps[s] * self.dps[s]
        return pm.db.p2p_ms(full * self.tps[s + 1] / g, inter)

    def time(self, s: int, ua: int, ub: int) -> float:
        key = (s, ua, ub)
        t = self.cache.get(key)
        if t is not None:
            return t
        srch = self.s
        a, b = srch.units[ua], srch.units[ub]
        tp, dp = self.tps[s], self.dps[s]
        flags, mem = srch.fit_recompute(self.mbs, a, b, tp, dp, s, self.S, self.M)
        if mem > srch.pm.memory_limit_mb:
            t = INF
        else:
            x = self.arr[s]
            t = x.pf[b] - x.pf[a] + x.pb[b] - x.pb[a]
            if flags:
                rkey = (x.key, a, flags)
                r = srch._rec_ms.get(rkey)
                if r is None:
                    r = srch._rec_ms[rkey] = sum(x.fwd[a + j] for j, f in enumerate(flags) if f)
                t += r
            p = (self._p2p_in(s, a) if s > 0 else 0.0) + (self._p2p_out(s, b) if s < self.S - 1 else 0.0)
            t += 2.0 * p  # forward activation and backward gradient
        self.cache[key] = t
        return t


def _greedy(st: _StageTimes, U: int, T: float) -> Optional[Tuple[int, ...]]:
    """Stage cuts with every stage's time <= T, each stage as long as it can be (front first);
    None when the last stage is left with more than T. Assumes a stage's time grows with its
    length (true up to the point-to-point size of the cut op)."""
    S = st.S
    bounds = [0]
    a = 0
    for s in range(S - 1):
        lo, hi = a + 1, U - (S - 1 - s)
        if lo > hi or st.time(s, a, lo) > T:
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if st.time(s, a, mid) <= T:
                lo = mid
            else:
                hi = mid - 1
        bounds.append(lo)
        a = lo
    if a >= U or st.time(S - 1, a, U) > T:
        return None
    bounds.append(U)
    return tuple(bounds)


def rebalance(srch, state: State, rel_tol: float = 2e-4) -> Optional[State]:
    """``state`` with its stage cuts re-chosen to minimise the slowest stage's time."""
    mbs, bounds, tps, dps = state
    S = len(tps)
    if S == 1:
        return None
    st = _StageTimes(srch, mbs, tps, dps)
    U = srch.U
    hi = max(st.time(s, bounds[s], bounds[s + 1]) for s in range(S))
    best = bounds if hi < INF else None
    if hi == INF:  # start from the compute-only time of the whole model as the upper bound
        x = st.arr[0]
        hi = 4.0 * (x.pf[-1] + x.pb[-1])
        got = _greedy(st, U, hi)
        if got is None:
            return None
        best = got
    # a lower bound: the whole model's compute spread over the stages' GPU shares, no overhead
    lo = 0.0
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        got = _greedy(st, U, mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    if best is None:
        return None
    best = _refine(st, list(best))
    if best == bounds:
        return None
    return (mbs, best, tps, dps)


def _refine(st: _StageTimes, bounds: List[int], window: int = 3) -> Tuple[int, ...]:
    """Move each cut within ``window`` units to where the slower of its two stages is fastest.
    A stage's time is not quite monotone in its length (the cut op's output sets its
    point-to-point time), which the greedy fill assumes; this repairs that locally."""
    changed = True
    while changed:
        changed = False
        for k in range(1, len(bounds) - 1):
            lo, hi = bounds[k - 1] + 1, bounds[k + 1] - 1
            cur = max(st.time(k - 1, bounds[k - 1], bounds[k]), st.time(k, bounds[k], bounds[k + 1]))
            for c in range(max(lo, bounds[k] - window), min(hi, bounds[k] + window) + 1):
                v = max(st.time(k - 1, bounds[k - 1], c), st.time(k, c, bounds[k + 1]))
                if v < cur * (1 - 1e-9):
                    cur, bounds[k], changed = v, c, True
    return tuple(bounds)


def polish(srch, ev, evaluate: Callable, neighbours_of: Callable[[State, int], List[State]],
           patience: Optional[int] = None):
    """Best-improvement local search from ``ev`` over every stage's primitives, each resource
    change also tried rebalanced; stops at a local optimum (or after ``patience`` trials
    without gain). Returns the best evaluated state."""
    best = ev
    start_trials = srch.trials
    while True:
        cur = best
        mbs, bounds, tps, dps = cur.state
        cands: List[State] = []
        rb = rebalance(srch, cur.state)
        if rb is not None:
            cands.append(rb)
        for s in range(len(tps)):
            cands.extend(neighbours_of(cur.state, s))
        seen = {cur.state}
        improved = None
        for c in cands:
            for cc in (c, None):
                if cc is None:
                    if c[0] == mbs and c[2] == tps and c[3] == dps:
                        continue  # a pure re-cut: rebalancing it again changes nothing new
                    cc = rebalance(srch, c)
                    if cc is None:
                        continue
                if cc in seen or not srch.legal(cc):
                    continue
                seen.add(cc)
                n = evaluate(cc)
                if n.key < best.key and (improved is None or n.key < improved.key):
                    improved = n
        if improved is None:
            return best
        best = improved
        if patience is not None and srch.trials - start_trials > patience:
            return best


def two_level_seeds(srch, S: int, top: int = 2) -> List[State]:
    """Start points beyond the uniform grid: S stages of two sizes, the k larger ones (2g GPUs)
    first or last, one TP per size class, cuts proportional to GPUs; the ``top`` best by the
    model, each re-cut by ``rebalance``. Early stages keep more micro-batches in flight, so
    giving them more GPUs is the heterogeneous layout the bottleneck moves reach only slowly
    (GPT-13B on 32 GPUs: 6 x 4 + 4 x 2 GPUs)."""
    G, U = srch.G, srch.U
    cands: List[State] = []
    g = 1
    while g * S < G:
        k = G // g - S  # g * (S + k) == G with k stages of 2g GPUs
        if g * (S + k) == G and 0 < k < S:
            for big_first in (True, False):
                gpus = [2 * g] * k + [g] * (S - k) if big_first else [g] * (S - k) + [2 * g] * k
                acc, bounds = 0, [0]
                for x in gpus[:-1]:
                    acc += x
                    bounds.append(max(bounds[-1] + 1, round(U * acc / G)))
                bounds.append(U)
                if any(bounds[i] >= bounds[i + 1] for i in range(S)):
                    continue
                for tb in srch.tps:
                    for ts in srch.tps:
                        if (2 * g) % tb or g % ts:
                            continue
                        tps = tuple(tb if x == 2 * g else ts for x in gpus)
                        dps = tuple(x // t for x, t in zip(gpus, tps))
                        for m in srch.mbs_local:
                            st = (m * max(dps), tuple(bounds), tps, dps)
                            if srch.legal(st):
                                cands.append(st)
        g *= 2
    scored = sorted((srch.evaluate(st).key, st) for st in cands)
    out = []
    for _, st in scored[:top]:
        rb = rebalance(srch, st)
        out.append(rb if rb is not None else st)
    return out
