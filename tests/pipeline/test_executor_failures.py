"""A pipeline peer that dies or stalls becomes an error naming the instruction, never a hang."""
import time

import torch.distributed as dist

from megatron.pipeline.executor import PlanExecutionError
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, tiny_config


def _peer_fails(rank, world, mode):
    cfg = tiny_config(world=world, pp=2, iters=1)
    cfg.parallel.distributed_timeout_minutes = 0.03  # 1.8 s
    t = make_trainer(cfg)
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


def test_stalled_peer_times_out_naming_instruction():
    msg, elapsed = run_distributed(_peer_fails, 2, "stall")[0]
    assert "Finish(microbatch=" in msg, msg
    assert "pipeline rank 1" in msg and "timed out" in msg
    assert elapsed < 6


def test_dead_peer_fails_fast_naming_instruction():
    msg, elapsed = run_distributed(_peer_fails, 2, "dead")[0]
    assert "pipeline rank 1" in msg and "the peer probably died" in msg, msg
    assert elapsed < 6
