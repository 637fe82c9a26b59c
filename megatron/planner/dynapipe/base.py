"""DynaPipe planner: one global batch of variable-length samples -> per-DP-group micro-batches,
recompute level, schedule and per-pipeline-rank `ExecutionPlan`s.

Steps per iteration (`DynaPipeBase.plan`):
1. order the samples (GPT: longest first; T5: cluster + tour order over (input, target)
   lengths, `partitioner.order_clustered`, and plain lexicographic order as a second
   candidate), pad lengths to `pad_multiple`;
2. for each recompute level: build the segment-time matrix from the cost model under the
   per-micro-batch memory limit ("1F1B fit": the micro-batch fits with S - s copies in
   flight on stage s); if no partition fits, fall back to "single fit" (one micro-batch
   fits), which only the memory-admitting adaptive schedule can run; cut optimally
   (`partitioner.optimal_partition`; T5: balancing the encoder and decoder halves' totals,
   `stage_loads.balanced_partition`) and split across DP groups (Karmarkar-Karp);
3. per DP group, search schedules x micro-batch orders (`schedules.search`: first-round
   orders, every order of 3 cost clusters, every order outright for tiny groups), levels in
   increasing partition objective so that the best makespan so far prunes the rest;
4. keep the recompute level with the smallest iteration makespan (slowest DP group);
5. lower the chosen per-stage orders to instruction streams (`lower_to_plans`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from megatron.compression import lowrank
from megatron.planner.dynapipe import packed
from megatron.planner.dynapipe import partitioner as part
from megatron.planner.cost.attention_cost import AttentionCost
from megatron.planner.cost.cost_model import CostModel
from megatron.planner.cost.moe_cost import moe_cost_model
from megatron.planner.dynapipe.config import DynaPipeConfig  # noqa: F401 (the planner's config, re-exported)
from megatron.planner.dynapipe.layout import t5_split
from megatron.planner.schedule.schedules import ScheduleChoice, lower_bound, search
from megatron.planner.schedule.simulator import PipelineCosts
from megatron.planner.cost.stage_loads import t5_candidates
from megatron.planner.schedule.zb_search import planned_split
from megatron.planner.cost.wpass_memory import planner_wstored
from megatron.planner.cost.wpass_time import stage_wgrad
from megatron.planner.cost.stage_memory import (compose, encoder_end_memory, postprocess_memory,
                                                preprocess_memory, tied_head_grad_mb, with_tied_head)


class PlanningError(RuntimeError):
    pass


@dataclass
class GroupPlan:
    microbatches: List[List[int]]  # sample indices per micro-batch id (ids in run order)
    shapes: List[Tuple[Tuple[int, ...], ...]]  # LoadInput shapes per micro-batch id
    schedule: str
    makespan_ms: float
    peak_memory_mb: List[float]  # activation peak per pipeline rank
    plans: list = field(default_factory=list)  # ExecutionPlan per pipeline rank
    compute_orders: list = field(default_factory=list)  # per rank [(kind, mb, stage)]
    result: object = None  # SimResult (chrome_trace() for a timeline)
    rows: Optional[list] = None  # packed plans: per micro-batch id, its rows (lists of sample indices)
    token_slices: Optional[list] = None  # sliced plans: per unit id, its (micro-batch id, offset, length)
    cp: Optional[list] = None  # variable CP: per micro-batch id, [CP size, this rank's index in its sub-group]


@dataclass
class DynaPipeIterationPlan:
    iteration: int
    recompute: str
    groups: List[GroupPlan]
    makespan_ms: float
    padding_efficiency: float
    planning_ms: float  # ordering, partition, DP split, schedule search
    lowering_ms: float  # instruction streams for every rank (+ validation)
    memory_fallback: bool  # True when only the admission-controlled schedule fits


class DynaPipeBase:
    """The DynaPipe planner (see the module docstring); `megatron.planner.dynapipe.planner.DynaPipePlanner`
    adds the systems composed with it. Keeps the cost model and per-length cost caches across
    iterations."""

    _dp_groups = staticmethod(part.balance_groups)  # micro-batches -> DP groups (planner.py: expert parallelism)
    T5_CACHE_ENTRIES = 4_000_000  # per (recompute, fit); the cache restarts when it would grow past this

    def __init__(self, config: DynaPipeConfig, cost_model: Optional[CostModel] = None):
        self.cfg = config
        self.cm = moe_cost_model(cost_model or CostModel.load(config.cost_model_path), config.moe)
        if self.cm.kind != config.model_kind:
            raise ValueError(f"cost model {self.cm.name!r} is for {self.cm.kind!r}, config is {config.model_kind!r}")
        self.cm.require_tp(config.tensor_parallel)
        self.layout = config.stage_layers()
        self.S = len(self.layout)
        self.stage_to_rank = list(range(self.S))
        sp = config.stage_parallel or [(config.tensor_parallel, 1)] * self.S
        self.stage_tp, self.stage_dp = [int(t) for t, _ in sp], [int(d) for _, d in sp]
        self.row_multiple = int(np.lcm.reduce(self.stage_dp))
        # T5: the first decoder stage (embeds the decoder tokens) and the last encoder stage
        self.split, self.enc_end = t5_split(self.layout) if config.model_kind == "t5" else (None, None)
        self.available = self._available_memory()
        self._cache = {}
        self.attention = AttentionCost(self.cm)
        self._mb_memo = {}
        # What the table leaves out of a step on the host that trains (fitted by
        # megatron.profiling.calibrate; identity for tables without it, e.g. the A100 ones).
        self.calibration = self.cm.calibration

    def iteration_ms(self, makespan: float) -> float:
        """The step time a plan of this pipeline `makespan` predicts: plus the per-iteration
        work outside the pipeline (optimizer step, reductions), the same for every plan."""
        return float(makespan) + self.calibration.step_overhead_ms

    # ---- memory -----------------------------------------------------------------------
    def _available_memory(self) -> np.ndarray:
        c = self.cfg
        zero = c.zero_shards or c.data_parallel
        per_param = (c.weight_grad_bytes_per_param + c.optimizer_bytes_per_param / zero) / 2.0  # x 16-bit MB
        avail = []
        for s, comps in enumerate(self.layout):
            tp = self.stage_tp[s]
            mb = sum(n * self.cm.param_mb(comp, tp) for comp, n in comps)
            first_dec = c.model_kind == "t5" and s == self.split
            if s == 0 or s == self.S - 1 or first_dec:  # embeddings (tied output head on the last)
                mb += self.cm.param_mb("embedding", tp)
            avail.append(c.memory_limit_mb - mb * per_param)
        avail = np.array(avail)
        if (avail <= 0).any():
            s = int(np.argmin(avail))
            raise PlanningError(f"model states alone exceed memory_limit_mb={c.memory_limit_mb} on stage {s}")
        return avail

    # ---- costs ------------------------------------------------------------------------
    def padded_rows(self, b):
        """Rows a micro-batch of b samples runs as: a multiple of every stage's DP size."""
        return (np.asarray(b) + self.row_multiple - 1) // self.row_multiple * self.row_multiple

    def stage_costs(self, rc: str, mbs, enc, dec=None, packed=None) -> dict:
        """Per-stage arrays (S, *shape): fwd, bwd, stored, transient, peak; and 'comm'.
        `packed`: micro-batches of packed rows run with per-document attention, given as
        (sum of squared encoder/GPT document lengths, of decoder lengths, of their products)
        per micro-batch (`megatron.planner.cost.attention_cost`); None: dense rows."""
        out = {k: [] for k in ("fwd", "bwd", "stored", "peak", "wstored", "wgrad")}
        whole, enc = np.asarray(mbs, float), np.asarray(enc, float)
        if dec is not None:
            whole, enc, dec = np.broadcast_arrays(whole, enc, np.asarray(dec, float))
        else:
            whole, enc = np.broadcast_arrays(whole, enc)
        layer = {}  # stages of one component, TP and DP share the per-layer costs: query each once
        head_len = enc if dec is None else dec  # the output head runs on the decoder sequence
        comm = []
        for s, comps in enumerate(self.layout):
            tp, mbs = self.stage_tp[s], self.padded_rows(whole) / self.stage_dp[s]  # this stage's rows per rank
            # A T5 decoder stage keeps the encoder output it received (all of [enc, b, h], the same
            # on every TP rank) until the micro-batch's backward: every decoder layer reads it.
            enc_out = mbs * enc * self.cfg.hidden_size * self.cfg.activation_bytes / 1e6
            sp = self.cfg.sequence_parallel and tp > 1
            tokens = mbs * (enc if dec is None else enc + dec)  # T5 decoder stages also pass the encoder output
            comm.append(tokens * self.cfg.hidden_size / tp * self.cfg.activation_bytes * 8
                        / (self.cfg.bandwidth_gbps * 1e6) + self.cfg.link_latency_ms)
            f = b = 0.0
            # Pieces in forward order, (stored, peak) each; `compose` stacks them. The first
            # stage also embeds, the last runs the head and the loss (stage_memory.py).
            parts, pieces = [], []  # pieces: (count, costs) for the measured W share (wpass_time.py)
            if dec is not None and (s > self.split or s == self.split > self.enc_end):  # received it
                parts.append((enc_out, enc_out))
            pre_index = []  # positions of the embeddings in `parts`
            if s == 0:
                pre_index.append(len(parts))
                parts.append(self._pre_post("pre", rc, mbs, enc, tp))
                f, b = self._pre_time(rc, mbs, enc, tp, f, b)
            for comp, n in comps:
                key = (comp, tp, self.stage_dp[s])
                if key not in layer and packed is not None:
                    layer[key] = self.attention.packed_layer(comp, tp, rc, mbs, enc, packed[0], dec, packed[1],
                                                             packed[2])
                elif key not in layer:
                    layer[key] = self.cm.layer(comp, tp, rc, mbs, enc, dec)
                c = layer[key]
                pieces.append((n, c))
                f, b = f + n * c["forward_ms"], b + n * c["backward_ms"]
                if comp == "decoder" and s == self.split:
                    pre_index.append(len(parts))
                    parts.append(self._pre_post("pre", rc, mbs, dec, tp))
                    f, b = self._pre_time(rc, mbs, dec, tp, f, b)
                st_l = n * c["stored_mb"]
                pk_l = c["stored_mb"] * (n - 1) + c["peak_mb"] if n > 1 else c["peak_mb"]  # no inf * 0
                if sp:
                    factor = sp_memory_factor(rc, tp, enc if dec is None else np.maximum(enc, dec),
                                              self.cfg.hidden_size, self.cfg.num_attention_heads)
                    st_l, pk_l = st_l * factor, pk_l * factor
                parts.append((st_l, pk_l))
                if comp == "encoder" and dec is not None and s == self.enc_end:
                    parts.append(encoder_end_memory(self.cm, mbs, enc, self.cfg.activation_bytes))
            if s == self.S - 1:
                p = self.cm.postprocess(tp, rc, mbs, head_len)
                pieces.append((1, p))
                f, b = f + p["forward_ms"], b + p["backward_ms"]
                parts.append(self._pre_post("post", rc, mbs, head_len, tp))
                if pre_index:  # the embedding and the head share their weight on this stage
                    parts = with_tied_head(parts, pre_index, tied_head_grad_mb(self.cm, tp, self.cfg.activation_bytes))
            st, pk = compose(parts)
            wst = planner_wstored(self, s, comps, rc, st, mbs * enc, tp, sp, dec is not None)
            f, b = self.calibration.op_ms(f), self.calibration.op_ms(b)
            wg = stage_wgrad(pieces, b, first=s == 0) if rc == "none" and packed is None else None
            for k, v in zip(("fwd", "bwd", "stored", "peak", "wstored", "wgrad"), (f, b, st, pk, wst, wg)):
                out[k].append(None if v is None else np.broadcast_to(v, mbs.shape))
        if any(v is None for v in out["wgrad"]):
            del out["wgrad"]  # not measured for every stage: zb_search derives W
        out = {k: np.stack(v) for k, v in out.items()}
        with np.errstate(invalid="ignore"):  # inf - inf where the shape is infeasible
            out["transient"] = np.nan_to_num(out["peak"] - out["stored"], nan=np.inf)
        out["comm"] = np.stack([np.broadcast_to(c, whole.shape) for c in comm])
        r = self.cfg.grad_compress_rank
        if r:
            # The executor's rule (lowrank.wire_bytes): float32 factors of the (tokens, h)
            # matrix when they hold fewer values, else the raw message as an activation.
            h, tp, tokens = self.cfg.hidden_size, self.cfg.tensor_parallel, whole * (enc if dec is None else enc + dec)
            sp = self.cfg.sequence_parallel and tp > 1
            mbs = whole
            raw = tokens * h / tp * self.cfg.activation_bytes
            if dec is None:
                rows = tokens / tp if sp else tokens  # a stage's message is [s(/tp), b, h]
                low = lowrank.wire_bytes(rows, h, r, raw, self.cfg.activation_bytes)
            else:  # T5 decoder stages send two gradients (encoder output, decoder hidden)
                ab = self.cfg.activation_bytes
                low = lowrank.wire_bytes(mbs * enc, h, r, mbs * enc * h / tp * ab, ab) \
                    + lowrank.wire_bytes(mbs * dec, h, r, mbs * dec * h / tp * ab, ab)
            grad = low * 8 / (self.cfg.bandwidth_gbps * 1e6)
            out["grad_comm"] = np.broadcast_to(grad + self.cfg.link_latency_ms, out["fwd"].shape)
        return out

    def _pre_post(self, which: str, rc: str, mbs, seq, tp: int):
        """(stored, peak) MB of the embedding ("pre") or head + loss ("post")."""
        fn = preprocess_memory if which == "pre" else postprocess_memory
        return fn(self.cm, tp, rc, mbs, seq, self.cfg.activation_bytes)

    def _pre_time(self, rc: str, mbs, seq, tp: int, f, b):
        """(f, b) plus the embedding's forward and backward ms where the table profiled it
        (the CPU tables; the converted A100 tables have no embedding column, so there it is left out)."""
        if "preprocess" not in self.cm.profile(tp, rc).components:
            return f, b
        p = self.cm.preprocess(tp, rc, mbs, seq)
        return f + p["forward_ms"], b + p["backward_ms"]

    def _feasible(self, sc: dict, fit: str) -> np.ndarray:
        S = self.S
        inflight = (S - np.arange(S)) if fit == "1f1b" else np.ones(S)
        shape = (S,) + (1,) * (sc["peak"].ndim - 1)
        with np.errstate(invalid="ignore"):
            need = (inflight.reshape(shape) - 1) * sc["stored"] + sc["peak"]
        ok = (need <= self.available.reshape(shape)) & np.isfinite(sc["fwd"]) & np.isfinite(sc["bwd"])
        return ok.all(axis=0)

    def _bottleneck(self, sc: dict) -> np.ndarray:
        """A micro-batch's time on the busiest pipeline rank (one stage per rank here)."""
        return (sc["fwd"] + sc["bwd"]).max(axis=0)

    def _gpt_segments(self, rc, fit, padded: np.ndarray) -> np.ndarray:
        """(N, M) bottleneck times for GPT. The cost depends only on (first = longest
        length, size), so rows are cached per padded length across iterations; a row
        stops at the first infeasible size (memory grows with micro-batch size)."""
        cache = self._cache.setdefault((rc, fit), {})
        uniq, inv = np.unique(padded, return_inverse=True)
        todo, size = [L for L in uniq.tolist() if L not in cache], 64
        while todo:
            m = np.arange(1, size + 1, dtype=float)
            sc = self.stage_costs(rc, m[None, :], np.array(todo, float)[:, None])
            T = np.where(self._feasible(sc, fit), self._bottleneck(sc), np.inf)
            left = []
            for L, row in zip(todo, T):
                bad = np.nonzero(~np.isfinite(row))[0]
                if len(bad) and bad[-1] == size - 1 or size >= 4096:
                    last = np.nonzero(np.isfinite(row))[0]
                    cache[L] = row[: (last[-1] + 1 if len(last) else 1)]
                else:
                    left.append(L)
            todo, size = left, size * 4
        rows = [cache[L] for L in uniq.tolist()]
        M = min(len(padded), max(len(r) for r in rows))
        out = np.full((len(uniq), M), np.inf)
        for k, r in enumerate(rows):
            out[k, : min(M, len(r))] = r[:M]
        return out[inv]

    def _t5_segments(self, rc, fit, enc: np.ndarray, dec: np.ndarray, m0: int, m1: int) -> np.ndarray:
        """Columns m0..m1-1 (sizes m0+1..m1) of the T5 segment matrix. The cost depends only on
        (size, padded enc max, padded dec max) and the maxima are running maxima along the
        order, so the block is a few numpy passes; distinct shapes are costed once and kept
        in a per-(recompute, fit) cache across iterations (sorted int64 keys, looked up with
        `searchsorted`: only shapes never seen before are interpolated). Per entry: the
        bottleneck time and the slowest encoder-side and decoder-side stage (`segment_times`)."""
        N = len(enc)
        idx = np.arange(N)[:, None] + np.arange(m1)[None, :]
        e = np.maximum.accumulate(enc[np.minimum(idx, N - 1)], axis=1)[:, m0:]
        d = np.maximum.accumulate(dec[np.minimum(idx, N - 1)], axis=1)[:, m0:]
        m = np.arange(m0 + 1, m1 + 1, dtype=np.int64)[None, :]
        key = ((m << 42) | (e.astype(np.int64) << 21) | d.astype(np.int64)).ravel()
        ck, cv = self._cache.get(("t5", rc, fit), (np.zeros(0, np.int64), np.zeros((0, 3))))
        t = np.empty((len(key), 3))
        if len(ck):  # warm cache: look every key up directly (no sort of the whole block)
            pos = np.minimum(np.searchsorted(ck, key), len(ck) - 1)
            hit = ck[pos] == key
            t[hit] = cv[pos[hit]]
        else:
            hit = np.zeros(len(key), bool)
        if not hit.all():
            miss, inv = np.unique(key[~hit], return_inverse=True)
            sc = self.stage_costs(rc, (miss >> 42).astype(float), ((miss >> 21) & 0x1FFFFF).astype(float),
                                  (miss & 0x1FFFFF).astype(float))
            st, h = sc["fwd"] + sc["bwd"], self.split or max(1, self.S // 2)  # per stage; encoder stages first
            sides = np.stack([st.max(axis=0), st[:h].max(axis=0), st[h:].max(axis=0) if self.S > 1 else st[0]], -1)
            tm = np.where(self._feasible(sc, fit)[:, None], sides, np.inf)
            t[~hit] = tm[inv]
            if len(ck) + len(miss) > self.T5_CACHE_ENTRIES:
                ck, cv = np.zeros(0, np.int64), np.zeros((0, 3))
            allk = np.concatenate([ck, miss])
            s = np.argsort(allk, kind="stable")
            self._cache[("t5", rc, fit)] = (allk[s], np.concatenate([cv, tm])[s])
        return t.reshape(e.shape + (3,))

    def segment_times(self, rc: str, fit: str, enc: np.ndarray, dec: Optional[np.ndarray],
                      sides: bool = False) -> np.ndarray:
        """Segment-time matrix for samples already in planning order, padded. `sides` (T5
        with encoder and decoder stages): (N, M, 3), the bottleneck time and the slowest
        encoder-side and decoder-side stage's time of each segment."""
        if dec is None:
            return self._gpt_segments(rc, fit, enc)
        N, M = len(enc), min(32, len(enc))
        T = self._t5_segments(rc, fit, enc, dec, 0, M)
        while M < N and np.isfinite(T[:, -1, 0]).any():  # grow until a whole column is infeasible
            M2 = min(N, 2 * M)
            T = np.concatenate([T, self._t5_segments(rc, fit, enc, dec, M, M2)], axis=1)
            M = M2
        return T if sides and self.S > 1 else T[..., 0]

    # ---- planning ---------------------------------------------------------------------
    def _pad(self, x, extra=0):
        q = self.cfg.pad_multiple
        return (np.asarray(x, dtype=np.int64) + extra + q - 1) // q * q

    def plan(self, lengths, iteration: int = 0, validate: bool = True) -> DynaPipeIterationPlan:
        """`validate`: check the emitted instruction streams with `validate_plans` (deadlock,
        matching, shapes); the trainer does it for the first --validate-plans-iters iterations.
        With the split backward ("zb" in the schedules) the planner also plans without it and
        keeps the faster plan, so splitting never makes an iteration slower than before."""
        if "zb" not in self.cfg.schedules:
            return self._plan(lengths, iteration, validate)
        t0 = time.perf_counter()
        split = self._plan(lengths, iteration, validate)
        saved = self.cfg.schedules
        self.cfg.schedules = tuple(x for x in saved if x != "zb")
        try:
            whole = self._plan(lengths, iteration, validate)
        finally:
            self.cfg.schedules = saved
        best = split if split.makespan_ms <= whole.makespan_ms else whole
        best.planning_ms = (time.perf_counter() - t0) * 1e3 - split.lowering_ms - whole.lowering_ms + best.lowering_ms
        return best

    def _plan(self, lengths, iteration: int = 0, validate: bool = True) -> DynaPipeIterationPlan:
        t_start = time.perf_counter()
        c = self.cfg
        self._mb_memo = {}
        if len(lengths) == 0:
            raise PlanningError(f"iteration {iteration}: empty batch")
        if c.model_kind == "gpt":
            lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
            orders = [part.order_by_length(lens)]
            enc_all, dec_all = self._pad(lens), None
        else:
            pairs = np.asarray(lengths, dtype=np.int64).reshape(-1, 2)
            orders = [part.order_clustered(pairs)]
            if c.t5_lexicographic_order:  # a second candidate order (see the config field)
                orders.append(part.order_lexicographic(pairs))
            enc_all, dec_all = self._pad(pairs[:, 0]), self._pad(pairs[:, 1], c.decoder_extra_tokens)
        best = None  # (makespan, rc, fit, order, partition, groups[(mb_ids, ScheduleChoice)])
        errors = []
        cands = []  # (partition objective, level index, rc, fit, order, partition)
        for k, rc in enumerate(c.recompute_levels):
            if not all(self.cm.has(tp, rc) for tp in set(self.stage_tp)):
                continue
            for fit in ("1f1b", "single"):
                got = self._partitions(rc, fit, orders, enc_all, dec_all, errors)
                cands += [(p.objective, k, rc, fit, order, p) for order, p in got]
                if got:
                    break  # "single" is only a fallback when no 1F1B-fit partition exists
        # Schedule the most promising level first: its makespan bounds (x spread) the others'
        # searches. Candidates within `refine_spread` of the quick best are all refined: the full
        # order search moves makespans by more than their gaps (ties keep the earlier one).
        near, spread = [], 1.0 + c.refine_spread
        for _, _, rc, fit, order, p in sorted(cands, key=lambda x: (x[0], x[1])):
            got = self._schedule_groups(rc, order, p, enc_all, dec_all, best[0] * spread if best else np.inf)
            if got is not None:
                near.append((got[0], rc, fit, order, p, got[1]))
                if best is None or got[0] < best[0]:
                    best = near[-1]
        self._enc_all, self._dec_all = enc_all, dec_all
        if best is not None:
            best = min((self._refine(x) for x in near if x[0] <= best[0] * spread), key=lambda x: x[0])
        got = self._after_refine(best, cands, orders, lengths, iteration, t_start, validate)
        if got is not None:
            return got
        if c.packed_rows:
            got = packed.search_packed(self, c.model_kind, lengths, self._packed_len(lengths),
                                       best[0] if best is not None else np.inf)
            if got is not None:
                return self._finish_packed(got, iteration, lengths, t_start, validate)
        if best is None:
            why = "; ".join(errors[-3:]) or "no schedule fits in memory"
            raise PlanningError(f"iteration {iteration}: no feasible plan ({why})")
        return self._finish(best, iteration, lengths, enc_all, dec_all, t_start, validate)

    def _after_refine(self, best, cands, orders, lengths, iteration, t_start, validate):
        """A composed system's plan that replaces the refined best one (token slices), or None."""
        return None

    def _packed_len(self, lengths):
        """Row length(s) of packed plans: an int, or (encoder, decoder) for T5 with packed_dec_len."""
        c = self.cfg
        L = int(c.packed_max_len) if c.packed_max_len else int(self._pad(np.asarray(lengths, dtype=np.int64).max()))
        return (L, int(c.packed_dec_len)) if c.model_kind == "t5" and c.packed_dec_len else L

    def _finish_packed(self, got, iteration, lengths, t_start, validate) -> DynaPipeIterationPlan:
        makespan, rc, sh, groups, _ = got
        planning_ms = (time.perf_counter() - t_start) * 1e3
        dims = [(int(b), int(e), 0 if sh.dec is None else int(sh.dec[k]))
                for k, (b, e) in enumerate(zip(sh.mbs, sh.enc))]
        group_plans = []
        for g, ch in groups:
            rows = [sh.rows[i] for i in g]
            samples = [[i for r in mb for i in r] for mb in rows]
            gp = self._group_plan(rc, ch, samples, None, None, iteration, validate,
                                  dims=[dims[i] for i in g], rows=rows)
            group_plans.append(gp)
        return DynaPipeIterationPlan(
            iteration=iteration, recompute=rc, groups=group_plans, makespan_ms=self.iteration_ms(makespan),
            padding_efficiency=sh.real_tokens / sh.computed_tokens, planning_ms=planning_ms,
            lowering_ms=(time.perf_counter() - t_start) * 1e3 - planning_ms, memory_fallback=False)

    def _partitions(self, rc, fit, orders, enc_all, dec_all, errors):
        """[(order, Partition)] to schedule: GPT's best cut, T5's `t5_candidates` per order."""
        got = []
        for order in orders:
            enc = enc_all[order]
            dec = None if dec_all is None else dec_all[order]
            T = self.segment_times(rc, fit, enc, dec, sides=True)
            try:
                if T.ndim == 3:  # T5: balance the encoder and the decoder half (stage_loads.py)
                    got += [(order, q) for q in t5_candidates(T, self.S, self.cfg.data_parallel, order is orders[0])]
                else:
                    got.append((order, part.optimal_partition(T, self.S, self.cfg.data_parallel)))
            except part.PartitionError as e:
                errors.append(f"recompute={rc}, fit={fit}: {e}")
        return got

    def _mb_costs(self, rc, order, p, enc_all, dec_all) -> Tuple[PipelineCosts, list]:
        # Once per candidate and plan (the entry keeps its objects, so their ids stay unique).
        key = (rc, id(order), id(p), id(enc_all))
        if key not in self._mb_memo:
            self._mb_memo[key] = ((order, p, enc_all), self._mb_costs_uncached(rc, order, p, enc_all, dec_all))
        return self._mb_memo[key][1]

    def _mb_costs_uncached(self, rc, order, p, enc_all, dec_all) -> Tuple[PipelineCosts, list]:
        b = p.boundaries
        samples = [order[b[k]:b[k + 1]] for k in range(len(b) - 1)]
        mbs, starts = np.diff(b).astype(float), np.asarray(b[:-1])
        enc = np.maximum.reduceat(enc_all[order], starts).astype(float)
        dec = None if dec_all is None else np.maximum.reduceat(dec_all[order], starts).astype(float)
        sc = self.stage_costs(rc, mbs, enc, dec)
        costs = PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], np.array(sc["comm"]),
                              grad_comm=np.array(sc["grad_comm"]) if "grad_comm" in sc else None, wstored=sc["wstored"],
                              wgrad=sc.get("wgrad"),
                              grad_comm_epilogue_only=self.cfg.grad_compress_epilogue_only)
        # split backward ("zb"): the derived W share (megatron/planner/schedule/zb_search.py)
        return planned_split(self, costs, enc, dec), samples

    def _schedule_groups(self, rc, order, p, enc_all, dec_all, bound):
        """Quick search (the first round's orders) per DP group: enough to rank recompute levels."""
        if p.num_microbatches < self.cfg.data_parallel:
            return None
        costs, _ = self._mb_costs(rc, order, p, enc_all, dec_all)
        out, makespan = [], 0.0
        for g in self._dp_groups(p.times, self.cfg.data_parallel):
            ch = self._quick_search(costs.subset(g), bound)
            if ch is None:
                return None
            makespan = max(makespan, ch.result.makespan)
            out.append((g, ch))
        return makespan, out

    def _quick_search(self, sub: PipelineCosts, bound: float) -> Optional[ScheduleChoice]:
        """One DP group's schedule from the first round's orders (no clusters, no polish)."""
        return search(sub, self.available, schedules=self.cfg.schedules, bound=bound, max_orders=self.cfg.max_orders,
                      num_clusters=0, polish_budget=0, exhaustive_up_to=self.cfg.exhaustive_orders_up_to)

    def _refine(self, best):
        """Full order search (clusters, polish) on the chosen level's groups; a group keeps its
        quick result unless the search finds a strictly faster schedule."""
        makespan, rc, fit, order, p, groups = best
        if self.cfg.order_clusters < 2:
            return best
        costs, _ = self._mb_costs(rc, order, p, self._enc_all, self._dec_all)
        out = []
        for g, ch in groups:
            better = self._refine_group(costs.subset(g), ch)
            out.append((g, better if better is not None else ch))
        return (max(ch.result.makespan for _, ch in out), rc, fit, order, p, out)

    def _refine_group(self, sub: PipelineCosts, ch: ScheduleChoice) -> Optional[ScheduleChoice]:
        """A strictly faster schedule for one DP group than its quick result `ch`, or None."""
        if ch.result.makespan <= lower_bound(sub) * (1.0 + self.cfg.refine_skip_gap):
            return None  # already (nearly) at a bound no order can beat
        return search(sub, self.available, schedules=self.cfg.schedules, bound=ch.result.makespan,
                      max_orders=self.cfg.max_orders, num_clusters=self.cfg.order_clusters,
                      exhaustive_up_to=self.cfg.exhaustive_orders_up_to)

    def _finish(self, best, iteration, lengths, enc_all, dec_all, t_start, validate=True) -> DynaPipeIterationPlan:
        makespan, rc, fit, order, p, groups = best
        _, samples = self._mb_costs(rc, order, p, enc_all, dec_all)
        planning_ms = (time.perf_counter() - t_start) * 1e3
        group_plans, computed = [], 0
        for g, ch in groups:
            gp = self._group_plan(rc, ch, [samples[i] for i in g], enc_all, dec_all, iteration, validate)
            group_plans.append(gp)
        for s in samples:
            computed += len(s) * (enc_all[s].max() + (0 if dec_all is None else dec_all[s].max()))
        raw = np.asarray(lengths, dtype=np.int64)
        real = int(raw.sum())
        return DynaPipeIterationPlan(
            iteration=iteration, recompute=rc, groups=group_plans, makespan_ms=self.iteration_ms(makespan),
            padding_efficiency=real / float(computed), planning_ms=planning_ms,
            lowering_ms=(time.perf_counter() - t_start) * 1e3 - planning_ms, memory_fallback=(fit == "single"))

    def _group_plan(self, rc, ch: ScheduleChoice, samples, enc_all, dec_all, iteration, validate=True,
                    dims=None, rows=None) -> GroupPlan:
        """`dims`/`rows` (packed plans): per micro-batch (rows, row length, decoder row length)
        and its rows, instead of the samples' padded lengths."""
        # Renumber micro-batches so that id k is the k-th one forwarded (the data loader
        # yields them in id order).
        rank_of = {old: new for new, old in enumerate(ch.order)}
        mbs = [samples[old] for old in ch.order]
        h, t5 = self.cfg.hidden_size, self.cfg.model_kind == "t5"
        shapes, act = [], []
        for old, s in zip(ch.order, mbs):
            if dims is not None:
                b, se, sd = dims[old]
            else:
                b, se = len(s), int(enc_all[s].max())
                sd = int(dec_all[s].max()) if t5 else 0
            b = int(self.padded_rows(b))  # stages with their own DP sizes: loss-free filler rows
            shapes.append(((b, se), (b, sd)) if t5 else ((b, se),))
            act.append((b, se, sd))
        orders = [[op._replace(microbatch=rank_of[op.microbatch]) for op in stage_ops] for stage_ops in ch.orders]
        plans = []
        if self.cfg.emit_plans:
            from megatron.pipeline.lowering import lower_to_plans
            # sequence parallel: [s/tp, b, h] pieces; with per-stage TP the lowered plans carry
            # the whole sequence and `split_plans` cuts each stage's pieces at its own TP
            sp = self.cfg.tensor_parallel if self.cfg.sequence_parallel and not self.cfg.stage_parallel else 1
            # context parallelism: a rank loads and sends its S/CP tokens of each row (and SP cuts those)
            cp = self.cfg.context_parallel
            sp *= cp

            def activation_shapes(mb, stage):
                b, se, sd = act[mb]
                se, sd = se // sp, sd // sp
                if not t5:
                    return ((se, b, h),)
                if stage < self.split:
                    return ((se, b, h),)
                return ((sd, b, h), (se, b, h))

            loads = [((b, se // cp),) for ((b, se),) in shapes] if cp > 1 else shapes  # a CP rank's share
            plans = lower_to_plans([list(ops) for ops in orders], self.stage_to_rank,
                                   loads, activation_shapes, recompute=rc, dtype=self.cfg.dtype,
                                   iteration=iteration, validate=validate and not self.cfg.stage_parallel)
            if self.cfg.stage_parallel:  # one plan per global rank, row-sliced messages
                from megatron.pipeline.validator import validate_plans
                from megatron.planner.passes.layout import split_plans
                plans = split_plans(plans, self.cfg.stage_parallel, self.cfg.sequence_parallel)
                if validate:
                    validate_plans(plans)
        return GroupPlan([[int(i) for i in s] for s in mbs], shapes, ch.name, float(ch.result.makespan),
                         [float(x) for x in ch.result.peak_memory], plans, orders, ch.result,
                         None if rows is None else [[[int(i) for i in r] for r in rows[old]] for old in ch.order])


def sp_memory_factor(rc: str, tp: int, seq, hidden: int, heads: Optional[int]):
    """Activation memory with sequence parallelism / without, per transformer layer.

    Megatron's accounting (Korthikanti et al., 2022), bytes per layer for s tokens, batch b,
    hidden h, a heads: without SP  s*b*h*(10 + 24/t + 5*a*s/(h*t)); with SP
    s*b*h*(34/t + 5*a*s/(h*t)). Selective recompute drops the a*s term; full recompute keeps
    only the layer input (2*s*b*h, split by t under SP). `heads` unknown -> h/64 heads."""
    if rc == "full":
        return 1.0 / tp
    if rc == "selective":
        return (34.0 / tp) / (10.0 + 24.0 / tp)
    a = heads or max(1, hidden // 64)
    attn = 5.0 * a * np.asarray(seq, float) / (hidden * tp)
    return (34.0 / tp + attn) / (10.0 + 24.0 / tp + attn)
