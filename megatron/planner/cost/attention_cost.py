"""Attention priced as the kernel runs it: a layer's cost split into a part that grows with
tokens and a part that grows with the sum of squared document lengths.

A cost table measures dense rows: `b` rows of `s` tokens, attention over the whole row. A
packed row of documents l_1..l_k run by a variable-length (per-document) kernel does the same
token-wise work (projections, MLP, norms: linear in sum l_i) but attention work in sum l_i^2,
not s^2. Per layer, component and quantity we model

    GPT / encoder:  q(b, s)      = c + a * b*s + beta * b*s^2
    T5 decoder:     q(b, e, d)   = c + a_e * b*e + a_d * b*d + beta * b*d^2 + beta_x * b*e*d

(d^2: decoder self-attention, e*d: cross-attention). A micro-batch of packed rows is priced as
the dense grid value at its row shape minus the quadratic terms the dense rows pay and the
per-document kernel does not:

    q_packed = q(b, s) - beta * (b*s^2 - sum_i l_i^2)        (decoder likewise, both terms)

so the measured token-wise efficiency of the table is kept and only attention is re-priced.
Memory (`stored_mb`, `peak_mb`): a variable-length kernel is a flash kernel, it keeps no
s^2 score matrix, so every quadratic memory term is dropped (a varlen row's activation memory
is linear in its tokens).

Where the split comes from: the profiler (`--attention-split`) measures what the per-document
kernel pays (`doc_quad`: packed rows of 1 vs 4 documents) and stores it in the cost-model file
(format version 2, optional `attention_split` per component, see cost_models/README.md), the
other terms fitted; for tables with only dense rows (the published A100 ones) everything is
fitted from the grid by relative-error least squares (`doc_quad` = the dense `quad`), and
`fit_report` prints the fit error
(`python -m megatron.planner.cost.attention_cost cost_models/gpt_6.7b_a100.json`).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

TIME_QUANTITIES = ("forward_ms", "backward_ms")
MEMORY_QUANTITIES = ("stored_mb", "peak_mb")
# Terms of the fit per component, in order; "const" is per-layer overhead.
TERMS = {
    "encoder": ("const", "tokens", "quad"),
    "decoder": ("const", "enc_tokens", "tokens", "quad", "cross"),
}
QUADRATIC_TERMS = ("quad", "cross")


@dataclass
class Split:
    """Fitted (or measured) coefficients of one quantity of one component."""

    coef: Dict[str, float]
    rel_err_median: float = 0.0
    rel_err_max: float = 0.0
    source: str = "fitted"

    def to_dict(self) -> dict:
        return {"coef": {k: float(v) for k, v in self.coef.items()}, "rel_err_median": round(self.rel_err_median, 4),
                "rel_err_max": round(self.rel_err_max, 4), "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "Split":
        return cls({k: float(v) for k, v in d["coef"].items()}, float(d.get("rel_err_median", 0.0)),
                   float(d.get("rel_err_max", 0.0)), d.get("source", "measured"))


def _features(component: str, mbs, seq, dec=None) -> np.ndarray:
    b, s = np.asarray(mbs, float), np.asarray(seq, float)
    if component == "decoder":
        d = np.asarray(dec, float)
        return np.stack(np.broadcast_arrays(np.ones_like(b * s * d), b * s, b * d, b * d * d, b * s * d), axis=-1)
    return np.stack(np.broadcast_arrays(np.ones_like(b * s), b * s, b * s * s), axis=-1)


def fit_grid(grid, component: str, quantity: str) -> Optional[Split]:
    """Least-squares fit of one grid quantity, weighted by 1/value (relative error), on its
    measured points; quadratic coefficients are kept non-negative."""
    if component not in TERMS or quantity not in grid.values:
        return None
    mesh = np.meshgrid(*grid.axes, indexing="ij")
    y = grid.values[quantity].ravel()
    X = _features(component, *[m.ravel() for m in mesh])
    ok = np.isfinite(y) & (y > 0)
    if ok.sum() < X.shape[1] + 1:
        return None
    X, y = X[ok], y[ok]
    names = TERMS[component]
    w = 1.0 / y
    free = list(range(len(names)))
    for _ in range(len(names)):  # drop a negative quadratic term and refit (active set)
        coef = np.zeros(len(names))
        sol, *_ = np.linalg.lstsq(X[:, free] * w[:, None], y * w, rcond=None)
        coef[free] = sol
        neg = [i for i in free if names[i] in QUADRATIC_TERMS and coef[i] < 0]
        if not neg:
            break
        free = [i for i in free if i not in neg]
    rel = np.abs(X @ coef - y) / y
    return Split(dict(zip(names, coef.tolist())), float(np.median(rel)), float(rel.max()))


class AttentionCost:
    """Splits of one cost model, per (tp, recompute, component, quantity): the file's own
    (`CostModel.attention_splits`) where it has them, else fitted from the grid once."""

    def __init__(self, cost_model):
        self.cm = cost_model
        self._splits = {}

    def split(self, tp: int, rc: str, component: str, quantity: str) -> Optional[Split]:
        key = (tp, rc, component, quantity)
        if key not in self._splits:
            stored = (getattr(self.cm, "attention_splits", None) or {}).get(key)
            if stored is not None:
                self._splits[key] = Split.from_dict(stored)
            else:
                self._splits[key] = fit_grid(self.cm.profile(tp, rc).components[component], component, quantity)
        return self._splits[key]

    def packed_layer(self, component: str, tp: int, rc: str, mbs, seq, quad, dec_seq=None,
                     dec_quad=None, cross=None) -> Dict[str, np.ndarray]:
        """Per-layer costs of micro-batches of `mbs` packed rows of `seq` tokens (decoder:
        `dec_seq`) whose documents' squared lengths sum to `quad` (decoder: `dec_quad` for
        self-attention, `cross` = sum e_i*d_i for cross-attention), vectorised like
        `CostModel.layer`."""
        dense = self.cm.layer(component, tp, rc, mbs, seq, dec_seq)
        b, s = np.asarray(mbs, float), np.asarray(seq, float)
        out = {}
        for q, v in dense.items():
            sp = self.split(tp, rc, component, q)
            if sp is None:
                out[q] = v
                continue
            c = sp.coef
            if component == "decoder":
                d = np.asarray(dec_seq, float)
                dense_quad = c["quad"] * b * d * d + c["cross"] * b * s * d
                doc_quad = c["quad"] * np.asarray(dec_quad, float) + c["cross"] * np.asarray(cross, float)
                linear = c["const"] + c["enc_tokens"] * b * s + c["tokens"] * b * d
            else:
                dense_quad = c["quad"] * b * s * s
                # A profiled split measures what the per-document kernel pays ("doc_quad");
                # otherwise the dense rows' fitted s^2 coefficient stands for it.
                doc_quad = c.get("doc_quad", c["quad"]) * np.asarray(quad, float)
                linear = c["const"] + c["tokens"] * b * s
            if q in MEMORY_QUANTITIES:
                doc_quad = 0.0  # flash/varlen kernel: no score matrix kept
            with np.errstate(invalid="ignore"):
                packed = v - dense_quad + doc_quad
                # Never above the dense price, never below the fitted token-wise part.
                out[q] = np.where(np.isfinite(v), np.clip(packed, np.minimum(np.maximum(linear, 0.0), v), v), v)
        return out


def fit_report(cost_model) -> list:
    """One dict per (tp, recompute, component, quantity): coefficients and relative fit error,
    and the attention share of a dense max-length row (the part packing with per-document
    attention saves at most)."""
    ac, rows = AttentionCost(cost_model), []
    for tp in cost_model.tps():
        for rc in cost_model.levels(tp):
            for comp, grid in cost_model.profile(tp, rc).components.items():
                for q in grid.values:
                    sp = ac.split(tp, rc, comp, q)
                    if sp is None:
                        continue
                    s = float(grid.axes[1][-1])
                    b = float(grid.axes[0][0])
                    f = _features(comp, b, s, s if comp == "decoder" else None)
                    terms = dict(zip(TERMS[comp], f.tolist()))
                    total = sum(sp.coef[k] * terms[k] for k in TERMS[comp])
                    quad = sum(sp.coef[k] * terms[k] for k in QUADRATIC_TERMS if k in sp.coef)
                    rows.append({"tp": tp, "recompute": rc, "component": comp, "quantity": q, "source": sp.source,
                                 "rel_err_median": round(sp.rel_err_median, 4), "rel_err_max": round(sp.rel_err_max, 4),
                                 "quadratic_share_at_max_seq": round(quad / total, 3) if total > 0 else None,
                                 "coef": {k: float(f"{v:.6g}") for k, v in sp.coef.items()}})
    return rows


def main(argv=None):
    from megatron.planner.cost.cost_model import CostModel, CostModelError
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m megatron.planner.cost.attention_cost COST_MODEL.json", file=sys.stderr)
        return 2
    try:
        cm = CostModel.load(argv[0])
    except CostModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for row in fit_report(cm):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
