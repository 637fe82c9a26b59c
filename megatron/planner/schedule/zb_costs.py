"""Per-stage F / B / W times that the zero-bubble greedy is clocked by at run time.

On unit costs every stage weighs the same, so the greedy cannot see that the last stage also
runs the output layer and the loss (on a GPT 6.7B A100 table about one more layer): its V
orders then trail torch's ZBV by up to 3.7 % and DualPipeV by up to 5.7 % on that table
(docs/zero_bubble.md). The runtime therefore clocks `zb_orders` by the run's own costs:

* `table_stage_costs`: from a profiled cost table (`--dynapipe-cost-model`), per layer and for
  the output layer (``postprocess``), as the planners price a stage;
* `analytic_stage_costs`: without a table, the forward FLOPs per token of each stage: a layer
  ``24 h^2 + 4 h s`` (QKV, projection and a 4h MLP: ``2 (4 h^2 + 2 h f)``; scores and values
  ``4 h s``), the output layer ``2 h V``; the embedding is a lookup (no FLOPs). Only the ratios
  matter: they break the unit-cost tie the way the table would.

W: where the table carries the profiler's measured halves (`input_grad_ms` / `weight_grad_ms`,
megatron/profiling/split_columns.py; cost_models/cpu_tiny_gpt.json has them), a layer's and the
output layer's W is their measured share W / (B + W) of the table's backward
(`planner/cost/wpass_time.py`'s rule); otherwise a layer's W is its weight-GEMM share
(`zb_search.derive_wgrad`) and the output layer's half its backward (its weight GEMM).

The analytic estimate's output layer: its backward / forward ratio and W share come from the
`--dynapipe-cost-model` table's measured head (`head_ratios`: medians over the table's
output-layer grid) when a table is given but lacks the run's layer row; without a table, the
hand values OUT_BWD_RATIO = 1.5 and OUT_W_SHARE = 0.5 stand (the loss's backward is
elementwise; the shipped A100 table has 1.26 x, a layer there 1.67 x; with 2 x the estimate's
dualpipev orders trail DualPipeV on that table by 1.4 % at PP 2, with 1.5 x <= 0.1 % on the
rows of tests/planner/schedule/test_zb_vs_torch.py). A layer's backward is 2 x its forward.
Costs are one micro-batch's.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megatron.planner.schedule.simulator import PipelineCosts
from megatron.planner.schedule.zb_search import derive_wgrad

OUT_BWD_RATIO = 1.5  # output layer's backward / forward without a measured head (module docstring)
OUT_W_SHARE = 0.5  # its W / backward: the weight GEMM of its two


def measured_w_share(costs) -> Optional[float]:
    """W / (B + W) from a table row's measured halves, None without them."""
    if "input_grad_ms" not in costs or "weight_grad_ms" not in costs:
        return None
    b, w = float(costs["input_grad_ms"]), float(costs["weight_grad_ms"])
    return w / (b + w) if np.isfinite(b + w) and b + w > 0 else None


def _costs(layers: Sequence[int], m: int, layer_f: float, layer_b: float, out_f: float, out_b: float,
           hidden: int, seq: int, layer_w_share: Optional[float] = None,
           out_w_share: Optional[float] = None) -> PipelineCosts:
    n = np.asarray(layers, float)[:, None] * np.ones((1, m))
    fwd, bwd = n * layer_f, n * layer_b
    wgrad = derive_wgrad(fwd, bwd, hidden, seq) if layer_w_share is None else bwd * layer_w_share
    fwd[-1] += out_f  # the last stage (on a V: rank 0's second chunk) runs the output layer
    bwd[-1] += out_b
    # its weight GEMM; the input-gradient GEMM is the rest
    wgrad[-1] += min(out_f, out_b * OUT_W_SHARE) if out_w_share is None else out_b * out_w_share
    z = np.zeros_like(fwd)
    return PipelineCosts(fwd, bwd, n.copy(), z, z, wgrad=wgrad)


def head_ratios(cost_model, tp: int):
    """(backward / forward, W / (B + W)) of the output layer, medians over the table's measured
    head grid at `tp` (any recompute level: the head is never recomputed); OUT_BWD_RATIO and
    None (the hand rule for W) for what the table lacks."""
    ratio, share = OUT_BWD_RATIO, None
    for rc in ("none", "selective", "full"):
        if not cost_model.has(tp, rc) or "postprocess" not in cost_model.profile(tp, rc).components:
            continue
        v = cost_model.profile(tp, rc).components["postprocess"].values
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.asarray(v["backward_ms"], float) / np.asarray(v["forward_ms"], float)
            if np.isfinite(r).any():
                ratio = float(np.median(r[np.isfinite(r)]))
            if "input_grad_ms" in v and "weight_grad_ms" in v:
                b, w = np.asarray(v["input_grad_ms"], float), np.asarray(v["weight_grad_ms"], float)
                sh = w / (b + w)
                if np.isfinite(sh).any():
                    share = float(np.median(sh[np.isfinite(sh)]))
        break
    return ratio, share


def analytic_stage_costs(layers: Sequence[int], m: int, hidden: int, seq: int, vocab: int,
                         ffn: Optional[int] = None, out_bwd_ratio: float = OUT_BWD_RATIO,
                         out_w_share: Optional[float] = None) -> PipelineCosts:
    """Stage costs in forward FLOPs per token (relative units) for `layers` per stage; the
    output layer's backward is `out_bwd_ratio` x its forward, `out_w_share` of it W (default:
    the hand rule, see the module docstring)."""
    ffn = ffn or 4 * hidden
    layer = 2.0 * (4 * hidden * hidden + 2 * hidden * ffn) + 4.0 * hidden * seq
    out = 2.0 * hidden * vocab
    return _costs(layers, m, layer, 2 * layer, out, out_bwd_ratio * out, hidden, seq, out_w_share=out_w_share)


def table_stage_costs(cost_model, layers: Sequence[int], m: int, tp: int, recompute: str, mbs: int,
                      seq: int) -> PipelineCosts:
    """Stage costs in ms from a profiled table (`CostModel`); raises `CostModelError` where the
    table lacks the configuration."""
    lay = cost_model.layer("encoder", tp, recompute, mbs, seq)
    post = cost_model.postprocess(tp, recompute, mbs, seq)
    return _costs(layers, m, float(lay["forward_ms"]), float(lay["backward_ms"]), float(post["forward_ms"]),
                  float(post["backward_ms"]), cost_model.model["hidden_size"], seq,
                  layer_w_share=measured_w_share(lay), out_w_share=measured_w_share(post))


def run_stage_costs(cfg, tp: int, layers: Sequence[int]):
    """`m -> PipelineCosts` for a GPT run's zero-bubble schedule: the `--dynapipe-cost-model`
    table where it has the run's TP and recompute level, else the analytic estimate."""
    from megatron.planner.cost.cost_model import CostModel, CostModelError
    mdl, rc, mbs = cfg.model, cfg.training.recompute_level, cfg.training.micro_batch_size
    table, ratios = None, (OUT_BWD_RATIO, None)  # the documented fallback: no table at all
    if cfg.data.dynapipe_cost_model:
        try:
            table = CostModel.load(cfg.data.dynapipe_cost_model)
            ratios = head_ratios(table, tp)  # the measured head, should the run's layer row be missing
            table_stage_costs(table, layers, 1, tp, rc, mbs, mdl.seq_length)
        except (CostModelError, OSError, ValueError, KeyError):
            table = None  # no row for this run: the analytic estimate still breaks the tie
    if table is not None:
        return lambda m: table_stage_costs(table, layers, m, tp, rc, mbs, mdl.seq_length)
    vocab = mdl.padded_vocab_size(tp)
    return lambda m: analytic_stage_costs(layers, m, mdl.hidden_size, mdl.seq_length, vocab, mdl.ffn_hidden_size,
                                          *ratios)
