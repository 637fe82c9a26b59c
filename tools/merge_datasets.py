#!/usr/bin/env python
"""Concatenate several .bin/.idx datasets into one (documents keep their order).

    python tools/merge_datasets.py --input out/shard_a_text_document out/shard_b_text_document \\
        --output-prefix out/all_text_document
    python tools/merge_datasets.py --input-dir out/shards --output-prefix out/all_text_document

All inputs must share one token dtype.  The output appears atomically.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.indexed_dataset import IndexedDatasetError, merge_datasets  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--input", nargs="+", help="dataset prefixes (without .bin/.idx), merged in this order")
    g.add_argument("--input-dir", help="merge every prefix in this folder, sorted by name")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    prefixes = args.input
    if args.input_dir:
        prefixes = sorted(os.path.join(args.input_dir, f[:-4]) for f in os.listdir(args.input_dir) if f.endswith(".idx"))
        if not prefixes:
            print(f"merge_datasets: error: no .idx files in --input-dir {args.input_dir}", file=sys.stderr)
            return 1
    try:
        merge_datasets(prefixes, args.output_prefix)
    except (IndexedDatasetError, OSError) as exc:
        print(f"merge_datasets: error: {exc}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets -> {args.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
