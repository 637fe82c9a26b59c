"""Micro-batches of packed rows (a micro-batch is a set of rows, a row a set of documents run
with per-document attention), priced by `attention_cost`, for the packing baselines and for
DynaPipe's search over them.

A row is what `megatron.data.packing.next_fit_rows` / `pack_samples` build at run time: a GPT
sample of planned length l occupies l + 1 tokens (its last label token) of a row of
max_len + 1, of which the model runs max_len; a T5 row holds (input, target) pairs with both
sides within max_len (or, `max_len` = (encoder, decoder) lengths, each side within its own:
the trainer's --encoder-seq-length / --decoder-seq-length). Row-building policies:

* next-fit in data order (`next_fit`): Megatron-Core THD packing, this project's
  `--pack-dataset`;
* cost-balanced (`balanced`): WLB-LLM's idea (Wang et al., 2025): documents, costliest first,
  each go to the micro-batch of least estimated cost (token part + attention part, from the
  attention split) that has room for it, so micro-batches carry similar work;
* first/best-fit decreasing (`dense_rows`): fewest rows, for DynaPipe's variable-size partition.

`search_packed` is DynaPipe's search over such micro-batches: the baselines' own micro-batches
(next-fit and balanced, every micro-batch size) and an optimal variable-size partition of
dense rows, each DP-split and scheduled with the planner's schedule search. Since the search
includes 1F1B in the baselines' order on the baselines' micro-batches, its plan is never
slower than theirs under the same cost model.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from megatron.data.packing import next_fit_rows
from megatron.planner.dynapipe import partitioner as part
from megatron.planner.schedule.schedules import one_f_one_b, search
from megatron.planner.schedule.simulator import PipelineCosts, simulate
from megatron.planner.schedule.zb_search import planned_split

SIZES = (1, 2, 4, 8, 16, 32, 64)


def caps(max_len):
    """(encoder/GPT, decoder) row lengths from one max length or an (encoder, decoder) pair."""
    return tuple(int(x) for x in max_len) if np.ndim(max_len) else (int(max_len), int(max_len))


def row_sizes(kind: str, lengths, max_len):
    """(per-sample row occupancy, row capacity) as the data path packs them (T5: capacity is
    an (encoder, decoder) pair)."""
    ce, cd = caps(max_len)
    if kind == "gpt":
        lens = np.minimum(np.asarray(lengths, dtype=np.int64).reshape(-1), ce)
        return lens + 1, ce + 1
    pairs = np.minimum(np.asarray(lengths, dtype=np.int64).reshape(-1, 2), [ce, cd])
    return pairs, (ce, cd)


def doc_lengths(kind: str, lengths, max_len):
    """(encoder/GPT, decoder) lengths each document runs attention over (decoder 0 for GPT)."""
    ce, cd = caps(max_len)
    if kind == "gpt":
        e = np.minimum(np.asarray(lengths, dtype=np.float64).reshape(-1), ce)
        return e, np.zeros_like(e)
    p = np.minimum(np.asarray(lengths, dtype=np.float64).reshape(-1, 2), [ce, cd])
    return p[:, 0], p[:, 1]


def next_fit(kind: str, lengths, max_len) -> List[List[int]]:
    sizes, cap = row_sizes(kind, lengths, max_len)
    return next_fit_rows(sizes, cap)


def _pairs(sizes) -> list:
    """Sizes as (first, second) Python ints (GPT (tokens, 0), T5 (input, target)): fast fit checks."""
    a = np.asarray(sizes, dtype=np.int64)
    return [(int(x), 0) for x in a] if a.ndim == 1 else [(int(x), int(y)) for x, y in a]


def _best_fit_1d(sizes, cap, order) -> List[List[int]]:
    """Best-fit decreasing for one-sided rows: each sample into the row with least free space
    that holds it (ties: the earliest row), else a new row."""
    import bisect
    rows, free = [], []  # free: sorted (free tokens, row index)
    for i in order:
        s = sizes[i]
        k = bisect.bisect_left(free, (s, -1))
        if k < len(free):
            f, r = free.pop(k)
            rows[r].append(i)
            bisect.insort(free, (f - s, r))
        else:
            rows.append([i])
            bisect.insort(free, (cap - s, len(rows) - 1))
    return rows


def dense_rows(kind: str, lengths, max_len) -> List[List[int]]:
    """Longest documents first, each into a row that holds it (GPT: best fit, T5: first fit):
    the fewest, fullest rows."""
    sizes, cap = row_sizes(kind, lengths, max_len)
    key = sizes if sizes.ndim == 1 else sizes.sum(axis=1)
    if sizes.ndim == 1:  # GPT: best fit, by bisection over the rows' free space
        return _best_fit_1d(sizes.tolist(), cap, np.argsort(-key, kind="stable").tolist())
    sizes = _pairs(sizes)
    rows, free = [], []
    for i in np.argsort(-key, kind="stable").tolist():
        a, b = sizes[i]
        for r, (fa, fb) in enumerate(free):
            if a <= fa and b <= fb:
                rows[r].append(i)
                free[r] = (fa - a, fb - b)
                break
        else:
            rows.append([i])
            free.append((cap[0] - a, cap[1] - b))
    return rows


def document_cost(planner, kind: str, lengths, max_len, rc: Optional[str] = None) -> np.ndarray:
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


def balanced(planner, kind: str, lengths, max_len, b: int, num_microbatches: Optional[int] = None,
             rc: Optional[str] = None) -> List[List[List[int]]]:
    """Cost-balanced micro-batches of at most `b` rows (WLB-LLM's packing): documents costliest
    first, each into the micro-batch of least estimated cost with a row that has room (the row
    with least free space that fits, to keep rows full); a new micro-batch when none has room.
    Starts from as many micro-batches as next-fit packing makes."""
    sizes, cap = row_sizes(kind, lengths, max_len)
    n0 = num_microbatches or -(-len(next_fit_rows(sizes, cap)) // b)
    cap = cap if isinstance(cap, tuple) else (cap, cap)
    cost = document_cost(planner, kind, lengths, max_len, rc).tolist()
    sizes = _pairs(sizes)
    mbs = [[] for _ in range(n0)]  # per micro-batch: rows (lists of indices)
    free = [[] for _ in range(n0)]  # per micro-batch: free space per row
    heap = [(0.0, m) for m in range(n0)]  # (estimated cost, micro-batch): least loaded first
    for i in sorted(range(len(cost)), key=lambda k: -cost[k]):
        a, b2 = sizes[i]
        skipped, placed = [], None
        while heap:
            load, m = heapq.heappop(heap)
            fits = [r for r, (fa, fb) in enumerate(free[m]) if a <= fa and b2 <= fb]
            if fits:
                r = min(fits, key=lambda r: free[m][r][0] + free[m][r][1])
            elif len(mbs[m]) < b:
                mbs[m].append([])
                free[m].append(cap)
                r = len(mbs[m]) - 1
            else:
                skipped.append((load, m))
                continue
            mbs[m][r].append(i)
            fa, fb = free[m][r]
            free[m][r] = (fa - a, fb - b2)
            placed = (load + cost[i], m)
            break
        if placed is None:
            mbs.append([[i]])
            free.append([(cap[0] - a, cap[1] - b2)])
            placed = (cost[i], len(mbs) - 1)
        for x in skipped + [placed]:
            heapq.heappush(heap, x)
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


def shapes_of(planner, kind: str, lengths, max_len, microbatches: List[List[List[int]]]) -> PackedShapes:
    e, d = doc_lengths(kind, lengths, max_len)
    ce, cd = caps(max_len)
    n = len(microbatches)
    mbs = np.array([len(m) for m in microbatches], float)
    enc = np.full(n, float(ce))
    # Flattened: each document's index, its micro-batch and its row (rows numbered in order).
    docs = np.array([i for m in microbatches for r in m for i in r], dtype=np.int64)
    row_of = np.repeat(np.arange(int(mbs.sum())), [len(r) for m in microbatches for r in m])
    mb_of = np.repeat(np.arange(n), [sum(len(r) for r in m) for m in microbatches])
    qe = np.bincount(mb_of, e[docs] ** 2, minlength=n)
    if kind == "gpt":
        dec, qd, qx = None, np.zeros(n), np.zeros(n)
    else:
        # The decoder row holds the row's targets plus the bos/eos the runtime adds, padded;
        # at most a max-length sequence (as the dense packing baseline prices it).
        extra = planner.cfg.decoder_extra_tokens
        row_dec = np.bincount(row_of, d[docs], minlength=int(mbs.sum()))
        first_row = np.concatenate([[0], np.cumsum(mbs[:-1])]).astype(np.int64)
        longest = np.maximum.reduceat(row_dec, first_row) if n else np.zeros(0)
        dec = np.minimum(planner._pad(longest + extra), planner._pad(cd)).astype(float)
        dd = d[docs] + extra
        qd = np.bincount(mb_of, dd ** 2, minlength=n)
        qx = np.bincount(mb_of, e[docs] * dd, minlength=n)
    real = int(np.asarray(lengths, dtype=np.int64).sum())
    return PackedShapes(microbatches, mbs, enc, dec, (qe, qd, qx), real)


def pipeline_costs(planner, rc: str, sh: PackedShapes, idx=None) -> Optional[PipelineCosts]:
    """Costs of the micro-batches `idx` (default all); None if one is infeasible."""
    idx = np.arange(len(sh.mbs)) if idx is None else np.asarray(idx)
    dec = None if sh.dec is None else sh.dec[idx]
    sc = planner.stage_costs(rc, sh.mbs[idx], sh.enc[idx], dec, packed=tuple(q[idx] for q in sh.quad))
    if not (np.isfinite(sc["fwd"]).all() and np.isfinite(sc["peak"]).all()):
        return None
    return planned_split(planner, PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"],
                                                np.array(sc["comm"]),
                                                grad_comm=np.array(sc["grad_comm"]) if "grad_comm" in sc else None,
                                                wstored=sc["wstored"],
                                                grad_comm_epilogue_only=planner.cfg.grad_compress_epilogue_only),
                         sh.enc[idx], dec)


def pipeline_costs_many(planner, rc: str, shapes: List[PackedShapes]) -> List[Optional[PipelineCosts]]:
    """`pipeline_costs` of several candidates with one cost-model query."""
    if not shapes:
        return []
    cat = lambda xs: np.concatenate(xs)  # noqa: E731
    dec = None if shapes[0].dec is None else cat([sh.dec for sh in shapes])
    sc = planner.stage_costs(rc, cat([sh.mbs for sh in shapes]), cat([sh.enc for sh in shapes]), dec,
                             packed=tuple(cat([sh.quad[k] for sh in shapes]) for k in range(3)))
    out, at = [], 0
    for sh in shapes:
        cut = slice(at, at + len(sh.mbs))
        at += len(sh.mbs)
        part_sc = {k: np.asarray(v)[:, cut] for k, v in sc.items()}
        if not (np.isfinite(part_sc["fwd"]).all() and np.isfinite(part_sc["peak"]).all()):
            out.append(None)
            continue
        out.append(planned_split(planner, PipelineCosts(
            part_sc["fwd"], part_sc["bwd"], part_sc["stored"], part_sc["transient"], part_sc["comm"],
            grad_comm=part_sc.get("grad_comm"), wstored=part_sc["wstored"],
            grad_comm_epilogue_only=planner.cfg.grad_compress_epilogue_only),
            sh.enc, sh.dec))
    return out


def contiguous_groups(n: int, dp: int):
    """The baselines' DP split: contiguous blocks of micro-batches; None with fewer than dp."""
    if n < dp:
        return None
    per = -(-n // dp)
    return [list(range(k * per, min((k + 1) * per, n))) for k in range(dp) if k * per < n]


def one_f_one_b_time(planner, rc: str, sh: PackedShapes, groups) -> float:
    """Megatron's run of these micro-batches: 1F1B in data order per DP group, slowest group,
    plus the calibrated step overhead; inf if a micro-batch does not fit or the 1F1B peak
    passes a stage's memory."""
    worst = 0.0
    for g in groups:
        costs = pipeline_costs(planner, rc, sh, g)
        if costs is None:
            return np.inf
        res = simulate(costs, one_f_one_b(planner.S, list(range(len(g)))))
        if any(p > a for p, a in zip(res.peak_memory, planner.available)):
            return np.inf
        worst = max(worst, res.makespan)
    return planner.iteration_ms(worst)


def variable_partition(planner, rc: str, kind: str, lengths, max_len, rows=None,
                       one=None) -> Optional[List[List[List[int]]]]:
    """DynaPipe's optimal partition over packed rows: dense rows (`rows`, default
    `dense_rows`; `one`: their single-row shapes) ordered by attention work, cut into
    variable-size micro-batches minimising (S-1) * max + sum / DP."""
    rows = dense_rows(kind, lengths, max_len) if rows is None else rows
    one = shapes_of(planner, kind, lengths, max_len, [[r] for r in rows]) if one is None else one
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
        dmax = one.dec[order]  # running maximum over each window [i, i + m)
        win = np.maximum.accumulate(dmax[np.minimum(np.arange(N)[:, None] + np.arange(M)[None, :], N - 1)], axis=1)
        dec = win.ravel()
    sc = planner.stage_costs(rc, m.astype(float), np.full(len(i), float(caps(max_len)[0])), dec, packed=quad)
    T = np.where(planner._feasible(sc, "1f1b") & ok, (sc["fwd"] + sc["bwd"]).max(axis=0), np.inf).reshape(N, M)
    try:
        p = part.optimal_partition(T, planner.S, planner.cfg.data_parallel)
    except part.PartitionError:
        return None
    bnd = p.boundaries
    return [[rows[int(order[k])] for k in range(bnd[j], bnd[j + 1])] for j in range(len(bnd) - 1)]


def fixed_size_candidates(planner, kind: str, lengths, max_len, sizes=SIZES):
    """(name, micro-batches): the baselines' own micro-batches at every size (the balanced
    ones estimated at the first recompute level, as `baselines` does)."""
    out, seen = [], set()
    nf = next_fit(kind, lengths, max_len)
    for b in sizes:
        for name, mbs in ((f"packing_varlen/b{b}", [nf[k:k + b] for k in range(0, len(nf), b)]),
                          (f"packing_balanced/b{b}", balanced(planner, kind, lengths, max_len, b,
                                                              num_microbatches=-(-len(nf) // b)))):
            key = repr(mbs)
            if key not in seen:
                seen.add(key)
                out.append((name, mbs))
        if b >= len(nf):  # one micro-batch of every row: larger sizes give the same
            break
    return out


def search_packed(planner, kind: str, lengths, max_len, bound: float = np.inf, keep: int = 2):
    """Fastest plan over packed-row micro-batches: every candidate is timed under 1F1B in data
    order (what the baselines run); the `keep` best get the full schedule search (1F1B and
    adaptive, micro-batch orders, contiguous and Karmarkar-Karp DP splits), each keeping its
    1F1B result unless the search beats it. Returns (makespan, rc, shapes, [(group, choice)])
    or None when nothing beats `bound`."""
    cfg, dp = planner.cfg, planner.cfg.data_parallel
    fixed = [(name, shapes_of(planner, kind, lengths, max_len, mbs))
             for name, mbs in fixed_size_candidates(planner, kind, lengths, max_len)]
    rows = dense_rows(kind, lengths, max_len)
    one = shapes_of(planner, kind, lengths, max_len, [[r] for r in rows])
    quick = []  # (1F1B time, name, rc, shapes, groups, costs), the `keep` best so far
    pending = []  # (lower bound, name, rc, shapes, groups, costs)
    for rc in cfg.recompute_levels:
        if not planner.cm.has(cfg.tensor_parallel, rc):
            continue
        cands = list(fixed)
        vp = variable_partition(planner, rc, kind, lengths, max_len, rows, one)
        if vp is not None:
            cands.append(("partition", shapes_of(planner, kind, lengths, max_len, vp)))
        all_costs = pipeline_costs_many(planner, rc, [sh for _, sh in cands])
        for (name, sh), costs in zip(cands, all_costs):
            groups = contiguous_groups(len(sh.mbs), dp)
            if groups is None or costs is None:
                continue
            work = costs.fwd + costs.bwd  # no schedule beats a group's busiest stage's total work
            lb = max(float(work[:, g].sum(axis=1).max()) for g in groups)
            pending.append((lb, name, rc, sh, groups, costs))
    # Most promising first, so that the `keep`-th best 1F1B time so far prunes the rest.
    for lb, name, rc, sh, groups, costs in sorted(pending, key=lambda x: x[0]):
        cut = quick[keep - 1][0] if len(quick) >= keep else np.inf
        if lb >= cut:
            break
        worst = 0.0
        for g in groups:  # 1F1B in data order: what the baselines run
            ch = search(costs.subset(g), planner.available, orders=[list(range(len(g)))],
                        schedules=("1f1b",), bound=cut)
            if ch is None:
                worst = np.inf
                break
            worst = max(worst, ch.result.makespan)
        if np.isfinite(worst):
            quick.append((worst, name, rc, sh, groups, costs))
            quick.sort(key=lambda x: x[0])
            quick = quick[:keep]
    best = None
    for t, name, rc, sh, groups, costs in quick:
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
