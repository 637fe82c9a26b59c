"""Dataclass configs. Each validates itself in `__post_init__`; messages name the CLI flag.

Core code receives these objects (never an argparse namespace). `megatron.cli.arguments` maps
Megatron-LM's flag names onto them; `MegatronConfig` checks the cross-cutting constraints
(world size vs. TP x PP, global batch vs. micro batch x DP, ...).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from megatron.config.errors import ConfigError, _require  # noqa: F401 (re-exported)
from megatron.config.systems import CompressionConfig, TeraPipeConfig  # noqa: F401 (re-exported)
from megatron.config.checkpoint_formats import check_ckpt_format
from megatron.config.context_parallel import check_context_parallel_config, check_cp_parallel
from megatron.config.schedules import V_SCHEDULES, check_parallel_schedule, check_schedule_config
from megatron.config.terapipe import check_terapipe_config
from megatron.config.moe import MoEConfig, check_moe_parallel


@dataclass
class ModelConfig:
    model_type: str = "gpt"  # "gpt" or "t5"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    seq_length: int = 128
    max_position_embeddings: Optional[int] = None
    vocab_size: Optional[int] = None  # unpadded; usually from the tokenizer
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    untie_embeddings_and_output_weights: bool = False
    normalization: str = "LayerNorm"  # or "RMSNorm"
    swiglu: bool = False  # gated SiLU MLP (gate and up projections, each ffn_hidden_size wide)
    # The MLP without --swiglu: act(up(x)), or with gated_linear_unit act(gate(x)) * up(x)
    # (Megatron-core's TransformerConfig names). "gelu" is the tanh approximation (HF gelu_new, and
    # Megatron's fused bias-GeLU); "gelu-erf" is the exact form Megatron computes without that fusion
    # (--no-bias-gelu-fusion); "relu" is the original T5's, GeLU + gated_linear_unit is T5 v1.1 /
    # Flan-T5's "gated-gelu".
    activation_func: str = "gelu"  # or "gelu-erf", "relu"
    gated_linear_unit: bool = False
    add_bias_linear: bool = True  # --disable-bias-linear sets False
    # --sequence-parallel: norms, dropout and residuals split along the sequence inside TP
    # regions (Megatron's); a no-op at TP=1. Lives here because the layers read it.
    sequence_parallel: bool = False
    # T5 only.
    encoder_num_layers: Optional[int] = None
    decoder_num_layers: Optional[int] = None
    encoder_seq_length: Optional[int] = None
    decoder_seq_length: Optional[int] = None
    position_embedding_type: str = "learned_absolute"  # or "relative" (T5), "rope" (GPT)
    rotary_percent: float = 1.0
    rotary_base: float = 10000.0
    num_query_groups: Optional[int] = None  # grouped-query attention; None = one group per head
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    # Fused kernels (megatron/fused_kernels), used where built; the --no-*-fusion flags turn them off.
    masked_softmax_fusion: bool = True  # packed rows: variable-length attention instead of a dense mask
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    moe: Optional[MoEConfig] = None  # mixture of experts (--num-experts; megatron/config/moe.py)

    def __post_init__(self):
        _require(self.model_type in ("gpt", "t5"), f"model type must be gpt or t5, got {self.model_type!r}")
        if isinstance(self.moe, dict):  # a config.json's (or a converter's) model dict
            self.moe = MoEConfig(**self.moe)
        if self.model_type == "t5":
            if self.encoder_num_layers is None:
                self.encoder_num_layers = self.num_layers
            if self.decoder_num_layers is None:
                self.decoder_num_layers = self.num_layers
            if self.encoder_seq_length is None:
                self.encoder_seq_length = self.seq_length
            if self.decoder_seq_length is None:
                self.decoder_seq_length = 128
            self.num_layers = self.encoder_num_layers + self.decoder_num_layers
            self.seq_length = self.encoder_seq_length
            for flag, v in (("--encoder-num-layers", self.encoder_num_layers),
                            ("--decoder-num-layers", self.decoder_num_layers),
                            ("--encoder-seq-length", self.encoder_seq_length),
                            ("--decoder-seq-length", self.decoder_seq_length)):
                _require(v > 0, f"{flag} must be positive, got {v}")
        for flag, v in (("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                        ("--num-attention-heads", self.num_attention_heads), ("--seq-length", self.seq_length)):
            _require(v > 0, f"{flag} must be positive, got {v}")
        for flag, v in (("--ffn-hidden-size", self.ffn_hidden_size), ("--kv-channels", self.kv_channels),
                        ("--max-position-embeddings", self.max_position_embeddings),
                        ("--vocab-size", self.vocab_size)):
            _require(v is None or v > 0, f"{flag} must be positive, got {v}")
        _require(self.layernorm_epsilon > 0, f"--layernorm-epsilon must be positive, got {self.layernorm_epsilon}")
        _require(self.init_method_std > 0, f"--init-method-std must be positive, got {self.init_method_std}")
        _require(self.relative_attention_num_buckets >= 1 and self.relative_attention_max_distance >= 1,
                 "--relative-attention-num-buckets and --relative-attention-max-distance must be >= 1")
        if self.kv_channels is None:
            _require(self.hidden_size % self.num_attention_heads == 0,
                     f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                     f"({self.num_attention_heads}), or give --kv-channels explicitly")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = max(self.seq_length, self.decoder_seq_length or 0)
        if self.model_type == "t5" and self.position_embedding_type == "learned_absolute":
            _require(self.max_position_embeddings >= self.decoder_seq_length,
                     f"--max-position-embeddings ({self.max_position_embeddings}) must be >= "
                     f"--decoder-seq-length ({self.decoder_seq_length}) with learned positions")
        _require(self.max_position_embeddings >= self.seq_length,
                 f"--max-position-embeddings ({self.max_position_embeddings}) must be >= "
                 f"--seq-length ({self.seq_length})")
        _require(0.0 <= self.hidden_dropout < 1.0, f"--hidden-dropout must be in [0, 1), got {self.hidden_dropout}")
        _require(0.0 <= self.attention_dropout < 1.0,
                 f"--attention-dropout must be in [0, 1), got {self.attention_dropout}")
        _require(self.make_vocab_size_divisible_by > 0,
                 f"--make-vocab-size-divisible-by must be positive, got {self.make_vocab_size_divisible_by}")
        _require(self.normalization in ("LayerNorm", "RMSNorm"),
                 f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        _require(self.activation_func in ("gelu", "gelu-erf", "relu"),
                 f"--activation-func must be gelu, gelu-erf or relu, got {self.activation_func!r}")
        _require(not self.swiglu or (self.activation_func == "gelu" and not self.gated_linear_unit),
                 "--swiglu is the gated SiLU MLP; it conflicts with --activation-func relu and --gated-linear-unit "
                 "(use --gated-linear-unit alone for a gated GeLU/ReLU MLP)")
        _require(self.position_embedding_type in ("learned_absolute", "relative", "rope"),
                 f"--position-embedding-type must be learned_absolute, relative or rope, "
                 f"got {self.position_embedding_type!r}")
        if self.position_embedding_type == "rope":
            _require(self.model_type == "gpt",
                     "--position-embedding-type rope is implemented for GPT; T5 uses relative")
            _require(0.0 < self.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
            rot = int(self.kv_channels * self.rotary_percent)
            _require(rot >= 2 and rot % 2 == 0,
                     f"--rotary-percent {self.rotary_percent} x head size {self.kv_channels} = {rot} "
                     "rotary dimensions; it must be a positive even number")
            _require(self.rotary_base > 0, f"--rotary-base must be positive, got {self.rotary_base}")
        if self.num_query_groups is not None:
            _require(self.num_query_groups >= 1 and self.num_attention_heads % self.num_query_groups == 0,
                     f"--num-query-groups ({self.num_query_groups}) must divide --num-attention-heads "
                     f"({self.num_attention_heads})")

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP has a gate projection beside the up projection (SwiGLU or GLU)."""
        return self.swiglu or self.gated_linear_unit

    @property
    def projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def padded_vocab_size(self, tp_size: int) -> int:
        """Megatron's rule: pad to a multiple of make_vocab_size_divisible_by x TP."""
        _require(self.vocab_size is not None and self.vocab_size > 0,
                 "the vocabulary size is unknown: give --vocab-size (with --mock-data or NullTokenizer) "
                 "or a tokenizer")
        multiple = self.make_vocab_size_divisible_by * tp_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)


@dataclass
class ParallelConfig:
    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    pipeline_model_parallel_split_rank: Optional[int] = None
    pipeline_schedule: str = "1f1b"  # 1f1b | gpipe (interleaved is implied by virtual stages)
    pipeline_stage_layers: Optional[List[int]] = None  # explicit uneven split
    distributed_backend: Optional[str] = None  # nccl on CUDA, gloo otherwise
    distributed_timeout_minutes: float = 10.0
    validate_plans_iters: int = 2  # validate the first N iterations' plans (0 = never, -1 = always)
    # Per-stage (TP, DP) sizes (--aceso-config with heterogeneous stages); None = uniform. Then
    # tensor_model_parallel_size is the largest stage TP and --micro-batch-size is the pipeline
    # micro-batch, split over each stage's DP ranks (megatron/planner/passes/layout.py).
    stage_parallel: Optional[List[List[int]]] = None
    # Context parallelism (megatron/core/context_parallel.py): ranks of a CP group hold two
    # chunks of every sequence and exchange keys/values (all_gather or a p2p ring).
    # cp_keyed_dropout runs the CP path at CP 1 too, so its dropout masks (keyed by absolute
    # token position) equal those of any CP size.
    context_parallel_size: int = 1
    cp_comm_type: str = "all_gather"
    cp_keyed_dropout: bool = False

    @property
    def context_parallel(self) -> bool:
        return self.context_parallel_size > 1 or self.cp_keyed_dropout

    def __post_init__(self):
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        _require(tp >= 1, f"--tensor-model-parallel-size must be >= 1, got {tp}")
        _require(pp >= 1, f"--pipeline-model-parallel-size must be >= 1, got {pp}")
        if self.stage_parallel is not None:
            self._check_stage_parallel()
        _require(self.stage_parallel is not None or self.world_size % (tp * pp) == 0,
                 f"world size ({self.world_size}) is not divisible by --tensor-model-parallel-size ({tp}) x "
                 f"--pipeline-model-parallel-size ({pp}) = {tp * pp}")
        check_cp_parallel(self)
        _require(self.distributed_backend in (None, "gloo", "nccl"),
                 f"--distributed-backend must be nccl or gloo, got {self.distributed_backend!r}")
        _require(self.distributed_timeout_minutes > 0,
                 f"--distributed-timeout-minutes must be positive, got {self.distributed_timeout_minutes}")
        _require(self.world_size >= 1, f"world size must be >= 1, got {self.world_size}")
        if self.num_layers_per_virtual_pipeline_stage is not None:
            _require(self.num_layers_per_virtual_pipeline_stage >= 1, "--num-layers-per-virtual-pipeline-stage "
                     f"must be >= 1, got {self.num_layers_per_virtual_pipeline_stage}")
        if self.pipeline_model_parallel_split_rank is not None:
            _require(0 <= self.pipeline_model_parallel_split_rank <= pp, "--pipeline-model-parallel-split-rank "
                     f"must be in [0, {pp}], got {self.pipeline_model_parallel_split_rank}")
        check_parallel_schedule(self)

    def _check_stage_parallel(self) -> None:
        sp = self.stage_parallel
        desc = ", ".join(f"stage {s}: TP {t} x DP {d}" for s, (t, d) in enumerate(sp))
        _require(len(sp) == self.pipeline_model_parallel_size,
                 f"{len(sp)} per-stage TP x DP sizes ({desc}) for --pipeline-model-parallel-size "
                 f"{self.pipeline_model_parallel_size}")
        _require(all(t >= 1 and d >= 1 for t, d in sp), f"per-stage TP and DP sizes must be >= 1 ({desc})")
        total = sum(t * d for t, d in sp)
        _require(total == self.world_size, f"the stages need {total} ranks ({desc}) but the job has {self.world_size}")
        _require(self.num_layers_per_virtual_pipeline_stage is None,
                 "stages with their own TP/DP sizes run one stage per pipeline rank: drop "
                 "--num-layers-per-virtual-pipeline-stage")
        self.tensor_model_parallel_size = max(t for t, _ in sp)

    @property
    def data_parallel_size(self) -> int:
        if self.stage_parallel is not None:
            return 1  # each stage splits the pipeline micro-batch over its own DP ranks
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                                   * self.context_parallel_size)


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    train_iters: int = 10
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_decay_iters: Optional[int] = None
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None  # static loss scale for fp16; dynamic when None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    recompute_granularity: Optional[str] = None  # None | "full" | "selective"
    recompute_method: Optional[str] = None  # "uniform" | "block" (full only)
    recompute_num_layers: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 10
    exit_interval: Optional[int] = None
    max_consecutive_skipped_iters: int = 100  # 0 = never stop
    use_distributed_optimizer: bool = False  # Adam state sharded over data parallelism (ZeRO-1)
    overlap_grad_reduce: bool = False  # DP all-reduce of a bucket starts during the backward passes
    overlap_param_gather: bool = False  # distributed optimizer: next forward waits only for its buckets
    ddp_bucket_size: Optional[int] = None  # elements per DP communication bucket (None: 40M)
    recompute_layers: Optional[List[str]] = None  # per layer none|selective|full|op+op (--aceso-config)

    def __post_init__(self):
        _require(self.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        _require(self.train_iters >= 0, f"--train-iters must be >= 0, got {self.train_iters}")
        _require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are mutually exclusive; pick one")
        _require(self.lr_decay_style in ("constant", "linear", "cosine", "inverse-square-root"),
                 f"--lr-decay-style must be constant, linear, cosine or inverse-square-root, "
                 f"got {self.lr_decay_style!r}")
        _require(self.lr >= 0 and self.min_lr >= 0, f"--lr ({self.lr}) and --min-lr ({self.min_lr}) must be >= 0")
        _require(self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        _require(not (self.lr_warmup_fraction is not None and self.lr_warmup_iters),
                 "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive; pick one")
        if self.lr_warmup_fraction is not None:
            _require(0.0 <= self.lr_warmup_fraction <= 1.0,
                     f"--lr-warmup-fraction must be in [0, 1], got {self.lr_warmup_fraction}")
        if self.lr_decay_iters is None:
            self.lr_decay_iters = self.train_iters
        _require(self.clip_grad >= 0, f"--clip-grad must be >= 0, got {self.clip_grad}")
        _require(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
                 f"--adam-beta1/--adam-beta2 must be in [0, 1), got {self.adam_beta1}/{self.adam_beta2}")
        _require(self.recompute_granularity in (None, "full", "selective"),
                 f"--recompute-granularity must be full or selective, got {self.recompute_granularity!r}")
        _require(self.recompute_method in (None, "uniform", "block"),
                 f"--recompute-method must be uniform or block, got {self.recompute_method!r}")
        if self.recompute_method is not None:
            _require(self.recompute_granularity == "full",
                     "--recompute-method applies only with --recompute-granularity full")
        _require(self.eval_interval > 0, f"--eval-interval must be positive, got {self.eval_interval}")
        _require(self.eval_iters >= 0, f"--eval-iters must be >= 0, got {self.eval_iters}")
        _require(self.global_batch_size is None or self.global_batch_size >= 1,
                 f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        _require(self.lr_decay_iters >= 0, f"--lr-decay-iters must be >= 0, got {self.lr_decay_iters}")
        _require(self.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        _require(self.exit_interval is None or self.exit_interval > 0,
                 f"--exit-interval must be positive, got {self.exit_interval}")
        _require(self.max_consecutive_skipped_iters >= 0,
                 f"--max-consecutive-skipped-iters must be >= 0, got {self.max_consecutive_skipped_iters}")
        _require(self.loss_scale is None or self.loss_scale > 0,
                 f"--loss-scale must be positive, got {self.loss_scale}")
        _require(self.initial_loss_scale > 0 and self.min_loss_scale > 0,
                 f"--initial-loss-scale ({self.initial_loss_scale}) and --min-loss-scale ({self.min_loss_scale}) "
                 "must be positive")
        _require(self.loss_scale_window >= 1, f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")
        _require(self.hysteresis >= 1, f"--hysteresis must be >= 1, got {self.hysteresis}")
        _require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _require(self.adam_eps > 0, f"--adam-eps must be positive, got {self.adam_eps}")
        _require(self.ddp_bucket_size is None or self.ddp_bucket_size >= 1,
                 f"--ddp-bucket-size must be >= 1 elements, got {self.ddp_bucket_size}")
        _require(not self.overlap_param_gather or self.use_distributed_optimizer,
                 "--overlap-param-gather overlaps the distributed optimizer's parameter all-gather: add "
                 "--use-distributed-optimizer or drop it")
        if self.recompute_layers is not None:
            from megatron.core.recompute import decode  # pure Python: the one definition of a setting
            _require(self.recompute_granularity is None,
                     f"per-layer recompute (--aceso-config) excludes --recompute-granularity, got "
                     f"{self.recompute_granularity}")
            for m in self.recompute_layers:
                try:
                    decode(m)
                except ValueError as e:
                    _require(False, f"--aceso-config: {e}")
        if self.recompute_num_layers is not None:
            _require(self.recompute_num_layers >= 1,
                     f"--recompute-num-layers must be >= 1, got {self.recompute_num_layers}")

    @property
    def recompute_level(self) -> str:
        return self.recompute_granularity or "none"

    @property
    def params_dtype_name(self) -> str:
        """What activations cross the pipeline in: the 16-bit type under --fp16/--bf16, else the
        parameters' dtype, torch's default: float32, or float64 where a caller set it (the parity
        tests do, so that no summation order can reach their bounds: tests/parity_utils.py)."""
        if self.bf16 or self.fp16:
            return "bfloat16" if self.bf16 else "float16"
        import torch  # only here: the rest of the configuration stays importable without torch
        return "float64" if torch.get_default_dtype() == torch.float64 else "float32"


@dataclass
class DataConfig:
    mock_data: bool = False
    data_path: Optional[List[str]] = None
    targets_data_path: Optional[List[str]] = None
    split: str = "969,30,1"
    data_cache_path: Optional[str] = None
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_extra_ids: int = 0
    num_workers: int = 0
    # Variable-length / DynaPipe batching.
    tokens_per_global_batch: Optional[int] = None
    pack_dataset: bool = False
    dynapipe: bool = False
    dynapipe_cost_model: Optional[str] = None
    dynapipe_memory_limit: float = 36000.0  # MB per device, for the planner
    dynapipe_planner_workers: int = 2
    dynapipe_lookahead: int = 4
    dynapipe_trace_dir: Optional[str] = None  # simulated + measured Chrome traces of the first trace_iters iterations
    dynapipe_trace_iters: int = 4
    dynapipe_packed_rows: bool = False  # DynaPipe may plan micro-batches of packed rows (GPT)
    dynapipe_cp_sizes: tuple = ()  # CP size per micro-batch (--dynapipe-cp-sizes); () = the static size

    def __post_init__(self):
        if not self.mock_data:
            _require(bool(self.data_path),
                     "no training data: give --data-path PREFIX, or --mock-data for generated tokens")
        if self.targets_data_path:
            _require(self.tokens_per_global_batch is not None and self.tokens_per_global_batch > 0,
                     "multi-task data (--targets-data-path) is batched by tokens: give --tokens-per-global-batch N")
        if self.dynapipe:
            _require(bool(self.targets_data_path),
                     "--dynapipe trains on multi-task data: give --data-path INPUTS --targets-data-path TARGETS")
            _require(self.dynapipe_cost_model is not None, "--dynapipe needs --dynapipe-cost-model FILE "
                     "(see cost_models/ and experiment_scripts/gen_cost_model.sh)")
            _require(not self.pack_dataset, "--pack-dataset fixes the micro-batches (rows of --micro-batch-size) that "
                     "--dynapipe plans per batch; DynaPipe packs rows itself with --dynapipe-packed-rows")
            _require(self.dynapipe_memory_limit > 0,
                     f"--dynapipe-memory-limit must be positive, got {self.dynapipe_memory_limit}")
            _require(self.dynapipe_planner_workers >= 0 and self.dynapipe_lookahead >= 1,
                     "--dynapipe-planner-workers must be >= 0 and --dynapipe-lookahead >= 1")
            _require(self.dynapipe_trace_iters >= 0,
                     f"--dynapipe-trace-iters must be >= 0, got {self.dynapipe_trace_iters}")
        _require(not self.pack_dataset or bool(self.targets_data_path),
                 "--pack-dataset packs multi-task (inputs, targets) samples into rows: give --targets-data-path "
                 "(pretraining data is already read as full --seq-length sequences)")
        _require(not self.dynapipe_packed_rows or self.dynapipe,
                 "--dynapipe-packed-rows is a DynaPipe planner option: it needs --dynapipe")
        _require(self.dynapipe_trace_dir is None or self.dynapipe,
                 "--dynapipe-trace-dir writes the DynaPipe planner's simulated timelines: it needs --dynapipe")
        _require(self.vocab_extra_ids >= 0, f"--vocab-extra-ids must be >= 0, got {self.vocab_extra_ids}")
        _require(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}")
        _require(self.tokens_per_global_batch is None or self.tokens_per_global_batch > 0,
                 f"--tokens-per-global-batch must be positive, got {self.tokens_per_global_batch}")


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    ckpt_format: str = "torch"
    async_save: bool = False  # --async-save: write on a thread, name at a later step (torch format)

    def __post_init__(self):
        _require(self.ckpt_format in ("torch", "torch_dist", "megatron-legacy"),
                 f"--ckpt-format must be torch, torch_dist or megatron-legacy, got {self.ckpt_format!r}")
        if self.save_interval is not None:
            _require(self.save_interval > 0, f"--save-interval must be positive, got {self.save_interval}")
            _require(self.save is not None, "--save-interval needs --save DIR")


@dataclass
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    pipeline_timeline: int = 0  # --pipeline-timeline ITER: measured and planned timelines of that iteration
    profile: bool = False  # --profile: torch.profiler Chrome trace of iterations [start, end) on profile_ranks
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple = (0,)
    profile_dir: Optional[str] = None

    def __post_init__(self):
        _require(self.log_interval > 0, f"--log-interval must be positive, got {self.log_interval}")
        if self.profile:
            _require(1 <= self.profile_step_start < self.profile_step_end,
                     f"--profile-step-start ({self.profile_step_start}) must be >= 1 and below --profile-step-end "
                     f"({self.profile_step_end})")
            _require(bool(self.profile_dir or self.tensorboard_dir),
                     "--profile writes its trace into --profile-dir or --tensorboard-dir: give one of them")


@dataclass
class MegatronConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(mock_data=True))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    terapipe: TeraPipeConfig = field(default_factory=TeraPipeConfig)

    def __post_init__(self):
        m, p, t = self.model, self.parallel, self.training
        self._check_compression()
        self._check_sequence_parallel()
        if p.context_parallel or self.data.dynapipe_cp_sizes:
            try:
                check_context_parallel_config(self)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        dp = p.data_parallel_size
        tp = p.tensor_model_parallel_size
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
                 f"--global-batch-size ({t.global_batch_size}) is not divisible by --micro-batch-size "
                 f"({t.micro_batch_size}) x data-parallel size ({dp}) = {t.micro_batch_size * dp}")
        if p.stage_parallel is not None:
            self._check_stage_parallel_model()
        _require(m.num_attention_heads % tp == 0,
                 f"--num-attention-heads ({m.num_attention_heads}) is not divisible by "
                 f"--tensor-model-parallel-size ({tp})")
        _require(m.query_groups % tp == 0, f"--num-query-groups ({m.query_groups}) is not divisible by "
                 f"--tensor-model-parallel-size ({tp})")
        _require(m.ffn_hidden_size % tp == 0,
                 f"--ffn-hidden-size ({m.ffn_hidden_size}) is not divisible by --tensor-model-parallel-size ({tp})")
        if p.num_layers_per_virtual_pipeline_stage is not None:
            _require(p.pipeline_model_parallel_size > 1,
                     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            per_rank = m.num_layers // p.pipeline_model_parallel_size
            _require(m.num_layers % p.pipeline_model_parallel_size == 0
                     and per_rank % p.num_layers_per_virtual_pipeline_stage == 0,
                     f"--num-layers ({m.num_layers}) / --pipeline-model-parallel-size "
                     f"({p.pipeline_model_parallel_size}) must be divisible by "
                     f"--num-layers-per-virtual-pipeline-stage ({p.num_layers_per_virtual_pipeline_stage})")
        if (p.pipeline_stage_layers is None and p.num_layers_per_virtual_pipeline_stage is None
                and m.model_type == "gpt"):
            _require(m.num_layers % p.pipeline_model_parallel_size == 0,
                     f"--num-layers ({m.num_layers}) is not divisible by --pipeline-model-parallel-size "
                     f"({p.pipeline_model_parallel_size}); give an explicit split with --pipeline-stage-layers")
        if p.pipeline_stage_layers is not None:
            _require(len(p.pipeline_stage_layers) == p.pipeline_model_parallel_size
                     and sum(p.pipeline_stage_layers) == m.num_layers
                     and all(n >= 1 for n in p.pipeline_stage_layers),
                     f"--pipeline-stage-layers {','.join(map(str, p.pipeline_stage_layers))} must list "
                     f"{p.pipeline_model_parallel_size} positive counts summing to --num-layers ({m.num_layers})")

        check_moe_parallel(self)
        if self.data.dynapipe:
            lengths = (m.seq_length,) if m.model_type == "gpt" else (m.encoder_seq_length, m.decoder_seq_length)
            _require(all(n % 8 == 0 for n in lengths),
                     f"--dynapipe pads micro-batches to multiples of 8 tokens: sequence lengths {lengths} must be "
                     "multiples of 8 (--seq-length / --encoder-seq-length / --decoder-seq-length)")
            _require(p.num_layers_per_virtual_pipeline_stage is None or m.model_type == "gpt",
                     "--dynapipe with T5 gives the encoder and the decoder whole pipeline ranks (split at "
                     "--pipeline-model-parallel-split-rank), so no rank can hold round-robin chunks of both: drop "
                     "--num-layers-per-virtual-pipeline-stage")
            _require(p.num_layers_per_virtual_pipeline_stage is None or not self.data.dynapipe_packed_rows,
                     "--dynapipe-packed-rows searches one-stage-per-rank schedules; with "
                     "--num-layers-per-virtual-pipeline-stage DynaPipe plans padded micro-batches: drop one")
            if m.model_type == "t5" and p.pipeline_model_parallel_size > 1 and p.pipeline_stage_layers is None:
                _require(p.pipeline_model_parallel_split_rank == p.pipeline_model_parallel_size // 2,
                         "--dynapipe with T5 puts the encoder on the first half of the pipeline: set "
                         f"--pipeline-model-parallel-split-rank {p.pipeline_model_parallel_size // 2}")

        check_ckpt_format(self)  # what --ckpt-format can write for this layout
        check_schedule_config(self)
        if self.terapipe.enabled:
            try:
                check_terapipe_config(self)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def _check_stage_parallel_model(self) -> None:
        """What stages with their own TP/DP sizes need from the rest of the configuration."""
        m, t, sp = self.model, self.training, self.parallel.stage_parallel
        for s, (tp, dp) in enumerate(sp):
            for what, n, flag in (("attention heads", m.num_attention_heads, "--num-attention-heads"),
                                  ("query groups", m.query_groups, "--num-query-groups"),
                                  ("FFN columns", m.ffn_hidden_size, "--ffn-hidden-size")):
                _require(n % tp == 0, f"stage {s} runs TP {tp}, which does not divide its {what} ({flag} {n})")
            _require(t.micro_batch_size % dp == 0,
                     f"stage {s} splits each micro-batch over DP {dp}: --micro-batch-size ({t.micro_batch_size}, the "
                     f"pipeline micro-batch) must be a multiple of it")
        _require(not self.data.dynapipe or not any(r != "none" for r in t.recompute_layers or ()),
                 "--dynapipe chooses each iteration's recompute level itself: clear the --aceso-config recompute_ops "
                 "flags or drop --dynapipe")

    def _check_sequence_parallel(self) -> None:
        m, p = self.model, self.parallel
        if not m.sequence_parallel:
            return
        tp = p.tensor_model_parallel_size
        _require(m.model_type == "gpt", "--sequence-parallel is implemented for GPT; drop it for T5")
        for tp in sorted({t for t, _ in p.stage_parallel}) if p.stage_parallel else [tp]:  # each stage's own TP
            if tp > 1 and m.seq_length is not None:
                _require(m.seq_length % tp == 0, f"--sequence-parallel splits the sequence over TP ranks: --seq-length "
                         f"({m.seq_length}) must be a multiple of --tensor-model-parallel-size ({tp})")

    def _check_compression(self) -> None:
        c, p = self.compression, self.parallel
        pp, dp = p.pipeline_model_parallel_size, p.data_parallel_size
        if c.inter_grad_comp:
            _require(pp > 1, "--inter-grad-comp compresses the gradients sent between pipeline stages: it needs "
                     "--pipeline-model-parallel-size > 1")
        if c.emb_comm_opt:
            _require(pp > 1, "--emb-comm-opt fuses the first/last-stage embedding sync: it needs "
                     "--pipeline-model-parallel-size > 1")
            _require(self.model.model_type == "gpt", "--emb-comm-opt is implemented for GPT only; drop it for T5")
            _require(not self.model.untie_embeddings_and_output_weights,
                     "--emb-comm-opt syncs tied embeddings: drop --untie-embeddings-and-output-weights or the flag")
        _require(not c.emb_grad_comp or pp > 1, "--emb-grad-comp compresses the first/last-stage embedding sync: it "
                 "needs --pipeline-model-parallel-size > 1")
        _require(p.pipeline_schedule not in V_SCHEDULES or not (c.emb_comm_opt or c.emb_grad_comp),
                 f"--pipeline-schedule {p.pipeline_schedule} puts the first and the last stage on pipeline rank 0 "
                 "(one tied embedding weight, nothing to sync): drop --emb-comm-opt/--emb-grad-comp")
        if c.mp_grad_comp or c.mp_acti_comp:
            _require(p.tensor_model_parallel_size > 1 and not self.model.sequence_parallel, "--mp-grad-comp/--mp-acti-"
                     "comp compress tensor-parallel all-reduces: they need --tensor-model-parallel-size > 1 and no "
                     "--sequence-parallel (which replaces those all-reduces)")
        if c.grad_comp:
            stage_dp = max(d for _, d in p.stage_parallel) if p.stage_parallel else dp
            _require(stage_dp > 1, "--grad-comp compresses the data-parallel all-reduce: it needs a data-parallel size "
                     "> 1 (more ranks than tensor x pipeline parallel, or a stage with DP > 1 in --aceso-config)")
        if c.selective_grad_comp:
            _require(c.selective_grad_comp_way <= pp,
                     f"--selective-grad-comp-way ({c.selective_grad_comp_way}) must be <= "
                     f"--pipeline-model-parallel-size ({pp})")

    @property
    def num_microbatches(self) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.data_parallel_size)

    def to_dict(self) -> dict:
        return asdict(self)
