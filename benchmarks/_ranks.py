"""One launcher for the benchmarks that run several gloo ranks in forked processes.

`run_ranks(fn, world, *args)` forks `world` processes; each sets one intra-op thread, joins a
gloo process group on 127.0.0.1 and returns `fn(rank, world, *args)` (anything picklable).
The parent collects every rank's result in rank order. A rank that raises is reported with its
traceback and rank; a rank that never reports is named after `timeout_s`; either way the other
ranks (blocked in a collective) are ended, so a benchmark never hangs.

Forking is safe here because the parent never computes (libgomp is not fork-safe after use).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Callable, List


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world, port, timeout_s, results, args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - the parent reports it with the rank's traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(fn: Callable, world: int, *args, timeout_s: float = 1800.0, what: str = "benchmark") -> List:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, timeout_s, results, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, status, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world)) - set(out))
                raise RuntimeError(f"{what} timed out after {timeout_s:.0f}s; ranks {missing} did not report") from None
            if status != "ok":
                raise RuntimeError(f"{what} rank {rank} failed:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:  # a failed rank leaves its peers blocked in gloo: end them
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
    return [out[r] for r in range(world)]
