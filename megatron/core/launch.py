"""Run a function on N ranks of this machine, each in a process group on loopback; collect the results.

One launcher for the tests (forked gloo ranks), the multi-rank benchmarks and the profiler's
tensor-parallel runs (spawned, gloo or NCCL). `run_ranks(fn, world, *args)` starts `world`
processes; rank r joins the process group (MASTER_ADDR 127.0.0.1, a free port, RANK/LOCAL_RANK/
WORLD_SIZE set as torchrun would) and returns `fn(r, world, *args, **kwargs)` (picklable). The
parent gets the results in rank order. A rank that raises is re-raised in the parent with its
traceback; a rank that dies without a word (segfault, OOM kill) is named with its exit code; ranks
that never report are named after the timeout. Either way the other ranks (blocked in a
collective) are killed, so nothing hangs and nothing is left behind.

Fork (0.1-0.3 s per start) is safe when the parent has not started an OpenMP pool, or when each
rank keeps one intra-op thread (libgomp is not fork-safe with more); spawn (seconds) is safe
always, and needs `fn` importable by name.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Callable, List, Optional

_post: Optional[Callable] = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(message) -> None:
    """From inside a rank: hand `message` to the parent's `on_message(rank, message)` now
    (progress lines of a long run). A no-op outside `run_ranks`."""
    if _post is not None:
        _post(message)


def _child(rank, world, port, fn, args, kwargs, results, timeout_s, env, threads, backend):
    global _post
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _post = lambda message: results.put((rank, "message", pickle.dumps(message)))  # noqa: E731
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        # Pickled here, not by the queue's feeder thread: an unpicklable result is this rank's error.
        results.put((rank, "ok", pickle.dumps(fn(rank, world, *args, **kwargs))))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
        _flush_and_exit(results, 1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    _flush_and_exit(results, 0)


def _flush_and_exit(results, code: int) -> None:
    # Queue.put hands the payload to a feeder thread; exiting before it has written a large
    # result would leave the parent blocked reading half a message. os._exit: a forked child
    # must not run the parent's atexit handlers (pytest's, a benchmark's).
    results.close()
    results.join_thread()
    os._exit(code)


def run_ranks(fn: Callable, world: int, *args, timeout_s: float, kwargs: Optional[dict] = None,
              start: str = "fork", backend: str = "gloo", threads: Optional[int] = 1, env: Optional[dict] = None,
              on_message: Optional[Callable] = None, slack_s: float = 0.0, join_s: float = 5.0,
              what: str = "", error: type = RuntimeError) -> List:
    """`[fn(r, world, *args, **kwargs) for r in range(world)]`, each on its own rank.

    timeout_s: the process group's collective timeout; the parent waits `slack_s` longer, so
    a rank stuck in a collective reports its own error first. threads: intra-op threads per rank
    (None leaves torch's default). env: extra environment of every rank. on_message(rank, msg):
    called in the parent for each `post(msg)` of a rank. Failures raise `error` whose message
    starts with `what`.
    """
    ctx = mp.get_context(start)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, dict(kwargs or {}), results, timeout_s,
                                              dict(env or {}), threads, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    head = f"{what}: " if what else ""
    outs: dict = {}
    deadline = time.monotonic() + timeout_s + slack_s
    try:
        while len(outs) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world)) - set(outs))
                raise error(f"{head}timed out after {timeout_s:.0f}s; ranks {missing} did not finish")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outs and p.exitcode not in (None, 0)]
                if not dead:
                    continue
                try:  # give a failing rank a moment to deliver its traceback before reporting
                    rank, status, payload = results.get(timeout=2.0)
                except queue.Empty:
                    raise error(f"{head}rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
            if status == "error":
                raise error(f"{head}rank {rank} failed:\n{payload}")
            if status == "message":
                if on_message is not None:
                    on_message(rank, pickle.loads(payload))
                continue
            outs[rank] = pickle.loads(payload)
    finally:
        end = time.monotonic() + join_s  # one grace period for all, not one per rank
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in procs:  # a failed rank leaves its peers blocked in a collective: end them
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outs[r] for r in range(world)]
