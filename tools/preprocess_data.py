#!/usr/bin/env python
"""Tokenize JSON-lines text into Megatron's mmap .bin/.idx format.

Example (the shipped corpus, GPT-2 BPE):
    python tools/preprocess_data.py --input data/kjv/kjv.jsonl.gz --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2/gpt2-vocab.json.gz \\
        --merge-file data/gpt2/gpt2-merges.txt.gz --append-eod --workers 2 \\
        --output-prefix data/cache/kjv_gpt2
    -> data/cache/kjv_gpt2_text_document.bin/.idx

See docs/data.md for every flag.  Exit status: 0 ok, 1 bad input (or an empty one with
--fail-on-empty), 2 bad arguments, 130 interrupted (Ctrl-C or SIGTERM; partial outputs removed).
SIGINT inherited as ignored (nohup, `cmd &` in a script) stays ignored, as POSIX tools do;
SIGTERM always stops the tool cleanly.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.preprocess import Options, PreprocessError, output_prefix_for, preprocess  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES  # noqa: E402


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, nargs="+",
                   help="input file(s) or glob(s): .jsonl, .json (one object per line) or .jsonl.gz")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one output per key")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (NLTK punkt, shipped)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences when splitting")
    g.add_argument("--lang", default="english", help="punkt language for --split-sentences")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (counted and reported) instead of stopping")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", help="GPT-2 encoder.json or BERT vocab.txt")
    g.add_argument("--merge-file", help="GPT-2 merges (vocab.bpe)")
    g.add_argument("--tokenizer-model", help="SentencePiece .model or HF tokenizer.json")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="T5 sentinel tokens to add")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_{document|sentence}.bin/.idx")
    g.add_argument("--dataset-impl", "--data-impl", dest="dataset_impl", default="mmap", choices=["mmap"],
                   help="accepted for older Megatron scripts; mmap is the only format (and the default)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (a multiple of --partitions)")
    g.add_argument("--partitions", type=int, default=1, help="split the input and process the parts in parallel")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="when not on a terminal, log at the first tokenizer batch (--chunk-lines) boundary past "
                        "every N documents; the line gives the exact count")
    g.add_argument("--fail-on-empty", action="store_true",
                   help="exit 1 (and remove the outputs) when the input holds no documents, instead of warning")
    g.add_argument("--chunk-lines", type=int, default=256, help="lines per tokenizer batch")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = get_args(argv)
    opts = Options(
        inputs=args.input, output_prefix=args.output_prefix, json_keys=args.json_keys,
        tokenizer_kwargs=dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                              merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                              vocab_size=args.vocab_size, vocab_extra_ids=args.vocab_extra_ids),
        append_eod=args.append_eod, split_sentences=args.split_sentences, keep_newlines=args.keep_newlines,
        lang=args.lang, workers=args.workers, partitions=args.partitions, log_interval=args.log_interval,
        skip_bad_lines=args.skip_bad_lines, chunk_lines=args.chunk_lines, progress=not args.no_progress)
    t0 = time.time()

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)  # a scheduler's kill cleans up like Ctrl-C
    try:
        stats = preprocess(opts)
    except KeyboardInterrupt:
        print("preprocess_data: interrupted; partial outputs were removed", file=sys.stderr)
        return 130
    except (PreprocessError, ValueError, FileNotFoundError) as exc:
        print(f"preprocess_data: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. an unwritable --output-prefix folder: one line, not a traceback
        print(f"preprocess_data: error: {exc.strerror or exc}: {exc.filename or args.output_prefix}", file=sys.stderr)
        return 1
    if stats.documents == 0:
        outs = [output_prefix_for(args.output_prefix, k, args.split_sentences) for k in args.json_keys]
        if args.fail_on_empty:
            for base in outs:
                for ext in (".bin", ".idx"):
                    if os.path.exists(base + ext):
                        os.remove(base + ext)
            print(f"preprocess_data: error: no documents in --input {' '.join(args.input)} (--fail-on-empty); "
                  "no outputs written", file=sys.stderr)
            return 1
        print(f"preprocess_data: WARNING: no documents in --input {' '.join(args.input)}; wrote empty datasets "
              f"{', '.join(outs)} that training will refuse (use --fail-on-empty to make this an error)",
              file=sys.stderr)
    dt = max(time.time() - t0, 1e-9)
    outs = ", ".join(output_prefix_for(args.output_prefix, k, args.split_sentences) for k in args.json_keys)
    print(f"done: {stats.documents} documents, {stats.tokens} tokens, {stats.bytes / 1e6:.1f} MB in {dt:.1f} s "
          f"({stats.documents / dt:.0f} docs/s, {stats.bytes / dt / 1e6:.2f} MB/s) -> {outs}.bin/.idx", file=sys.stderr)
    if stats.bad_lines:
        print(f"skipped {stats.bad_lines} malformed line(s); first: " + "; ".join(stats.bad_examples[:5]),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
