"""Cost of checking every `.idx` pointer at open (megatron.data.indexed_dataset.check_pointers);
prints one JSON object.

    .venv/bin/python benchmarks/bench_idx_check.py [--sequences 2e7]

Writes an index of --sequences random-length sequences to a temporary folder, then times
`check_pointers` over its memory-mapped arrays, warm (pages cached) and as a whole open of the
index (header, size checks, mapping, pointer check), best of --trials.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from megatron.data.indexed_dataset import _Index, check_pointers, write_index


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=float, default=2e7)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    n = int(args.sequences)
    lengths = np.random.default_rng(0).integers(1, 2048, n, dtype=np.int32)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.idx")
        write_index(path, np.uint16, lengths, np.arange(n + 1, dtype=np.int64))
        idx = _Index(path)
        check, whole = [], []
        for _ in range(args.trials):
            t0 = time.perf_counter()
            check_pointers(path, idx.sequence_lengths, idx.sequence_pointers, 2)
            check.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _Index(path)
            whole.append(time.perf_counter() - t0)
    print(json.dumps({"sequences": n, "check_ms": round(min(check) * 1e3, 2),
                      "check_ms_per_million_sequences": round(min(check) * 1e3 / (n / 1e6), 2),
                      "open_ms": round(min(whole) * 1e3, 2),
                      "open_ms_per_million_sequences": round(min(whole) * 1e3 / (n / 1e6), 2)}))


if __name__ == "__main__":
    main()
