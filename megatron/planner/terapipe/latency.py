"""TeraPipe's latency model t(b, l, c): forward + backward time of one layer for a slice of
l tokens of b sequences after c context tokens, and the stage time built from it.

As in TeraPipe: the context-free part t(b, l, 0) is a table over (b, l); the context term
is a linear regression

    t(b, l, c) - t(b, l, 0) = a1 * b*l + a2 * b*c + a3 * b*l*c

fitted on profiled points with c > 0 by non-negative least squares (`nnls`): more tokens or
more context never make a slice faster, and an unconstrained fit on noisy CPU timings can
give negative coefficients that predict negative times. A stage of `layers` layers costs
``layers * t(b, l, c) + p2p(b*l)`` with the activation transfer linear in its size.

Sources of a model (file format "megatron-terapipe-latency", version 1, JSON):
* `profile_cpu_model`: measured here, on the current device, with the real sliced attention
  path (`SequenceKVCache`), then fitted (`fit_context`).
* `from_cost_model`: derived from a DynaPipe-style per-layer table (the A100 GPT-6.7B one in
  cost_models/). The table times full sequences, so t(b, l, 0) is read from it directly; the
  context term is derived, not measured: fitting ``t(b, s, 0) = u + v*b*s + w*b*s^2`` on the
  table gives w, the cost per query-key pair of the layer's core attention (Megatron's
  non-flash attention scores the full s x s matrix, so the quadratic term counts l*l pairs);
  a slice over c context tokens scores l*c more pairs, hence a3 = w, a1 = a2 = 0. This is an
  approximation: it ignores the K/V concatenation (memory-bound, linear in b*c) and assumes
  the table's attention kernel scales the same way for rectangular score matrices.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from megatron.atomic import write_json
from megatron.planner.cost import cost_model_checks as checks
from megatron.planner.cost.calibration import IDENTITY, HostCalibration

FORMAT_NAME = "megatron-terapipe-latency"
FORMAT_VERSION = 1


def nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||A x - y|| subject to x >= 0, exactly, for a handful of columns: the optimum is
    the unconstrained least-squares solution on its own support (the KKT conditions), so among
    the supports whose least-squares solution is non-negative the one with the smallest
    residual is it. 2^n small solves (n = 3 here); scipy is not a dependency."""
    A, y = np.asarray(A, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = A.shape[1]
    if n > 12:
        raise ValueError("nnls enumerates supports; use it for at most 12 columns")
    best, best_res = np.zeros(n), float(np.sum(y * y))
    for mask in range(1, 2 ** n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
        if np.any(x < 0):
            continue
        res = float(np.sum((A[:, cols] @ x - y) ** 2))
        if res < best_res - 1e-12 * max(best_res, 1.0):
            best, best_res = np.zeros(n), res
            best[cols] = x
    return best


def fit_context(points: Sequence[tuple]) -> tuple:
    """Non-negative least squares of dt on [b*l, b*c, b*l*c]; points are (b, l, c, dt).
    Returns (a1, a2, a3), each >= 0, so the context term never predicts a negative time or one
    that falls as a slice or its context grows (plain least squares did, on noisy CPU times:
    issue 23). Solved exactly by `nnls`."""
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] != 4 or len(pts) < 3:
        raise ValueError("fit_context needs at least 3 points (b, l, c, dt)")
    b, l, c, dt = pts.T
    X = np.stack([b * l, b * c, b * l * c], axis=1)
    return tuple(float(x) for x in nnls(X, dt))


def monotone_table(t0) -> np.ndarray:
    """t(b, l, 0) made non-decreasing in b and in l by running maxima: a measured point that
    is faster than a smaller slice is timing noise (the profiler records that it did this)."""
    t = np.array(t0, dtype=np.float64)
    return np.maximum.accumulate(np.maximum.accumulate(t, axis=0), axis=1)


class SliceLatencyModel:
    def __init__(self, mbs: Sequence[float], seq: Sequence[float], t0_ms, context_coef: Sequence[float],
                 p2p_ms_per_mb: float = 0.0, p2p_latency_ms: float = 0.0, hidden_size: int = 0,
                 meta: Optional[dict] = None):
        from megatron.planner.cost.cost_model import Grid
        self.mbs, self.seq = [float(x) for x in mbs], [float(x) for x in seq]
        self.t0_ms = np.array([[np.nan if x is None else x for x in row] for row in t0_ms], dtype=np.float64)
        self.grid = Grid([self.mbs, self.seq], {"ms": self.t0_ms})
        self.coef = tuple(float(x) for x in context_coef)
        self.p2p_ms_per_mb, self.p2p_latency_ms = float(p2p_ms_per_mb), float(p2p_latency_ms)
        self.hidden_size = int(hidden_size)
        self.meta = dict(meta or {})
        # What the layer table leaves out of a training step on this host (planner/calibration.py;
        # fitted by megatron.profiling.calibrate, identity until then).
        self.calibration = IDENTITY

    def layer_ms(self, b, l, c):
        """Scalars or numpy-broadcastable arrays (the planner's DP asks for all slices at once)."""
        a1, a2, a3 = self.coef
        t0 = self.grid(b, l)["ms"]
        out = t0 + a1 * np.multiply(b, l) + a2 * np.multiply(b, c) + a3 * np.multiply(np.multiply(b, l), c)
        return float(out) if np.ndim(out) == 0 else out

    def problems(self) -> list:
        """Why this model would predict a negative or non-monotone time (empty when sound):
        the planner compares slicings by these times, so such a model plans nonsense."""
        bad = []
        t = self.t0_ms
        fin = t[np.isfinite(t)]
        if fin.size and fin.min() < 0:
            bad.append(f"negative t(b, l, 0) ({fin.min():.3g} ms)")
        with np.errstate(invalid="ignore"):
            dec = [name for name, ax in (("micro-batch size", 0), ("slice length", 1))
                   if np.any(np.diff(t, axis=ax) < 0)]
        if dec:
            bad.append("t(b, l, 0) decreases with " + " and ".join(dec))
        bad += self._context_problems()
        if self.p2p_ms_per_mb < 0 or self.p2p_latency_ms < 0:
            bad.append("a negative transfer time")
        return bad

    def _context_problems(self) -> list:
        """The context term a1 b l + a2 b c + a3 b l c is linear in each of l and c, and so are its
        slopes: its value and slopes at the corners of [shortest, longest slice] x [0, longest
        context] bound them on the whole grid (contexts run up to the longest sequence)."""
        a1, a2, a3 = self.coef
        lmax = max(self.seq) if self.seq else 0.0
        for l in (min(self.seq, default=0.0), lmax):
            for c in (0.0, lmax):
                if a1 * l + a2 * c + a3 * l * c < 0:
                    return [f"context_coef {list(self.coef)} predicts a negative context time at l={l:g}, c={c:g}"]
                if a2 + a3 * l < 0 or a1 + a3 * c < 0:
                    return [f"context_coef {list(self.coef)} predicts a time that falls as the context or the "
                            f"slice grows (at l={l:g}, c={c:g})"]
        return []

    def p2p_ms(self, b, l, bytes_per: int = 2):
        if not self.hidden_size:
            return 0.0 * np.multiply(b, l)
        return self.p2p_latency_ms + self.p2p_ms_per_mb * b * l * self.hidden_size * bytes_per / 2 ** 20

    def stage_ms(self, b: int, l: int, c: int, layers: int) -> float:
        """Forward + backward of one slice on a stage of `layers` layers, with its two transfers
        (activation forward, gradient back), as a training step on the calibrated host sees them."""
        return self.calibration.op_ms(layers * self.layer_ms(b, l, c)) + self.calibration.op_overhead_ms \
            + 2 * self.p2p_ms(b, l)

    # -- persistence ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "meta": self.meta,
                "hidden_size": self.hidden_size, "mbs": self.mbs, "seq": self.seq,
                # an unmeasured (or infeasible) shape is null: JSON has no NaN/Infinity
                "t0_ms": [[float(x) if np.isfinite(x) else None for x in row] for row in self.t0_ms],
                "context_coef": list(self.coef),
                "p2p_ms_per_mb": self.p2p_ms_per_mb, "p2p_latency_ms": self.p2p_latency_ms,
                **({} if self.calibration.identity else {"calibration": self.calibration.to_dict()})}

    def save(self, path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, self.to_dict(), indent=1, end="")

    @classmethod
    def load(cls, path) -> "SliceLatencyModel":
        try:
            doc = checks.parse(Path(path).read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ValueError(f"--terapipe-cost-model {path}: cannot read it ({str(e)[:200]})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME or doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"--terapipe-cost-model {path}: not a {FORMAT_NAME} v{FORMAT_VERSION} file (make one "
                             f"with `python -m megatron.planner.terapipe.latency`)")
        problem = checks.latency_problem(doc.get("mbs"), doc.get("seq"), doc.get("t0_ms"), doc.get("context_coef"),
                                         (doc.get("p2p_ms_per_mb", 0.0), doc.get("p2p_latency_ms", 0.0)))
        if problem:
            raise ValueError(f"--terapipe-cost-model {path}: {problem}")
        try:
            model = cls(doc["mbs"], doc["seq"], doc["t0_ms"], doc["context_coef"], doc.get("p2p_ms_per_mb", 0.0),
                        doc.get("p2p_latency_ms", 0.0), doc.get("hidden_size", 0), doc.get("meta"))
            model.calibration = HostCalibration.from_dict(doc.get("calibration"), f"--terapipe-cost-model {path}")
        except (KeyError, ValueError) as e:
            raise ValueError(f"--terapipe-cost-model {path}: malformed ({e})") from None
        bad = model.problems()
        if bad:
            raise ValueError(f"--terapipe-cost-model {path}: predicts negative or non-monotone times ("
                             + "; ".join(bad) + "); re-profile it with `python -m megatron.planner.terapipe.latency`")
        return model


# ---------------------------------------------------------------------------- from a table
def from_cost_model(cost_model, tp: int = 1, recompute: str = "none", p2p_gbps: float = 25.0) -> SliceLatencyModel:
    """Derive t(b, l, c) from a DynaPipe-style per-layer table (see module docstring)."""
    g = cost_model._grid(tp, recompute, "encoder")
    mbs, seq = g.axes
    ms = g.values["forward_ms"] + g.values["backward_ms"]
    B, S = np.meshgrid(mbs, seq, indexing="ij")
    ok = np.isfinite(ms) & (B * S >= 4096)  # where compute, not launch overhead, dominates
    X = np.stack([np.ones(ok.sum()), (B * S)[ok], (B * S * S)[ok]], axis=1)
    (u, v, w), *_ = np.linalg.lstsq(X, ms[ok], rcond=None)
    hidden = int(cost_model.model.get("hidden_size", 0))
    meta = {"origin": f"derived from cost model {cost_model.name!r} (tp={tp}, {recompute}); context term "
                      f"a3 = quadratic coefficient of t(b,s) = u + v*b*s + w*b*s^2 fitted on the table",
            "fit": {"u": float(u), "v": float(v), "w": float(w)}, "tp": tp}
    # p2p: bandwidth in GB/s -> ms per MB.
    # The table's smallest shapes are launch-bound and slightly non-monotone (3.5 ms at 1x16,
    # 3.0 ms at 1x128): raised to the running maximum, as a profiled table is.
    table = np.where(np.isfinite(ms), ms, np.inf)
    meta["t0"] = f"running maximum over b and l (raised {int(np.sum(monotone_table(table) > table))} table points)"
    return SliceLatencyModel(mbs, seq, monotone_table(table), (0.0, 0.0, max(float(w), 0.0)),
                             p2p_ms_per_mb=1.0 / (p2p_gbps * 1.024), p2p_latency_ms=0.02, hidden_size=hidden,
                             meta=meta)


# ---------------------------------------------------------------------------- profiling
def time_layer_slice(layer, b: int, l: int, c: int, hidden: int, repeats: int = 3, **noise_kw):
    """Forward + backward of `layer` on a slice of l tokens after c cached ones, as a
    `noise.Timing` whose value is the fastest ms (on a shared CPU other processes only ever add
    time, as in megatron.profiling), with its spread; re-measured past `max_spread`."""
    import torch

    from megatron.models.sliced_attention import SequenceKVCache
    from megatron.profiling import noise

    def sample(_):
        cache = SequenceKVCache(0, 0)
        if c:
            with torch.no_grad():
                cache.begin(0, c)
                layer(torch.randn(c, b, hidden), kv_cache=cache)
                cache.end()
        x = torch.randn(l, b, hidden, requires_grad=True)
        t0 = noise.clock()
        cache.begin(c, l)
        y = layer(x, kv_cache=cache)
        rec = cache.end()
        kv, _ = cache.output_grads(rec)
        torch.autograd.backward([y], [torch.ones_like(y)])
        cache.accumulate(rec)
        ms = (noise.clock() - t0) * 1e3
        del kv
        return (ms,)
    return noise.repeat(sample, 1, repeats, statistic="min", **noise_kw)


def profile_cpu_model(model_cfg, mbs: Sequence[int], seqs: Sequence[int], contexts: Sequence[int],
                      repeats: int = 3, seed: int = 1234, *, threads: int = 1, max_spread: float = float("inf"),
                      remeasure: int = 0, noise_log=None, log=lambda s: None) -> SliceLatencyModel:
    """Profile one layer of `model_cfg` here (TP=1, `threads` torch threads): t(b, l, 0) on the
    mbs x seqs grid, then t(b, l, c) - t(b, l, 0) on mbs x seqs x contexts, fitted with
    `fit_context`. Every cell's spread goes to `noise_log` (profiling/noise.py); implausible
    cells and a context term fitted to nothing are warned about through `log`."""
    import torch

    from megatron.core.host_memory import keep_freed_host_memory
    from megatron.models.transformer import TransformerLayer
    from megatron.profiling import noise
    keep_freed_host_memory()  # the allocator the CPU trainer runs with (initialize.py)
    torch.manual_seed(seed)
    layer = TransformerLayer(model_cfg, None, layer_number=0, num_layers_total=1, seed=seed, key="profile")
    h = model_cfg.hidden_size
    nl = noise_log if noise_log is not None else noise.NoiseLog(max_spread)
    ctx = [c for c in contexts if c > 0]
    progress = noise.Progress(len(mbs) * len(seqs) * (1 + len(ctx)))

    def cell(b, l, c):
        t = nl.add(f"t(b={b}, l={l}, c={c})", time_layer_slice(layer, b, l, c, h, repeats, max_spread=max_spread,
                                                              remeasure=remeasure))
        log(f"{progress.next()} t(b={b}, l={l}, c={c}) = {t.values[0]:.3f} ms, spread {t.spread:.0%}"
            + (f" ({t.rounds} rounds)" if t.rounds > 1 else "") + (" NOISY" if t.noisy else ""))
        return t.values[0]

    with noise.pin_threads(threads):
        measured = np.array([[cell(b, l, 0) for l in seqs] for b in mbs])
        with_ctx = np.array([[[cell(b, l, c) for c in ctx] for l in seqs] for b in mbs]).reshape(len(mbs), len(seqs),
                                                                                               len(ctx))
    t0 = monotone_table(measured)
    pts = [(b, l, c, with_ctx[i, j, k] - measured[i, j]) for i, b in enumerate(mbs) for j, l in enumerate(seqs)
           for k, c in enumerate(ctx)]
    coef = fit_context(pts)
    warnings = noise.implausible_lines(measured, [mbs, seqs], ["b", "l"], "t(b, l, 0)")
    if ctx:
        warnings += noise.implausible_lines(with_ctx, [mbs, seqs, ctx], ["b", "l", "c"], "t(b, l, c)")
        dts = np.array([p[3] for p in pts])
        b, l, c = max(mbs), max(seqs), max(ctx)
        extra = coef[0] * b * l + coef[1] * b * c + coef[2] * b * l * c
        if extra < 0.01 * t0[-1, -1]:  # attending to c more keys is never free
            warnings.append(f"WARNING: the context term fitted to context_coef "
                            f"[{', '.join(f'{x:.3g}' for x in coef)}]: "
                            f"{extra:.3g} ms for {c} context tokens at b={b}, l={l}, under 1% of t(b, l, 0) = "
                            f"{t0[-1, -1]:.3g} ms; {int(np.sum(dts <= 1e-9))} of {len(dts)} measured t(b, l, c) - "
                            f"t(b, l, 0) are <= 0 (median {np.median(dts):.3g} ms): timing noise from a busy host, "
                            "re-profile when it is idle")
    for w in warnings:
        log(w)
    log(f"timing noise: {nl.summary()}")
    meta = {"origin": "profiled on CPU with megatron.planner.terapipe.latency.profile_cpu_model",
            "model": {"hidden_size": h, "num_attention_heads": model_cfg.num_attention_heads,
                      "ffn_hidden_size": model_cfg.ffn_hidden_size},
            "contexts": list(contexts), "threads": threads, "repeats": repeats,
            "noise": {"summary": nl.summary(), "warnings": len(warnings)},
            "fit": "context term by non-negative least squares; t(b, l, 0) made non-decreasing by running maxima "
                   f"(raised {int(np.sum(t0 > measured))} of {t0.size} measured points)"}
    return SliceLatencyModel(mbs, seqs, t0, coef, hidden_size=h, meta=meta)


def main(argv=None) -> int:
    import argparse
    import sys

    from megatron.config.core import ModelConfig
    from megatron.profiling import noise
    p = argparse.ArgumentParser(prog="python -m megatron.planner.terapipe.latency",
                                description="Profile (or derive) TeraPipe's latency model t(b, l, c) and save it.")
    p.add_argument("--output", required=True)
    p.add_argument("--from-cost-model", default=None, help="derive from a cost_models/*.json table instead")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--mbs", default="1,2")
    p.add_argument("--seqs", default="8,16,32,64")
    p.add_argument("--contexts", default="16,64,128")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per cell (the fastest is kept)")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads while profiling (default 1, as each rank of a CPU pipeline whose ranks "
                        "share the cores runs)")
    p.add_argument("--max-spread", type=float, default=noise.MAX_SPREAD,
                   help="a cell whose repeats spread more ((median - min) / min) is re-measured, then refused: "
                        "nothing is written while one stays noisy (default %(default)s)")
    p.add_argument("--remeasure", type=int, default=noise.REMEASURE, help="extra rounds for a noisy cell")
    p.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    a = p.parse_args(argv)
    if a.from_cost_model:
        from megatron.planner.cost.cost_model import CostModel
        m = from_cost_model(CostModel.load(a.from_cost_model), a.tp)
    else:
        def ints(flag, text):
            try:
                vals = [int(x) for x in text.split(",") if x.strip()]
            except ValueError:
                vals = []
            if not vals or min(vals) < 0 or (flag != "--contexts" and min(vals) < 1):
                p.error(f"{flag} takes comma-separated positive integers, got {text!r}")
            return vals
        mbs, seqs, ctxs = ints("--mbs", a.mbs), ints("--seqs", a.seqs), ints("--contexts", a.contexts)
        if a.repeats < 1 or a.cpu_threads < 1 or not a.max_spread > 0 or a.remeasure < 0:
            p.error("--repeats and --cpu-threads must be >= 1, --max-spread > 0, --remeasure >= 0")
        if not any(c > 0 for c in ctxs):
            p.error("--contexts needs a positive context length (the context term is fitted on them)")
        cfg = ModelConfig(num_layers=1, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                          seq_length=max(seqs) + max(ctxs), vocab_size=128,
                          max_position_embeddings=max(seqs) + max(ctxs), hidden_dropout=0.0, attention_dropout=0.0)
        log = (lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
        line = noise.host_load_line()
        if line:
            log(line)
        nl = noise.NoiseLog(a.max_spread)
        m = profile_cpu_model(cfg, mbs, seqs, ctxs, a.repeats, threads=a.cpu_threads, max_spread=a.max_spread,
                              remeasure=a.remeasure, noise_log=nl, log=log)
        refusal = nl.refusal("terapipe_latency")
        if refusal:
            print(refusal, file=sys.stderr)
            return 1
    m.save(a.output)
    print(json.dumps({"output": a.output, "context_coef": m.coef, "meta": m.meta}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
