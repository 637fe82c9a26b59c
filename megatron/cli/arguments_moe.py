"""Megatron-Core's mixture-of-experts flags -> `MoEConfig` (megatron/config/moe.py).

Kept apart from arguments.py (one registration line there); names and defaults are
Megatron-Core's (`--num-experts`, `--moe-router-topk` 2, dispatcher allgather, ...).
"""
from __future__ import annotations

from typing import Optional

from megatron.config.moe import MoEConfig, parse_layer_freq


def add_moe_args(p) -> None:
    g = p.add_argument_group("mixture of experts (docs/moe.md)")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (None/0: dense)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-layer-freq", type=str, default="1",
                   help="int N: layers 0, N, 2N, ... are MoE; or a list of 0/1 per layer, e.g. \"[1,0,1,0]\"")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="FFN width of each expert "
                   "(default: --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="total FFN width of the shared expert(s); none by default")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "none"], help="auxiliary load-balancing loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="load-balancing loss coefficient (1e-2 is usual)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="router z-loss coefficient (1e-3 is usual)")
    g.add_argument("--moe-router-pre-softmax", action="store_true", help="softmax over all experts before top-k")
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"],
                   help="router score function")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None, help="scale the top-k probs")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: per-expert selection bias (DeepSeek-V3; needs sigmoid scores)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3, help="expert-bias step per iteration")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="drop tokens beyond ceil(tokens x topk / experts x factor) per expert (default: dropless)")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
                   help="which tokens an over-full expert drops: lowest probability, or latest position")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="every expert receives exactly its capacity (zero-weighted padding tokens)")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"],
                   help="how tokens reach the experts of other EP ranks")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="one grouped GEMM for all local experts (torch.nn.functional.grouped_mm; float32/bf16/fp16)")
    g.add_argument("--moe-per-layer-logging", action="store_true", help="log load and losses of every MoE layer")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP: ranks the experts are split over")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="expert TP: only 1 is supported (experts are never tensor-parallel here)")


def moe_config(args) -> Optional[MoEConfig]:
    """None for a dense model; raises ConfigError naming the flag on a bad value."""
    from megatron.config.errors import _require
    _require(args.expert_tensor_parallel_size in (None, 1),
             f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size} is not supported: experts are not "
             "tensor-parallel here (expert TP 1, Megatron-Core's recommendation); drop the flag or pass 1")
    if not args.num_experts:
        _require(args.expert_model_parallel_size == 1, "--expert-model-parallel-size needs --num-experts")
        return None
    return MoEConfig(
        num_experts=args.num_experts, router_topk=args.moe_router_topk,
        layer_freq=parse_layer_freq(args.moe_layer_freq),
        ffn_hidden_size=args.moe_ffn_hidden_size,
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        router_load_balancing_type=args.moe_router_load_balancing_type, aux_loss_coeff=args.moe_aux_loss_coeff,
        z_loss_coeff=args.moe_z_loss_coeff, router_pre_softmax=args.moe_router_pre_softmax,
        router_score_function=args.moe_router_score_function,
        router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        router_enable_expert_bias=args.moe_router_enable_expert_bias,
        router_bias_update_rate=args.moe_router_bias_update_rate,
        expert_capacity_factor=args.moe_expert_capacity_factor, token_drop_policy=args.moe_token_drop_policy,
        pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        token_dispatcher_type=args.moe_token_dispatcher_type, grouped_gemm=args.moe_grouped_gemm,
        expert_model_parallel_size=args.expert_model_parallel_size, per_layer_logging=args.moe_per_layer_logging)
