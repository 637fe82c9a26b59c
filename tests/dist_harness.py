"""Run a test function on N gloo ranks on loopback.

Ranks are forked (0.1-0.3 s per test instead of ~8 s for spawn), run with one intra-op thread
(libgomp is not fork-safe with more after the parent used OpenMP), and are killed when the
test ends or times out, so nothing is left behind. A failure on any rank is re-raised in the
test process with that rank's traceback.
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(AssertionError):
    pass


def _child(rank, world, port, fn, args, kwargs, results, timeout_s, env):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
    )
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        out = fn(rank, world, *args, **kwargs)
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - everything goes back to the test process
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
    # Queue.put hands the payload to a feeder thread; os._exit before it has written a large
    # result would leave the test process blocked reading half a message.
    results.close()
    results.join_thread()
    os._exit(code)


def run_distributed(fn, world: int = 2, *args, timeout_s: float = 60.0, env=None, **kwargs):
    """Run `fn(rank, world, *args, **kwargs)` on `world` forked gloo ranks.

    Returns the list of per-rank return values (must be picklable). Raises `RankFailed`
    with the first failing rank's traceback, or on timeout, naming the ranks still running.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world, port, fn, args, kwargs, results, timeout_s, dict(env or {})),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outs: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s + 10
    try:
        while len(outs) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world)) - set(outs))
                raise RankFailed(f"timed out after {timeout_s:.0f}s; ranks {missing} did not finish")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outs and p.exitcode not in (None, 0)]
                if dead:
                    # Give a failing rank a moment to deliver its traceback before reporting.
                    try:
                        rank, status, payload = results.get(timeout=2.0)
                    except queue.Empty:
                        raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                else:
                    continue
            if status == "error":
                raise RankFailed(f"rank {rank} failed:\n{payload}")
            outs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outs[r] for r in range(world)]
