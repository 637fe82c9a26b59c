"""The MoE dispatcher's all-to-all (uneven splits, as --moe-token-dispatcher-type alltoall sends
them): milliseconds and bus bandwidth per message size, one JSON line per size.

    python benchmarks/bench_moe_alltoall.py [--ranks 2] [--device cpu|cuda] [--hidden 64] [--tokens 256,1024]

EP = --ranks processes (gloo on CPU; NCCL, one GPU per rank, on CUDA). Each rank sends
tokens x top-2 rows of `hidden` values, split over the ranks unevenly (rank r sends
proportionally to 1, 2, ..., EP to the ranks: a skewed router), with the same
`torch.distributed.all_to_all_single` call and split lists the dispatcher makes
(megatron/models/moe/dispatcher.py). Reported per size: the median over --iters of the
slowest rank's time, and busbw = bytes a rank sends to the others / that time (GB/s).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def splits(rows: int, ranks: int):
    w = list(range(1, ranks + 1))
    out = [rows * x // sum(w) for x in w]
    out[-1] += rows - sum(out)
    return out


def worker(rank, a, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=a.ranks)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    for tokens in [int(x) for x in a.tokens.split(",")]:
        send = [splits(tokens * 2, a.ranks) for _ in range(a.ranks)]  # every rank's, so each knows what it receives
        mine = send[rank]
        recv = [send[r][rank] for r in range(a.ranks)]
        x = torch.randn(sum(mine), a.hidden, device=dev, dtype=dtype)
        out = torch.empty(sum(recv), a.hidden, device=dev, dtype=dtype)
        ts = []
        for i in range(a.iters + 1):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_to_all_single(out, x, recv, mine)
            if cuda:
                torch.cuda.synchronize()
            t = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i:
                ts.append(float(t))
        ms = statistics.median(ts)
        sent = (sum(mine) - mine[rank]) * a.hidden * x.element_size()
        if rank == 0:
            q.put({"bench": "moe_alltoall", "ranks": a.ranks, "device": a.device, "dtype": str(dtype).split(".")[-1],
                   "tokens_per_rank": tokens, "topk": 2, "hidden": a.hidden, "bytes_sent_rank0": sent,
                   "ms_median": round(ms, 4), "busbw_gbps": round(sent / ms / 1e6, 3)})
    if rank == 0:
        q.put(None)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", default="256,1024", help="tokens per rank, comma-separated")
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < a.ranks:
        print(f"bench_moe_alltoall: --ranks {a.ranks} needs {a.ranks} GPUs, {torch.cuda.device_count()} visible",
              file=sys.stderr)
        return 2
    q = mp.get_context("spawn").SimpleQueue()
    port = 29700 + os.getpid() % 1000
    ctx = mp.start_processes(worker, args=(a, port, q), nprocs=a.ranks, start_method="spawn", join=False)
    while (row := q.get()) is not None:
        print(json.dumps(row), flush=True)
    ctx.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
