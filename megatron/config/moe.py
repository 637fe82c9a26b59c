"""Mixture-of-experts configuration: Megatron-Core's MoE flags, names and defaults.

`ModelConfig.moe` is None for a dense model (`--num-experts` absent or 0). The layers read it
(megatron/models/moe); `check_moe_parallel` checks it against the parallel layout and names the
flags of any combination that is not supported yet.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import List, Optional

from megatron.config.errors import _require


@dataclass
class MoEConfig:
    num_experts: int = 8
    router_topk: int = 2
    # int N: layer i (0-based) is MoE iff i % N == 0; or one 0/1 per layer (Megatron's list string)
    layer_freq: object = 1
    ffn_hidden_size: Optional[int] = None  # --moe-ffn-hidden-size; None = --ffn-hidden-size
    shared_expert_intermediate_size: Optional[int] = None
    router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | none
    aux_loss_coeff: float = 0.0
    z_loss_coeff: Optional[float] = None
    router_pre_softmax: bool = False
    router_score_function: str = "softmax"  # softmax | sigmoid
    router_topk_scaling_factor: Optional[float] = None
    router_enable_expert_bias: bool = False
    router_bias_update_rate: float = 1e-3
    expert_capacity_factor: Optional[float] = None  # None = dropless
    token_drop_policy: str = "probs"  # probs | position
    pad_expert_input_to_capacity: bool = False
    token_dispatcher_type: str = "allgather"  # allgather | alltoall
    grouped_gemm: bool = False
    expert_model_parallel_size: int = 1
    per_layer_logging: bool = False

    def __post_init__(self):
        e, k = self.num_experts, self.router_topk
        _require(e >= 1, f"--num-experts must be positive, got {e}")
        _require(1 <= k <= e, f"--moe-router-topk ({k}) must be between 1 and --num-experts ({e})")
        _require(self.router_load_balancing_type in ("aux_loss", "seq_aux_loss", "none"),
                 f"--moe-router-load-balancing-type {self.router_load_balancing_type!r} is not supported: use "
                 "aux_loss, seq_aux_loss or none (sinkhorn and global_aux_loss are not implemented)")
        _require(self.router_score_function in ("softmax", "sigmoid"),
                 f"--moe-router-score-function must be softmax or sigmoid, got {self.router_score_function!r}")
        _require(self.token_drop_policy in ("probs", "position"),
                 f"--moe-token-drop-policy must be probs or position, got {self.token_drop_policy!r}")
        _require(self.token_dispatcher_type in ("allgather", "alltoall"),
                 f"--moe-token-dispatcher-type {self.token_dispatcher_type!r} is not supported: use allgather or "
                 "alltoall (alltoall_seq and flex are not implemented)")
        # Megatron's TransformerConfig: a softmax over one chosen logit has zero gradient.
        _require(not (k == 1 and self.router_score_function == "softmax" and not self.router_pre_softmax),
                 "--moe-router-topk 1 with the softmax score function needs --moe-router-pre-softmax (a softmax over "
                 "the one chosen logit is always 1 and gives the router no gradient)")
        _require(not self.router_enable_expert_bias or self.router_score_function == "sigmoid",
                 "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as Megatron-Core)")
        if self.expert_capacity_factor is not None and self.expert_capacity_factor < 0:
            self.expert_capacity_factor = None  # Megatron: a negative factor means dropless
        _require(not self.pad_expert_input_to_capacity or self.expert_capacity_factor is not None,
                 "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        _require(self.aux_loss_coeff >= 0, f"--moe-aux-loss-coeff must be >= 0, got {self.aux_loss_coeff}")
        _require(self.expert_model_parallel_size >= 1,
                 f"--expert-model-parallel-size must be >= 1, got {self.expert_model_parallel_size}")
        _require(e % self.expert_model_parallel_size == 0,
                 f"--num-experts ({e}) must be divisible by --expert-model-parallel-size "
                 f"({self.expert_model_parallel_size})")
        for flag, v in (("--moe-ffn-hidden-size", self.ffn_hidden_size),
                        ("--moe-shared-expert-intermediate-size", self.shared_expert_intermediate_size)):
            _require(v is None or v > 0, f"{flag} must be positive, got {v}")

    def moe_layers(self, num_layers: int) -> List[bool]:
        """Which of the model's layers (0-based, global) are MoE layers."""
        return moe_layer_pattern(self.layer_freq, num_layers)


def parse_layer_freq(text: str):
    """--moe-layer-freq: an int, or a Python list expression of 0/1 (e.g. "[1,0]*2" or "([0]*3+[1]*5)")."""
    text = str(text).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        # Megatron evaluates the string; only list literals and `*`/`+` on them are accepted here.
        tree = ast.parse(text, mode="eval")
        for node in ast.walk(tree):
            _require(isinstance(node, (ast.Expression, ast.BinOp, ast.List, ast.Constant, ast.Mult, ast.Add,
                                       ast.Load)), f"--moe-layer-freq {text!r}: only an int or a list expression of "
                     "0/1 with * and + is accepted")
        value = eval(compile(tree, "<--moe-layer-freq>", "eval"), {"__builtins__": {}}, {})  # noqa: S307
    except SyntaxError:
        value = None
    _require(isinstance(value, list) and all(v in (0, 1) for v in value),
             f"--moe-layer-freq {text!r} must be an int or a list of 0/1, e.g. \"[1,0,1,0]\" or \"([0]*1+[1]*3)\"")
    return value


def moe_layer_pattern(freq, num_layers: int) -> List[bool]:
    if isinstance(freq, int):
        _require(freq >= 1, f"--moe-layer-freq must be >= 1, got {freq}")
        return [i % freq == 0 for i in range(num_layers)]
    _require(len(freq) == num_layers,
             f"--moe-layer-freq lists {len(freq)} layers but --num-layers is {num_layers}")
    return [bool(v) for v in freq]


def check_moe_parallel(cfg) -> None:
    """What the MoE layers need from the rest of a MegatronConfig; one line per refusal."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    moe = m.moe
    if moe is None:
        return
    moe.moe_layers(m.num_layers)
    ep, tp = moe.expert_model_parallel_size, p.tensor_model_parallel_size
    _require(m.model_type == "gpt", "--num-experts is implemented for GPT; drop it for T5")
    # (before the TP check: an Aceso layout's own TP sizes are not what the user would change)
    _require(p.stage_parallel is None, "--num-experts with per-stage TP/DP sizes (--aceso-config) is not supported")
    _require(tp == 1 or m.sequence_parallel,
             "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (as Megatron-Core: each "
             "TP rank routes its own tokens)")
    _require(p.context_parallel_size == 1 and not p.cp_keyed_dropout,
             "--num-experts with --context-parallel-size > 1 is not supported yet: drop one of them")
    stage = p.world_size // p.pipeline_model_parallel_size if p.stage_parallel is None else 1
    _require(stage % ep == 0,
             f"--expert-model-parallel-size ({ep}) must divide the ranks of a pipeline stage (TP x DP = {stage}): "
             "expert parallelism folds into the tensor- and data-parallel ranks")
    _require(cfg.checkpoint.ckpt_format != "megatron-legacy", "--ckpt-format megatron-legacy with --num-experts: "
             "Megatron-LM's legacy model has no experts; save with --ckpt-format torch or torch_dist, then "
             "`tools/checkpoint/convert.py --to-megatron --target-expert-parallel-size N` writes Megatron-Core's MoE "
             "files (docs/moe.md)")
    if tp > 1:
        _require(not t.use_distributed_optimizer, "--use-distributed-optimizer with --tensor-model-parallel-size > 1 "
                 "and --num-experts is not supported yet (TP-replicated experts and routers)")
    if ep > 1 and t.use_distributed_optimizer:
        # its torch-format state is gathered over DP, whose ranks hold other experts
        _require(cfg.checkpoint.ckpt_format == "torch_dist" or not (cfg.checkpoint.save or cfg.checkpoint.load),
                 "--use-distributed-optimizer with --expert-model-parallel-size > 1 saves and loads with --ckpt-format "
                 "torch_dist only (the torch format's sharded optimizer state is per DP group, whose ranks hold "
                 "other experts)")
    if ep > 1 or tp > 1:
        _require(not t.overlap_grad_reduce, "--overlap-grad-reduce with --num-experts and --expert-model-parallel-"
                 "size > 1 or --tensor-model-parallel-size > 1 is not supported yet")
        _require(not cfg.compression.grad_comp, "--grad-comp with --num-experts and expert or tensor parallelism is "
                 "not supported")
    if ep > 1:
        # --dynapipe plans equal micro-batch counts and 1F1B passes for the EP ranks (planner/dynapipe/lockstep.py)
        d = cfg.data
        _require(not cfg.data.dynapipe or not (d.dynapipe_packed_rows or p.num_layers_per_virtual_pipeline_stage),
                 "--dynapipe with --expert-model-parallel-size > 1 plans unpacked rows on one stage per rank: drop "
                 "--dynapipe-packed-rows / --num-layers-per-virtual-pipeline-stage")
        # measured: the composition smoke run crashed in the all-gather dispatcher (gloo size mismatch)
        _require(not cfg.data.pack_dataset, "--pack-dataset with --expert-model-parallel-size > 1 is not supported yet "
                 "(packing gives each DP rank its own micro-batch count, but EP ranks exchange tokens every "
                 "micro-batch in lockstep): drop one of them")
        _require(not cfg.terapipe.enabled, "--terapipe with --expert-model-parallel-size > 1 is not supported")
        # zb-h1 / zb-h2 / zb-v are parity-tested at EP 2 x PP 2 with uniform plans only
        _require(not (cfg.data.dynapipe and p.pipeline_schedule.startswith("zb")), f"--pipeline-schedule "
                 f"{p.pipeline_schedule} with --dynapipe and --expert-model-parallel-size > 1 is not supported yet "
                 "(DynaPipe's EP plans are 1F1B): use --pipeline-schedule 1f1b")
