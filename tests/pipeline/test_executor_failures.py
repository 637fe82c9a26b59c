"""A pipeline peer that dies or stalls becomes an error naming the instruction, never a hang."""
import time

import torch.distributed as dist

from megatron.pipeline.executor import PlanExecutionError
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, tiny_config


def _built_together(world):
    """Start the step together: under load, building the trainers can skew the ranks by more than
    the seconds-long limits here, and a rank still building would then be blamed (or left inside
    a start-up collective its peer has already passed)."""
    store = dist.distributed_c10d._get_default_store()
    store.add("test/built", 1)
    while store.add("test/built", 0) < world:
        time.sleep(0.02)
    return store


def _peer_fails(rank, world, mode):
    cfg = tiny_config(world=world, pp=2, iters=1)
    cfg.parallel.distributed_timeout_minutes = 0.03  # 1.8 s
    t = make_trainer(cfg)
    _built_together(world)
    if rank == 1:
        if mode == "stall":
            time.sleep(6)
        else:
            dist.destroy_process_group()
        return None
    start = time.monotonic()
    try:
        t.train_step()
    except PlanExecutionError as e:
        return str(e), time.monotonic() - start
    raise AssertionError("rank 0 finished a step without its pipeline peer")


FAST_BEAT = {"MEGATRON_HEARTBEAT_SECONDS": "0.3"}


def test_stalled_peer_times_out_naming_instruction():
    msg, elapsed = run_distributed(_peer_fails, 2, "stall", env=FAST_BEAT)[0]
    assert "Finish(microbatch=" in msg, msg
    assert "pipeline rank 1" in msg and "timed out" in msg
    # rank 1 sleeps in its main thread: its heartbeat thread still beats, so it is not blamed as dead
    assert "every other rank is still alive" in msg, msg
    assert elapsed < 6


def test_dead_peer_fails_fast_naming_instruction():
    msg, elapsed = run_distributed(_peer_fails, 2, "dead")[0]
    assert "pipeline rank 1" in msg and "the peer probably died" in msg, msg
    assert elapsed < 6


def _stopped_last_rank(rank, world):
    import os
    import signal
    import subprocess
    cfg = tiny_config(world=world, pp=4, iters=1)
    cfg.parallel.distributed_timeout_minutes = 0.05  # 3 s
    t = make_trainer(cfg)
    store = _built_together(world)
    if rank == world - 1:
        # Stop this whole process (heartbeat thread included), as SIGSTOP or a hung host would;
        # a child wakes it long after the others have timed out and reported.
        subprocess.Popen(["sh", "-c", f"sleep 9; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    try:
        t.train_step()
    except PlanExecutionError as e:
        msg = str(e)
    else:
        raise AssertionError("finished a step while the last stage was stopped")
    # Rank 0 hosts the TCPStore: survivors that time out later still need it for their own
    # diagnosis, so nobody leaves until every survivor has reported.
    store.add("test/diagnosed", 1)
    deadline = time.monotonic() + 20
    while store.add("test/diagnosed", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return msg


def test_stopped_rank_is_blamed_by_every_survivor():
    msgs = run_distributed(_stopped_last_rank, 4, env=FAST_BEAT, timeout_s=40)
    for rank, msg in enumerate(msgs[:3]):
        # Rank 2 times out on rank 3; rank 1 may then time out too, or see rank 2 drop the connection
        # when it gives up: either way the diagnosis must name rank 3 and only rank 3.
        assert "timed out" in msg or "gave up waiting itself" in msg, (rank, msg)
        assert "not responding" in msg and "global rank 3 (last at" in msg, (rank, msg)
        assert "global rank 2 (" not in msg and "global rank 1 (" not in msg, (rank, msg)
