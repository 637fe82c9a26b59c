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

A layer's backward is 2 x its forward, W its weight-GEMM share (`zb_search.derive_wgrad`); the
output layer's backward is 1.5 x its forward (the loss's backward is elementwise; the shipped
A100 table has 1.26 x, a layer there 1.67 x), of which half is W (its weight GEMM). With 2 x,
the estimate's dualpipev orders trail DualPipeV on that table by 1.4 % at PP 2 (1.5 x: <= 0.1 %
on the rows of tests/planner/schedule/test_zb_vs_torch.py). Costs are one micro-batch's.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megatron.planner.schedule.simulator import PipelineCosts
from megatron.planner.schedule.zb_search import derive_wgrad


def _costs(layers: Sequence[int], m: int, layer_f: float, layer_b: float, out_f: float, out_b: float,
           hidden: int, seq: int) -> PipelineCosts:
    n = np.asarray(layers, float)[:, None] * np.ones((1, m))
    fwd, bwd = n * layer_f, n * layer_b
    wgrad = derive_wgrad(fwd, bwd, hidden, seq)
    fwd[-1] += out_f  # the last stage (on a V: rank 0's second chunk) runs the output layer
    bwd[-1] += out_b
    wgrad[-1] += min(out_f, out_b / 2)  # its weight GEMM; the input-gradient GEMM is the rest
    z = np.zeros_like(fwd)
    return PipelineCosts(fwd, bwd, n.copy(), z, z, wgrad=wgrad)


def analytic_stage_costs(layers: Sequence[int], m: int, hidden: int, seq: int, vocab: int,
                         ffn: Optional[int] = None) -> PipelineCosts:
    """Stage costs in forward FLOPs per token (relative units) for `layers` per stage."""
    ffn = ffn or 4 * hidden
    layer = 2.0 * (4 * hidden * hidden + 2 * hidden * ffn) + 4.0 * hidden * seq
    out = 2.0 * hidden * vocab
    return _costs(layers, m, layer, 2 * layer, out, 1.5 * out, hidden, seq)


def table_stage_costs(cost_model, layers: Sequence[int], m: int, tp: int, recompute: str, mbs: int,
                      seq: int) -> PipelineCosts:
    """Stage costs in ms from a profiled table (`CostModel`); raises `CostModelError` where the
    table lacks the configuration."""
    lay = cost_model.layer("encoder", tp, recompute, mbs, seq)
    post = cost_model.postprocess(tp, recompute, mbs, seq)
    return _costs(layers, m, float(lay["forward_ms"]), float(lay["backward_ms"]), float(post["forward_ms"]),
                  float(post["backward_ms"]), cost_model.model["hidden_size"], seq)


def run_stage_costs(cfg, tp: int, layers: Sequence[int]):
    """`m -> PipelineCosts` for a GPT run's zero-bubble schedule: the `--dynapipe-cost-model`
    table where it has the run's TP and recompute level, else the analytic estimate."""
    from megatron.planner.cost.cost_model import CostModel, CostModelError
    mdl, rc, mbs = cfg.model, cfg.training.recompute_level, cfg.training.micro_batch_size
    table = None
    if cfg.data.dynapipe_cost_model:
        try:
            table = CostModel.load(cfg.data.dynapipe_cost_model)
            table_stage_costs(table, layers, 1, tp, rc, mbs, mdl.seq_length)
        except (CostModelError, OSError, ValueError, KeyError):
            table = None  # no row for this run: the analytic estimate still breaks the tie
    if table is not None:
        return lambda m: table_stage_costs(table, layers, m, tp, rc, mbs, mdl.seq_length)
    vocab = mdl.padded_vocab_size(tp)
    return lambda m: analytic_stage_costs(layers, m, mdl.hidden_size, mdl.seq_length, vocab, mdl.ffn_hidden_size)
