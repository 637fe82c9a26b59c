"""Micro-batches of packed rows (a micro-batch is a set of rows, a row a set of documents run
with per-document attention), priced by `attention_cost`, for the packing baselines and for
DynaPipe's search over them.

A row is what `megatron.data.packing.next_fit_rows` / `pack_samples` build at run time: a GPT
sample of planned length l occupies l + 1 tokens (its last label token) of a row of
max_len + 1, of which the model runs max_len; a T5 row holds (input, target) pairs with both
sides within max_len. Row-building policies:

* next-fit in data order (`next_fit`): Megatron-Core THD packing, this project's
  `--pack-dataset`;
* cost-balanced (`balanced`): WLB-LLM's idea (Wang et al., 2025): documents, costliest first,
  each go to the micro-batch of least estimated cost (token part + attention part, from the
  attention split) that has room for it, so micro-batches carry similar work;
* first-fit decreasing (`dense_rows`): fewest rows, for DynaPipe's variable-size partition.

`search_packed` is DynaPipe's search over such micro-batches: the baselines' own micro-batches
(next-fit and balanced, every micro-batch size) and an optimal variable-size partition of
dense rows, each DP-split and scheduled with the planner's schedule search. Since the search
includes 1F1B in the baselines' order on the baselines' micro-batches, its plan is never
slower than theirs under the same cost model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from megatron.data.packing import next_fit_rows
from megatron.planner import partitioner as part
from megatron.planner.schedules import one_f_one_b, search
from megatron.planner.simulator import PipelineCosts, simulate

SIZES = (1, 2, 4, 8, 16, 32, 64)


def row_sizes(kind: str, lengths, max_len: int):
    """(per-sample row occupancy, row capacity) as the data path packs them."""
    if kind == "gpt":
        lens = np.minimum(np.asarray(lengths, dtype=np.int64).reshape(-1), max_len)
        return lens + 1, max_len + 1
    pairs = np.minimum(np.asarray(lengths, dtype=np.int64).reshape(-1, 2), max_len)
    return pairs, max_len


def doc_lengths(kind: str, lengths, max_len: int):
    """(encoder/GPT, decoder) lengths each document runs attention over (decoder 0 for GPT)."""
    if kind == "gpt":
        e = np.minimum(np.asarray(lengths, dtype=np.float64).reshape(-1), max_len)
        return e, np.zeros_like(e)
    p = np.minimum(np.asarray(lengths, dtype=np.float64).reshape(-1, 2), max_len)
    return p[:, 0], p[:, 1]


def next_fit(kind: str, lengths, max_len: int) -> List[List[int]]:
    sizes, cap = row_sizes(kind, lengths, max_len)
    return next_fit_rows(sizes, cap)


def _tuples(sizes) -> list:
    """Sizes as tuples of Python ints (GPT (tokens,), T5 (input, target)): fast fit checks."""
    return [tuple(int(v) for v in np.atleast_1d(s)) for s in sizes]


def _fits(s, f) -> bool:
    return all(a <= b for a, b in zip(s, f))


def _minus(f, s) -> tuple:
    return tuple(a - b for a, b in zip(f, s))


def dense_rows(kind: str, lengths, max_len: int) -> List[List[int]]:
    """First-fit decreasing (longest documents first): the fewest, fullest rows."""
    sizes, cap = row_sizes(kind, lengths, max_len)
    key = sizes if sizes.ndim == 1 else sizes.sum(axis=1)
    sizes = _tuples(sizes)
    rows, free = [], []
    for i in np.argsort(-key, kind="stable").tolist():
        s = sizes[i]
        for r, f in enumerate(free):
            if _fits(s, f):
                rows[r].append(i)
                free[r] = _minus(f, s)
                break
        else:
            rows.append([i])
            free.append(_minus((cap,) * len(s), s))
    return rows


def document_cost(planner, kind: str, lengths, max_len: int, rc: Optional[str] = None) -> np.ndarray:
    """Estimated forward + backward time of each document alone (token part + attention part
    of the attention split; per layer, so only its ratios matter)."""
    tp = planner.cfg.tensor_parallel
    rc = rc or next(r for r in planner.cfg.recompute_levels if planner.cm.has(tp, r))
    e, d = doc_lengths(kind, lengths, max_len)
    total = np.zeros_like(e)
    for q in ("forward_ms", "backward_ms"):
        sp = planner.attention.split(tp, rc, "encoder", q)
        if sp is not None:
            total += sp.coef["tokens"] * e + sp.coef["quad"] * e * e
        if kind == "t5" and planner.cm.has(tp, rc) and "decoder" in planner.cm.profile(tp, rc).components:
            sd = planner.attention.split(tp, rc, "decoder", q)
            if sd is not None:
                c = sd.coef
                total += c["enc_tokens"] * e + c["tokens"] * d + c["quad"] * d * d + c["cross"] * e * d
    return np.maximum(total, 1e-9)


def balanced(planner, kind: str, lengths, max_len: int, b: int, num_microbatches: Optional[int] = None,
             rc: Optional[str] = None) -> List[List[List[int]]]:
    """Cost-balanced micro-batches of at most `b` rows (WLB-LLM's packing): documents costliest
    first, each into the micro-batch of least estimated cost with a row that has room (the row
    with least free space that fits, to keep rows full); a new micro-batch when none has room.
    Starts from as many micro-batches as next-fit packing makes."""
    sizes, cap = row_sizes(kind, lengths, max_len)
    n0 = num_microbatches or -(-len(next_fit_rows(sizes, cap)) // b)
    cost = document_cost(planner, kind, lengths, max_len, rc).tolist()
    sizes = _tuples(sizes)
    mbs = [[] for _ in range(n0)]  # per micro-batch: rows (lists of indices)
    free = [[] for _ in range(n0)]  # per micro-batch: free space per row
    load = [0.0] * n0
    for i in sorted(range(len(cost)), key=lambda k: -cost[k]):
        s = sizes[i]
        placed = False
        for m in sorted(range(len(load)), key=load.__getitem__):
            fits = [r for r, f in enumerate(free[m]) if _fits(s, f)]
            if fits:
                r = min(fits, key=lambda r: sum(free[m][r]))
            elif len(mbs[m]) < b:
                mbs[m].append([])
                free[m].append((cap,) * len(s))
                r = len(mbs[m]) - 1
            else:
                continue
            mbs[m][r].append(i)
            free[m][r] = _minus(free[m][r], s)
            load[m] += cost[i]
            placed = True
            break
        if not placed:
            mbs.append([[i]])
            free.append([_minus((cap,) * len(s), s)])
            load.append(cost[i])
    return [[sorted(r) for r in m] for m in mbs if m]


@dataclass
class PackedShapes:
    """Per micro-batch: rows, row length(s) and the squared-length sums attention pays."""

    rows: List[List[List[int]]]  # micro-batch -> rows -> sample indices
    mbs: np.ndarray  # rows per micro-batch
    enc: np.ndarray  # row length (GPT, T5 encoder)
    dec: Optional[np.ndarray]  # T5 decoder row length (padded), None for GPT
    quad: tuple  # (sum e^2, sum d^2, sum e*d) per micro-batch
    real_tokens: int

    @property
    def computed_tokens(self) -> float:
        return float((self.mbs * (self.enc + (0 if self.dec is None else self.dec))).sum())


def shapes_of(planner, kind: str, lengths, max_len: int, microbatches: List[List[List[int]]]) -> PackedShapes:
    e, d = doc_lengths(kind, lengths, max_len)
    n = len(microbatches)
    mbs = np.array([len(m) for m in microbatches], float)
    enc = np.full(n, float(max_len))
    qe = np.array([sum(float(e[i] ** 2) for r in m for i in r) for m in microbatches])
    if kind == "gpt":
        dec, qd, qx = None, np.zeros(n), np.zeros(n)
    else:
        # The decoder row holds the row's targets plus the bos/eos the runtime adds, padded;
        # at most a max-length sequence (as the dense packing baseline prices it).
        extra, pad = planner.cfg.decoder_extra_tokens, planner._pad
        dec = np.array([min(int(pad(max(sum(d[i] for i in r) for r in m) + extra)), int(pad(max_len)))
                        for m in microbatches], float)
        qd = np.array([sum(float((d[i] + extra) ** 2) for r in m for i in r) for m in microbatches])
        qx = np.array([sum(float(e[i] * (d[i] + extra)) for r in m for i in r) for m in microbatches])
    real = int(np.asarray(lengths, dtype=np.int64).sum())
    return PackedShapes(microbatches, mbs, enc, dec, (qe, qd, qx), real)


def pipeline_costs(planner, rc: str, sh: PackedShapes, idx=None) -> Optional[PipelineCosts]:
    """Costs of the micro-batches `idx` (default all); None if one is infeasible."""
    idx = np.arange(len(sh.mbs)) if idx is None else np.asarray(idx)
    dec = None if sh.dec is None else sh.dec[idx]
    sc = planner.stage_costs(rc, sh.mbs[idx], sh.enc[idx], dec, packed=tuple(q[idx] for q in sh.quad))
    if not (np.isfinite(sc["fwd"]).all() and np.isfinite(sc["peak"]).all()):
        return None
    return PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], np.array(sc["comm"]),
                         grad_comm=np.array(sc["grad_comm"]) if "grad_comm" in sc else None,
                         grad_comm_epilogue_only=planner.cfg.grad_compress_epilogue_only)


def contiguous_groups(n: int, dp: int):
    """The baselines' DP split: contiguous blocks of micro-batches; None with fewer than dp."""
    if n < dp:
        return None
    per = -(-n // dp)
    return [list(range(k * per, min((k + 1) * per, n))) for k in range(dp) if k * per < n]


def one_f_one_b_time(planner, rc: str, sh: PackedShapes, groups) -> float:
    """Megatron's run of these micro-batches: 1F1B in data order per DP group, slowest group;
    inf if a micro-batch does not fit or the 1F1B peak passes a stage's memory."""
    worst = 0.0
    for g in groups:
        costs = pipeline_costs(planner, rc, sh, g)
        if costs is None:
            return np.inf
        res = simulate(costs, one_f_one_b(planner.S, list(range(len(g)))))
        if any(p > a for p, a in zip(res.peak_memory, planner.available)):
            return np.inf
        worst = max(worst, res.makespan)
    return worst


def variable_partition(planner, rc: str, kind: str, lengths, max_len: int) -> Optional[List[List[List[int]]]]:
    """DynaPipe's optimal partition over packed rows: dense rows ordered by attention work,
    cut into variable-size micro-batches minimising (S-1) * max + sum / DP."""
    rows = dense_rows(kind, lengths, max_len)
    one = shapes_of(planner, kind, lengths, max_len, [[r] for r in rows])
    order = np.argsort(-(one.quad[0] + one.quad[1] + one.quad[2]), kind="stable")
    N = len(rows)
    M = min(N, 64)
    i = np.repeat(np.arange(N), M)
    m = np.tile(np.arange(1, M + 1), N)
    ok = i + m <= N
    cum = [np.concatenate([[0.0], np.cumsum(q[order])]) for q in one.quad]
    end = np.minimum(i + m, N)
    quad = tuple(c[end] - c[i] for c in cum)
    dec = None
    if one.dec is not None:
        dmax = one.dec[order]
        dec = np.array([dmax[a:b].max() for a, b in zip(i, end)])
    sc = planner.stage_costs(rc, m.astype(float), np.full(len(i), float(max_len)), dec, packed=quad)
    T = np.where(planner._feasible(sc, "1f1b") & ok, (sc["fwd"] + sc["bwd"]).max(axis=0), np.inf).reshape(N, M)
    try:
        p = part.optimal_partition(T, planner.S, planner.cfg.data_parallel)
    except part.PartitionError:
        return None
    bnd = p.boundaries
    return [[rows[int(order[k])] for k in range(bnd[j], bnd[j + 1])] for j in range(len(bnd) - 1)]


def fixed_size_candidates(planner, kind: str, lengths, max_len: int, sizes=SIZES):
    """(name, micro-batches): the baselines' own micro-batches at every size (the balanced
    ones estimated at the first recompute level, as `baselines` does)."""
    out, seen = [], set()
    nf = next_fit(kind, lengths, max_len)
    for b in sizes:
        for name, mbs in ((f"packing_varlen/b{b}", [nf[k:k + b] for k in range(0, len(nf), b)]),
                          (f"packing_balanced/b{b}", balanced(planner, kind, lengths, max_len, b))):
            key = repr(mbs)
            if key not in seen:  # large b: one micro-batch of every row, the same for all
                seen.add(key)
                out.append((name, mbs))
    return out


def search_packed(planner, kind: str, lengths, max_len: int, bound: float = np.inf, keep: int = 3):
    """Fastest plan over packed-row micro-batches: every candidate is timed under 1F1B in data
    order (what the baselines run); the `keep` best get the full schedule search (1F1B and
    adaptive, micro-batch orders, contiguous and Karmarkar-Karp DP splits), each keeping its
    1F1B result unless the search beats it. Returns (makespan, rc, shapes, [(group, choice)])
    or None when nothing beats `bound`."""
    cfg, dp = planner.cfg, planner.cfg.data_parallel
    fixed = [(name, shapes_of(planner, kind, lengths, max_len, mbs))
             for name, mbs in fixed_size_candidates(planner, kind, lengths, max_len)]
    quick = []  # (1F1B time, name, rc, shapes, groups), the `keep` best so far
    for rc in cfg.recompute_levels:
        if not planner.cm.has(cfg.tensor_parallel, rc):
            continue
        cands = list(fixed)
        vp = variable_partition(planner, rc, kind, lengths, max_len)
        if vp is not None:
            cands.append(("partition", shapes_of(planner, kind, lengths, max_len, vp)))
        for name, sh in cands:
            groups = contiguous_groups(len(sh.mbs), dp)
            if groups is None:
                continue
            costs = pipeline_costs(planner, rc, sh)
            if costs is None:
                continue
            worst = 0.0
            cut = quick[keep - 1][0] if len(quick) >= keep else np.inf
            for g in groups:  # 1F1B in data order: what the baselines run
                ch = search(costs.subset(g), planner.available, orders=[list(range(len(g)))],
                            schedules=("1f1b",), bound=cut)
                if ch is None:
                    worst = np.inf
                    break
                worst = max(worst, ch.result.makespan)
            if np.isfinite(worst):
                quick.append((worst, name, rc, sh, groups))
                quick.sort(key=lambda x: x[0])
                quick = quick[:keep]
    best = None
    for t, name, rc, sh, groups in quick:
        costs = pipeline_costs(planner, rc, sh)
        splits = [groups]
        times = (costs.fwd + costs.bwd).max(axis=0)
        kk = part.balance_groups(times.tolist(), dp)
        if kk != groups:
            splits.append(kk)
        for split in splits:
            got = _schedule(planner, costs, split, min(bound, best[0] if best else np.inf), full=False)
            if got is not None:
                best = (got[0], rc, sh, got[1], name, costs)
    if best is None:
        return None
    # The full order search (clusters, polish) on the winner only, as DynaPipe's `_refine`.
    makespan, rc, sh, groups, name, costs = best
    full = _schedule(planner, costs, [g for g, _ in groups], makespan, full=True)
    if full is not None:
        makespan, groups = full
    return makespan, rc, sh, groups, name


def _schedule(planner, costs, split, bound, full: bool):
    """(slowest group's makespan, [(group, ScheduleChoice)]) beating `bound`, or None."""
    cfg = planner.cfg
    out, makespan = [], 0.0
    for g in split:
        ch = search(costs.subset(g), planner.available, schedules=cfg.schedules, bound=bound,
                    max_orders=cfg.max_orders, num_clusters=cfg.order_clusters if full else 0,
                    polish_budget=None if full else 0, exhaustive_up_to=cfg.exhaustive_orders_up_to)
        if ch is None:
            return None
        makespan = max(makespan, ch.result.makespan)
        out.append((g, ch))
    return makespan, out
