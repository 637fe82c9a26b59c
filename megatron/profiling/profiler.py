"""Sweep a grid of shapes on one tensor-parallel rank and turn the numbers into a `CostModel`.

Grid (DynaPipe's): per TP size, recompute level in none/selective/full, micro-batch size x
sequence length (T5 decoder: x decoder length). Shapes are visited in increasing order; once a
shape does not fit, every shape at least as large on every axis is skipped (recorded as null)
without running, as DynaPipe did.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from megatron.config.core import ModelConfig
from megatron.core.host_memory import keep_freed_host_memory
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import get_rng_tracker, model_parallel_seed
from megatron.planner.cost.attention_cost import fit_grid
from megatron.planner.cost.cost_model import COMPONENT_AXES, RECOMPUTE_LEVELS, CostModel, Grid, Profile
from megatron.profiling import components as C
from megatron.profiling import noise
from megatron.profiling.weight_pass import time_split
from megatron.profiling.measure import STATISTICS, ShapeInfeasible, measure

MB = 1e6  # the cost-model files use decimal megabytes (the DynaPipe tables do too)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ProfileSpec:
    model: ModelConfig
    tps: List[int]
    micro_batch_sizes: List[int]
    seq_lengths: List[int]
    decoder_seq_lengths: List[int] = field(default_factory=list)
    recompute: List[str] = field(default_factory=lambda: list(RECOMPUTE_LEVELS))
    layers: int = 3
    warmup: int = 2
    iters: int = 5
    device: str = "cpu"
    dtype: str = "float32"
    max_seconds: Optional[float] = None  # one forward+backward slower than this = infeasible
    max_tokens: Optional[int] = None  # mbs x length above this = infeasible, not run
    seed: int = 1234
    name: str = "profiled"
    cpu_threads: int = 1  # per rank; the CPU trainer runs its ranks with one thread each
    # "min" suits a shared CPU: other processes only ever add time, so the fastest iteration
    # is the best estimate of the uncontended cost. DynaPipe (dedicated GPUs) used the median.
    statistic: str = "median"
    # Also measure the per-document attention term of a layer (`attention_split` in the file,
    # see megatron.planner.cost.attention_cost): packed rows of 1 vs `split_docs` documents.
    attention_split: bool = False
    split_docs: int = 4
    # profiling/noise.py: a cell whose (median - min) / min is past max_spread is re-measured
    # up to `remeasure` more rounds, then reported (profile_model refuses to write the file).
    max_spread: float = noise.MAX_SPREAD
    remeasure: int = noise.REMEASURE

    def __post_init__(self):
        def bad(flag, msg):
            raise ValueError(f"{flag}: {msg}")
        for flag, vals in (("--tp", self.tps), ("--micro-batch-sizes", self.micro_batch_sizes),
                           ("--seq-lengths", self.seq_lengths)):
            if not vals or any(v < 1 for v in vals) or sorted(set(vals)) != list(vals):
                bad(flag, f"needs distinct positive values in increasing order, got {vals}")
        t5 = self.model.model_type == "t5"
        if t5 and (not self.decoder_seq_lengths or sorted(set(self.decoder_seq_lengths)) != self.decoder_seq_lengths
                   or self.decoder_seq_lengths[0] < 1):
            bad("--decoder-seq-lengths",
                f"T5 needs distinct positive increasing values, got {self.decoder_seq_lengths}")
        if not t5 and self.decoder_seq_lengths:
            bad("--decoder-seq-lengths", "only applies to --model-type t5")
        if not self.recompute or any(r not in RECOMPUTE_LEVELS for r in self.recompute):
            bad("--recompute", f"values must be among {RECOMPUTE_LEVELS}, got {self.recompute}")
        if self.layers < 1:
            bad("--num-layers-profiled", f"must be >= 1, got {self.layers}")
        if self.iters < 1 or self.warmup < 0:
            bad("--iters/--warmup", f"need iters >= 1 and warmup >= 0, got {self.iters}/{self.warmup}")
        if self.statistic not in STATISTICS:
            bad("--statistic", f"must be one of {sorted(STATISTICS)}, got {self.statistic!r}")
        if not self.max_spread > 0 or self.remeasure < 0:
            bad("--max-spread/--remeasure", f"need max-spread > 0 and remeasure >= 0, got {self.max_spread}/"
                                            f"{self.remeasure}")
        if self.cpu_threads < 1:
            bad("--cpu-threads", f"must be >= 1, got {self.cpu_threads}")
        if self.dtype not in DTYPES:
            bad("--dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        m = self.model
        for tp in self.tps:
            if m.num_attention_heads % tp or m.ffn_hidden_size % tp:
                bad("--tp", f"{tp} must divide --num-attention-heads ({m.num_attention_heads}) and "
                            f"--ffn-hidden-size ({m.ffn_hidden_size})")

    @property
    def components(self) -> List[str]:
        if self.model.model_type == "t5":
            return ["encoder", "decoder", "preprocess", "postprocess"]
        return ["encoder", "preprocess", "postprocess"]

    def axes(self, component: str) -> List[List[int]]:
        enc, dec = self.seq_lengths, self.decoder_seq_lengths
        if component == "decoder":
            return [self.micro_batch_sizes, enc, dec]
        if component == "postprocess" and self.model.model_type == "t5":
            return [self.micro_batch_sizes, dec]  # the head runs on the decoder sequence
        if component == "preprocess" and self.model.model_type == "t5":
            return [self.micro_batch_sizes, sorted(set(enc) | set(dec))]  # encoder and decoder embeddings
        return [self.micro_batch_sizes, enc]


@contextlib.contextmanager
def _seeded(seed: int, tp_rank: int, device_type: str):
    """Attention dropout needs the TP RNG stream; restore the caller's RNG state afterwards so
    profiling in-process (tests, notebooks) does not perturb it."""
    tracker = get_rng_tracker()
    saved = (tracker.device_type, tracker.get_states(), torch.get_rng_state())
    model_parallel_seed(seed, tp_rank, 0, device_type)
    try:
        yield
    finally:
        tracker.device_type = saved[0]
        tracker.set_states(saved[1])
        torch.set_rng_state(saved[2])


def _sweep(spec, axes, run_shape, log, label, noise_log) -> Dict[str, np.ndarray]:
    shape = tuple(len(a) for a in axes)
    out = {q: np.full(shape, np.nan) for q in ("forward_ms", "backward_ms", "stored_mb", "peak_mb",
                                                "input_grad_ms", "weight_grad_ms")}
    failed = []  # index tuples that did not fit: everything dominating them is skipped
    progress = noise.Progress(int(np.prod(shape)))
    for idx in itertools.product(*[range(n) for n in shape]):
        vals = [a[i] for a, i in zip(axes, idx)]
        # A counter with the total and an ETA on every line (the lines come through the TP
        # ranks' queue, so a redrawn tqdm bar would interleave badly).
        label_k = f"{progress.next()} {label}"
        tokens = vals[0] * max(vals[1:])
        why = None
        if any(all(i >= j for i, j in zip(idx, f)) for f in failed):
            why = "dominated by a shape that did not fit"
        elif spec.max_tokens is not None and tokens > spec.max_tokens:
            why = f"mbs x length = {tokens} > --max-tokens {spec.max_tokens}"
        else:
            try:
                r = run_shape(*vals)
            except ShapeInfeasible as e:
                why = str(e)
        if why is not None:
            failed.append(idx)
            log(f"{label_k} {vals}: unmeasured ({why})")
            continue
        for q, v in zip(out, (r.forward_ms, r.backward_ms, r.stored_bytes / MB, r.peak_bytes / MB,
                              r.input_grad_ms, r.weight_grad_ms)):
            out[q][idx] = v
        t = r.timing
        note = ""
        if t is not None:
            noise_log.add(f"{label} {vals}", t)
            note = f" spread {t.spread:.0%}" + (f" ({t.rounds} rounds)" if t.rounds > 1 else "") + \
                (" NOISY" if t.noisy else "")
        log(f"{label_k} {vals}: fwd {r.forward_ms:.3f} ms bwd {r.backward_ms:.3f} ms "
            f"stored {r.stored_bytes / MB:.3f} MB peak {r.peak_bytes / MB:.3f} MB{note}")
    return out


def profile_rank(spec: ProfileSpec, ps: ParallelState, agree: Callable[[bool], bool] = lambda x: x,
                 log: Callable[[str], None] = lambda s: None) -> dict:
    """Everything one TP size contributes, measured on this rank (all TP ranks must call it).

    Returns {"tp", "params": {component: (count, bytes)}, "grids": {recompute: {component:
    {quantity: per-layer array}}}, "noise": `noise.NoiseLog`}. `agree(flag)` ORs a flag over the TP group so every rank
    skips the same shapes (a rank alone leaving a collective would hang the others)."""
    device = torch.device(spec.device)
    if device.type == "cpu":
        keep_freed_host_memory()  # the allocator the CPU trainer runs with (initialize.py)
    dtype = DTYPES[spec.dtype]
    n, tp, cfg = spec.layers, ps.tp_size, spec.model
    cap = spec.max_seconds
    noise_log = noise.NoiseLog(spec.max_spread)
    timing = dict(max_spread=spec.max_spread, remeasure=spec.remeasure)

    def fits(fn):
        try:
            res, err = fn(), None
        except ShapeInfeasible as e:
            res, err = None, e
        if agree(err is not None):
            raise err or ShapeInfeasible("another tensor-parallel rank could not run this shape")
        return res

    with _seeded(spec.seed, ps.tp_rank, device.type):
        mods = {c: C.build_layers(cfg, ps, c, n, spec.seed).to(device, dtype)
                for c in spec.components if c not in ("preprocess", "postprocess")}
        head = C.build_postprocess(cfg, ps, spec.seed).to(device, dtype)
        emb = C.build_embedding(cfg, ps, spec.seed).to(device, dtype)
        params = {c: C.param_bytes(m.layers[0]) for c, m in mods.items()}
        params["embedding"] = C.param_bytes(emb)
        grids = {}
        post = pre = None
        for rc in spec.recompute:
            grids[rc] = {}
            for comp, block in mods.items():
                def run(mbs, seq, dec=None, block=block, rc=rc):
                    w = C.layer_workload(block, cfg, rc, mbs, seq, device, dtype, dec)
                    r = fits(lambda: measure(w, device, spec.warmup, spec.iters, cap, agree, spec.statistic, **timing))
                    r.forward_ms, r.backward_ms = r.forward_ms / n, r.backward_ms / n
                    if rc == "none" and cfg.model_type == "gpt":  # the zero-bubble split, timed
                        b, wg = fits(lambda: time_split(w, device, spec.warmup, spec.iters, spec.statistic, agree))
                        r.input_grad_ms, r.weight_grad_ms = b / n, wg / n
                    r.stored_bytes //= n
                    # The stack peaks at (n - 1) layers' stored memory plus one layer's peak; the
                    # planner adds them back the same way for a stage of any depth.
                    r.peak_bytes = max(r.peak_bytes - (n - 1) * r.stored_bytes, r.stored_bytes)
                    return r
                grids[rc][comp] = _sweep(spec, spec.axes(comp), run, log, f"tp{tp} {rc} {comp}", noise_log)
            if post is None:  # the head is never recomputed: one sweep serves every level
                def run_post(mbs, seq):
                    w = C.postprocess_workload(head, cfg, mbs, seq, device, dtype)
                    r = fits(lambda: measure(w, device, spec.warmup, spec.iters, cap, agree, spec.statistic,
                                             **timing))
                    if cfg.model_type == "gpt":
                        r.input_grad_ms, r.weight_grad_ms = fits(
                            lambda: time_split(w, device, spec.warmup, spec.iters, spec.statistic, agree))
                    return r
                post = _sweep(spec, spec.axes("postprocess"), run_post, log, f"tp{tp} postprocess", noise_log)
            if pre is None:  # nor is the embedding
                def run_pre(mbs, seq):
                    w = C.preprocess_workload(emb, cfg, mbs, seq, device)
                    return fits(lambda: measure(w, device, spec.warmup, spec.iters, cap, agree, spec.statistic,
                                                **timing))
                pre = _sweep(spec, spec.axes("preprocess"), run_pre, log, f"tp{tp} preprocess", noise_log)
            grids[rc]["postprocess"] = post
            grids[rc]["preprocess"] = pre
        doc_quad = _measure_doc_quad(spec, mods, grids, device, dtype, fits, log) if spec.attention_split else {}
    return {"tp": tp, "params": params, "grids": grids, "doc_quad": doc_quad, "noise": noise_log}


def _measure_doc_quad(spec, mods, grids, device, dtype, fits, log) -> dict:
    """{recompute: {quantity: ms per squared document token}} of one encoder/GPT layer, measured
    with the variable-length kernel: the same rows (smallest micro-batch size, longest length
    the grid measured) holding 1 and `split_docs` documents; their time difference is the
    attention work that per-document packing removes. Empty without the kernel on this device."""
    from megatron.fused_kernels import ops
    from megatron.profiling.measure import time_workload
    if "encoder" not in mods or not ops.use_fused(torch.zeros(1, device=device)):
        log("attention split: no variable-length kernel on this device; the planner fits it from the grid")
        return {}
    n, K, b = spec.layers, spec.split_docs, spec.micro_batch_sizes[0]
    out = {}
    for rc, comps in grids.items():
        ok = np.isfinite(comps["encoder"]["forward_ms"][0])
        seqs = [s for s, good in zip(spec.seq_lengths, ok) if good and s % K == 0]
        if not seqs:
            continue
        s = seqs[-1]
        t = {}
        for docs in (1, K):
            w = C.packed_layer_workload(mods["encoder"], spec.model, rc, b, s, docs, device, dtype)
            t[docs] = fits(lambda: time_workload(w, device, spec.warmup, spec.iters, spec.max_seconds,
                                                 statistic=spec.statistic))
        work = b * s * s * (1.0 - 1.0 / K)  # squared document tokens removed by splitting rows
        out[rc] = {q: max(0.0, (t[1][i] - t[K][i]) / n) / work for i, q in enumerate(("forward_ms", "backward_ms"))}
        log(f"attention split {rc}: rows of {s} tokens, 1 vs {K} documents: "
            f"fwd {t[1][0] / n:.3f} vs {t[K][0] / n:.3f} ms, bwd {t[1][1] / n:.3f} vs {t[K][1] / n:.3f} ms per layer")
    return out


def to_cost_model(spec: ProfileSpec, results: List[dict], meta: dict) -> CostModel:
    m = spec.model
    profiles, params, splits = [], {}, {}
    for res in results:
        # The format stores 16-bit parameter MB (the planner scales it to weights + grads +
        # optimizer state), whatever dtype the profile ran in.
        state = {c: cnt * 2 / MB for c, (cnt, _) in res["params"].items()}
        params[str(res["tp"])] = {c: {"count": cnt, "bytes": b} for c, (cnt, b) in res["params"].items()}
        for rc, comps in res["grids"].items():
            # a quantity measured nowhere (the split at recompute levels) is left out of the file
            grids = {c: Grid(spec.axes(c), {q: v for q, v in comps[c].items() if not np.isnan(v).all()})
                     for c in COMPONENT_AXES if c in comps}
            profiles.append(Profile(res["tp"], rc, state, grids))
            for q, value in res.get("doc_quad", {}).get(rc, {}).items():
                sp = fit_grid(grids["encoder"], "encoder", q)
                if sp is not None:  # the dense rows' s^2 term stays fitted; documents pay the measured one
                    sp.coef["doc_quad"] = value
                    sp.source = f"doc_quad measured (1 vs {spec.split_docs} documents per row), rest fitted"
                    splits[(res["tp"], rc, "encoder", q)] = sp.to_dict()
    model = {"kind": m.model_type, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
             "ffn_hidden_size": m.ffn_hidden_size, "kv_channels": m.kv_channels, "vocab_size": m.vocab_size,
             "max_position_embeddings": m.max_position_embeddings,
             "hidden_dropout": m.hidden_dropout, "attention_dropout": m.attention_dropout,
             # The architecture changes per-layer time and memory: planning another with this
             # file is refused (arguments._check_cost_model_matches).
             "normalization": m.normalization, "swiglu": m.swiglu, "add_bias_linear": m.add_bias_linear,
             "activation_func": m.activation_func, "gated_linear_unit": m.gated_linear_unit,
             "position_embedding_type": m.position_embedding_type, "num_query_groups": m.query_groups}
    meta = dict(meta, units={"time": "ms", "memory": "MB (1e6 bytes)"}, parameters=params,
                dtype=spec.dtype, profiler={"cpu_threads_per_rank": spec.cpu_threads,
                                             "layers_per_measurement": spec.layers, "warmup": spec.warmup,
                                             "iters": spec.iters, "statistic": spec.statistic,
                                             "max_spread": spec.max_spread, "remeasure": spec.remeasure,
                                             "max_seconds": spec.max_seconds, "max_tokens": spec.max_tokens})
    cm = CostModel(spec.name, model, profiles, meta)
    cm.attention_splits.update(splits)
    return cm


def describe_device(device: str) -> str:
    import platform
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()}, torch {torch.__version__}"


def implausible_warnings(spec: ProfileSpec, results: List[dict]) -> List[str]:
    """`noise.implausible_lines` over every measured time grid (forward + backward per layer)."""
    lines = []
    for res in results:
        for rc, comps in res["grids"].items():
            for comp, q in comps.items():
                if rc != next(iter(res["grids"])) and comp in ("preprocess", "postprocess"):
                    continue  # shared by every recompute level: checked once
                total = q["forward_ms"] + q["backward_ms"]
                lines += noise.implausible_lines(total, spec.axes(comp), ["mbs", "seq", "decoder seq"],
                                                 f"tp{res['tp']} {rc} {comp} forward+backward")
    return lines


def run_profile(spec: ProfileSpec, log: Callable[[str], None] = lambda s: None,
                noise_log: Optional[noise.NoiseLog] = None) -> CostModel:
    """Profile every TP size of `spec` (TP > 1 in spawned ranks) and return the cost model.
    The cells' spreads are collected in `noise_log` (its `refusal` says whether any stayed noisy)."""
    from megatron.profiling.launch import run_tp_ranks
    t0 = time.perf_counter()
    results = []
    if not spec.device.startswith("cuda"):
        line = noise.host_load_line()
        if line:
            log(line)
    for tp in spec.tps:
        if tp > 1:
            results.append(run_tp_ranks(spec, tp, log, profile_rank))
            continue
        if spec.device.startswith("cuda"):
            results.append(profile_rank(spec, ParallelState(), log=log))
            continue
        with noise.pin_threads(spec.cpu_threads):
            results.append(profile_rank(spec, ParallelState(), log=log))
    nl = noise_log if noise_log is not None else noise.NoiseLog(spec.max_spread)
    for res in results:
        rl = res.pop("noise", None)
        if rl is not None:
            nl.spreads += rl.spreads
            nl.remeasured += rl.remeasured
            nl.cells += rl.cells
    warnings = implausible_warnings(spec, results)
    for line in warnings:
        log(line)
    log(f"timing noise: {nl.summary()}")
    meta = {"device": describe_device(spec.device), "source": "megatron.profiling.profile_model",
            "profile_seconds": round(time.perf_counter() - t0, 1),
            "noise": {"summary": nl.summary(), "implausible_cells": len(warnings)}}
    return to_cost_model(spec, results, meta)
