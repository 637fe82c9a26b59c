"""Memory a deferred weight pass (W of a zero-bubble schedule) keeps, per micro-batch, in MB.

Between a micro-batch's input pass and its weight pass the executor keeps only what W reads
(`megatron/pipeline/weight_store.py`): each weight GEMM's input and output gradient, and each
norm's input, output gradient and fp32 statistics (mean, inverse deviation: 8 bytes per
token). Per token of a GPT transformer layer, with activation element size ``a``, hidden
``h``, attention projection width ``P`` (heads x kv channels, ``h`` by default), FFN width
``f``, TP size ``t`` (column-parallel outputs and row-parallel inputs are split):

* input norm: input ``h a`` + gradient ``h a`` + 8;  QKV: input ``h a`` + gradient ``3P/t a``;
* output projection: input ``P/t a`` + gradient ``h a``;  MLP norm: as the input norm;
* FFN in: input ``h a`` + gradient ``f/t a``;  FFN out: input ``f/t a`` + gradient ``h a``.

That is ``20 h a + 16`` bytes per token at ``P = h, f = 4h, t = 1``. Sequence parallelism
splits the norms' terms by ``t``; the QKV and FFN-in inputs are then the gathered sequence
(full ``h``); without the fused bias-dropout-add, the two row-parallel biases, added after the
reduce-scatter, capture their own sequence-local gradient (``2 h/t a``; without SP it is the
GEMM's output gradient itself; fused, the input pass hands W the bias gradient itself).
Grouped-query attention narrows the QKV gradient (``P + 2 groups kv``), a gated MLP (SwiGLU)
doubles the FFN-in gradient (``2f``), this project's RMSNorm keeps no statistics. The last
stage adds the final norm and the output head (input ``h a``, logits gradient ``v/t a``).
Attention scores, dropout masks and the FFN activation's input are freed at the input pass:
that is the difference from a kept whole graph, growing with the sequence (score-keeping
attention) and with dropout. The kept state does not depend on the sequence
length otherwise, so it is a formula, not a table column.

The first stage (no input gradient: its W is the whole backward), recompute (the weight pass
walks the kept graph again) and T5 stages keep the whole graph: there ``stored`` is W's kept
state. `tests/planner/cost/test_wpass_memory.py` checks the formula against the bytes the
weight store holds, per row, within 5 %; `benchmarks/bench_zb_wpass.py` prints both.
"""
from __future__ import annotations

import numpy as np

MB = 1e6
STATS = 8.0  # fp32 mean + inverse deviation per token of a norm


def layer_wstore_bytes(tokens, h: float, a: float, *, ffn: float = None, proj: float = None, tp: int = 1,
                       sp: bool = False, bias: bool = True, qkv: float = None, gated: bool = False,
                       stats: float = STATS, fused_bias_dropout: bool = True):
    """Bytes W keeps for one GPT transformer layer on `tokens` tokens (per TP rank). `qkv`: the
    QKV GEMM's output width (``3P``; grouped-query attention: ``P + 2 groups kv``); `gated`: a
    gated MLP (SwiGLU / GLU: the FFN-in output is ``2f``); `stats`: bytes per token a norm keeps
    besides its input (LayerNorm 8; this project's RMSNorm 0)."""
    ffn = 4.0 * h if ffn is None else float(ffn)
    proj = float(h) if proj is None else float(proj)
    qkv = 3.0 * proj if qkv is None else float(qkv)
    t = float(tp)
    norm = (2.0 * h * a + stats) / (t if sp else 1.0)
    ffn_out = (2.0 if gated else 1.0) * ffn
    gemms = (h * a + qkv / t * a) + (proj / t * a + h * a) + (h * a + ffn_out / t * a) + (ffn / t * a + h * a)
    row_bias = 2.0 * h / t * a if sp and tp > 1 and bias and not fused_bias_dropout else 0.0
    return np.asarray(tokens, float) * (2.0 * norm + gemms + row_bias)


def post_wstore_bytes(tokens, h: float, vocab_per_tp: float, a: float, *, tp: int = 1, sp: bool = False,
                      stats: float = STATS):
    """Bytes W keeps for the final norm and the output head on the last stage."""
    norm = (2.0 * h * a + stats) / (float(tp) if sp else 1.0)
    return np.asarray(tokens, float) * (norm + h * a + vocab_per_tp * a)


def stage_wstore_mb(stored_mb, *, first: bool, last: bool, layers: int, tokens, h: float, a: float,
                    vocab_per_tp: float = 0.0, ffn: float = None, proj: float = None, tp: int = 1,
                    sp: bool = False, bias: bool = True, whole_graph: bool = False, **arch):
    """MB W keeps for one micro-batch on a GPT stage; `stored_mb` where the whole graph is kept
    (first stage, recompute, or `whole_graph`: a model this formula does not describe)."""
    if first or whole_graph:
        return np.asarray(stored_mb, float)
    kept = layers * layer_wstore_bytes(tokens, h, a, ffn=ffn, proj=proj, tp=tp, sp=sp, bias=bias, **arch)
    if last:
        kept = kept + post_wstore_bytes(tokens, h, vocab_per_tp, a, tp=tp, sp=sp, stats=arch.get("stats", STATS))
    return kept / MB


def planner_wstored(planner, s, comps, rc, stored, tokens, tp, sp, t5):
    """MB a deferred weight pass keeps on stage `s` of a DynaPipe planner's layout."""
    from megatron.planner.cost.stage_memory import _shape
    shape = _shape(planner.cm, tp)
    m = planner.cm.model
    h = float(planner.cfg.hidden_size)
    heads, kv, groups = m.get("num_attention_heads"), m.get("kv_channels"), m.get("num_query_groups")
    kv = kv or (h / heads if heads else None)
    proj = heads * kv if heads and kv else None
    qkv = proj + 2.0 * groups * kv if proj and groups else None
    return stage_wstore_mb(stored, first=s == 0, last=s == planner.S - 1, layers=sum(n for _, n in comps),
                           tokens=tokens, h=h, a=float(planner.cfg.activation_bytes),
                           vocab_per_tp=shape[1] if shape else 0.0, ffn=m.get("ffn_hidden_size"),
                           proj=proj, qkv=qkv, tp=tp, sp=sp, bias=m.get("add_bias_linear", True) is not False,
                           gated=bool(m.get("swiglu") or m.get("gated_linear_unit")),
                           stats=0.0 if m.get("normalization") == "RMSNorm" else STATS,
                           fused_bias_dropout=(m.get("bias_dropout_fusion", True) is not False
                                               if getattr(planner.cfg, "bias_dropout_fused", None) is None
                                               else bool(planner.cfg.bias_dropout_fused)),
                           whole_graph=rc != "none" or t5 or planner.cfg.model_kind == "t5")
