"""The argument groups of the systems built on the core trainer (DynaPipe, TeraPipe, Aceso,
Optimus-CC, fused kernels, profiling); megatron/cli/arguments.py builds the parser from these and
Megatron-LM's own groups."""
from __future__ import annotations

import argparse

from megatron.cli.parser import int_list


def _add_compression_args(p) -> None:
    """Optimus-CC flags. The published underscore spellings are accepted as aliases."""
    g = p.add_argument_group("communication compression (Optimus-CC)")

    def both(name, **kw):
        g.add_argument(name, **kw)
        alias = name.replace("-", "_").replace("__", "--")  # same dest; listed once in --help
        g.add_argument(alias, **dict(kw, help=argparse.SUPPRESS))

    both("--inter-grad-comp", action="store_true",
         help="compress the activation gradients sent to the previous pipeline stage (rank-r PowerSGD step)")
    both("--inter-grad-comp-rank", type=int, default=16, help="PowerSGD rank for --inter-grad-comp")
    both("--inter-grad-comp-epilogue-only", action="store_true",
         help="compress only the sends of the pipeline drain (after each rank's last forward)")
    both("--use-error-feedback", action="store_true",
         help="keep compression residuals: lazy error propagation for pipeline gradients (the residual of one "
              "micro-batch rides on the next one's gradient within the iteration), error feedback for --grad-comp")
    both("--emb-comm-opt", action="store_true",
         help="one tied-embedding all-reduce per TP rank over the first and last stages of all DP replicas")
    both("--grad-comp", action="store_true", help="PowerSGD for the data-parallel gradient all-reduce")
    both("--grad-comp-rank", type=int, default=128, help="PowerSGD rank for --grad-comp")
    both("--grad-comp-warm-up", type=float, default=0.0,
         help="fraction of --train-iters that use a plain all-reduce first")
    both("--selective-grad-comp", action="store_true",
         help="compress the DP all-reduce only on the first --selective-grad-comp-way pipeline stages")
    both("--selective-grad-comp-way", type=int, default=None,
         help="how many leading pipeline stages --selective-grad-comp compresses")
    both("--grad-comp-type", default="PowerSGD", choices=["PowerSGD", "RandomizedSVD"],
         help="low-rank reducer for --grad-comp: PowerSGD (warm-started power step) or RandomizedSVD (fresh "
              "Gaussian sketch of width rank+4 each step, truncated to rank by a local SVD)")
    both("--emb-grad-comp", action="store_true",
         help="low-rank reducer for the tied-embedding gradient all-reduce between the first and last stage "
              "(over all DP replicas with --emb-comm-opt)")
    both("--emb-grad-comp-rank", type=int, default=4, help="rank of --emb-grad-comp")
    both("--emb-grad-comp-type", default="PowerSGD", choices=["PowerSGD", "RandomizedSVD"],
         help="reducer of --emb-grad-comp (see --grad-comp-type)")
    both("--emb-grad-comp-warm-up", type=float, default=0.0,
         help="fraction of --train-iters that sync the embedding uncompressed first")
    both("--emb-use-error-feedback", action="store_true",
         help="keep the per-rank residual of --emb-grad-comp and add it to the next step's gradient")
    both("--log-compression-stats", action="store_true",
         help="at each --log-interval print one line (and TensorBoard scalars) per stage and message kind: "
              "compression ratio, relative error of what was sent, residual/gradient norm, orthogonalisation "
              "error, compression time; costs a device synchronisation per message (its timer) and one extra exact "
              "all-reduce per compressed collective (the reference sum)")
    both("--lep-carry-across-iterations", action="store_true",
         help="lazy error propagation as published: the last pipeline-gradient residual of an iteration rides on "
              "the next iteration's first compressed gradient (after the optimizer step) instead of being dropped; "
              "measured worse than plain CB here (README, Optimus-CC)")
    both("--mp-grad-comp", action="store_true",
         help="low-rank tensor-parallel input-gradient all-reduce (backward of column-parallel layers): two "
              "all-reduces of rank-r factors of the (tokens, hidden) gradient, fixed random sketch; not with "
              "--sequence-parallel")
    both("--mp-grad-comp-rank", type=int, default=4, help="rank of --mp-grad-comp")
    both("--mp-acti-comp", action="store_true",
         help="low-rank tensor-parallel output all-reduce (forward of row-parallel layers and the embedding): "
              "CHANGES THE FORWARD (the model computes with the rank-r sum); exact only when the rank covers it")
    both("--mp-acti-comp-rank", type=int, default=4, help="rank of --mp-acti-comp")


def _add_dynapipe_args(p) -> None:
    g = p.add_argument_group("dynapipe")
    g.add_argument("--dynapipe", action="store_true",
                   help="plan every global batch with DynaPipe (variable micro-batches, schedule, recompute)")
    g.add_argument("--dynapipe-cost-model", default=None, help="cost model file (cost_models/*.json)")
    g.add_argument("--dynapipe-memory-limit", type=float, default=36000.0, help="planner memory limit per device, MB")
    g.add_argument("--dynapipe-planner-workers", type=int, default=2,
                   help="planner processes on rank 0 (0: plan in-process on every rank)")
    g.add_argument("--dynapipe-lookahead", type=int, default=4, help="iterations planned ahead")
    g.add_argument("--dynapipe-trace-dir", default=None,
                   help="write the simulated and the measured Chrome trace of the first --dynapipe-trace-iters "
                        "iterations here (iter_N.sim.json, iter_N.measured.json)")
    g.add_argument("--dynapipe-trace-iters", type=int, default=4,
                   help="how many iterations --dynapipe-trace-dir traces")
    g.add_argument("--dynapipe-cost-model-any", action="store_true",
                   help="use --dynapipe-cost-model although it was profiled for another model shape (experiments)")
    g.add_argument("--dynapipe-packed-rows", action="store_true",
                   help="let DynaPipe also plan micro-batches of packed rows (--seq-length tokens, several samples "
                        "each, per-document attention as with --pack-dataset) and pick them where the cost model "
                        "says they are faster (T5: rows of --encoder-seq-length / --decoder-seq-length)")
    g.add_argument("--dynapipe-cp-sizes", type=int_list, default=None, metavar="C1,C2,...",
                   help="with --context-parallel-size N: DynaPipe picks each micro-batch's CP size from these "
                        "(each divides N, N included; e.g. 1,2,4): short ones at CP 1 on the CP group's ranks as "
                        "extra data parallelism, long ones on the whole group (docs/context_parallel.md)")


def _add_fused_kernel_args(p: argparse.ArgumentParser) -> None:
    """Megatron's switches for the fused kernels (megatron/fused_kernels); all on by default."""
    g = p.add_argument_group("fused kernels (built on first use; PyTorch fallback when no compiler)")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                   help="packed rows (--pack-dataset, DynaPipe) use SDPA with a dense block-diagonal mask instead "
                        "of the variable-length attention kernel")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="MLP bias + GeLU as two eager ops instead of the fused kernel")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="bias + dropout + residual add as eager ops instead of the fused kernel")


def _apply_fused_kernel_args(args: argparse.Namespace, model) -> None:
    for name in ("masked_softmax_fusion", "bias_gelu_fusion", "bias_dropout_fusion"):
        setattr(model, name, getattr(args, name, True))


def _add_aceso_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("aceso")
    g.add_argument("--aceso-config", default=None,
                   help="run an Aceso JSON configuration (python -m megatron.aceso search): per-stage "
                        "layer counts, recompute, TP and DP sizes (stages may differ), PP, micro/global "
                        "batch; GPT only")


def _add_terapipe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("terapipe")
    g.add_argument("--terapipe", action="store_true",
                   help="GPT only: pipeline token slices of each sequence (TeraPipe), attention over cached K/V")
    g.add_argument("--terapipe-slices", default="auto",
                   help="auto (DP over slicings, needs --terapipe-cost-model), N uniform slices, or lengths l1,l2,...; "
                        "with --dynapipe: auto (the DynaPipe planner decides) or N slices per micro-batch")
    g.add_argument("--terapipe-cost-model", default=None,
                   help="latency model t(b,l,c) (python -m megatron.planner.terapipe.latency --output FILE)")
    g.add_argument("--terapipe-memory-limit", type=float, default=36000.0,
                   help="per-stage activation + K/V cache limit the slice planner respects, MB")


def _terapipe_config(args):
    from megatron.config.core import TeraPipeConfig
    return TeraPipeConfig(enabled=args.terapipe, slices=args.terapipe_slices, cost_model=args.terapipe_cost_model,
                          memory_limit_mb=args.terapipe_memory_limit, with_dynapipe=args.dynapipe)


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's profiling flags (torch.profiler; see megatron/profiling/step_trace.py) and
    the distributed optimizer's parameter-gather overlap."""
    g = p.add_argument_group("communication overlap")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: all-gather the updated parameters asynchronously; "
                        "each module's next forward waits only for the buckets holding its parameters")
    g = p.add_argument_group("profiling")
    g.add_argument("--profile", action="store_true",
                   help="write a torch.profiler Chrome trace (CPU and CUDA activities) of some iterations")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="first profiled iteration (1-based)")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="profiling stops before this iteration")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                   help="global ranks that write a trace")
    g.add_argument("--profile-dir", default=None,
                   help="folder for the traces (default: --tensorboard-dir)")
    g.add_argument("--pipeline-timeline", type=int, default=0, metavar="ITER",
                   help="write iteration ITER's pipeline timeline (Chrome/Perfetto JSON, one track per rank, "
                        "sends -> receives as arrows) and its unit-cost replay into RUN/timeline/")
