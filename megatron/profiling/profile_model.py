"""Profile a model shape into a cost-model file the DynaPipe planner loads.

    python -m megatron.profiling.profile_model --model-type gpt --num-layers-profiled 2 \\
        --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --vocab-size 512 \\
        --tp 1 --micro-batch-sizes 1,2,4 --seq-lengths 32,64,128 --recompute none,selective,full \\
        --warmup 2 --iters 5 --output cost_models/cpu_tiny_gpt.json

T5 adds `--decoder-seq-lengths`. The file is written atomically once every shape is done.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.atomic import atomic_path


def _ints(flag):
    def parse(text):
        try:
            vals = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, got {text!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"{flag} is empty")
        return vals
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron.profiling.profile_model", description=__doc__.split("\n")[0])
    g = p.add_argument_group("model")
    g.add_argument("--model-type", choices=["gpt", "t5"], default="gpt")
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--vocab-size", type=int, required=True, help="unpadded; padded like training does")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: the longest profiled length")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    # The training flags of the same names: profile the architecture you will train.
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--position-embedding-type", default=None, choices=["learned_absolute", "relative", "rope"])
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--activation-func", default="gelu", choices=["gelu", "relu"],
                   help="MLP activation without --swiglu (as pretrain_*.py)")
    g.add_argument("--gated-linear-unit", action="store_true",
                   help="gated MLP act(gate(x)) * up(x) (as pretrain_*.py; T5 v1.1 / Flan-T5)")
    g = p.add_argument_group("grid")
    g.add_argument("--tp", type=_ints("--tp"), default=[1], help="tensor-parallel sizes, e.g. 1,2")
    g.add_argument("--micro-batch-sizes", type=_ints("--micro-batch-sizes"), required=True)
    g.add_argument("--seq-lengths", type=_ints("--seq-lengths"), required=True, help="GPT / T5 encoder lengths")
    g.add_argument("--decoder-seq-lengths", type=_ints("--decoder-seq-lengths"), default=[], help="T5 only")
    g.add_argument("--recompute", default="none,selective,full", help="comma-separated: none,selective,full")
    g = p.add_argument_group("measurement")
    g.add_argument("--num-layers-profiled", type=int, default=3, help="layers per measurement (DynaPipe: 3)")
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--iters", type=int, default=5, help="timed iterations")
    g.add_argument("--statistic", choices=["median", "min"], default="median",
                   help="kept over the timed iterations (min resists other processes on a shared CPU)")
    g.add_argument("--max-spread", type=float, default=None,
                   help="a shape whose timed iterations spread more than this ((median - min) / min, default 0.5) is "
                        "re-measured, then refused: nothing is written while a cell stays noisy")
    g.add_argument("--remeasure", type=int, default=None, help="extra rounds for a noisy shape (default 2)")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--max-seconds-per-shape", type=float, default=None,
                   help="a shape whose first forward+backward takes longer is recorded as unmeasured")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="shapes with micro-batch size x length above this are recorded as unmeasured")
    g.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads per rank on CPU (default 1, like the CPU trainer's ranks)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--min-share", type=float, default=None,
                   help="refuse at once when a 2 s host probe gets less of a core than this (default 0.6; 0 profiles "
                        "on any host): a busy host's cells come out noisy and are refused after minutes otherwise")
    g.add_argument("--attention-split", action="store_true",
                   help="also measure the per-document attention term of a GPT/encoder layer (packed rows of 1 vs 4 "
                        "documents, variable-length kernel) and store it in the file (attention_split)")
    g = p.add_argument_group("output")
    g.add_argument("--output", required=True, help="cost-model JSON to write")
    g.add_argument("--name", default=None, help="name stored in the file (default: output file stem)")
    g.add_argument("--quiet", action="store_true", help="no per-shape log lines")
    return p


def spec_from_args(args):
    import torch

    from megatron.config.core import ConfigError, ModelConfig
    from megatron.profiling.profiler import ProfileSpec
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    longest = max(args.seq_lengths + args.decoder_seq_lengths)
    try:
        kw = dict(model_type=args.model_type, num_layers=args.num_layers_profiled, hidden_size=args.hidden_size,
                  num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                  kv_channels=args.kv_channels, vocab_size=args.vocab_size,
                  make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                  max_position_embeddings=args.max_position_embeddings or longest,
                  hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                  seq_length=max(args.seq_lengths), normalization=args.normalization, swiglu=args.swiglu,
                  activation_func=args.activation_func, gated_linear_unit=args.gated_linear_unit,
                  add_bias_linear=args.add_bias_linear, rotary_percent=args.rotary_percent,
                  rotary_base=args.rotary_base,
                  num_query_groups=args.num_query_groups if args.group_query_attention else None,
                  position_embedding_type=args.position_embedding_type
                  or ("relative" if args.model_type == "t5" else "learned_absolute"))
        if args.model_type == "t5":
            kw.update(encoder_num_layers=args.num_layers_profiled, decoder_num_layers=args.num_layers_profiled,
                      encoder_seq_length=max(args.seq_lengths),
                      decoder_seq_length=max(args.decoder_seq_lengths or [1]))
        model = ModelConfig(**kw)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return ProfileSpec(
        model=model, tps=args.tp, micro_batch_sizes=args.micro_batch_sizes, seq_lengths=args.seq_lengths,
        decoder_seq_lengths=args.decoder_seq_lengths, recompute=[r.strip() for r in args.recompute.split(",")],
        layers=args.num_layers_profiled, warmup=args.warmup, iters=args.iters, device=device,
        dtype=args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"),
        max_seconds=args.max_seconds_per_shape, max_tokens=args.max_tokens, seed=args.seed,
        cpu_threads=args.cpu_threads, statistic=args.statistic, attention_split=args.attention_split,
        name=args.name or Path(args.output).stem,
        **{k: v for k, v in (("max_spread", args.max_spread), ("remeasure", args.remeasure)) if v is not None})


def probe_host():
    """The 2 s host probe (profiling/noise.py; tests replace it)."""
    from megatron.profiling import noise
    return noise.probe()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as e:
        print(f"profile_model: error: {e}", file=sys.stderr)
        return 2
    from megatron.profiling.profiler import run_profile
    out = Path(args.output)
    if not out.parent.is_dir():
        print(f"profile_model: error: --output directory {out.parent} does not exist", file=sys.stderr)
        return 2
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    from megatron.profiling import noise
    from megatron.profiling.noise import NoiseLog
    min_share = noise.MIN_SHARE if args.min_share is None else args.min_share
    if min_share > 0:  # measured at load 40 on 2 cores: 20 % of a core, 3 of 27 cells refused after 134 s
        host = probe_host()
        log(f"host probe: {host.describe()}")
        if host.share < min_share:
            print(f"profile_model: error: host too busy to profile ({host.describe()}; under --min-share "
                  f"{min_share:g} cells come out noisy and are refused after minutes): nothing written. Run it on an "
                  "idle host, or pass --min-share 0 to try anyway.", file=sys.stderr)
            return 1
    noise_log = NoiseLog(spec.max_spread)
    cm = run_profile(spec, log, noise_log)
    refusal = noise_log.refusal("profile_model")
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    with atomic_path(out) as tmp:  # an interrupted run never leaves half a file
        cm.save(tmp)
    print(f"wrote {out} ({cm.meta['profile_seconds']} s of profiling)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
