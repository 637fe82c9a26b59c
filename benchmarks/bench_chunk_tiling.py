"""Time of checking that a Megatron-Core torch_dist tensor's chunks tile it
(megatron.checkpointing.mcore_dist._check_tiling: volume + corner parity, linear in the chunk
count) on the index issue 48 forged: N one-column chunks of one tensor, which made the former
all-pairs check quadratic (1,000 chunks 4.5 s, 20,000 past 150 s). Prints one JSON object.

    .venv/bin/python benchmarks/bench_chunk_tiling.py [--chunks 1000 10000 100000] [--trials 3]

The chunks are DCP's own ChunkStorageMetadata objects (what the index unpickles to); the
overlapping variant moves the last chunk onto its neighbour (refused: timed to the refusal).
"""
from __future__ import annotations

import argparse
import json
import os
import time

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, \
    TensorStorageMetadata
import torch

from megatron.checkpointing.mcore_dist import McoreDistError, _check_tiling


def _md(n: int, overlap: bool) -> Metadata:
    chunks = [ChunkStorageMetadata(offsets=torch.Size([0, i]), sizes=torch.Size([4, 1])) for i in range(n)]
    if overlap:
        chunks[-1] = ChunkStorageMetadata(offsets=torch.Size([0, n - 2]), sizes=torch.Size([4, 1]))
    entry = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([4, n]),
                                  chunks=chunks)
    return Metadata(state_dict_metadata={"w": entry})


def _time(md, trials: int) -> tuple:
    """(best wall seconds, best CPU seconds of this process): on a shared host the CPU time is
    what the check costs, the wall time what it cost under that load."""
    wall = cpu = float("inf")
    for _ in range(trials):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            _check_tiling(md, "/bench", ["w"])
        except McoreDistError:
            pass
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall, cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    out = {"bench": "chunk_tiling", "trials": args.trials, "load_average_1min": os.getloadavg()[0],
           "cpus": os.cpu_count(), "results": []}
    for n in args.chunks:
        for overlap in (False, True):
            wall, cpu = _time(_md(n, overlap), args.trials)
            out["results"].append({"chunks": n, "overlap": overlap, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                                   "cpu_us_per_chunk": round(cpu / n * 1e6, 3)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
