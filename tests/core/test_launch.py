"""megatron.core.launch: results in rank order; a failing, dying or stuck rank is named, and no
rank outlives the call."""
import os
import time

import pytest

from megatron.core import launch


def _sum_of_ranks(rank, world, scale, *, offset=0):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    launch.post(f"rank {rank} of {world} ({os.environ['RANK']}/{os.environ['WORLD_SIZE']})")
    return {"pid": os.getpid(), "value": scale * t.item() + offset}


def test_results_in_rank_order_with_args_kwargs_and_messages():
    got = []
    out = launch.run_ranks(_sum_of_ranks, 3, 10, kwargs={"offset": 1}, timeout_s=60,
                           on_message=lambda rank, msg: got.append((rank, msg)))
    assert [o["value"] for o in out] == [31.0, 31.0, 31.0]
    assert sorted(got) == [(r, f"rank {r} of 3 ({r}/3)") for r in range(3)]
    assert len({o["pid"] for o in out}) == 3 and os.getpid() not in {o["pid"] for o in out}


def _one_rank_raises(rank, world):
    if rank == 1:
        raise ValueError("bad shard 7")
    import torch.distributed as dist
    dist.barrier()  # the peer waits here until it is killed


def _one_rank_dies(rank, world):
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def _returns_unpicklable(rank, world):
    return lambda: None


class Custom(AssertionError):
    pass


@pytest.mark.parametrize("fn, pattern", [
    (_one_rank_raises, r"(?s)^job: rank 1 failed:\n.*ValueError: bad shard 7"),
    (_one_rank_dies, r"^job: rank 1 died with exit code 3$"),
    (_returns_unpicklable, r"(?s)rank \d failed:\n.*(pickle|lambda)"),
])
def test_failures_name_the_rank_and_end_the_others(fn, pattern):
    t0 = time.monotonic()
    with pytest.raises(Custom, match=pattern):
        launch.run_ranks(fn, 2, timeout_s=30, what="job", error=Custom)
    assert time.monotonic() - t0 < 25  # reported at once, not at the timeout
    import multiprocessing
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def _sleeps(rank, world):
    time.sleep(60 if rank == 0 else 0)


def test_timeout_names_the_ranks_that_did_not_finish():
    # [0, 1] when a loaded machine has not even finished rank 1 within the 20 s
    with pytest.raises(RuntimeError, match=r"^timed out after 20s; ranks \[0(, 1)?\] did not finish$"):
        launch.run_ranks(_sleeps, 2, timeout_s=20)
