"""MoE layers priced from a dense cost table (issue 47, item 5).

Derived, not profiled: a layer of a shipped table (the A100 GPT-6.7B one, or a CPU table)
is split into its MLP share and the rest by forward FLOPs per token (attention projections
8h^2, scores 4sh, MLP 4h*ffn, x1.5 gated), and the MoE layer is priced as

* the rest of the dense layer (attention, norms) unchanged;
* the router: the MLP time scaled by its FLOPs (h x E against the MLP's 2 h x ffn);
* the experts: one grouped GEMM per EP rank over the tokens that rank receives, timed as the
  dense MLP on that many tokens (the table's micro-batch axis at the same length, so small
  GEMMs keep the table's low efficiency) x (expert width / dense width). The busiest EP rank
  decides: its tokens are ``skew x T x k`` for T tokens on each of the EP ranks (``skew`` =
  busiest rank's routed tokens over the mean, 1 for balanced routing, at most EP; at EP = E
  that is the busiest expert); a capacity factor caps them at E x capacity (padding: exactly that);
* dispatch + combine, forward and backward: alltoall sends T k h bytes each way, minus the
  1/EP that stays local, and the busiest rank receives its ``skew``-fold share; allgather
  gathers all EP ranks' T h bytes and reduce-scatters the output; both at `a2a_gbps`;
* a shared expert: the dense MLP at its width on every token.

Memory (MB, per layer): the dense layer's minus its MLP activations (input, fc1 and
activation outputs at 16 bits, dropout mask) plus the MoE's: router logits and probabilities
(T x E, fp32), the dispatched tokens on the busiest rank (its tokens x (h + fc1 + act)) and
the combine buffer (T k h); under full recompute only the peak carries them (the stored
input is the dense one). Parameters: the rank's E/EP experts and the router replace the MLP.

`MoECostModel` wraps a `CostModel`: every planner that asks `layer("encoder", ...)` or
`param_mb("encoder", ...)` (DynaPipe, the packing baselines, packed rows) gets MoE layers,
mixed with dense ones in the model's proportion (`layer_fraction`, --moe-layer-freq).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Dict, Optional

import numpy as np

from megatron.planner.cost.cost_model import CostModel, CostModelError

TIME_KEYS = ("forward_ms", "backward_ms", "input_grad_ms", "weight_grad_ms")


@dataclass(frozen=True)
class MoEPricing:
    num_experts: int
    topk: int = 2
    expert_ffn: Optional[int] = None  # --moe-ffn-hidden-size; None: the table's ffn_hidden_size
    ep: int = 1
    dispatcher: str = "alltoall"  # or allgather
    layer_fraction: float = 1.0  # MoE layers / all layers (--moe-layer-freq)
    shared_ffn: int = 0
    capacity_factor: Optional[float] = None
    pad_to_capacity: bool = False
    gated: bool = False
    a2a_gbps: float = 100.0  # per-rank all-to-all bandwidth, GB/s (default: 8 x 100 Gb/s IB per node / 8)
    a2a_latency_ms: float = 0.02
    activation_bytes: int = 2
    skew: float = 1.0  # busiest EP rank's routed tokens over the mean (load-blind: 1.0)

    def __post_init__(self):
        if self.dispatcher not in ("alltoall", "allgather"):
            raise ValueError(f"dispatcher must be alltoall or allgather, got {self.dispatcher!r}")
        if self.num_experts < 1 or not 1 <= self.topk <= self.num_experts or self.num_experts % self.ep:
            raise ValueError(f"need 1 <= topk ({self.topk}) <= num_experts ({self.num_experts}), "
                             f"num_experts divisible by ep ({self.ep})")
        if not 0 < self.skew <= self.ep:  # below 1: a rank with fewer tokens than its peers (expert_load.py)
            raise ValueError(f"skew (busiest EP rank's routed tokens over this rank's own) must be in "
                             f"(0, ep={self.ep}], got {self.skew}")

    @classmethod
    def from_config(cls, moe, num_layers: int, gated: bool = False, **kw) -> "MoEPricing":
        """From a `megatron.config.moe.MoEConfig` (the trainer's flags)."""
        pattern = moe.moe_layers(num_layers)
        return cls(num_experts=moe.num_experts, topk=moe.router_topk, expert_ffn=moe.ffn_hidden_size,
                   ep=moe.expert_model_parallel_size, dispatcher=moe.token_dispatcher_type,
                   layer_fraction=sum(pattern) / len(pattern), shared_ffn=moe.shared_expert_intermediate_size or 0,
                   capacity_factor=moe.expert_capacity_factor, pad_to_capacity=moe.pad_expert_input_to_capacity,
                   gated=gated, **kw)


def busiest_rank_tokens(p: MoEPricing, tokens):
    """Routed tokens the busiest EP rank computes for `tokens` tokens per rank (see module doc)."""
    tokens = np.asarray(tokens, float)
    n = p.skew * tokens * p.topk  # every EP rank sends T k; each receives T k on average
    if p.capacity_factor is not None:
        cap = np.ceil(tokens * p.topk / p.num_experts * p.capacity_factor) * p.num_experts
        n = cap if p.pad_to_capacity else np.minimum(n, cap)
    return n


def mlp_share(h: int, ffn: int, seq, gated: bool, heads_share: float = 1.0):
    """Forward FLOPs of the MLP over the whole layer's, per token at length `seq`."""
    g = 1.5 if gated else 1.0
    mlp = 4.0 * h * ffn * g
    return mlp / (8.0 * h * h * heads_share + 4.0 * np.asarray(seq, float) * h + mlp)


def dispatch_ms(p: MoEPricing, h: int, tokens) -> np.ndarray:
    """One direction (dispatch or combine) on the busiest rank, ms."""
    tokens = np.asarray(tokens, float)
    if p.ep == 1:
        return np.zeros_like(tokens)
    b = p.activation_bytes
    if p.dispatcher == "alltoall":
        send = tokens * p.topk * h * b * (p.ep - 1) / p.ep
        recv = busiest_rank_tokens(p, tokens) * h * b * (p.ep - 1) / p.ep
        vol = np.maximum(send, recv)
    else:  # all-gather of every EP rank's hidden states (and a reduce-scatter back)
        vol = tokens * h * b * (p.ep - 1)
    return vol / (p.a2a_gbps * 1e6) + p.a2a_latency_ms


class MoECostModel(CostModel):
    """A dense `CostModel` whose encoder layers are (a `layer_fraction` of) MoE layers."""

    def __init__(self, dense: CostModel, pricing: MoEPricing):
        self.__dict__.update(copy.copy(dense.__dict__))
        if dense.kind != "gpt":
            raise CostModelError(f"cost model {dense.name!r}: MoE pricing is implemented for GPT tables only")
        m = dense.model
        self.h, self.ffn = int(m["hidden_size"]), int(m.get("ffn_hidden_size") or 4 * m["hidden_size"])
        heads, groups = m.get("num_attention_heads"), m.get("num_query_groups")
        self.kv_share = (2 + 2 * groups / heads) / 4 if heads and groups else 1.0  # GQA: smaller k, v projections
        self.dense, self.pricing = dense, pricing
        self.name = f"{dense.name}+moe{pricing.num_experts}"

    def with_skew(self, skew: float) -> "MoECostModel":
        return MoECostModel(self.dense, replace(self.pricing, skew=skew))

    def moe_layer(self, tp, recompute, mbs, seq) -> Dict[str, np.ndarray]:
        """One MoE layer's costs at (mbs, seq), every layer MoE."""
        p, h, ffn = self.pricing, self.h, self.ffn
        efn = p.expert_ffn or ffn
        mbs, seq = np.broadcast_arrays(np.asarray(mbs, float), np.asarray(seq, float))
        d = self.dense.layer("encoder", tp, recompute, mbs, seq)
        phi = mlp_share(h, ffn, seq, p.gated, self.kv_share)
        tokens = mbs * seq
        n = busiest_rank_tokens(p, tokens)
        # the dense MLP on n tokens: the table at the same length with n / seq rows where that is
        # fewer rows than the micro-batch's own (small GEMMs keep the table's efficiency); more
        # rows (n is up to EP x k x T) are linear from the micro-batch's own shape, which the
        # table has (a larger one may not have been measured: it ran out of memory)
        rows = n / seq
        base = np.minimum(rows, mbs)
        on_n = self.dense.layer("encoder", tp, recompute, base, seq)
        on_n = {k: v * rows / base for k, v in on_n.items()}
        g = 1.5 if p.gated else 1.0
        router = p.num_experts / (2.0 * ffn * g)
        comm = 2 * dispatch_ms(p, h, tokens)  # dispatch + combine
        out = {}
        ok = np.isfinite(d["forward_ms"]) & np.isfinite(on_n["forward_ms"])  # else infeasible: inf
        for k in TIME_KEYS:
            if k not in d:
                continue
            with np.errstate(invalid="ignore"):
                mlp = phi * d[k]
                t = d[k] - mlp + mlp * router + phi * on_n[k] * efn / ffn + mlp * p.shared_ffn / ffn
            # the backward sends the gradients back the same ways; W has no communication
            out[k] = np.where(ok, t + (comm if k != "weight_grad_ms" else 0.0), np.inf)
        ab = p.activation_bytes
        dense_mlp = tokens * (h * ab + ffn * g * 2 * ab + ffn * ab + h) / tp
        routed = n * (h * ab + efn * 2 * g * ab + efn * ab) + tokens * p.topk * h * ab
        moe_mb = (tokens * p.num_experts * 8 + routed) / 1e6 + dense_mlp * p.shared_ffn / ffn / 1e6
        delta = moe_mb - dense_mlp / 1e6
        out["stored_mb"] = np.where(ok, d["stored_mb"] + (0.0 if recompute == "full" else delta), np.inf)
        out["peak_mb"] = np.where(ok, d["peak_mb"] + delta, np.inf)
        return out

    def layer(self, component, tp, recompute, mbs, seq, dec_seq=None) -> Dict[str, np.ndarray]:
        d = self.dense.layer(component, tp, recompute, mbs, seq, dec_seq)
        f = self.pricing.layer_fraction
        if component != "encoder" or f == 0:
            return d
        m = self.moe_layer(tp, recompute, mbs, seq)
        with np.errstate(invalid="ignore"):
            return {k: np.where(np.isfinite(d[k]), d[k] + f * (m[k] - d[k]), np.inf) if f < 1 else m[k]
                    for k in d if k in m}

    def param_mb(self, component: str, tp: int) -> float:
        d = self.dense.param_mb(component, tp)
        if component != "encoder":
            return d
        p, h = self.pricing, self.h
        g = 2 if p.gated else 1
        efn = p.expert_ffn or self.ffn
        dense_mlp = (h * self.ffn * (g + 1)) / tp
        moe = p.num_experts // p.ep * h * efn * (g + 1) + h * p.num_experts + h * p.shared_ffn * (g + 1) / tp
        return d + p.layer_fraction * (moe - dense_mlp) * 2 / 1e6


def moe_cost_model(dense: CostModel, pricing: Optional[MoEPricing]) -> CostModel:
    if pricing is None or isinstance(dense, MoECostModel):
        return dense
    return MoECostModel(dense, pricing)
