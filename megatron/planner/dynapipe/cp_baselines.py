"""Context parallelism over packed rows, as a Megatron-Core or torchtitan user runs it: the fair
baseline for DynaPipe + CP (benchmarks/bench_cp.py, system `cp_packed`).

The user packs documents next-fit into rows of the sequence length the CP group handles
(`packed.next_fit`, this project's `--pack-dataset`, Megatron-Core's THD format), runs them
with per-document attention (`cu_seqlens` / document masks), `b` rows per micro-batch in data
order, contiguous blocks per DP group, 1F1B, at one static CP size for every micro-batch, with
Megatron's causal load balancing (2N chunks, rank r holding chunks r and 2N-1-r). Two ways to
cut a packed row into those chunks (`balance`):

* "document": every document cut into 2N chunks (Megatron-Core THD through Transformer
  Engine: `thd_get_partitioned_indices`): each rank attends to exactly 1/N of every
  document's causal pairs, sum l_i^2 / N;
* "row": the row cut into 2N chunks, documents wherever they fall (this project's runtime,
  megatron/core/context_parallel.py, and a head-tail balancer over a document mask): the slowest
  rank's share of the documents' causal pairs sets the time (`row_rank_pairs`).

Priced with the CP cost model (megatron/planner/cost/cp_cost.py) that DynaPipe + CP plans with:
token-wise work on s/N tokens per rank, the K/V exchange of the whole row (per-document
attention does not shrink what the ring or the all-gather moves), and only the attention part
re-priced to the slowest rank's document pairs. The ring's overlap shrinks with it: a block's
transfer hides behind that rank's per-document attention of the block, not a dense row's.
Memory is linear in tokens (variable-length kernels are flash kernels).
"""
from __future__ import annotations

import numpy as np

from megatron.planner.cost.attention_cost import MEMORY_QUANTITIES, AttentionCost
from megatron.planner.cost.cp_cost import ContextParallelCostModel, cp_planner
from megatron.planner.dynapipe import packed

BALANCES = ("document", "row")


def row_rank_pairs(doc_lengths, row_len: int, cp: int, gap: int = 1) -> np.ndarray:
    """Causal (query, key) pairs inside documents that each CP rank's queries attend to, when a
    row of `row_len` tokens is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r.
    Documents lie in order from token 0, each running attention over its l tokens and taking
    l + `gap` positions (a GPT sample's last label token: megatron/data/packing.py)."""
    n = 2 * cp
    if row_len % n:
        raise ValueError(f"--context-parallel-size {cp}: a packed row of {row_len} tokens does not cut into "
                         f"2 x CP = {n} equal chunks")
    c = row_len // n
    pairs, start = np.zeros(cp), 0
    for length in np.asarray(doc_lengths, dtype=np.int64).reshape(-1).tolist():
        a, e = start, min(start + length, row_len)
        for r in range(cp):
            for k in (r, n - 1 - r):
                lo, hi = max(a, k * c), min(e, (k + 1) * c)
                if hi > lo:  # queries a+lo .. a+hi-1 of the document see lo+1 .. hi of its keys
                    lo, hi = lo - a, hi - a
                    pairs[r] += (hi * (hi + 1) - lo * (lo + 1)) / 2
        start += length + gap
    return pairs


def rank_quad(kind: str, lengths, max_len: int, microbatches, cp: int, balance: str = "document") -> np.ndarray:
    """Per micro-batch: the slowest CP rank's per-document attention in squared tokens (the
    units of `sum l_i^2`, which a whole document's l(l+1)/2 causal pairs count twice)."""
    if balance not in BALANCES:
        raise ValueError(f"--cp-balance must be one of {BALANCES}, got {balance!r}")
    if kind != "gpt":
        raise ValueError("context parallelism is priced for GPT only (megatron/config/context_parallel.py)")
    e, _ = packed.doc_lengths(kind, lengths, max_len)
    out = np.zeros(len(microbatches))
    for m, rows in enumerate(microbatches):
        if balance == "document":
            out[m] = sum(float((e[r] ** 2).sum()) for r in rows) / cp
            continue
        # rank r is the same rank in every row of the micro-batch: sum the rows, then the slowest
        out[m] = 2.0 * sum(row_rank_pairs(e[r], max_len, cp) for r in rows).max()
    return out


class _RankQuadCP(ContextParallelCostModel):
    """The CP cost model with one rank's attention given as document pairs (`rank_quad`)."""

    rank_quad = None

    def _attention_ms(self, tp, rc, quantity, b, s):
        if self.rank_quad is None:
            return super()._attention_ms(tp, rc, quantity, b, s)
        sp = self.attention.split(tp, rc, "encoder", quantity)
        return 0.0 * b if sp is None else max(sp.coef.get("doc_quad", sp.coef["quad"]), 0.0) * self.rank_quad


class PackedCPAttention(AttentionCost):
    """`AttentionCost.packed_layer` for a CP planner: `quad` is the slowest rank's document
    pairs (`rank_quad`), not the micro-batch's sum l_i^2 (see the module docstring)."""

    def __init__(self, cp_model: ContextParallelCostModel):
        super().__init__(cp_model.base)
        if not cp_model.flash_memory:
            raise ValueError("packed rows run a variable-length (flash) kernel: price them with flash_memory=True")
        self.cp = _RankQuadCP(cp_model.base, cp_model.cp, cp_model.comm_type, cp_model.link_gbps,
                              cp_model.latency_ms, cp_model.bytes, True)

    def packed_layer(self, component, tp, rc, mbs, seq, quad, dec_seq=None, dec_quad=None, cross=None):
        if component != "encoder":
            raise ValueError("context parallelism is priced for GPT layers (component 'encoder') only")
        b, s = np.broadcast_arrays(np.asarray(mbs, float), np.asarray(seq, float))
        q_rank = np.broadcast_to(np.asarray(quad, float), b.shape)
        self.cp.rank_quad = q_rank
        try:  # the exchange's exposed part, with per-document attention to overlap it
            out = self.cp.layer(component, tp, rc, b, s)
        finally:
            self.cp.rank_quad = None
        for q in ("forward_ms", "backward_ms"):
            sp = self.split(tp, rc, component, q)
            if sp is None or q in MEMORY_QUANTITIES:
                continue
            dense = max(sp.coef["quad"], 0.0) * b * s * s / self.cp.cp  # what the CP model charged
            doc = max(sp.coef.get("doc_quad", sp.coef["quad"]), 0.0) * q_rank
            with np.errstate(invalid="ignore"):
                out[q] = np.where(np.isfinite(out[q]), np.maximum(out[q] - dense + doc, 0.0), out[q])
        return out


def packed_cp_planner(cfg, cp: int, comm_type: str = "p2p"):
    """A planner for CP groups of `cp` (`cp_planner`: `cfg` counts every GPU of a stage as DP)
    whose packed-row micro-batches are priced per document at that CP size."""
    planner = cp_planner(cfg, cp, comm_type, flash_memory=True)
    if cp > 1:
        planner.attention = PackedCPAttention(planner.cm)
    return planner


def cp_packed_time(planner, batch, max_len: int, cp: int, balance: str = "document", sizes=packed.SIZES):
    """(best iteration ms, rows per micro-batch, recompute) of next-fit packed rows of
    `max_len` tokens, 1F1B in data order, on `planner` (`packed_cp_planner(cfg, cp)`); inf when
    nothing fits."""
    rows = packed.next_fit("gpt", batch, max_len)
    rcs = [r for r in planner.cfg.recompute_levels if planner.cm.has(planner.cfg.tensor_parallel, r)]
    best = (np.inf, None, None)
    for b in sizes:
        mbs = [rows[k:k + b] for k in range(0, len(rows), b)]
        groups = packed.contiguous_groups(len(mbs), planner.cfg.data_parallel)
        if groups is None:
            continue
        sh = packed.shapes_of(planner, "gpt", batch, max_len, mbs)
        if cp > 1:
            sh.quad = (rank_quad("gpt", batch, max_len, mbs, cp, balance), sh.quad[1], sh.quad[2])
        for rc in rcs:
            t = packed.one_f_one_b_time(planner, rc, sh, groups)
            if t < best[0]:
                best = (t, b, rc)
        if b >= len(rows):  # one micro-batch holds every row: larger sizes give the same
            break
    return best
