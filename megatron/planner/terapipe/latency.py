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
def slice_sampler(layer, hidden: int):
    """sample(b, l, c) -> ms of one forward + backward of `layer` on a slice of l tokens of b
    sequences after c cached ones (the cache is filled untimed first)."""
    import torch

    from megatron.models.sliced_attention import SequenceKVCache
    from megatron.profiling import noise

    def sample(b, l, c):
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
        return ms
    return sample


def _shape(name: str) -> tuple:
    """(b, l, c) back from a cell name "t(b=B, l=L, c=C)"."""
    return tuple(int(x.split("=")[1]) for x in name[2:-1].split(", "))


def _factor_error(pred, measured):
    """max(p/m, m/p) - 1: the relative error, symmetric, so a cell that spoils its neighbours'
    predictions is worse than they are (a relative error on the measured value would blame them).
    Predictions count as at least 0.1 ms (the timer's and interpreter's jitter)."""
    p, m = np.maximum(np.asarray(pred, float), 0.1), np.asarray(measured, float)
    return np.maximum(p / m, m / p) - 1


def t0_held_out(mbs, seqs, measured) -> tuple:
    """Leave-one-out check of the context-free table: each t(b, l, 0) predicted by
    u + v*b*l + w*b*l^2 (launch overhead, per-token work, attention) fitted on the others; an
    idle host's table (cost_models/terapipe_cpu_tiny_gpt.json) is within 2.3 % rms, a cell a busy
    host slowed down is not. Returns (relative errors, names, predictions); empty under 5 cells."""
    B, L = np.meshgrid(np.asarray(mbs, float), np.asarray(seqs, float), indexing="ij")
    X = np.stack([np.ones(B.size), (B * L).ravel(), (B * L * L).ravel()], axis=1)
    y = np.asarray(measured, float).ravel()
    if len(y) < 5:
        return np.zeros(0), [], np.zeros(0)
    preds = np.array([X[i] @ np.linalg.lstsq(X[np.arange(len(y)) != i], y[np.arange(len(y)) != i], rcond=None)[0]
                      for i in range(len(y))])
    names = [f"t(b={int(b)}, l={int(l)}, c=0)" for b, l in zip(B.ravel(), L.ravel())]
    return _factor_error(preds, y), names, preds


def held_out_errors(points: Sequence[tuple], t0_of, folds: int = 4) -> tuple:
    """k-fold check of the context fit: each fold of (b, l, c, t(b, l, c)) points is predicted
    as t0_of(b, l) + the context term fitted on the other folds. Returns (relative errors,
    predictions)."""
    pts = list(points)
    k = max(2, min(folds, len(pts)))
    rel, preds = np.zeros(len(pts)), np.zeros(len(pts))
    for f in range(k):
        train = [(b, l, c, t - t0_of(b, l)) for i, (b, l, c, t) in enumerate(pts) if i % k != f]
        a1, a2, a3 = fit_context(train)
        for i in range(f, len(pts), k):
            b, l, c, t = pts[i]
            preds[i] = t0_of(b, l) + a1 * b * l + a2 * b * c + a3 * b * l * c
            rel[i] = _factor_error(preds[i], t)
    return rel, preds


def _check(mbs, seqs, shapes, value) -> tuple:
    """(rms relative error on held-out cells, the worst one in words, context_coef) of a
    profile's cells `value[(b, l, c)]`: `t0_held_out` on the table, `held_out_errors` on the
    context fit."""
    measured = np.array([[value[(b, l, 0)] for l in seqs] for b in mbs])
    idx = {(b, l): (i, j) for i, b in enumerate(mbs) for j, l in enumerate(seqs)}
    pts = [(b, l, c, value[(b, l, c)]) for b, l, c in shapes if c]
    coef = fit_context([(b, l, c, t - measured[idx[b, l]]) for b, l, c, t in pts])
    rel, names, preds = t0_held_out(mbs, seqs, measured)
    if len(pts) >= 4:
        r, p_ = held_out_errors(pts, lambda b, l: measured[idx[b, l]])
        rel, preds = np.concatenate([rel, r]), np.concatenate([preds, p_])
        names += [f"t(b={b}, l={l}, c={c})" for b, l, c, _ in pts]
    if not len(rel):
        return 0.0, "no cells held out", coef
    wi = int(np.argmax(rel))
    return (float(np.sqrt(np.mean(rel ** 2))), f"worst {names[wi]}: predicted {preds[wi]:.3g} ms, measured "
            f"{value[_shape(names[wi])]:.3g} ms", coef)


class ProfileRefused(Exception):
    """The profile ended without a usable model; the message is the one line to print."""


def profile_cpu_model(model_cfg, mbs: Sequence[int], seqs: Sequence[int], contexts: Sequence[int],
                      repeats: int = 10, seed: int = 1234, *, threads: int = 1, max_disagreement: float = 0.1,
                      extra_rounds: int = 10, time_limit: float = 180.0, max_fit_error: float = 0.15,
                      sampler=None, log=lambda s: None) -> SliceLatencyModel:
    """Profile one layer of `model_cfg` here (TP=1, `threads` torch threads pinned): t(b, l, 0)
    on the mbs x seqs grid and t(b, l, c) on mbs x seqs x contexts, as the minimum over
    `repeats` interleaved rounds (`noise.interleaved`: every round visits every cell, so load
    changes hit the whole table alike; on a shared CPU other processes only ever add time), then
    the context term fitted by `fit_context`. The table and the fit are checked on held-out
    cells (`_check`), the one judge of a busy host's table: past `max_fit_error`, more rounds
    while `time_limit` allows, then `ProfileRefused`. `sampler(b, l, c) -> ms` replaces the
    real layer (tests)."""
    from megatron.profiling import noise
    h = model_cfg.hidden_size
    ctx = [c for c in contexts if c > 0]
    shapes = [(b, l, 0) for b in mbs for l in seqs] + [(b, l, c) for b in mbs for l in seqs for c in ctx]
    with noise.pin_threads(threads):
        if sampler is None:
            import torch

            from megatron.core.host_memory import keep_freed_host_memory
            from megatron.models.transformer import TransformerLayer
            keep_freed_host_memory()  # the allocator the CPU trainer runs with (initialize.py)
            torch.manual_seed(seed)
            layer = TransformerLayer(model_cfg, None, layer_number=0, num_layers_total=1, seed=seed, key="profile")
            sampler = slice_sampler(layer, h)
        start = noise.clock()
        cells, batch = None, repeats
        while True:  # more rounds while the fit misses held-out cells and time is left
            cells = noise.interleaved([f"t(b={b}, l={l}, c={c})" for b, l, c in shapes],
                                      lambda i: sampler(*shapes[i]), batch, max_disagreement=max_disagreement,
                                      extra_rounds=extra_rounds, deadline=start + time_limit, cells=cells,
                                      on_round=lambda r, n: log(f"round {r}/{n}: {len(shapes)} cells, "
                                                                f"{noise.clock() - start:.0f} s"))
            value = {sh: c.value for sh, c in zip(shapes, cells)}
            err, worst, coef = _check(mbs, seqs, shapes, value)
            dis = np.array([c.disagreement for c in cells])
            summary = (f"{len(cells)} cells x {min(len(c.samples) for c in cells)}-"
                       f"{max(len(c.samples) for c in cells)} interleaved rounds in {noise.clock() - start:.0f} s; "
                       f"minima of even vs odd rounds differ by median {np.median(dis):.0%}, worst {dis.max():.0%}")
            log(f"fit on held-out cells: {err:.1%} rms relative error ({worst}); {summary}")
            elapsed = noise.clock() - start
            per_round = elapsed / max(1, min(len(c.samples) for c in cells))
            if err <= max_fit_error or elapsed + per_round * batch > time_limit:
                break
            batch = max(2, repeats // 2)
    measured = np.array([[value[(b, l, 0)] for l in seqs] for b in mbs])
    warnings = noise.implausible_lines(measured, [mbs, seqs], ["b", "l"], "t(b, l, 0)")
    if err > max_fit_error:
        for w in warnings:  # the cell to blame, when one stands out
            log(w)
        raise ProfileRefused(f"the fit misses held-out cells by {err:.1%} rms (past --max-fit-error "
                             f"{max_fit_error:g}; {worst}; {summary})")
    t0 = monotone_table(measured)
    idx = {(b, l): (i, j) for i, b in enumerate(mbs) for j, l in enumerate(seqs)}
    pts = [(b, l, c, value[(b, l, c)]) for b, l, c in shapes if c]
    if ctx:
        b, l, c = max(mbs), max(seqs), max(ctx)
        extra = coef[0] * b * l + coef[1] * b * c + coef[2] * b * l * c
        dts = np.array([t - measured[idx[bb, ll]] for bb, ll, _, t in pts])
        if extra < 0.01 * t0[-1, -1]:  # attending to c more keys is never free
            warnings.append(f"WARNING: the context term fitted to context_coef "
                            f"[{', '.join(f'{x:.3g}' for x in coef)}]: "
                            f"{extra:.3g} ms for {c} context tokens at b={b}, l={l}, under 1% of t(b, l, 0) = "
                            f"{t0[-1, -1]:.3g} ms; {int(np.sum(dts <= 1e-9))} of {len(dts)} measured t(b, l, c) - "
                            f"t(b, l, 0) are <= 0 (median {np.median(dts):.3g} ms): timing noise from a busy host, "
                            "re-profile when it is idle")
    for w in warnings:
        log(w)
    meta = {"origin": "profiled on CPU with megatron.planner.terapipe.latency.profile_cpu_model",
            "model": {"hidden_size": h, "num_attention_heads": model_cfg.num_attention_heads,
                      "ffn_hidden_size": model_cfg.ffn_hidden_size},
            "contexts": list(contexts), "threads": threads, "repeats": repeats,
            "noise": {"summary": summary, "warnings": len(warnings)},
            "fit": "minimum over interleaved rounds; context term by non-negative least squares; "
                   f"{err:.1%} rms relative error on held-out cells; t(b, l, 0) made non-decreasing "
                   f"by running maxima (raised {int(np.sum(t0 > measured))} of {t0.size} measured points)",
            "held_out_rms_error": round(err, 4)}
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
    p.add_argument("--repeats", type=int, default=10,
                   help="interleaved rounds over all cells (each cell keeps its fastest); raised to what the host "
                        "probe says a busy host needs, within --time-limit")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads while profiling (default 1, as each rank of a CPU pipeline whose ranks "
                        "share the cores runs)")
    p.add_argument("--max-spread", type=float, default=0.1,
                   help="a cell whose minima over even and odd rounds differ by more is measured in extra rounds "
                        "(default %(default)s)")
    p.add_argument("--remeasure", type=int, default=10, help="extra rounds for cells past --max-spread")
    p.add_argument("--max-fit-error", type=float, default=noise.MAX_FIT_ERROR,
                   help="the context fit's rms relative error on held-out cells above which nothing is written")
    p.add_argument("--min-clean", type=float, default=noise.MIN_CLEAN,
                   help="refuse at once (2 s host probe) when fewer probe samples than this fraction run "
                        "undisturbed (default %(default)s)")
    p.add_argument("--time-limit", type=float, default=180.0, help="seconds of timed rounds at most (default 180)")
    p.add_argument("--quiet", action="store_true", help="no per-round progress lines")
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
        if a.repeats < 2 or a.cpu_threads < 1 or not a.max_spread > 0 or a.remeasure < 0 or a.time_limit <= 0:
            p.error("--repeats must be >= 2, --cpu-threads >= 1, --max-spread and --time-limit > 0, --remeasure >= 0")
        if not any(c > 0 for c in ctxs):
            p.error("--contexts needs a positive context length (the context term is fitted on them)")
        cfg = ModelConfig(num_layers=1, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                          seq_length=max(seqs) + max(ctxs), vocab_size=128,
                          max_position_embeddings=max(seqs) + max(ctxs), hidden_dropout=0.0, attention_dropout=0.0)
        log = (lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
        with noise.pin_threads(a.cpu_threads):  # not pinned to a core: on a shared host that core's load is ours
            host = noise.probe()
            log(f"host probe: {host.describe()}")
            if host.clean < a.min_clean:
                print(f"terapipe_latency: error: host too busy to profile ({host.describe()}; the fastest of k "
                      f"repeats would need {min(host.repeats_for(), 10 ** 4)} repeats a cell): nothing written. Run it "
                      f"on an idle host, or pass --min-clean {max(host.clean / 2, 0.001):.3g} to try anyway.",
                      file=sys.stderr)
                return 1
            repeats = min(max(a.repeats, host.repeats_for()), 100)
            try:
                m = profile_cpu_model(cfg, mbs, seqs, ctxs, repeats, threads=a.cpu_threads,
                                      max_disagreement=a.max_spread, extra_rounds=a.remeasure,
                                      time_limit=a.time_limit, max_fit_error=a.max_fit_error, log=log)
            except ProfileRefused as e:
                print(f"terapipe_latency: error: {e}; {host.describe()}: nothing written. Re-run on an idle host, "
                      "or with more --repeats / --time-limit.", file=sys.stderr)
                return 1
        m.meta["host"] = host.describe()
    m.save(a.output)
    print(json.dumps({"output": a.output, "context_coef": m.coef, "meta": m.meta}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
