#!/usr/bin/env python
"""Convert checkpoints of this project between tensor / pipeline parallel layouts.

    python tools/checkpoint/convert.py --load runs/ckpt --save runs/ckpt_tp1 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1

GPT checkpoints (any TP/PP, learned or RoPE positions, tied or untied output) are re-split to
the target layout with uniform stages; T5 checkpoints put the encoder on pipeline ranks
[0, split) and the decoder on [split, pp) (--target-pipeline-model-parallel-split-rank).
Model weights move bit for bit; optimizer state does not
(it is sharded like the model), so training resumes with a fresh optimizer and LR schedule
position kept, as with Megatron's converter.

Hugging Face: GPT-2 (learned positions, LayerNorm, GeLU, biases, tied output), Llama (RoPE,
RMSNorm, SwiGLU, no biases, optional GQA) or T5ForConditionalGeneration (our T5 with relative
positions, RMSNorm, no linear biases; FFN relu (original T5), gated-gelu (T5 v1.1 / Flan-T5,
untied LM head), gelu-tanh, gated-relu or gated-silu; chosen from the checkpoint):
    python tools/checkpoint/convert.py --load runs/ckpt --save hf_out --to-hf --verify
    python tools/checkpoint/convert.py --load hf_out --save runs/from_hf --from-hf \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2 --verify
`--verify` runs both models on the same random tokens and prints max_abs_logit_diff=<float>.
Needs `pip install transformers safetensors` (only for these modes). Exit status: 0 ok, 1 bad checkpoint, 2 bad flags.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.checkpoint.reshard import ReshardError, read_full_model, write_resharded  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint folder (with latest_checkpointed_iteration.txt)")
    p.add_argument("--save", required=True, help="output folder (must not hold a checkpoint already)")
    p.add_argument("--iteration", type=int, default=None, help="iteration to convert (default: the tracked one)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=None)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=None)
    p.add_argument("--target-expert-parallel-size", type=int, default=1,
                   help="--to-megatron of an MoE model: Megatron's EP size (one file per expert-parallel rank)")
    p.add_argument("--target-pipeline-model-parallel-split-rank", type=int, default=None,
                   help="T5 only: first pipeline rank of the decoder (default: the source's when the pipeline "
                        "size is unchanged, else target pp // 2)")
    p.add_argument("--to-hf", action="store_true",
                   help="write a Hugging Face folder (safetensors + config): GPT-2, Llama or T5, from the model")
    p.add_argument("--from-hf", action="store_true",
                   help="read a Hugging Face folder (config.json + model.safetensors): gpt2, llama or t5")
    p.add_argument("--to-megatron", action="store_true",
                   help="write Megatron-LM's legacy format (args Namespace, nested language_model, release/) at the "
                        "target TP/PP, for Megatron-LM's own --load and converters (GPT and T5)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--from-megatron: the tokenizer's vocabulary size, when Megatron's args do not record it "
                        "(GPT2BPETokenizer runs store only padded_vocab_size; e.g. 50257 for GPT-2)")
    p.add_argument("--megatron-norm-names", choices=("layernorm", "norm"), default=None,
                   help="--to-megatron: `input_layernorm` (Megatron-LM <= 23.x, v2.x, transformers' converters; the "
                        "GPT default) or `input_norm` (the legacy model of Megatron-Core 0.5 and later; T5's default)")
    p.add_argument("--tokenizer-type", default=None,
                   help="--to-megatron: the tokenizer recorded in Megatron's args (default: the source run's, or "
                        "NullTokenizer when it had none); Megatron's --load compares it when --vocab-file is given, "
                        "transformers' converter picks its tokenizer from it (GPT2BPETokenizer)")
    # One set of tokenizer-file flags for both directions that write a tokenizer
    p.add_argument("--vocab-file", default=None,
                   help="--to-megatron (with --tokenizer-type): the vocabulary file recorded in Megatron's args; "
                        "--to-hf: the run's vocabulary when it moved since training (its files go in --save)")
    p.add_argument("--merge-file", default=None, help="the BPE merges file, as --vocab-file")
    p.add_argument("--tokenizer-model", default=None, help="the SentencePiece model file, as --vocab-file")
    p.add_argument("--from-megatron", action="store_true",
                   help="read a checkpoint Megatron-LM wrote (legacy, or Megatron-Core torch or torch_dist "
                        "format, any TP/PP) and write this project's format at the target TP/PP (GPT and T5)")
    p.add_argument("--verify", action="store_true", help="compare logits of both models on random tokens")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="--from-hf: the vocabulary padding the training run will use (must match its flag)")
    p.add_argument("--encoder-seq-length", type=int, default=None,
                   help="--from-hf T5: the training run's --encoder-seq-length (HF T5 has none; it sets the "
                        "checkpoint's max position embeddings, which the run must match)")
    p.add_argument("--decoder-seq-length", type=int, default=None, help="--from-hf T5: as --encoder-seq-length")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Flags, checked for consistency (exit status 2 with one line on a bad combination)."""
    p = build_parser()
    args = p.parse_args(argv)
    if sum(map(bool, (args.to_hf, args.from_hf, args.to_megatron, args.from_megatron))) > 1:
        p.error("--to-hf, --from-hf, --to-megatron and --from-megatron are separate directions; pick one")
    if any((args.vocab_file, args.merge_file, args.tokenizer_model)) and not (args.tokenizer_type or args.to_hf):
        p.error("--vocab-file / --merge-file / --tokenizer-model go with --to-hf, or with --tokenizer-type "
                "(--to-megatron); add one")
    if args.tokenizer_type and not args.to_megatron:
        p.error("--tokenizer-type is recorded by --to-megatron only")
    if not args.to_hf and (args.target_tensor_parallel_size is None or args.target_pipeline_parallel_size is None):
        p.error("give --target-tensor-parallel-size and --target-pipeline-parallel-size")
    if args.target_expert_parallel_size != 1 and not args.to_megatron:
        p.error("--target-expert-parallel-size goes with --to-megatron (this project's format holds every expert "
                "in each file, whatever the EP size of the run that loads it)")
    if not args.to_hf and min(args.target_tensor_parallel_size, args.target_pipeline_parallel_size) < 1:
        p.error("target sizes must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.to_hf or args.from_hf:
        return _hf(args)
    if args.to_megatron or args.from_megatron:
        return _megatron(args)
    if os.path.exists(os.path.join(args.save, "latest_checkpointed_iteration.txt")):
        print(f"convert: error: --save {args.save} already holds a checkpoint; choose an empty folder",
              file=sys.stderr)
        return 2
    try:
        config, full, meta = read_full_model(args.load, args.iteration)
        out = write_resharded(config, full, meta, args.save, args.target_tensor_parallel_size,
                              args.target_pipeline_parallel_size, args.target_pipeline_model_parallel_split_rank)
    except (ReshardError, OSError) as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 1
    src = config["parallel"]
    print(f"converted iteration {meta['iteration']}: TP {src['tensor_model_parallel_size']} x PP "
          f"{src['pipeline_model_parallel_size']} -> TP {args.target_tensor_parallel_size} x PP "
          f"{args.target_pipeline_parallel_size}, {len(full)} tensors -> {out}")
    return 0


def _megatron(args) -> int:
    from megatron.checkpointing import megatron_legacy as mlegacy
    from megatron.checkpointing import megatron_write as mwrite
    from megatron.checkpointing.torch_format import _atomic_write_bytes
    from megatron.checkpointing.safety import UnsafeCheckpointError
    from megatron.config.core import MegatronConfig, ModelConfig
    try:
        if args.to_megatron:
            config, full, meta = read_full_model(args.load, args.iteration)
            t5 = config["model"].get("model_type") == "t5"
            norm = args.megatron_norm_names or ("norm" if t5 else "layernorm")
            tokenizer = dict(config.get("data") or {})
            if args.tokenizer_type:
                tokenizer = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                                 merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
            out = mwrite.write_full(args.save, config["model"], full, meta, args.target_tensor_parallel_size,
                                     args.target_pipeline_parallel_size, release=True, norm_names=norm,
                                     atomic_write=_atomic_write_bytes,
                                     split=args.target_pipeline_model_parallel_split_rank, tokenizer=tokenizer,
                                     ep=args.target_expert_parallel_size)
            kind = mwrite.tokenizer_fields(tokenizer, config["model"]["vocab_size"])["tokenizer_type"]
            print(f"wrote Megatron-LM legacy checkpoint (release, {len(full)} tensors, tokenizer_type {kind}) to {out}"
                  + ("; Megatron's --load with --vocab-file needs the same --tokenizer-type: pass --tokenizer-type "
                     "(and its files) to convert.py to record another" if not args.tokenizer_type else ""))
            return 0
        from megatron.checkpointing import mcore_dist  # Megatron-Core's --ckpt-format torch_dist
        margs, full, meta = (mcore_dist.read_full if mcore_dist.detect(args.load) else mlegacy.read_full)(args.load)
        fields = mlegacy.model_fields(margs)
        fields["vocab_size"] = args.vocab_size or mlegacy.tokenizer_vocab_size(margs)
        for k in ("embedding.word_embeddings.weight", "output_layer.weight", "lm_head_bias"):
            if k in full:
                full[k] = full[k][:fields["vocab_size"]]
        fields = {k: v for k, v in fields.items() if v is not None}
        config = MegatronConfig(model=ModelConfig(**fields)).to_dict()
        meta = {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"], "skipped_iters": 0,
                "consumed_tokens": 0}
        out = write_resharded(config, full, meta, args.save, args.target_tensor_parallel_size,
                              args.target_pipeline_parallel_size, args.target_pipeline_model_parallel_split_rank)
        print(f"wrote our checkpoint (iteration {meta['iteration']}) to {out}")
        return 0
    except (ReshardError, mlegacy.MegatronCheckpointError, UnsafeCheckpointError, ValueError, KeyError, OSError) as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 1


def _hf(args) -> int:
    try:
        from tools.checkpoint import hf_gpt2, hf_llama, hf_mixtral, hf_t5
        import transformers  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError as e:
        print(f"convert: error: Hugging Face conversion needs `pip install transformers safetensors` ({e})",
              file=sys.stderr)
        return 2
    import torch
    try:
        if args.to_hf:
            config, full, meta = read_full_model(args.load, args.iteration)
            arch = hf_llama if hf_llama.is_llama(config["model"]) else hf_gpt2
            if hf_mixtral.is_mixtral(config["model"]):
                arch = hf_mixtral
            if config["model"]["model_type"] == "t5":
                arch = hf_t5
            hf_config, sd = arch.to_hf(config, full)
            hf_gpt2.save_hf(args.save, hf_config, sd)
            model_fields, hf_dir = config["model"], args.save
            print(f"wrote Hugging Face {hf_config['architectures'][0]} ({len(sd)} tensors) to {args.save}")
            _write_tokenizer(args, config)
        else:
            from megatron.config.core import MegatronConfig, ModelConfig
            hf_config, sd = hf_gpt2.load_hf(args.load)
            arch = {"llama": hf_llama, "t5": hf_t5, "mixtral": hf_mixtral}.get(hf_config.get("model_type"), hf_gpt2)
            model_fields, full = arch.from_hf(hf_config, sd)
            model_fields["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by
            if arch is hf_t5:
                for k in ("encoder_seq_length", "decoder_seq_length"):
                    if getattr(args, k) is not None:
                        model_fields[k] = getattr(args, k)
            config = MegatronConfig(model=ModelConfig(**model_fields)).to_dict()
            meta = {"iteration": 0, "consumed_samples": 0, "skipped_iters": 0, "consumed_tokens": 0}
            out = write_resharded(config, full, meta, args.save, args.target_tensor_parallel_size,
                                  args.target_pipeline_parallel_size, args.target_pipeline_model_parallel_split_rank)
            model_fields, hf_dir = config["model"], args.load
            print(f"wrote our checkpoint (iteration 0) to {out}")
    except (ReshardError, ValueError, KeyError, OSError) as e:
        print(f"convert: error: {e}", file=sys.stderr)
        return 1
    if args.verify and arch is hf_t5:
        print(f"max_abs_logit_diff={hf_t5.logit_diff(model_fields, full, hf_dir):.3e}")
    elif args.verify:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, model_fields["vocab_size"], (2, min(16, model_fields["seq_length"])), generator=g)
        diff = (hf_gpt2.our_logits(model_fields, full, tokens) - arch.hf_logits(hf_dir, tokens)).abs().max()
        print(f"max_abs_logit_diff={float(diff):.3e}")
    return 0


def _write_tokenizer(args, config) -> None:
    """The run's tokenizer files beside the model, so AutoTokenizer loads the folder too."""
    from tools.checkpoint.hf_tokenizer import tokenizer_files, write_tokenizer
    d = tokenizer_files(config.get("data") or {}, {"vocab_file": args.vocab_file, "merge_file": args.merge_file,
                                                   "tokenizer_model": args.tokenizer_model})
    model = config["model"]
    length = model.get("seq_length") or model.get("encoder_seq_length") or model.get("max_position_embeddings")
    try:
        print(write_tokenizer(args.save, d, int(length or 1024)))
    except (OSError, ValueError) as e:  # the model is written and sound; say how to add the tokenizer
        print(f"convert: note: no tokenizer files written ({str(e).splitlines()[0]}); give the run's "
              "--vocab-file/--merge-file or --tokenizer-model to write them", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
