import functools
import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron.planner.service.service import PlanService, PlanServiceError
from tests.dist_harness import free_port, run_distributed
from tests.planner.plan_fns import crashing_plan, failing_plan, fake_plan, logging_plan, parent_pid_plan


def local_store():
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))


def test_single_process_order_and_cleanup():
    store = local_store()
    with PlanService(fake_plan, 0, 1, store, lookahead=2, num_workers=2, num_iterations=6, prefix="t1") as svc:
        got = [svc.get(i) for i in range(6)]
    assert got == [fake_plan(i) for i in range(6)]
    for i in range(6):  # every key of a consumed iteration is gone
        assert not store.check([f"t1/{i}", f"t1/{i}/readers", f"t1/{i}/digest"])


def test_lookahead_is_bounded(tmp_path):
    store = local_store()
    log = tmp_path / "planned"

    def planned(at_least):
        deadline = time.time() + 10
        while time.time() < deadline:
            if log.exists() and len(log.read_text().split()) >= at_least:
                break
            time.sleep(0.01)
        time.sleep(0.3)  # give a wrongly eager producer the chance to plan more
        return sorted(int(x) for x in log.read_text().split())

    with PlanService(functools.partial(logging_plan, str(log)), 0, 1, store, lookahead=2, num_workers=3, prefix="t2") as svc:
        assert planned(2) == [0, 1]  # nothing read yet: only `lookahead` iterations planned
        assert svc.get(0) == 0
        assert planned(3) == [0, 1, 2]


def test_timeout_names_iteration():
    store = local_store()
    svc = PlanService(None, 1, 2, store, timeout_s=0.5, prefix="t3")  # nobody produces
    with pytest.raises(PlanServiceError, match="iteration 7"):
        svc.get(7)


def _ranks_read(rank, world, plan_fn, n, workers=2):
    # The harness forks daemonic ranks; rank 0 must be allowed to start planner processes.
    mp.current_process().daemon = False
    svc = PlanService(plan_fn if rank == 0 else None, rank, world, lookahead=2, num_workers=workers,
                      prefix="dist", timeout_s=20)
    out = []
    try:
        for i in range(n):
            try:
                out.append(svc.get(i))
            except PlanServiceError as e:
                out.append(f"error: {e}")
                break
    finally:
        dist.barrier()  # keep the store (rank 0) alive until everyone has read
        svc.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_all_ranks_get_the_same_plans(world):
    outs = run_distributed(_ranks_read, world, fake_plan, 5, timeout_s=60)
    for out in outs:
        assert out == [fake_plan(i) for i in range(5)]


def test_planner_failure_reaches_every_rank():
    outs = run_distributed(_ranks_read, 2, failing_plan, 6, timeout_s=60)
    for out in outs:
        assert out[:3] == [fake_plan(i) for i in range(3)]
        assert len(out) == 4
        assert out[3].startswith("error: planner failed for iteration 3")
        assert "cost model says no" in out[3]
        # The worker's own traceback (its frame and source line), not only the message.
        assert "failing_plan" in out[3] and 'raise ValueError("cost model says no")' in out[3]


def test_worker_crash_names_iteration_and_worker_stack():
    # One worker: iterations 0 and 1 are done before iteration 2 kills it (with two, a dying
    # worker also fails whatever the other one is still planning).
    outs = run_distributed(_ranks_read, 2, crashing_plan, 5, 1, timeout_s=60)
    for out in outs:
        assert out[:2] == [fake_plan(0), fake_plan(1)]
        assert len(out) == 3
        assert out[2].startswith("error: planner failed for iteration 2")
        assert "worker process died while iteration 2 was planned" in out[2]
        assert "crashing_plan" in out[2]  # faulthandler's dump of the dying worker's Python stack


def test_workers_are_not_forked_from_the_training_process():
    store = local_store()
    with PlanService(parent_pid_plan, 0, 1, store, lookahead=1, num_workers=1, num_iterations=1, prefix="t5") as svc:
        assert svc.get(0) != os.getpid()  # the fork server is the parent, not this process


def test_different_bytes_are_detected():
    store = local_store()
    svc = PlanService(None, 1, 2, store, prefix="t4", timeout_s=2)
    from megatron.planner.service import wire
    from megatron.planner.service.service import NO_BATCH, plan_record
    store.set("t4/job", b"j" * 16)
    for payload in (wire.encode("a"), wire.encode("b")):
        store.set("t4/0", plan_record(0, b"j" * 16, NO_BATCH, payload))
        if payload == wire.encode("a"):
            assert svc.get(0) == "a"
    with pytest.raises(PlanServiceError, match="different plan for iteration 0"):
        svc.get(0)
