"""DynaPipeConfig: what the DynaPipe planner (megatron/planner/dynapipe/planner.py) plans for: the
model, the parallel layout, the memory limit, the device's link, and the options of the
systems composed with it (token slices, virtual stages, stages with their own TP/DP, packed
rows, compressed gradients)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron.planner.cost.cost_model import RECOMPUTE_LEVELS
from megatron.planner.cost.moe_cost import MoEPricing
from megatron.planner.dynapipe.layout import stage_components


@dataclass
class DynaPipeConfig:
    """Model shape, parallel layout, memory limit and cost model of a DynaPipe planner.

    GPT: `num_layers` layers split evenly over `pipeline_parallel` stages (or
    `layers_per_stage` each, to plan a slice of a deeper model). T5: encoder stages first,
    then decoder stages, half of the pipeline each (`pipeline_parallel` must be even).
    Memory: `memory_limit_mb` per device; model states (`weight_grad_bytes_per_param` for the
    weights and gradients, 16-bit each by default as in the published runs, plus
    `optimizer_bytes_per_param` of fp32 optimizer state, sharded over `zero_shards` ranks,
    default DP) are subtracted per stage; the rest is for activations.
    """

    cost_model_path: str
    model_kind: str = "gpt"
    hidden_size: int = 4096
    num_layers: int = 32
    encoder_layers: int = 0
    decoder_layers: int = 0
    pipeline_parallel: int = 4
    data_parallel: int = 1
    tensor_parallel: int = 1
    layers_per_stage: Optional[int] = None
    memory_limit_mb: float = 36000.0
    weight_grad_bytes_per_param: float = 4.0
    optimizer_bytes_per_param: float = 12.0
    zero_shards: Optional[int] = None
    recompute_levels: Tuple[str, ...] = RECOMPUTE_LEVELS
    pad_multiple: int = 8
    decoder_extra_tokens: int = 2  # bos/eos added to T5 targets
    bandwidth_gbps: float = 4800.0  # per pipeline link (NVSwitch intra-node)
    link_latency_ms: float = 0.01
    # Optimus-CC compressed backpropagation: rank of the factors (0 = off); sizes follow
    # megatron.compression.pipeline (float32 P and Q, only where smaller than the gradient).
    grad_compress_rank: int = 0
    grad_compress_epilogue_only: bool = False
    # --sequence-parallel: stage boundaries carry [s/tp, b, h]; activation memory scaled from
    # the (non-SP) profile by Megatron's per-layer activation formula (see `sp_memory_factor`).
    sequence_parallel: bool = False
    num_attention_heads: Optional[int] = None
    # Whether the run adds the row-parallel biases in the fused bias-dropout-add kernel (None:
    # the table's `bias_dropout_fusion`, default fused). Unfused under SP, a deferred W keeps
    # those biases' sequence-local gradients too (megatron/planner/cost/wpass_memory.py).
    bias_dropout_fused: Optional[bool] = None
    activation_bytes: int = 2  # element size of cross-stage tensors in the cost model's runs
    schedules: Tuple[str, ...] = ("1f1b", "adaptive")
    max_orders: int = 2
    # Schedule search: every order of this many micro-batch clusters (0/1: off), and every
    # order outright for groups of at most `exhaustive_orders_up_to` micro-batches.
    order_clusters: int = 3
    exhaustive_orders_up_to: int = 4
    refine_skip_gap: float = 0.005  # skip the full search where the quick one is this close to the lower bound
    refine_spread: float = 0.07  # refine every candidate partition whose quick makespan is this close to the best
    # T5: also cut the lexicographic order (input length first); it wins where the encoder
    # stages are the bottleneck (long inputs). Costs a second segment matrix per recompute level.
    t5_lexicographic_order: bool = True
    dtype: str = "float32"
    emit_plans: bool = True
    # Also search micro-batches of packed rows run with per-document attention
    # (`megatron.planner.dynapipe.packed`): rows of `packed_max_len` tokens (GPT: the model's
    # --seq-length; T5: encoder rows, `packed_dec_len` decoder rows, default the same). The
    # plan then carries each micro-batch's rows (`GroupPlan.rows`).
    packed_rows: bool = False
    packed_max_len: Optional[int] = None
    packed_dec_len: Optional[int] = None
    # GPT: cut micro-batches into TeraPipe token slices (megatron/planner/dynapipe/slicing.py):
    # 0 off, -1 the planner decides (auto), N: N uniform slices per micro-batch.
    token_slices: int = 0
    # GPT: model chunks per pipeline rank (--num-layers-per-virtual-pipeline-stage): plans
    # then run on PP * v virtual stages placed round-robin (megatron/planner/dynapipe/interleaved.py).
    virtual_stages: int = 1
    # CP sizes a micro-batch may run at (each divides context_parallel; () = static): the plan
    # has one group per rank of DP x CP (megatron/planner/dynapipe/variable_cp.py)
    cp_sizes: Tuple[int, ...] = ()
    # Stages with their own (TP, DP) sizes (Aceso layouts, one pipeline): stage s is costed
    # at its TP on its share of each micro-batch's rows (padded to a multiple of every DP), with
    # `stage_layer_counts` layers; the plans are lowered onto the ranks (megatron/planner/passes/layout.py).
    stage_parallel: Optional[Tuple[Tuple[int, int], ...]] = None
    stage_layer_counts: Optional[Tuple[int, ...]] = None
    # GPT: a static context-parallel group of this many ranks per DP rank runs every micro-batch
    # (each rank its 2 chunks of every row): priced by megatron/planner/cost/cp_cost.py (the
    # worker builds that planner), plans lowered with the S/CP-token stage boundaries a rank sends.
    context_parallel: int = 1
    cp_comm_type: str = "p2p"
    # Mixture of experts (GPT): the table's layers priced as MoE layers (megatron/planner/cost/moe_cost.py)
    moe: Optional[MoEPricing] = None
    # Expert parallelism: every DP group the same micro-batch count and passes (lockstep.py)
    lockstep_groups: bool = False

    def __post_init__(self):
        if self.model_kind not in ("gpt", "t5"):
            raise ValueError(f"model_kind must be 'gpt' or 't5', got {self.model_kind!r}")
        if self.pipeline_parallel < 1 or self.data_parallel < 1 or self.tensor_parallel < 1:
            raise ValueError("pipeline_parallel, data_parallel and tensor_parallel must be >= 1")
        if self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.stage_parallel is not None and (self.data_parallel != 1 or self.stage_layer_counts is None
                                                or len(self.stage_parallel) != self.pipeline_parallel):
            raise ValueError("stage_parallel plans one pipeline: one (TP, DP) and layer count per stage, "
                             "data_parallel 1")
        if self.model_kind == "t5" and self.pipeline_parallel % 2 and self.pipeline_parallel != 1 \
                and self.stage_layer_counts is None:
            raise ValueError(f"T5 needs an even pipeline_parallel (encoder half, decoder half), "
                             f"got {self.pipeline_parallel}")
        tps = [t for t, _ in self.stage_parallel] if self.stage_parallel else [self.tensor_parallel]
        if self.sequence_parallel and any(self.pad_multiple % t for t in tps):
            raise ValueError(f"sequence_parallel splits each micro-batch's length over the TP ranks: pad_multiple "
                             f"({self.pad_multiple}) must be a multiple of every TP size ({sorted(set(tps))})")
        cp = self.context_parallel
        # plans lower S/CP-token boundaries: lengths must cut into 2 x CP chunks (pricing alone need not)
        if cp > 1 and (self.model_kind != "gpt" or (self.emit_plans and self.pad_multiple % (2 * cp))
                       or self.token_slices or self.stage_parallel or self.packed_rows):
            raise ValueError(f"context_parallel {cp}: GPT only, pad_multiple ({self.pad_multiple}) a multiple of "
                             f"2 x CP where plans are emitted, no token slices, per-stage layouts or packed rows")
        bad = [r for r in self.recompute_levels if r not in RECOMPUTE_LEVELS]
        if bad or not self.recompute_levels:
            raise ValueError(f"recompute_levels must be a non-empty subset of {RECOMPUTE_LEVELS}, "
                             f"got {self.recompute_levels}")
        for s in self.schedules:
            if s not in ("1f1b", "adaptive", "zb"):
                raise ValueError(f"unknown schedule {s!r}; choose from '1f1b', 'adaptive', 'zb' (split backward)")
        if "zb" in self.schedules and (self.token_slices or self.virtual_stages > 1 or self.stage_parallel):
            raise ValueError("schedule 'zb' (split backward) plans whole micro-batches on one stage per rank with one "
                             "TP/DP size: not with token slices, virtual stages or per-stage TP/DP sizes")

        if self.lockstep_groups and (self.model_kind != "gpt" or self.token_slices or self.virtual_stages > 1
                                     or self.stage_parallel or self.packed_rows or set(self.schedules) != {"1f1b"}):
            raise ValueError("lockstep_groups (expert parallelism) plans GPT with schedules ('1f1b',) only: no token "
                             "slices, virtual stages, per-stage layouts or packed rows")

    def stage_layers(self) -> List[List[Tuple[str, int]]]:
        """Per stage: [(component, layer count)] (megatron/planner/dynapipe/layout.py)."""
        return stage_components(self)
