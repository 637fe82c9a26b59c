"""Configurations of the systems built on the core trainer: Optimus-CC compression and TeraPipe
(the core ones are in megatron/config/core.py, which re-exports these)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.config.errors import _require


@dataclass
class CompressionConfig:
    """Optimus-CC's three mechanisms (megatron/compression); all off by default."""
    inter_grad_comp: bool = False  # compressed backpropagation between pipeline stages
    inter_grad_comp_rank: int = 16
    inter_grad_comp_epilogue_only: bool = False
    use_error_feedback: bool = False  # LEP for pipeline grads; error feedback for DP PowerSGD
    emb_comm_opt: bool = False  # fused tied-embedding sync
    grad_comp: bool = False  # data-parallel PowerSGD
    grad_comp_rank: int = 128
    grad_comp_warm_up: float = 0.0  # fraction of --train-iters with a plain all-reduce
    selective_grad_comp: bool = False
    selective_grad_comp_way: Optional[int] = None  # pipeline stages [0, K) compress
    grad_comp_type: str = "PowerSGD"  # or RandomizedSVD (megatron/compression/data_parallel.py)
    emb_grad_comp: bool = False  # low-rank tied-embedding all-reduce
    emb_grad_comp_rank: int = 4
    emb_grad_comp_type: str = "PowerSGD"
    emb_grad_comp_warm_up: float = 0.0
    emb_use_error_feedback: bool = False
    log_compression_stats: bool = False  # megatron/compression/stats.py
    # LEP residuals normally end with their iteration (measured: carrying them over hurts, README)
    lep_carry_across_iterations: bool = False
    mp_grad_comp: bool = False  # low-rank TP input-gradient all-reduce (compression/tensor_parallel.py)
    mp_grad_comp_rank: int = 4
    mp_acti_comp: bool = False  # low-rank TP output all-reduce: changes the forward
    mp_acti_comp_rank: int = 4

    def __post_init__(self):
        _require(self.inter_grad_comp_rank >= 1,
                 f"--inter-grad-comp-rank must be >= 1, got {self.inter_grad_comp_rank}")
        _require(self.grad_comp_rank >= 1, f"--grad-comp-rank must be >= 1, got {self.grad_comp_rank}")
        _require(0.0 <= self.grad_comp_warm_up <= 1.0,
                 f"--grad-comp-warm-up is a fraction of --train-iters in [0, 1], got {self.grad_comp_warm_up}")
        _require(not self.inter_grad_comp_epilogue_only or self.inter_grad_comp,
                 "--inter-grad-comp-epilogue-only needs --inter-grad-comp")
        _require(not self.selective_grad_comp or self.grad_comp, "--selective-grad-comp needs --grad-comp")
        if self.selective_grad_comp:
            _require(self.selective_grad_comp_way is not None and self.selective_grad_comp_way >= 1,
                     "--selective-grad-comp needs --selective-grad-comp-way K >= 1 (the first K pipeline stages "
                     "compress)")
        for flag, v in (("--emb-grad-comp-rank", self.emb_grad_comp_rank),
                        ("--mp-grad-comp-rank", self.mp_grad_comp_rank),
                        ("--mp-acti-comp-rank", self.mp_acti_comp_rank)):
            _require(v >= 1, f"{flag} must be >= 1, got {v}")
        _require(0.0 <= self.emb_grad_comp_warm_up <= 1.0,
                 f"--emb-grad-comp-warm-up is a fraction of --train-iters in [0, 1], got {self.emb_grad_comp_warm_up}")
        for flag, v in (("--grad-comp-type", self.grad_comp_type), ("--emb-grad-comp-type", self.emb_grad_comp_type)):
            _require(v in ("PowerSGD", "RandomizedSVD"), f"{flag} must be PowerSGD or RandomizedSVD, got {v!r}")

    @property
    def enabled(self) -> bool:
        return self.inter_grad_comp or self.emb_comm_opt or self.grad_comp or self.emb_grad_comp


@dataclass
class TeraPipeConfig:
    """--terapipe: token-level pipelining of GPT (megatron/planner/terapipe/lowering.py)."""
    enabled: bool = False
    slices: str = "auto"              # auto | N | l1,l2,...
    cost_model: Optional[str] = None  # megatron-terapipe-latency JSON (needed by 'auto')
    memory_limit_mb: float = 36000.0
    with_dynapipe: bool = False       # --dynapipe plans the slices from its own cost model

    def __post_init__(self):
        if self.enabled:
            _require(self.slices != "auto" or self.cost_model is not None or self.with_dynapipe,
                     "--terapipe-slices auto plans slices from a latency model: give --terapipe-cost-model FILE "
                     "(python -m megatron.planner.terapipe.latency --output FILE), "
                     "or fixed --terapipe-slices N|l1,l2,...")
            _require(self.memory_limit_mb > 0,
                     f"--terapipe-memory-limit must be positive, got {self.memory_limit_mb}")
