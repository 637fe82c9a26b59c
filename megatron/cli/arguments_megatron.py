"""Megatron-LM flags its users pass every day (the example scripts' flag lists under
tests/fixtures/megatron_scripts/ are the test of this file), sorted three ways:

- honoured: the flag does here what it does in Megatron-LM (sample-based training length,
  wall-clock exit, parameter-norm and zero-count logging, manual GC, W&B, ...);
- accepted with one log line: an engine choice (Transformer Engine, attention backend, fusions,
  communication overlap of TE) or a behaviour that is already how this project works;
- refused, with the nearest supported way named.

`apply_megatron_args` runs before the configuration is built: it turns sample counts into
iterations and returns the log lines, which rank 0 prints once at start-up.
"""
from __future__ import annotations

import argparse
import os
from typing import List

from megatron.config.errors import ConfigError
from megatron.config.extras import ExtrasConfig

# flag -> (argparse kwargs, the line printed when it is given). Engine choices: no effect here.
_ENGINE = {
    "--transformer-impl": (dict(choices=["local", "transformer_engine", "inference_optimized"]),
                           "this project has one transformer implementation in plain PyTorch (no Transformer Engine)"),
    "--attention-backend": (dict(choices=["auto", "flash", "fused", "unfused", "local"]),
                            "attention runs through torch's SDPA, which picks its own kernel (flash where it applies)"),
    "--use-flash-attn": (dict(action="store_true"),
                         "attention runs through torch's SDPA, which uses its flash kernel on CUDA where it applies"),
    "--use-mcore-models": (dict(action="store_true"), "there is one model implementation (Megatron-Core's layout)"),
    "--use-legacy-models": (dict(action="store_true"), "there is one model implementation; checkpoints still read "
                            "and write the legacy layout (--ckpt-format megatron-legacy)"),
    "--tp-comm-overlap": (dict(action="store_true"), "Transformer Engine's userbuffer overlap does not exist here; "
                          "TP all-reduces run when their layer needs them"),
    "--no-gradient-accumulation-fusion": (dict(action="store_true"), "weight gradients are accumulated by autograd "
                                          "(no apex fused wgrad kernel to turn off)"),
    "--gradient-accumulation-fusion": (dict(action="store_true"), "weight gradients are accumulated by autograd "
                                       "(no apex fused wgrad kernel)"),
    "--cross-entropy-loss-fusion": (dict(action="store_true"), "the vocab-parallel cross entropy is one PyTorch "
                                    "implementation"),
    "--no-async-tensor-model-parallel-allreduce": (dict(action="store_true"), "TP all-reduces are synchronous here"),
    "--overlap-p2p-comm": (dict(action="store_true"), "pipeline sends and receives are batched per step by the "
                           "executor's plan"),
    "--no-rope-fusion": (dict(action="store_true"), "RoPE is applied in plain PyTorch"),
    "--no-persist-layer-norm": (dict(action="store_true"), "norms are torch's"),
    "--use-cpu-initialization": (dict(action="store_true"), "weights are initialised from the seed the same way on "
                                 "any device"),
    "--empty-unused-memory-level": (dict(type=int), "the CUDA caching allocator keeps its blocks (no empty_cache "
                                    "calls between steps)"),
    "--no-create-attention-mask-in-dataloader": (dict(action="store_true"), "the causal mask is never materialised "
                                                 "by the dataloader here"),
    "--no-mmap-bin-files": (dict(action="store_true"), ".bin files are always memory-mapped here"),
    "--grad-reduce-in-bf16": (dict(action="store_true"), "gradients are float32 (fp32 parameters under autocast) "
                              "and are reduced in float32"),
    "--timing-log-level": (dict(type=int, choices=[0, 1, 2]), "the log line has the iteration time; per-operation "
                           "timings come from --profile (torch.profiler trace)"),
    "--timing-log-option": (dict(choices=["max", "minmax", "all"]), "the log line has the iteration time of the "
                            "reporting rank; see --profile"),
    "--log-timers-to-tensorboard": (dict(action="store_true"), "the iteration time is always written to "
                                    "TensorBoard (iteration-time)"),
    "--log-throughput": (dict(action="store_true"), "the log line always has tokens/s and TFLOP/s/device"),
    "--calculate-per-token-loss": (dict(action="store_true"), "the loss is always the mean over the global batch's "
                                   "loss tokens here (every micro-batch weighted by its tokens)"),
    "--accumulate-allreduce-grads-in-fp32": (dict(action="store_true"), "gradients are always accumulated and "
                                             "reduced in float32 here (fp32 parameters under --fp16/--bf16 "
                                             "autocast)"),
    "--tiktoken-pattern": (dict(), "only read by Megatron's TikTokenizer, which this project does not have"),
    "--apply-layernorm-1p": (dict(action="store_true"), "norms compute x*w with w starting at 1, which trains exactly "
                             "as Megatron's x*(1+w) with w starting at 0 (same gradients; norms take no weight "
                             "decay); checkpoints store the scale w itself"),
}

# flag -> (argparse kwargs, what to use instead)
_REFUSED = {
    "--fp8-format": (dict(), "FP8 training (Transformer Engine) is not available here; use --bf16"),
    "--fp8-amax-history-len": (dict(type=int), "FP8 is not available here; use --bf16"),
    "--fp8-amax-compute-algo": (dict(), "FP8 is not available here; use --bf16"),
    "--fp8-param-gather": (dict(action="store_true"), "FP8 is not available here; use --bf16"),
    "--use-torch-fsdp2": (dict(action="store_true"), "FSDP2 is not used here; --use-distributed-optimizer shards "
                          "the optimizer state over data parallelism (ZeRO-1)"),
}


def add_megatron_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-LM run options (training length in samples, exit, logging extras)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train for this many samples (instead of --train-iters): ceil(samples / global batch) "
                        "iterations")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="with --train-samples: decay the learning rate over this many samples")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples: linear warm-up samples")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCR", "SAMPLES"),
                   help="grow the global batch from START by INCR over SAMPLES samples up to --global-batch-size "
                        "(Megatron-LM core_v0.9.0's semantics; the learning rate advances by samples)")
    g.add_argument("--step-batch-size-schedule", default=None,
                   help="'TOKENS:BATCH ...' global batch sizes from token thresholds (K/M/B/T suffixes; Megatron-LM "
                        "core_v0.19.0's semantics), e.g. '0:16 2.4B:320'")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the word embedding and output layer (their own curve of the same "
                        "shape)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="with --decoupled-lr: their minimum learning rate (default: --min-lr)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints on a background thread while training goes on (--ckpt-format torch); "
                        "the tracker moves once every rank's file and the manifest are complete")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="after this many minutes of training, save (with --save) and exit; all ranks agree on "
                        "the iteration")
    g.add_argument("--log-params-norm", action="store_true", help="the global parameter norm on each log line")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="the number of gradient entries that are exactly zero (before clipping) on each log line")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="write the per-iteration TensorBoard scalars every N iterations")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's garbage collector off during training (collect at --manual-gc-interval)")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="with --manual-gc: collect every N iterations "
                   "(0: never during training)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: do not collect around evaluations")
    g.add_argument("--wandb-project", default=None,
                   help="log the scalars to Weights & Biases (needs `pip install .[wandb]`; off, with one line, "
                        "when wandb is not installed)")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name")
    g.add_argument("--wandb-save-dir", default=None, help="W&B local folder (default: --save/wandb)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape flags from the --load checkpoint (this project's, or Megatron's "
                        "args) instead of the command line")
    g = p.add_argument_group("Megatron-LM engine choices (accepted; one log line says what happens here)")
    for flag, (kw, note) in _ENGINE.items():
        g.add_argument(flag, default=None, **kw, help=f"accepted: {note}")
    g = p.add_argument_group("Megatron-LM flags not supported here (refused, naming what to use)")
    for flag, (kw, note) in _REFUSED.items():
        g.add_argument(flag, default=None, **kw, help=f"refused: {note}")


def _given(args, flag: str) -> bool:
    v = getattr(args, flag.lstrip("-").replace("-", "_"), None)
    return v not in (None, False)


def _data_parallel(args, world_size: int) -> int:
    cp = getattr(args, "context_parallel_size", 1) or 1
    return max(world_size // max(args.tensor_model_parallel_size * args.pipeline_model_parallel_size * cp, 1), 1)


def apply_megatron_args(args: argparse.Namespace, world_size: int) -> List[str]:
    """Refuse what cannot run, convert samples to iterations, and return the log lines."""
    for flag, (_, instead) in _REFUSED.items():
        if _given(args, flag):
            raise ConfigError(f"{flag}: {instead}")
    notes = []
    if args.use_checkpoint_args:
        from megatron.checkpointing.saved_args import apply_checkpoint_args
        notes += apply_checkpoint_args(args)
    for flag, (_, note) in _ENGINE.items():
        if _given(args, flag):
            value = getattr(args, flag.lstrip("-").replace("-", "_"))
            notes.append(f"note: {flag}{'' if value is True else f' {value}'}: {note}")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1 and not args.aceso_config:
        args.sequence_parallel = False  # as Megatron's validate_args (per-stage TP sizes keep it: Aceso)
        notes.append("note: --sequence-parallel has no effect at --tensor-model-parallel-size 1 (off, as in "
                     "Megatron-LM, which turns it off silently)")
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        # Megatron's own GPT-3 example passes the files without --tokenizer-type (and Megatron then
        # stops: 'None tokenizer is not implemented'); a vocabulary and merges are GPT-2's BPE.
        args.tokenizer_type = "GPT2BPETokenizer"
        notes.append("note: --vocab-file and --merge-file without --tokenizer-type: GPT2BPETokenizer (the tokenizer "
                     "that reads both; Megatron-LM stops with 'None tokenizer is not implemented')")
    if args.apply_layernorm_1p and args.ckpt_format == "megatron-legacy":
        raise ConfigError("--apply-layernorm-1p with --ckpt-format megatron-legacy: Megatron would read the stored "
                          "scale w as w-1; save with --ckpt-format torch (or drop --apply-layernorm-1p for Megatron)")
    if args.async_save and args.ckpt_format != "torch":
        raise ConfigError(f"--async-save writes --ckpt-format torch only (got {args.ckpt_format}): drop --async-save "
                          f"or save with --ckpt-format torch")
    if args.async_save and not args.save:
        notes.append("note: --async-save without --save: nothing is saved")
    elif args.async_save:
        notes.append("note: --async-save: checkpoints are written on a background thread; each is named (tracker) "
                     "at the first step after every rank's file is written")
    if args.log_num_zeros_in_grad and args.use_distributed_optimizer:
        raise ConfigError("--log-num-zeros-in-grad counts the gradients the plain optimizer steps on; with "
                          "--use-distributed-optimizer they are reduce-scattered shards: drop one of the two")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ConfigError("--decoupled-min-lr needs --decoupled-lr")
    dp = _data_parallel(args, world_size)
    schedule = _batch_schedule(args, dp, notes)
    gbs = args.global_batch_size or args.micro_batch_size * dp
    if args.train_samples is not None:
        if args.train_samples <= 0:
            raise ConfigError(f"--train-samples must be positive, got {args.train_samples}")
        if args.train_iters is not None:
            raise ConfigError("--train-samples and --train-iters are exclusive (as in Megatron-LM); pick one")
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            raise ConfigError("--train-samples counts the schedule in samples: use --lr-decay-samples / "
                              "--lr-warmup-samples instead of --lr-decay-iters / --lr-warmup-iters")
        # Megatron's update_train_iters: whole global batches, a partial last one dropped
        args.train_iters = schedule.iterations_for(args.train_samples) if schedule else args.train_samples // gbs
        if args.train_iters < 1:
            raise ConfigError(f"--train-samples {args.train_samples} is less than one global batch ({gbs})")
        # Megatron's schedule in samples is the same curve in iterations of --global-batch-size
        # samples (sample n*gbs is reached at n); fractional bounds keep it exact. Under a batch
        # schedule the scheduler advances by samples / gbs per iteration, as Megatron's by samples.
        # (Megatron decays over --train-samples when --lr-decay-samples is not given)
        args.lr_decay_iters = (args.train_samples if args.lr_decay_samples is None else args.lr_decay_samples) / gbs
        if args.lr_warmup_samples:
            args.lr_warmup_iters = args.lr_warmup_samples / gbs
        notes.append(f"note: --train-samples {args.train_samples}: {args.train_iters} iterations"
                     + ("" if schedule else f" of {gbs} samples"))
    elif args.lr_decay_samples is not None or args.lr_warmup_samples:
        raise ConfigError("--lr-decay-samples / --lr-warmup-samples need --train-samples (else use "
                          "--lr-decay-iters / --lr-warmup-iters)")
    elif schedule is not None and args.rampup_batch_size:
        notes.append("note: --rampup-batch-size with --train-iters: Megatron-LM core_v0.9.0 refuses this pair "
                     "('expected no batch-size rampup for iteration-based training'); here --train-iters iterations "
                     "run with the ramped batches, the learning rate advancing by samples")
    args.batch_schedule = schedule
    if args.train_iters is None:
        args.train_iters = 10
    return notes


def _batch_schedule(args, dp: int, notes: List[str]):
    """--rampup-batch-size / --step-batch-size-schedule -> BatchSchedule (None without them)."""
    from megatron.config.batch_schedule import BatchSchedule, check_divisible, parse_step_schedule
    if args.rampup_batch_size and args.step_batch_size_schedule:
        raise ConfigError("--rampup-batch-size and --step-batch-size-schedule are two ways to grow the batch; pick one")
    if not (args.rampup_batch_size or args.step_batch_size_schedule):
        return None
    flag = "--rampup-batch-size" if args.rampup_batch_size else "--step-batch-size-schedule"
    others = [f for f, on in (("--dynapipe", args.dynapipe), ("--targets-data-path", args.targets_data_path),
                              ("--terapipe", args.terapipe), ("--aceso-config", args.aceso_config)) if on]
    if others:
        raise ConfigError(f"{flag} grows Megatron's fixed global batches; {others[0]} makes its own batches")
    if args.rampup_batch_size:
        schedule = BatchSchedule(args.global_batch_size or args.micro_batch_size * dp, tuple(args.rampup_batch_size))
    else:
        seq = args.seq_length or getattr(args, "encoder_seq_length", None) or 1
        steps = parse_step_schedule(args.step_batch_size_schedule, seq)
        final = max(b for _, b in steps)
        if args.global_batch_size is not None and args.global_batch_size != final:
            raise ConfigError(f"--global-batch-size {args.global_batch_size} differs from the largest batch of "
                              f"--step-batch-size-schedule ({final}); drop --global-batch-size")
        if args.global_batch_size is not None:
            notes.append("note: --global-batch-size with --step-batch-size-schedule: Megatron-LM core_v0.19.0 refuses "
                         "the pair; here it is the schedule's largest batch, and the schedule decides")
        args.global_batch_size = final
        schedule = BatchSchedule(final, steps=steps)
    check_divisible(schedule, args.micro_batch_size * dp, flag)
    notes.append(f"note: {flag}: global batch sizes {schedule.sizes()[:6]}{' ...' if len(schedule.sizes()) > 6 else ''}"
                 f" by consumed samples")
    return schedule


def extras_from_args(args: argparse.Namespace) -> ExtrasConfig:
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
    return ExtrasConfig(exit_duration_in_mins=args.exit_duration_in_mins, log_params_norm=args.log_params_norm,
                        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
                        tensorboard_log_interval=args.tensorboard_log_interval, manual_gc=args.manual_gc,
                        manual_gc_interval=args.manual_gc_interval, manual_gc_eval=args.manual_gc_eval,
                        wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
                        wandb_save_dir=save_dir, batch_schedule=getattr(args, "batch_schedule", None),
                        decoupled_lr=args.decoupled_lr,
                        decoupled_min_lr=args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr)


def print_notes(notes: List[str]) -> None:
    if os.environ.get("RANK", "0") == "0":
        for line in notes:
            print(line, flush=True)
