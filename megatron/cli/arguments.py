"""Megatron-LM's command-line flags -> `MegatronConfig`.

Only entry points call this. An inconsistent combination of flags exits with status 2 and one
line naming the flags, before any process group is created.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from megatron.cli.arguments_megatron import add_megatron_args, apply_megatron_args, extras_from_args, print_notes
from megatron.cli.arguments_moe import add_moe_args, moe_config
from megatron.cli.parser import HelpFormatter, OneLineParser, first_to_report, int_list, tell_torchrun
from megatron.cli.arguments_systems import (_add_aceso_args, _add_compression_args, _add_dynapipe_args,
                                        _add_fused_kernel_args, _add_profile_args, _add_terapipe_args,
                                        _apply_fused_kernel_args, _terapipe_config)
from megatron.config.core import (CheckpointConfig, CompressionConfig, ConfigError, DataConfig, LoggingConfig,
                             MegatronConfig, ModelConfig, ParallelConfig, TrainingConfig)
from megatron.config.schedules import PIPELINE_SCHEDULES


def build_parser(model_type: str = "gpt") -> argparse.ArgumentParser:
    """The flags, grouped as Megatron-LM groups them, then this project's systems."""
    p = OneLineParser(
        prog=f"pretrain_{model_type}.py", formatter_class=HelpFormatter,
        usage=f"torchrun --nproc-per-node N pretrain_{model_type}.py [options]   (one process: python ...)",
        description=f"Megatron-style {model_type.upper()} pretraining (launch with torchrun).",
    )
    _add_network_size_args(p, model_type)
    _add_regularization_args(p)
    _add_training_args(p)
    _add_initialization_args(p)
    _add_learning_rate_args(p)
    _add_checkpointing_args(p)
    _add_mixed_precision_args(p)
    _add_distributed_args(p)
    _add_validation_args(p)
    _add_data_args(p, model_type)
    _add_logging_args(p)
    _add_dynapipe_args(p)
    _add_terapipe_args(p)
    _add_aceso_args(p)
    _add_compression_args(p)
    _add_fused_kernel_args(p)
    _add_legacy_args(p)
    _add_profile_args(p)
    add_megatron_args(p)
    add_moe_args(p)
    return p


def _add_network_size_args(p, model_type: str) -> None:
    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None,
                   help="transformer layers" + (" per stack (encoder and decoder)" if model_type == "t5" else ""))
    g.add_argument("--hidden-size", type=int, default=None, help="transformer hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None, help="attention heads per layer")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default: 4 x --hidden-size)")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="channels per attention head (default: --hidden-size / --num-attention-heads)")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="learned position embeddings (default: the sequence length)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP size")
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5, help="epsilon of LayerNorm / RMSNorm")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output layer instead of the input embedding's transpose")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"], help="normalization layer")
    g.add_argument("--swiglu", action="store_true", help="gated SiLU MLP (Llama-style)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases in the attention and MLP linears")
    g.add_argument("--position-embedding-type", default=None, choices=["learned_absolute", "relative", "rope"],
                   help="position encoding (default: learned_absolute for GPT, relative for T5)")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="fraction of each head's channels RoPE rotates")
    g.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base period")
    g.add_argument("--group-query-attention", action="store_true", help="grouped-query attention (--num-query-groups)")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value head groups for --group-query-attention")
    if model_type == "t5":
        g.add_argument("--encoder-num-layers", type=int, default=None, help="encoder layers (default: --num-layers)")
        g.add_argument("--decoder-num-layers", type=int, default=None, help="decoder layers (default: encoder's)")
        g.add_argument("--relative-attention-num-buckets", type=int, default=32, help="T5 relative position buckets")
        g.add_argument("--relative-attention-max-distance", type=int, default=128,
                       help="T5 relative positions beyond this share the last bucket")
    g.add_argument("--activation-func", default="gelu", choices=["gelu", "gelu-erf", "relu"],
                   help="MLP activation without --swiglu: gelu (tanh approximation, as HF GPT-2 and Megatron's "
                        "fused bias-GeLU), gelu-erf (exact, as Megatron without --bias-gelu-fusion) or relu "
                        "(the original T5's)")
    g.add_argument("--gated-linear-unit", action="store_true",
                   help="gated MLP act(gate(x)) * up(x) with --activation-func (T5 v1.1 / Flan-T5 gated GeLU)")


def _add_regularization_args(p) -> None:
    g = p.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="dropout on the attention probabilities")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="dropout after attention and MLP")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (not on biases and norms)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")


def _add_training_args(p) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch per data-parallel rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration over all DP ranks (default: micro-batch x DP)")
    g.add_argument("--train-iters", type=int, default=None,
                   help="iterations to train for (default: 10; or --train-samples)")
    g.add_argument("--exit-interval", type=int, default=None, help="stop when the iteration is a multiple of this")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="activation recomputation: whole layers (full) or attention core only (selective)")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="with full: recompute every --recompute-num-layers (uniform) or the first N per stage (block)")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="layers per recompute unit / per stage")
    g.add_argument("--max-consecutive-skipped-iters", type=int, default=100,
                   help="stop with an error after this many iterations in a row are skipped for inf/nan "
                        "gradients (0 = never)")


def _add_initialization_args(p) -> None:
    g = p.add_argument_group("initialization")
    g.add_argument("--seed", type=int, default=1234, help="random seed (data order, init, dropout)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the normal weight initialisation")


def _add_learning_rate_args(p) -> None:
    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument("--lr-decay-style", default="cosine", help="constant, linear, cosine or inverse-square-root")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="iterations to decay over (default: --train-iters)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up iterations")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")


def _add_checkpointing_args(p) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="folder to save checkpoints to")
    g.add_argument("--load", default=None, help="folder to resume from (its latest checkpoint that verifies)")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer state from --load")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the random-number state from --load")
    g.add_argument("--finetune", action="store_true",
                   help="load the weights only and start at iteration 0 (no optimizer, RNG or iteration)")
    g.add_argument("--ckpt-format", choices=("torch", "torch_dist", "megatron-legacy"), default="torch",
                   help="torch: one model_optim_rng.pt per TP/PP rank (Megatron's layout); torch_dist: "
                        "torch.distributed.checkpoint shards that load at any TP/PP/DP layout; megatron-legacy: "
                        "the files Megatron-LM's legacy code writes, for Megatron-LM's --load (GPT; weights, "
                        "counters, schedule, RNG; no optimizer state)")


def _add_mixed_precision_args(p) -> None:
    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true", help="fp16 parameters and compute, fp32 master weights")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and compute, fp32 master weights")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16; default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32, help="first dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="lowest dynamic loss scale")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="iterations without overflow before the scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the scale halves")


def _add_distributed_args(p) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks per layer")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk: interleaved 1F1B with several chunks per rank")
    g.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None,
                   help="T5: the first decoder pipeline rank")
    g.add_argument("--pipeline-schedule", default="1f1b", choices=list(PIPELINE_SCHEDULES),
                   help="pipeline schedule; zb-h1 (1F1B's peak memory), zb-h2 (more memory), zb-v and dualpipev (two "
                        "stages per rank in a V; dualpipev keeps one more) split each backward into input- and "
                        "weight-gradient passes (zero bubble; docs/zero_bubble.md)")
    g.add_argument("--pipeline-stage-layers", type=int_list, default=None,
                   help="explicit per-stage layer counts, e.g. 3,5 (uneven pipeline stages; T5: counts of the "
                        "encoder layers followed by the decoder layers, the split rank follows from them)")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="collective backend (default: nccl with CUDA, else gloo)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="collective timeout; the stuck rank is named when it expires")
    g.add_argument("--validate-plans-iters", type=int, default=2,
                   help="validate the pipeline plans of the first N iterations (-1: always, 0: never)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context-parallel ranks: each holds two chunks of every sequence (causal load balancing) "
                        "and attention exchanges keys/values over the group")
    g.add_argument("--cp-comm-type", default="all_gather", choices=["all_gather", "p2p"],
                   help="how context-parallel attention exchanges keys/values: all-gather, or a p2p ring with "
                        "online-softmax merging")
    g.add_argument("--cp-keyed-dropout", action="store_true",
                   help="run the context-parallel path at CP 1 too: dropout keyed by token position, the masks "
                        "every --context-parallel-size draws (to compare runs across CP sizes)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms, dropout and residuals along the sequence in TP regions (needs TP > 1)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each bucket's data-parallel all-reduce during the backward passes, as soon as its "
                        "gradients are final (from the plan)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per data-parallel communication bucket (default 40M)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard Adam state over the data-parallel group (gradients reduce-scattered, "
                        "parameters all-gathered)")


def _add_validation_args(p) -> None:
    g = p.add_argument_group("validation")
    g.add_argument("--eval-interval", type=int, default=1000, help="validate every N iterations")
    g.add_argument("--eval-iters", type=int, default=10, help="validation iterations per evaluation")


def _add_data_args(p, model_type: str) -> None:
    g = p.add_argument_group("data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefix of a .bin/.idx pair (no suffix), or 'W1 P1 W2 P2 ...' to blend")
    g.add_argument("--mock-data", action="store_true",
                   help="generated tokens: the same samples in the same order for any parallel layout")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions of --data-path")
    g.add_argument("--data-cache-path", default=None, help="folder for the sample-index caches")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per sample")
    if model_type == "t5":
        g.add_argument("--encoder-seq-length", type=int, default=None, help="encoder tokens (default: --seq-length)")
        g.add_argument("--decoder-seq-length", type=int, default=None, help="decoder tokens (default: 128)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size for --mock-data or NullTokenizer")
    g.add_argument("--tokenizer-type", default=None, help="GPT2BPETokenizer, GPTSentencePieceTokenizer, ... (the "
                   "one tools/preprocess_data.py used)")
    g.add_argument("--vocab-file", default=None, help="vocabulary file (GPT2BPETokenizer, BertWordPiece*)")
    g.add_argument("--merge-file", default=None, help="BPE merges file (GPT2BPETokenizer)")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece model / Hugging Face tokenizer file")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="T5 sentinel tokens <extra_id_i> to add")
    g.add_argument("--num-workers", type=int, default=0, help="dataloader worker processes")
    g.add_argument("--targets-data-path", nargs="*", default=None,
                   help="multi-task: prefix of the targets aligned with --data-path's inputs")
    g.add_argument("--tokens-per-global-batch", type=int, default=None,
                   help="multi-task: token budget of each global batch (instead of --global-batch-size)")
    g.add_argument("--pack-dataset", action="store_true",
                   help="multi-task baseline: pack samples into rows of --seq-length (block-diagonal mask)")


def _add_logging_args(p) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="print the training metrics every N iterations")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")


def _add_legacy_args(p: argparse.ArgumentParser) -> None:
    """Older Megatron-LM spellings that scripts in the wild (the DynaPipe fork's among them) still pass.

    Each maps to today's meaning, is accepted where it changes nothing here, or is rejected in
    `_apply_legacy_args` with a pointer to the current flag."""
    g = p.add_argument_group("older Megatron spellings (accepted for compatibility)")
    g.add_argument("--data-impl", "--dataset-impl", dest="data_impl", default=None,
                   help="only mmap .bin/.idx exists here; 'mmap' and 'infer' are accepted, others rejected")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="old name of --recompute-granularity full --recompute-method uniform")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's short form of --recompute-granularity selective")
    g.add_argument("--DDP-impl", dest="ddp_impl", default=None, choices=["local", "torch"],
                   help="accepted; gradients are always reduced by our own (local-style) data-parallel code")
    for name in ("masked-softmax", "bias-gelu", "bias-dropout"):
        if not any(f"--no-{name}-fusion" in a.option_strings for a in p._actions):
            g.add_argument(f"--no-{name}-fusion", dest=f"{name.replace('-', '_')}_fusion", action="store_false",
                           help="turn the fused kernel off (the eager path is used where no fused kernel is built)")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="accepted, no effect: token-budget global batches already take samples in data order")


def _apply_legacy_args(args: argparse.Namespace) -> None:
    if getattr(args, "data_impl", None) not in (None, "mmap", "infer"):
        raise ConfigError(f"--data-impl {args.data_impl}: only Megatron's mmap .bin/.idx format is supported; "
                          "re-run tools/preprocess_data.py (it writes mmap) and drop the flag")
    if getattr(args, "checkpoint_activations", False):
        if args.recompute_granularity not in (None, "full"):
            raise ConfigError("--checkpoint-activations means --recompute-granularity full; it conflicts with "
                              f"--recompute-granularity {args.recompute_granularity}")
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1
    if getattr(args, "recompute_activations", False):
        if args.recompute_granularity not in (None, "selective"):
            raise ConfigError("--recompute-activations means --recompute-granularity selective; it conflicts with "
                              f"--recompute-granularity {args.recompute_granularity}")
        args.recompute_granularity = "selective"


def _query_groups(args) -> Optional[int]:
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ConfigError("--num-query-groups needs --group-query-attention (as in Megatron-LM)")
    if args.group_query_attention and args.num_query_groups is None:
        raise ConfigError("--group-query-attention needs --num-query-groups G")
    return args.num_query_groups if args.group_query_attention else None


def _required(args, names, model_type):
    missing = [n for n in names if getattr(args, n.lstrip("-").replace("-", "_")) is None]
    if missing:
        raise ConfigError(f"missing required flag(s) for pretrain_{model_type}.py: {' '.join(missing)}")


def _check_writable_dir(flag: str, path: Optional[str]) -> None:
    """An output folder that cannot be written fails here, in one line, not mid-run in a traceback."""
    if not path:
        return
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{flag} {path}: {probe} exists and is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {probe} is not writable by this user; choose a folder you can write")


def _check_load_dir(load: Optional[str], save: Optional[str]) -> None:
    """A --load folder that does not exist is a typo, unless it is also --save (resume or start)."""
    from megatron.checkpointing.hints import missing_load_dir_message
    msg = missing_load_dir_message(load, save)
    if msg:
        raise ConfigError(msg)


def _check_cost_model_matches(path: str, model: ModelConfig) -> None:
    """A cost model describes one model shape; planning another with it gives meaningless plans."""
    from megatron.planner.cost.cost_model import CostModel, CostModelError
    try:
        saved = CostModel.load(path).model
    except CostModelError as e:
        raise ConfigError(f"--dynapipe-cost-model: {e}") from None
    run = {"kind": model.model_type, "hidden_size": model.hidden_size,
           "num_attention_heads": model.num_attention_heads, "ffn_hidden_size": model.ffn_hidden_size,
           "kv_channels": model.kv_channels, "normalization": model.normalization, "swiglu": model.swiglu,
           "add_bias_linear": model.add_bias_linear, "activation_func": model.activation_func,
           "gated_linear_unit": model.gated_linear_unit, "position_embedding_type": model.position_embedding_type,
           "num_query_groups": model.query_groups}
    diffs = [f"{k} {saved[k]} vs {run[k]}" for k in run if k in saved and saved[k] != run[k]]
    if diffs:
        raise ConfigError(f"--dynapipe-cost-model {path} was profiled for another model ({', '.join(diffs)}: "
                          "cost model vs this run); profile this model (experiment_scripts/gen_cost_model.sh) or "
                          "pass --dynapipe-cost-model-any to plan with it anyway")


def _check_enough_processes(args, model_type: str, world_size: int) -> None:
    """TP x PP larger than the job: say how to launch it (the usual cause is plain `python`)."""
    cp = getattr(args, "context_parallel_size", 1) or 1
    need = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * cp
    if getattr(args, "stage_parallel", None) is not None or need <= world_size or need < 1:
        return
    sizes = (f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}) x "
             f"--pipeline-model-parallel-size ({args.pipeline_model_parallel_size})"
             + (f" x --context-parallel-size ({cp})" if cp > 1 else "") + f" = {need}")
    launch = f"`torchrun --nproc-per-node {need} pretrain_{model_type}.py ...`"
    if "WORLD_SIZE" not in os.environ and world_size == 1:
        raise ConfigError(f"{sizes} processes are needed, but this is one process (plain python): run it with {launch}")
    raise ConfigError(f"world size ({world_size}) is less than {sizes}: launch a multiple of {need} processes, "
                      f"e.g. {launch}")


def config_from_args(args: argparse.Namespace, model_type: str = "gpt",
                     world_size: Optional[int] = None) -> MegatronConfig:
    _apply_legacy_args(args)
    from megatron.cli.flag_checks import check_flags
    defaults = build_parser(model_type)  # a flag left at its default asks for nothing
    check_flags(args, model_type, {k: defaults.get_default(k) for k in ("eval_interval", "eval_iters")})
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    notes = apply_megatron_args(args, world_size)
    if getattr(args, "aceso_config", None):
        from megatron.aceso.runtime import AcesoConfigError, apply_to_args
        parser = build_parser(model_type)
        defaults = {k: parser.get_default(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                       "micro_batch_size", "global_batch_size")}
        try:
            apply_to_args(args, model_type, world_size, defaults)
        except (AcesoConfigError, OSError, KeyError) as e:
            raise ConfigError(str(e)) from None
    if model_type == "t5":
        _required(args, ["--hidden-size", "--num-attention-heads"], model_type)
        if args.encoder_num_layers is None and args.num_layers is None:
            raise ConfigError("missing required flag for pretrain_t5.py: --encoder-num-layers (or --num-layers)")
        enc_layers = args.encoder_num_layers if args.encoder_num_layers is not None else args.num_layers
        dec_layers = args.decoder_num_layers if args.decoder_num_layers is not None else enc_layers
        enc_len = args.encoder_seq_length or args.seq_length
        if enc_len is None:
            raise ConfigError("missing required flag for pretrain_t5.py: --encoder-seq-length (or --seq-length)")
        model = ModelConfig(
            model_type="t5", num_layers=enc_layers + dec_layers, encoder_num_layers=enc_layers,
            decoder_num_layers=dec_layers, encoder_seq_length=enc_len,
            decoder_seq_length=args.decoder_seq_length or 128, seq_length=enc_len,
            hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
            max_position_embeddings=args.max_position_embeddings, vocab_size=args.vocab_size,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
            layernorm_epsilon=args.layernorm_epsilon, init_method_std=args.init_method_std,
            normalization=args.normalization, swiglu=args.swiglu, add_bias_linear=args.add_bias_linear,
            activation_func=args.activation_func, gated_linear_unit=args.gated_linear_unit,
            rotary_percent=args.rotary_percent, rotary_base=args.rotary_base, num_query_groups=_query_groups(args),
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type or "relative",
            sequence_parallel=args.sequence_parallel,
            relative_attention_num_buckets=args.relative_attention_num_buckets,
            relative_attention_max_distance=args.relative_attention_max_distance,
        )
    else:
        _required(args, ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"], model_type)
        model = ModelConfig(
            model_type="gpt", num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
            kv_channels=args.kv_channels, seq_length=args.seq_length,
            max_position_embeddings=args.max_position_embeddings, vocab_size=args.vocab_size,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
            layernorm_epsilon=args.layernorm_epsilon, init_method_std=args.init_method_std,
            normalization=args.normalization, swiglu=args.swiglu, add_bias_linear=args.add_bias_linear,
            activation_func=args.activation_func, gated_linear_unit=args.gated_linear_unit,
            rotary_percent=args.rotary_percent, rotary_base=args.rotary_base, num_query_groups=_query_groups(args),
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type or "learned_absolute",
            sequence_parallel=args.sequence_parallel,
        )
    _apply_fused_kernel_args(args, model)
    model.moe = moe_config(args)
    _check_enough_processes(args, model_type, world_size)
    parallel = ParallelConfig(
        world_size=world_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        pipeline_model_parallel_split_rank=args.pipeline_model_parallel_split_rank,
        pipeline_schedule=args.pipeline_schedule, pipeline_stage_layers=args.pipeline_stage_layers,
        distributed_backend=args.distributed_backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        validate_plans_iters=args.validate_plans_iters,
        stage_parallel=getattr(args, "stage_parallel", None),
        context_parallel_size=args.context_parallel_size, cp_comm_type=args.cp_comm_type,
        cp_keyed_dropout=args.cp_keyed_dropout,
    )
    training = TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
        lr_decay_iters=args.lr_decay_iters, lr_warmup_iters=args.lr_warmup_iters,
        lr_warmup_fraction=args.lr_warmup_fraction, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, seed=args.seed, bf16=args.bf16, fp16=args.fp16,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, exit_interval=args.exit_interval,
        max_consecutive_skipped_iters=args.max_consecutive_skipped_iters,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce, ddp_bucket_size=args.ddp_bucket_size,
        overlap_param_gather=args.overlap_param_gather,
        recompute_layers=getattr(args, "recompute_layers", None),
    )
    data = DataConfig(
        mock_data=args.mock_data, data_path=args.data_path, targets_data_path=args.targets_data_path,
        split=args.split, data_cache_path=args.data_cache_path, tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file, merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
        vocab_extra_ids=args.vocab_extra_ids, num_workers=args.num_workers,
        tokens_per_global_batch=args.tokens_per_global_batch, pack_dataset=args.pack_dataset,
        dynapipe=args.dynapipe, dynapipe_cost_model=args.dynapipe_cost_model,
        dynapipe_memory_limit=args.dynapipe_memory_limit, dynapipe_planner_workers=args.dynapipe_planner_workers,
        dynapipe_lookahead=args.dynapipe_lookahead, dynapipe_trace_dir=args.dynapipe_trace_dir,
        dynapipe_trace_iters=args.dynapipe_trace_iters, dynapipe_packed_rows=args.dynapipe_packed_rows,
        dynapipe_cp_sizes=tuple(args.dynapipe_cp_sizes or ()),
    )
    if args.mock_data and args.vocab_size is None and args.tokenizer_type is None:
        raise ConfigError("--mock-data needs --vocab-size (or a tokenizer) to know the vocabulary")
    if args.data_path and not args.mock_data and args.vocab_size is None and args.tokenizer_type is None:
        # caught here, before torchrun's ranks build anything: the size is needed for the embedding
        raise ConfigError("--data-path needs --tokenizer-type (with the tokenizer's files, e.g. "
                          "GPTSentencePieceTokenizer --tokenizer-model FILE) or --vocab-size: the vocabulary size "
                          "is unknown")
    for flag, d in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir)):
        _check_writable_dir(flag, d)
    _check_load_dir(args.load, args.save)
    checkpoint = CheckpointConfig(save=args.save, load=args.load, save_interval=args.save_interval,
                                  no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
                                  finetune=args.finetune, ckpt_format=args.ckpt_format,
                                  async_save=args.async_save)
    _check_writable_dir("--profile-dir", args.profile_dir)
    logging_cfg = LoggingConfig(log_interval=args.log_interval, tensorboard_dir=args.tensorboard_dir,
                                profile=args.profile, profile_step_start=args.profile_step_start,
                                profile_step_end=args.profile_step_end, profile_ranks=tuple(args.profile_ranks),
                                profile_dir=args.profile_dir, pipeline_timeline=args.pipeline_timeline)
    compression = CompressionConfig(
        inter_grad_comp=args.inter_grad_comp, inter_grad_comp_rank=args.inter_grad_comp_rank,
        inter_grad_comp_epilogue_only=args.inter_grad_comp_epilogue_only,
        use_error_feedback=args.use_error_feedback, emb_comm_opt=args.emb_comm_opt, grad_comp=args.grad_comp,
        grad_comp_rank=args.grad_comp_rank, grad_comp_warm_up=args.grad_comp_warm_up,
        selective_grad_comp=args.selective_grad_comp, selective_grad_comp_way=args.selective_grad_comp_way,
        grad_comp_type=args.grad_comp_type, emb_grad_comp=args.emb_grad_comp,
        emb_grad_comp_rank=args.emb_grad_comp_rank,
        emb_grad_comp_type=args.emb_grad_comp_type, emb_grad_comp_warm_up=args.emb_grad_comp_warm_up,
        emb_use_error_feedback=args.emb_use_error_feedback, log_compression_stats=args.log_compression_stats,
        lep_carry_across_iterations=args.lep_carry_across_iterations, mp_grad_comp=args.mp_grad_comp,
        mp_grad_comp_rank=args.mp_grad_comp_rank, mp_acti_comp=args.mp_acti_comp,
        mp_acti_comp_rank=args.mp_acti_comp_rank)
    cfg = MegatronConfig(model=model, parallel=parallel, training=training, data=data,
                         checkpoint=checkpoint, logging=logging_cfg, compression=compression,
                         terapipe=_terapipe_config(args))
    if args.dynapipe and args.dynapipe_cost_model and not args.dynapipe_cost_model_any:
        _check_cost_model_matches(args.dynapipe_cost_model, cfg.model)
    if cfg.terapipe.enabled and cfg.terapipe.cost_model and os.path.isfile(cfg.terapipe.cost_model):
        # (a missing file is named by megatron/cli/startup_checks.py, with the other input files)
        from megatron.planner.terapipe.latency import SliceLatencyModel
        try:  # a missing, malformed or unsound latency model is one line before any process group
            SliceLatencyModel.load(cfg.terapipe.cost_model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    cfg.extras = extras_from_args(args)
    print_notes(notes)
    return cfg


def parse_args(argv: Optional[Sequence[str]] = None, model_type: str = "gpt",
               world_size: Optional[int] = None) -> MegatronConfig:
    """Parse flags; on an inconsistent combination print one line and exit with status 2."""
    parser = build_parser(model_type)
    args = parser.parse_args(argv)
    try:
        return config_from_args(args, model_type, world_size)
    except ConfigError as e:
        exit_with_error(model_type, e)


def exit_with_error(model_type: str, error) -> None:
    """Print one line and exit with status 2. Every rank hits the same error, and the first rank
    to exit makes torchrun kill the others: so the first rank to get here prints (not rank 0,
    which may be killed before it prints), and the other ranks of the node stay silent."""
    line = f"pretrain_{model_type}.py: error: {error}"
    tell_torchrun(line)  # torchrun's failure summary ends with it
    if first_to_report(str(error)):
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(2)


