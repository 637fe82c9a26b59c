"""Aceso-style performance model of a pipeline whose stages have their own ops, TP, DP, recompute.

A model is a flat list of operators (embedding, the profiled per-layer ops repeated once per
layer, final norm, post-process). A stage owns a contiguous op range, a TP size ``tp`` and a
DP size ``dp`` (``tp*dp`` GPUs over a contiguous rank range) and a recompute flag per op. A
micro-batch of ``mbs`` samples is split over the stage's DP ranks, so each op is priced from
the table of (``mbs // dp``, ``tp``).

Per stage and micro-batch (ms)::

    t_s = sum(fwd + bwd) + sum(fwd of recomputed ops) + p2p_s
    p2p_s = 2 * p2p(F_in / dp_s) + 2 * p2p(F_out * tp_next / (tp_s * dp_s))

where ``F`` is the whole boundary activation of one micro-batch (op output size per device x
its DP size): a receiving rank gets its batch shard with the full hidden size (possibly from
several senders), and the senders share the ``tp_next`` copies the next stage needs. Forward
(activation) and backward (gradient) transfers are both counted. Boundaries between stages on
different nodes use the inter-node bandwidth.

Iteration (1F1B over ``M = global_batch / mbs`` micro-batches)::

    T_pipe = (M - 1) * max_s t_s + sum_s t_s
    T      = max_s (T_pipe - sum_{j<s} b_j + allreduce_s)

``b_j`` is the backward share of ``t_j`` (bwd, recompute, backward p2p): stage s finishes its
last backward that much before stage 0, then all-reduces its gradients (``sum weights`` MB
per device) over its own DP group, priced from the all_reduce table. Aceso leaves this term
out; ``include_allreduce=False`` reproduces that.

Memory per device (MB)::

    8 * W  +  A_s * min(S - s, M)  +  peak_recompute  +  reserved

``W`` = weights (fp16 MB; fp16 weights + fp32 master + fp16 grads + fp32 Adam m, v = 8 W).
``A_s`` = activations kept per micro-batch: non-recomputed ops keep their ``activations``;
a run of recomputed ops inside one layer keeps only the run's input. ``peak_recompute`` = the
largest run's activations (rebuilt during backward). ``reserved`` = max allocator reserve of
the stage's ops.

That last pair is Aceso's rule for its published tables, whose reserve columns are allocator
numbers. Tables from our own profiler (``OpDatabase.working_set``) hold instead each op's
measured working set (``fwd_reserved`` / ``bwd_reserved``: memory it needs while it runs
beyond what is live around it), and the pair becomes the position-aware peak of the
micro-batch in flight::

    peak = max over ops k of the stage of
             bwd_ws_k + rebuilt_k - kept_after_k        (backward of op k)
             fwd_ws_k - kept_from_k                      (forward of op k)
             + residual_k
           + 2 * out_last

``rebuilt_k``: the activations of k's recompute run up to k (rebuilt, not yet freed);
``kept_after_k``: what ops after k keep (already freed when k's backward runs); ``out_last``:
the stage output and its gradient; ``residual_k``: the residual stream's gradient where it is
a tensor of its own (before a layer's last residual add, or in any but the stage's last layer).
Backward of the attention core with the MLP's activations freed, not the
sum of the largest run and the largest working set, is where a layer peaks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron.aceso.db import OpDatabase
from megatron.core.recompute import contiguous_runs, residual_inputs_kept


@dataclass(frozen=True)
class ModelSpec:
    """A model the databases cover: name in the DB file names and its layer counts."""
    family: str          # "gpt" or "t5"
    size: str            # as in the DB file names, e.g. "1_3B"
    layers: Tuple[int, ...]  # layers per repeated block kind, in op order (GPT: (L,), T5: (enc, dec))
    hidden: int
    seq_length: int
    default_global_batch: int = 1024

    @property
    def key(self) -> str:
        return f"{self.family}-{self.size.replace('_', '.').lower()}"


# Layer counts follow the GPT-3 / T5 size ladder; hidden sizes match the weights in the tables
# (e.g. GPT-1.3B: qkv weights 24 MB fp16 = 3 * 2048^2 params).
MODELS: Dict[str, ModelSpec] = {s.key: s for s in [
    ModelSpec("gpt", "350M", (24,), 1024, 2048),
    ModelSpec("gpt", "1_3B", (24,), 2048, 2048),
    ModelSpec("gpt", "2_6B", (32,), 2560, 2048),
    ModelSpec("gpt", "6_7B", (32,), 4096, 2048),
    ModelSpec("gpt", "13B", (40,), 5120, 2048),
    ModelSpec("t5", "770M", (24, 24), 1024, 2048),
    ModelSpec("t5", "3B", (24, 24), 1024, 2048),
    ModelSpec("t5", "6B", (24, 24), 1024, 2048),
    ModelSpec("t5", "11B", (24, 24), 1024, 2048),
]}


def get_model_spec(name: str) -> ModelSpec:
    key = name.lower()
    if key not in MODELS:
        raise KeyError(f"--model {name}: unknown; choose one of {', '.join(sorted(MODELS))}")
    return MODELS[key]


def is_layer_op(name: str) -> bool:
    return (name.startswith("enc-") or name.startswith("dec-")) and "final-layernorm" not in name


@dataclass(frozen=True)
class FlatOp:
    row: int      # row index in the DB table
    layer: int    # global layer index, -1 for head/tail ops


def build_op_list(op_names: Sequence[str], layers: Sequence[int]) -> List[FlatOp]:
    """Expand the table rows into the model's op sequence (each layer block repeated)."""
    blocks: List[Tuple[bool, List[int]]] = []
    for i, n in enumerate(op_names):
        lay = is_layer_op(n)
        if blocks and blocks[-1][0] == lay and lay:
            blocks[-1][1].append(i)
        else:
            blocks.append((lay, [i]))
    layer_blocks = [b for b in blocks if b[0]]
    if len(layer_blocks) != len(layers):
        raise ValueError(f"table has {len(layer_blocks)} layer kinds, model spec {len(layers)}")
    out: List[FlatOp] = []
    k = 0
    layer_id = 0
    for lay, rows in blocks:
        if not lay:
            out.extend(FlatOp(r, -1) for r in rows)
            continue
        for _ in range(layers[k]):
            out.extend(FlatOp(r, layer_id) for r in rows)
            layer_id += 1
        k += 1
    return out


@dataclass
class Stage:
    start: int               # first op (inclusive) in the flat op list
    end: int                 # last op (exclusive)
    tp: int
    dp: int
    recompute: Tuple[int, ...] = ()   # per op of the stage, 0/1; empty = none
    algo: int = 0

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    def flags(self) -> Tuple[int, ...]:
        return self.recompute if self.recompute else (0,) * (self.end - self.start)


@dataclass
class Plan:
    model: str
    micro_batch: int
    global_batch: int
    stages: List[Stage]

    @property
    def num_gpus(self) -> int:
        return sum(s.gpus for s in self.stages)


@dataclass
class StageCost:
    fwd_ms: float
    bwd_ms: float
    recompute_ms: float
    p2p_fwd_ms: float
    p2p_bwd_ms: float
    allreduce_ms: float
    weights_mb: float
    act_per_mb_mb: float
    inflight: int
    peak_recompute_mb: float
    reserved_mb: float

    @property
    def time_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms + self.recompute_ms + self.p2p_fwd_ms + self.p2p_bwd_ms

    @property
    def bwd_share_ms(self) -> float:
        return self.bwd_ms + self.recompute_ms + self.p2p_bwd_ms

    @property
    def memory_mb(self) -> float:
        return (8.0 * self.weights_mb + self.act_per_mb_mb * self.inflight
                + self.peak_recompute_mb + self.reserved_mb)


@dataclass
class Prediction:
    iteration_ms: float
    pipeline_ms: float
    stages: List[StageCost]
    memory_limit_mb: float
    num_micro_batches: int

    @property
    def fits(self) -> bool:
        return all(s.memory_mb <= self.memory_limit_mb for s in self.stages)

    @property
    def bottleneck(self) -> int:
        return max(range(len(self.stages)), key=lambda i: self.stages[i].time_ms)


class _Arrays:
    """Per (local mbs, tp, algo): per-op columns over the flat op list plus prefix sums."""

    def __init__(self, rows, ops: List[FlatOp]):
        r = [rows[o.row] for o in ops]
        self.fwd = [x.fwd_us / 1000.0 for x in r]
        self.bwd = [x.bwd_us / 1000.0 for x in r]
        self.act = [x.act_mb for x in r]
        self.inp = [x.input_mb for x in r]
        self.out = [x.output_mb for x in r]
        self.res = [max(x.fwd_reserved_mb, x.bwd_reserved_mb) for x in r]
        self.fws = [x.fwd_reserved_mb for x in r]
        self.bws = [x.bwd_reserved_mb for x in r]
        self.pf = _prefix(self.fwd)
        self.pb = _prefix(self.bwd)
        self.pa = _prefix(self.act)
        self.pw = _prefix([x.weight_mb for x in r])
        self.key: Tuple[int, int, int] = (0, 0, 0)  # (local mbs, tp, algo), set by PerfModel.arrays


def _prefix(xs: List[float]) -> List[float]:
    out = [0.0]
    acc = 0.0
    for x in xs:
        acc += x
        out.append(acc)
    return out


class PerfModel:
    def __init__(self, db: OpDatabase, spec: ModelSpec, memory_limit_mb: float,
                 gpus_per_node: int = 8, include_allreduce: bool = True):
        self.db, self.spec = db, spec
        self.memory_limit_mb = memory_limit_mb
        self.gpus_per_node = gpus_per_node
        self.include_allreduce = include_allreduce
        # our profiler's tables measure each op's working set; published ones an allocator reserve
        self.working_set = getattr(db, "working_set", False)
        self.ops = build_op_list(db.op_names, spec.layers)
        self.layer_of = [o.layer for o in self.ops]
        self._arrays: Dict[Tuple[int, int, int], _Arrays] = {}
        self._ar_cache: Dict[Tuple[int, int], float] = {}
        self._layer_terms: Dict[tuple, Tuple[float, float, float]] = {}
        self._stage_cache: Dict[tuple, Tuple[float, float, float]] = {}
        self._res_cache: Dict[tuple, float] = {}
        # _group_end[i]: the first op after i in another layer (head ops form their own groups)
        self._group_end = [0] * len(self.ops)
        for i in range(len(self.ops) - 1, -1, -1):
            nxt = i + 1
            self._group_end[i] = (self._group_end[nxt] if nxt < len(self.ops)
                                  and self.layer_of[nxt] == self.layer_of[i] else nxt)

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def arrays(self, mbs_local: int, tp: int, algo: int = 0) -> _Arrays:
        key = (mbs_local, tp, algo)
        a = self._arrays.get(key)
        if a is None:
            a = self._arrays[key] = _Arrays(self.db.ops(mbs_local, tp, algo), self.ops)
            a.key = key
        return a

    def local_mbs_ok(self, mbs: int, stage: Stage) -> bool:
        return mbs % stage.dp == 0 and self.db.has(mbs // stage.dp, stage.tp, stage.algo)

    # ---- memory pieces that depend only on the stage's own choices
    def activation_terms(self, a: _Arrays, st: Stage) -> Tuple[float, float]:
        """(activations kept per micro-batch, recompute peak) for ``st``'s recompute flags."""
        return self._stage_terms(a, st)[:2]

    def _stage_terms(self, a: _Arrays, st: Stage) -> Tuple[float, float, float]:
        """(activations kept, recompute peak, recompute ms) per micro-batch; cached, as the
        search prices the same stage in many plans."""
        if self.working_set:
            return self._working_set_terms(a, st)
        kept = a.pa[st.end] - a.pa[st.start]
        if not st.recompute or not any(st.recompute):
            return kept, 0.0, 0.0
        skey = (a.key, st.start, st.recompute)
        hit = self._stage_cache.get(skey)
        if hit is not None:
            return hit
        peak = rec = 0.0
        # checkpoint segments never span two layers, so each layer's share is its own; the
        # search asks for the same (rows, flags) of a layer many times, hence the cache
        ends, flags = self._group_end, st.recompute
        i = st.start
        while i < st.end:
            j = min(ends[i], st.end)
            f = flags[i - st.start:j - st.start]
            if any(f):
                key = (a.key, self.ops[i].row, j - i, f)
                hit = self._layer_terms.get(key)
                if hit is None:
                    hit = self._layer_terms[key] = self._layer_activation_terms(a, i, j, f)
                kept += hit[0]
                peak = max(peak, hit[1])
                rec += hit[2]
            i = j
        out = self._stage_cache[skey] = (kept, peak, rec)
        return out

    def _layer_activation_terms(self, a: _Arrays, i0: int, i1: int, flags) -> Tuple[float, float, float]:
        """(change of kept activations, recompute peak, recompute ms) of ops [i0, i1) of one layer."""
        delta = peak = 0.0
        rec = sum(a.fwd[i0 + k] for k, f in enumerate(flags) if f)
        # the runtime's checkpoint segments (megatron/models/layer_ops.py): runs of consecutive
        # flagged ops inside one layer, each keeping its input and freeing its ops' activations
        for lo, hi in contiguous_runs(flags):
            i, j = i0 + lo, i0 + hi
            run_act = a.pa[j] - a.pa[i]
            delta += a.inp[i] - run_act
            peak = max(peak, run_act)
        # a segment holding a residual add may also keep the residual stream (core/recompute.py)
        names = [self.db.op_names[o.row] for o in self.ops[i0:i1]]
        for k in residual_inputs_kept(names, flags):
            delta += a.inp[i0 + k]
        return delta, peak, rec

    def _working_set_terms(self, a: _Arrays, st: Stage) -> Tuple[float, float, float]:
        """(activations kept, working peak above them, recompute ms) of the micro-batch in
        flight, from measured per-op working sets (see the module docstring)."""
        skey = (a.key, st.start, st.end, st.recompute)
        hit = self._stage_cache.get(skey)
        if hit is not None:
            return hit
        ends, flags = self._group_end, st.flags()
        groups = []
        i = st.start
        while i < st.end:
            j = min(ends[i], st.end)
            f = flags[i - st.start:j - st.start]
            key = ("ws", a.key, self.ops[i].row, j - i, f, self.layer_of[i] >= 0, j == st.end)
            hit = self._layer_terms.get(key)
            if hit is None:
                hit = self._layer_terms[key] = self._layer_working_set(a, i, j, f, j == st.end)
            groups.append(hit)
            i = j
        kept = rec = 0.0
        peak = float("-inf")
        for g_kept, g_peak, g_rec in reversed(groups):  # later groups are freed first
            peak = max(peak, g_peak - kept)
            kept += g_kept
            rec += g_rec
        peak = max(0.0, peak + 2.0 * a.out[st.end - 1])
        out = self._stage_cache[skey] = (kept, peak, rec)
        return out

    def _layer_working_set(self, a: _Arrays, i0: int, i1: int, flags, last: bool) -> Tuple[float, float, float]:
        """(kept, peak above the group's own kept, recompute ms) of ops [i0, i1) of one layer
        (or one head/tail op group); ``last``: the stage ends with it."""
        n = i1 - i0
        names = [self.db.op_names[o.row] for o in self.ops[i0:i1]]
        # the residual stream's gradient: a tensor of its own beside each op before the
        # layer's last residual add; after it, in the stage's last group, it is the stage's
        # incoming gradient itself (counted with the output)
        resid = [0.0] * n
        if self.layer_of[i0] >= 0:
            adds = [k for k, nm in enumerate(names) if "post-" in nm and nm.endswith("-dropout")]
            upto = n if not last else (adds[-1] if adds else 0)
            for k in range(upto):
                resid[k] = a.inp[i0]
        keep = [0.0 if flags[k] else a.act[i0 + k] for k in range(n)]
        rebuilt = [0.0] * n
        for lo, hi in contiguous_runs(flags):
            keep[lo] += a.inp[i0 + lo]   # a checkpoint segment keeps its input
            # rebuilt: the run's saved tensors again, less its input (kept already) where the
            # first op saves it
            acc = -min(a.act[i0 + lo], a.inp[i0 + lo])
            for k in range(lo, hi):
                acc += a.act[i0 + k]
                rebuilt[k] = acc
        if any(flags) and self.layer_of[i0] >= 0:
            for k in residual_inputs_kept(names, flags):
                keep[k] += a.inp[i0 + k]
        total = sum(keep)
        peak = float("-inf")
        after = 0.0
        for k in range(n - 1, -1, -1):
            peak = max(peak, a.bws[i0 + k] + rebuilt[k] - after + resid[k], a.fws[i0 + k] - after - keep[k])
            after += keep[k]
        rec = sum(a.fwd[i0 + k] for k in range(n) if flags[k])
        return total, peak, rec

    def _reserved(self, a: _Arrays, start: int, end: int) -> float:
        """Largest allocator reserve of ops [start, end) (cached: O(ops) per stage otherwise)."""
        if self.working_set:
            return 0.0  # the working sets are in the peak term
        key = (a.key, start, end)
        r = self._res_cache.get(key)
        if r is None:
            r = self._res_cache[key] = max(a.res[start:end])
        return r

    def stage_memory_mb(self, mbs: int, st: Stage, s: int, num_stages: int, m: int) -> float:
        a = self.arrays(mbs // st.dp, st.tp, st.algo)
        kept, peak = self.activation_terms(a, st)
        w = a.pw[st.end] - a.pw[st.start]
        res = self._reserved(a, st.start, st.end)
        return 8.0 * w + kept * min(num_stages - s, m) + peak + res

    def allreduce_ms(self, grad_mb: float, st: Stage) -> float:
        if st.dp <= 1 or not self.include_allreduce:
            return 0.0
        key = (st.dp, st.tp, round(grad_mb, 3))
        t = self._ar_cache.get(key)
        if t is None:
            # Gradients of a TP shard are reduced over the DP group (ranks strided by tp).
            # The group spans nodes when tp * dp > gpus_per_node: collective_ms scales groups
            # larger than a node itself; a smaller group spread over nodes by a large tp gets
            # the intra/inter-node bandwidth ratio here.
            t = self.db.collective_ms("all_reduce", st.dp, grad_mb, self.gpus_per_node)
            if (st.gpus > self.gpus_per_node and st.dp <= self.gpus_per_node
                    and self.db.p2p_inter is not None):
                t *= self.db.p2p_intra.bandwidth(grad_mb) / self.db.p2p_inter.bandwidth(grad_mb)
            self._ar_cache[key] = t
        return t

    def predict(self, plan: Plan) -> Prediction:
        stages = plan.stages
        S = len(stages)
        mbs = plan.micro_batch
        if plan.global_batch % mbs:
            raise ValueError(f"global batch {plan.global_batch} is not a multiple of micro batch {mbs}")
        M = plan.global_batch // mbs
        arrs = []
        for st in stages:
            if mbs % st.dp:
                raise ValueError(f"micro batch {mbs} is not divisible by stage DP size {st.dp}")
            arrs.append(self.arrays(mbs // st.dp, st.tp, st.algo))
        # boundary tensors: whole micro-batch activation leaving stage s
        full_out = [arrs[s].out[st.end - 1] * st.dp for s, st in enumerate(stages)]
        first_rank = []
        r = 0
        for st in stages:
            first_rank.append(r)
            r += st.gpus
        costs: List[StageCost] = []
        for s, st in enumerate(stages):
            a = arrs[s]
            fwd = a.pf[st.end] - a.pf[st.start]
            bwd = a.pb[st.end] - a.pb[st.start]
            kept, peak, rec = self._stage_terms(a, st)
            p_in = p_out = 0.0
            if s > 0:
                inter = self._inter(first_rank[s - 1], first_rank[s] + st.gpus)
                p_in = self.db.p2p_ms(full_out[s - 1] / st.dp, inter)
            if s < S - 1:
                nxt = stages[s + 1]
                inter = self._inter(first_rank[s], first_rank[s + 1] + nxt.gpus)
                p_out = self.db.p2p_ms(full_out[s] * nxt.tp / st.gpus, inter)
            w = a.pw[st.end] - a.pw[st.start]
            costs.append(StageCost(
                fwd_ms=fwd, bwd_ms=bwd, recompute_ms=rec,
                p2p_fwd_ms=p_in + p_out, p2p_bwd_ms=p_in + p_out,
                allreduce_ms=self.allreduce_ms(w, st),
                weights_mb=w, act_per_mb_mb=kept, inflight=min(S - s, M),
                peak_recompute_mb=peak, reserved_mb=self._reserved(a, st.start, st.end)))
        times = [c.time_ms for c in costs]
        pipe = (M - 1) * max(times) + sum(times)
        total = 0.0
        lead = 0.0
        for c in costs:
            total = max(total, pipe - lead + c.allreduce_ms)
            lead += c.bwd_share_ms
        return Prediction(total, pipe, costs, self.memory_limit_mb, M)

    def _inter(self, lo: int, hi_excl: int) -> bool:
        g = self.gpus_per_node
        return lo // g != (hi_excl - 1) // g


def format_prediction(plan: Plan, pred: Prediction) -> str:
    lines = [f"model {plan.model}: micro batch {plan.micro_batch}, global batch {plan.global_batch}, "
             f"{pred.num_micro_batches} micro-batches, {len(plan.stages)} stages, {plan.num_gpus} GPUs"]
    lines.append("stage  ops        gpus tp dp  recomp  fwd_ms   bwd_ms  recomp_ms  p2p_ms  t_ms    "
                 "allreduce_ms  mem_MB")
    for i, (st, c) in enumerate(zip(plan.stages, pred.stages)):
        nrec = sum(st.flags())
        lines.append(f"{i:>5}  {st.start:>4}-{st.end:<5} {st.gpus:>4} {st.tp:>2} {st.dp:>2}  {nrec:>6}  "
                     f"{c.fwd_ms:7.2f}  {c.bwd_ms:7.2f}  {c.recompute_ms:9.2f}  "
                     f"{c.p2p_fwd_ms + c.p2p_bwd_ms:6.2f}  {c.time_ms:6.2f}  {c.allreduce_ms:12.2f}  "
                     f"{c.memory_mb:8.0f}")
    lines.append(f"iteration {pred.iteration_ms / 1000:.3f} s (pipeline {pred.pipeline_ms / 1000:.3f} s), "
                 f"bottleneck stage {pred.bottleneck}, memory limit {pred.memory_limit_mb:.0f} MB, "
                 f"{'fits' if pred.fits else 'OUT OF MEMORY'}")
    return "\n".join(lines)
