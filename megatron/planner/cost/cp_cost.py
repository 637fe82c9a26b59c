"""Context parallelism priced with the same cost table as everything else.

A CP rank of a group of N runs every layer on s/N tokens of each sequence (two chunks, causal
load balancing: megatron/core/context_parallel.py) and exchanges keys and values with the
group. Per layer and micro-batch of b rows of s tokens, with the table's cost T(b, s) split
into a token-wise part and an attention part beta * b * s^2 (megatron.planner.cost.attention_cost):

* compute: T(b, s/N) + beta * b * (s^2/N - (s/N)^2) - the table's measured token-wise cost
  on the local tokens, and 1/N of the sequence's attention (each local query sees up to all S
  keys; load balancing gives every rank the same share), not the (s/N)^2 that a table row of
  s/N tokens pays;
* K/V exchange, bytes per layer V = 2 * b * s * (N-1)/N * h/tp * bytes (K and V of the other
  ranks' tokens) at the link bandwidth, each way (forward: K/V; backward: their gradients):
  `all_gather` pays it exposed (gather, then attend; backward reduce-scatter), `p2p` (ring)
  sends N-1 blocks of V/(N-1), each overlapped with attending to the block before it, so only
  what a block's transfer takes beyond its attention is exposed;
* memory: the table's stored/peak memory of s/N tokens without its score-matrix term. The
  runtime (megatron/models/cp_flash.py) is flash-style for both exchanges: a rank keeps q, k,
  v and the output of its s/N tokens and a log-sum-exp per row and head, recomputes scores in
  the backward and fetches K/V again (the ring re-sends the blocks, all_gather gathers
  again), so no gathered K/V is stored: `attention_core_saved_bytes`, fitted to what the
  runtime keeps (megatron/profiling/cp_memory.py, within 1 %: tests/planner/cost/test_cp_memory_model.py).
  The exchange's buffers are transient, in the peak only: all_gather holds all S keys and
  values and, in the backward, their gradients (float32); the ring two blocks in flight and,
  in the backward, two float32 dK/dV accumulators. `flash_memory=False` keeps the table's
  score memory and adds the s^2/N share instead (the A100 tables' non-flash kernels).

`ContextParallelCostModel` wraps a `CostModel` with these rules, so every planner that reads a
cost model (DynaPipe, the baselines) plans at a static CP size unchanged: give it the data-
parallel size world / (PP x CP), ZeRO shards over DP x CP (`cp_planner_config`). Stage
boundaries carry s/N tokens per CP rank: priced as N x the link bandwidth; the embedding's and
the head's memory are those of s/N tokens (`cp_planner`).
"""
from __future__ import annotations

import dataclasses
from typing import Dict

import numpy as np

from megatron.planner.cost.attention_cost import MEMORY_QUANTITIES, AttentionCost

COMM_TYPES = ("all_gather", "p2p")
STAT_BYTES = 4  # softmax statistics and gradient accumulators: float32 (float64 for float64 inputs)


def attention_core_saved_bytes(b, s, heads, head_size, cp: int, activation_bytes: int = 2) -> float:
    """Bytes one rank's attention core keeps for the backward, either exchange, CP 1 included
    (one process: torch's SDPA flash kernel keeps the same): q, k, v and the output of its s/cp
    tokens, and the log-sum-exp of each of its query rows and heads (float32; float64 inputs
    keep float64 statistics)."""
    local = np.asarray(s, float) / cp * np.asarray(b, float) * heads
    return 4.0 * local * head_size * activation_bytes + local * max(STAT_BYTES, activation_bytes)


class ContextParallelCostModel:
    """A `CostModel` as one rank of a CP group of `cp` sees it (see the module docstring)."""

    def __init__(self, cost_model, cp: int, comm_type: str = "p2p", link_gbps: float = 4800.0,
                 latency_ms: float = 0.01, activation_bytes: int = 2, flash_memory: bool = True):
        if comm_type not in COMM_TYPES:
            raise ValueError(f"--cp-comm-type must be one of {COMM_TYPES}, got {comm_type!r}")
        self.base, self.cp, self.comm_type = cost_model, int(cp), comm_type
        self.link_gbps, self.latency_ms, self.bytes = link_gbps, latency_ms, activation_bytes
        self.attention = AttentionCost(cost_model)
        self.flash_memory = flash_memory
        self.name = f"{cost_model.name} (CP {cp}, {comm_type})"

    def __getattr__(self, name):  # kind, has, profile, param_mb, calibration, ... of the table
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    # -- pieces --------------------------------------------------------------------------
    def exchange_mb(self, tp: int, mbs, seq) -> np.ndarray:
        """MB of other ranks' keys and values one rank receives per layer (one direction)."""
        n, h = self.cp, self.base.model["hidden_size"]
        return 2.0 * np.asarray(mbs, float) * np.asarray(seq, float) * (n - 1) / n * h / tp * self.bytes / 1e6

    def _ms(self, mb) -> np.ndarray:
        return np.asarray(mb, float) * 8e6 / (self.link_gbps * 1e6)

    def layer(self, component, tp, recompute, mbs, seq, dec_seq=None) -> Dict[str, np.ndarray]:
        if component != "encoder" or self.cp == 1:
            if component != "encoder":
                raise ValueError("context parallelism is priced for GPT layers (component 'encoder') only")
            return self.base.layer(component, tp, recompute, mbs, seq)
        n = self.cp
        b, s = np.broadcast_arrays(np.asarray(mbs, float), np.asarray(seq, float))
        local = s / n
        dense = self.base.layer(component, tp, recompute, b, local)
        extra_pairs = b * (s * s / n - local * local)
        out = {}
        for q, v in dense.items():
            sp = self.attention.split(tp, recompute, component, q)
            beta = 0.0 if sp is None else max(sp.coef["quad"], 0.0)
            if q in MEMORY_QUANTITIES and self.flash_memory:
                out[q] = np.maximum(v - beta * b * local * local, 0.0)
            else:
                out[q] = v + beta * extra_pairs
        attn_fwd = self._attention_ms(tp, recompute, "forward_ms", b, s)
        attn_bwd = self._attention_ms(tp, recompute, "backward_ms", b, s)
        vol = self.exchange_mb(tp, b, s)
        stat = max(STAT_BYTES, self.bytes) / self.bytes  # float32 gradient buffers per activation byte
        if self.comm_type == "all_gather":
            fwd_comm = self._ms(vol) + self.latency_ms
            bwd_comm = 2 * self._ms(vol) + self.latency_ms  # K/V gathered again, then dK/dV reduce-scattered
            transient = vol * (1 + stat)  # gathered K/V and, in the backward, their gradients
        else:
            block = self._ms(vol / (n - 1)) + self.latency_ms
            fwd_comm = (n - 1) * np.maximum(block - attn_fwd / n, 0.0)
            # K/V and dK/dV travel together, overlapped; the last accumulator's trip home is exposed
            bwd_comm = (n - 1) * np.maximum((1 + stat) * block - attn_bwd / n, 0.0) + stat * block
            transient = 2 * vol / (n - 1) * (1 + stat)  # two blocks in flight, two dK/dV accumulators
        if recompute == "full":  # the backward replays the forward, exchange included
            bwd_comm = bwd_comm + fwd_comm
        out["forward_ms"] = out["forward_ms"] + fwd_comm
        out["backward_ms"] = out["backward_ms"] + bwd_comm
        if "peak_mb" in out:  # nothing exchanged is stored (attention_core_saved_bytes)
            out["peak_mb"] = out["peak_mb"] + transient
        return out

    def _attention_ms(self, tp, rc, quantity, b, s) -> np.ndarray:
        """One rank's share of the sequence's attention time: beta * b * s^2 / N."""
        sp = self.attention.split(tp, rc, "encoder", quantity)
        return 0.0 * b if sp is None else max(sp.coef["quad"], 0.0) * b * s * s / self.cp

    def postprocess(self, tp, recompute, mbs, seq):
        return self.base.postprocess(tp, recompute, mbs, np.asarray(seq, float) / self.cp)

    def preprocess(self, tp, recompute, mbs, seq):
        return self.base.preprocess(tp, recompute, mbs, np.asarray(seq, float) / self.cp)


def cp_planner_config(cfg, cp: int):
    """A DynaPipeConfig for the same GPUs with a CP group of `cp` ranks: DP / cp, ZeRO still
    sharded over DP x CP, stage boundaries of s/cp tokens (N x the per-token bandwidth)."""
    dp = cfg.data_parallel // cp
    if dp < 1 or cfg.data_parallel % cp:
        raise ValueError(f"CP {cp} does not divide the {cfg.data_parallel} data-parallel ranks")
    return dataclasses.replace(cfg, data_parallel=dp, zero_shards=(cfg.zero_shards or cfg.data_parallel),
                               bandwidth_gbps=cfg.bandwidth_gbps * cp, packed_rows=False)


def cp_planner(cfg, cp: int, comm_type: str = "p2p", flash_memory: bool = True):
    """A DynaPipePlanner that plans micro-batches for CP groups of `cp` (static size); `cfg`
    counts every GPU of a pipeline stage as data parallel (see `cp_planner_config`)."""
    from megatron.planner.cost.cost_model import CostModel
    from megatron.planner.dynapipe.planner import DynaPipePlanner
    if cp == 1:
        return DynaPipePlanner(cfg, cost_model=CostModel.load(cfg.cost_model_path))
    cfg = dataclasses.replace(cp_planner_config(cfg, cp), context_parallel=cp, cp_comm_type=comm_type)
    return cp_group_planner(cfg, flash_memory)


def cp_group_planner(cfg, flash_memory: bool = True):
    """The planner of a config whose `context_parallel` is set and whose `data_parallel`
    already counts CP groups (the runtime's: megatron/training/supervised.py)."""
    from megatron.planner.cost.cost_model import CostModel
    from megatron.planner.dynapipe.planner import DynaPipePlanner
    cp = cfg.context_parallel
    cm = ContextParallelCostModel(CostModel.load(cfg.cost_model_path), cp, cfg.cp_comm_type, cfg.bandwidth_gbps,
                                  cfg.link_latency_ms, cfg.activation_bytes, flash_memory)

    class ContextParallelPlanner(DynaPipePlanner):
        def _pre_post(self, which, rc, mbs, seq, tp):
            """The embedding and the head (logits, loss) of a CP rank hold its s/N tokens."""
            return super()._pre_post(which, rc, mbs, np.asarray(seq, float) / cp, tp)

    return ContextParallelPlanner(cfg, cost_model=cm)
