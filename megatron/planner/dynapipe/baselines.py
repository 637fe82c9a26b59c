"""Megatron-style baselines for multi-task batches, costed with a DynaPipe planner's cost model.

* packing: samples packed next-fit into the rows the data path builds (`packed.next_fit`: a GPT
  sample of l tokens takes l + 1 of a row of max_len + 1; T5: both sides must fit), `b` rows per
  micro-batch, 1F1B, attention over the whole row (the DynaPipe paper's baseline: dense rows
  costing b * L^2, kept to reproduce its figures);
* packing_varlen: the same rows run with per-document attention (Megatron-Core THD /
  `cu_seqlens`, this project's `--pack-dataset`): attention priced on sum l_i^2 and activation
  memory linear in tokens (flash/varlen kernel), see `megatron.planner.cost.attention_cost`;
* packing_balanced: WLB-LLM's packing (`megatron.planner.dynapipe.packed.balanced`): documents placed so
  that micro-batches carry similar estimated (token + attention) cost, per-document attention;
  across iterations (`BalancedStream`) long outliers are deferred at most a bounded number of
  iterations so that each iteration gets a similar share of them;
* fixed: unpacked samples in data order, `b` per micro-batch, each micro-batch padded to its
  longest sample, 1F1B.

Micro-batches are split over the planner's DP groups in order (contiguous blocks); the
iteration time is the slowest group's simulated 1F1B makespan, infinite when a micro-batch
does not fit the memory limit with 1F1B's in-flight copies. Used by
`benchmarks/bench_planner.py` and the experiment drivers (`megatron.experiments`).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from megatron.planner.dynapipe import packed
from megatron.planner.schedule.schedules import one_f_one_b, search
from megatron.planner.schedule.simulator import PipelineCosts, simulate

SIZES = packed.SIZES
NAMES = ("packing", "packing_varlen", "packing_balanced", "fixed")


def microbatch_shapes(planner, kind: str, system: str, batch, max_len: int, b: int) -> List[Tuple[int, int, int]]:
    """(size, encoder/GPT length, decoder length) of each micro-batch of `system`."""
    q = planner.cfg.pad_multiple
    pad = lambda x: -(-int(x) // q) * q  # noqa: E731
    extra = planner.cfg.decoder_extra_tokens
    if system == "packing":
        rows = packed.next_fit(kind, batch, max_len)  # the rows the data path builds
        n_mb = -(-len(rows) // b)
        # Rows are full max-length sequences; T5 pads targets to the longest row's (at most
        # max_len: the decoder row is a max_len sequence, its bos/eos included).
        if kind == "t5":
            dec = packed.doc_lengths(kind, batch, max_len)[1]
            dec_len = min(pad(max(dec[row].sum() for row in rows) + extra), pad(max_len))
        else:
            dec_len = 0
        return [(min(b, len(rows) - k * b), max_len, dec_len) for k in range(n_mb)]
    if system != "fixed":
        raise ValueError(f"unknown baseline {system!r}; choose 'packing' or 'fixed'")
    shapes = []
    for k in range(0, len(batch), b):
        chunk = batch[k:k + b]
        if kind == "gpt":
            shapes.append((len(chunk), pad(max(chunk)), 0))
        else:
            shapes.append((len(chunk), pad(max(c[0] for c in chunk)), pad(max(c[1] for c in chunk) + extra)))
    return shapes


def padding_efficiency(kind: str, batch, shapes) -> float:
    """Real tokens / computed tokens (size x padded length; T5 both sides)."""
    real = float(np.asarray(batch, dtype=np.int64).sum())
    computed = sum(m * (e + d) for m, e, d in shapes)
    return real / computed if computed else 0.0


def split_groups(shapes, dp: int):
    """Contiguous blocks of micro-batches per DP group; None when there are fewer than dp."""
    if len(shapes) < dp:
        return None
    per = -(-len(shapes) // dp)
    return [g for g in (shapes[k * per:(k + 1) * per] for k in range(dp)) if g]


def group_costs(planner, kind, shapes, rc) -> PipelineCosts | None:
    mbs = np.array([s[0] for s in shapes], float)
    enc = np.array([s[1] for s in shapes], float)
    dec = None if kind == "gpt" else np.array([s[2] for s in shapes], float)
    sc = planner.stage_costs(rc, mbs, enc, dec)
    if not (np.isfinite(sc["fwd"]).all() and np.isfinite(sc["peak"]).all()):
        return None
    return PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], np.array(sc["comm"]))


def iteration_time(planner, kind, groups, rc, schedules: Sequence[str] = ("1f1b",), max_orders: int = 1) -> float:
    """Slowest group's makespan for micro-batches of fixed shapes at recompute level rc, plus the
    calibrated step overhead (as DynaPipe's plans report it); inf if a micro-batch does not fit.
    With the default ("1f1b", data order) this is Megatron's run."""
    makespan = 0.0
    for shapes in groups:
        costs = group_costs(planner, kind, shapes, rc)
        if costs is None:
            return np.inf
        if tuple(schedules) == ("1f1b",) and max_orders == 1:
            res = simulate(costs, one_f_one_b(planner.S, list(range(len(shapes)))))
            if any(p > a for p, a in zip(res.peak_memory, planner.available)):
                return np.inf
            t = res.makespan
        else:
            ch = search(costs, planner.available, schedules=tuple(schedules), max_orders=max_orders)
            if ch is None:
                return np.inf
            t = ch.result.makespan
        makespan = max(makespan, t)
    return planner.iteration_ms(makespan)


def baseline_time(planner, kind, mb_shapes_per_group, rcs):
    """Best 1F1B makespan (and its rc) over recompute levels for fixed micro-batches; inf if none fits."""
    best = (np.inf, None)
    for rc in rcs:
        t = iteration_time(planner, kind, mb_shapes_per_group, rc)
        if t < best[0]:
            best = (t, rc)
    return best


def packed_time(planner, kind, batch, max_len, name, b, rcs):
    """Best 1F1B time (and rc) of the per-document-attention packings at micro-batch size b."""
    best = (np.inf, None)
    for rc in rcs:
        if name == "packing_varlen":
            rows = packed.next_fit(kind, batch, max_len)
            mbs = [rows[k:k + b] for k in range(0, len(rows), b)]
        else:  # cost estimated at the first recompute level for all levels, as DynaPipe's search does
            mbs = packed.balanced(planner, kind, batch, max_len, b)
        groups = packed.contiguous_groups(len(mbs), planner.cfg.data_parallel)
        if groups is None:
            continue
        t = packed.one_f_one_b_time(planner, rc, packed.shapes_of(planner, kind, batch, max_len, mbs), groups)
        if t < best[0]:
            best = (t, rc)
    return best


def baselines(planner, kind, batch, max_len, sizes=SIZES, names=NAMES):
    """{name: (best time, micro-batch size, recompute)} over sizes and levels, for each of
    `names` (see the module docstring)."""
    dp, rcs = planner.cfg.data_parallel, [r for r in planner.cfg.recompute_levels
                                          if planner.cm.has(planner.cfg.tensor_parallel, r)]
    out = {}
    for name in names:
        best = (np.inf, None, None)
        for b in sizes:
            if name in ("packing_varlen", "packing_balanced"):
                t, rc = packed_time(planner, kind, batch, max_len, name, b, rcs)
            else:
                groups = split_groups(microbatch_shapes(planner, kind, name, batch, max_len, b), dp)
                if groups is None:
                    continue
                t, rc = baseline_time(planner, kind, groups, rcs)
            if t < best[0]:
                best = (t, b, rc)
        out[name] = best
    return out


class BalancedStream:
    """WLB-LLM's outlier delay over a stream of global batches: documents of more than
    `threshold` x max_len tokens are queued; each iteration takes the queued ones that have
    waited `max_delay` iterations plus the oldest others up to the running mean number of
    outliers per batch, so long documents spread evenly over iterations. The last batch of a
    stream (`last=True`) takes everything still queued, so no document is dropped."""

    def __init__(self, kind: str, max_len: int, threshold: float = 0.5, max_delay: int = 1):
        self.kind, self.max_len, self.threshold, self.max_delay = kind, max_len, threshold, max_delay
        self.queue = []  # (sample, age)
        self.seen = self.batches = 0

    def _long(self, s) -> bool:
        tokens = s if self.kind == "gpt" else s[0] + s[1]
        return tokens > self.threshold * self.max_len

    def next(self, batch, last: bool = False) -> list:
        keep = [s for s in batch if not self._long(s)]
        self.queue += [(s, 0) for s in batch if self._long(s)]
        self.seen += sum(1 for s in batch if self._long(s))
        self.batches += 1
        quota = max(1, int(round(self.seen / self.batches)))
        self.queue.sort(key=lambda x: -x[1])  # oldest first
        take = [x for x in self.queue if x[1] >= self.max_delay]
        rest = [x for x in self.queue if x[1] < self.max_delay]
        n_more = max(0, quota - len(take))
        take, rest = take + rest[:n_more], rest[n_more:]
        if last:
            take, rest = take + rest, []
        self.queue = [(s, a + 1) for s, a in rest]
        return keep + [s for s, _ in take]
