"""Run `profile_rank` on TP ranks: one spawned process per rank, gloo on CPU, NCCL on CUDA.

Spawn rather than fork: the parent may already have used OpenMP (tests, notebooks) and
libgomp does not survive a fork with its thread pool started. Rank 0's numbers are kept (the
collectives inside every layer keep the ranks in lock-step, so the ranks time the same thing).
"""
from __future__ import annotations

import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.core.parallel_state import ParallelState


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, tp, port, spec, results, timeout_s, profile_rank):
    try:
        cuda = spec.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(rank)
            spec.device = f"cuda:{rank}"
        else:
            torch.set_num_threads(spec.cpu_threads)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=tp, timeout=timedelta(seconds=timeout_s))
        group = dist.new_group(list(range(tp)))
        ps = ParallelState(world_size=tp, rank=rank, tp_size=tp, tp_rank=rank, tp_group=group,
                           tp_global_ranks=list(range(tp)))
        dev = torch.device(spec.device)

        def agree(flag: bool) -> bool:
            t = torch.tensor([1.0 if flag else 0.0], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            return bool(t.item() > 0)

        log = (lambda s: results.put(("log", s))) if rank == 0 else (lambda s: None)
        out = profile_rank(spec, ps, agree=agree, log=log)
        results.put(("ok", out) if rank == 0 else ("done", rank))
    except BaseException:  # noqa: BLE001 - the parent reports it with the rank
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_tp_ranks(spec, tp: int, log, profile_rank, timeout_s: float = 3600.0) -> dict:
    """`profile_rank(spec, ps, agree=, log=)` (a module-level function: it travels to spawned
    processes by name; the profiler passes its own, so this module does not import it) on `tp`
    ranks; returns rank 0's result. Raises RuntimeError with the
    failing rank's traceback, or naming the dead rank."""
    if spec.device.startswith("cuda") and torch.cuda.device_count() < tp:
        raise RuntimeError(f"--tp {tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, spec, results, timeout_s, profile_rank), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    out, done = None, 0
    deadline = time.monotonic() + timeout_s
    try:
        while done < tp:
            try:
                kind, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"profiling rank {dead[0]} of --tp {tp} died "
                                       f"(exit code {procs[dead[0]].exitcode})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"profiling with --tp {tp} timed out after {timeout_s:.0f}s") from None
                continue
            if kind == "log":
                log(payload)
            elif kind == "error":
                raise RuntimeError(f"profiling with --tp {tp} failed on {payload}")
            else:
                done += 1
                if kind == "ok":
                    out = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return out
