"""Plan functions for the plan-service tests. A module of its own without torch, so the
service's fork server (which preloads it) and its workers start quickly."""
import os


def fake_plan(iteration):
    # Deterministic, picklable, and different per iteration.
    return {"iteration": iteration, "microbatches": [[iteration, k] for k in range(iteration % 3 + 1)]}


def failing_plan(iteration):
    if iteration == 3:
        raise ValueError("cost model says no")
    return fake_plan(iteration)


def crashing_plan(iteration):
    if iteration == 2:
        os.abort()  # the worker dies: no exception travels back, only faulthandler's stack
    return fake_plan(iteration)


def parent_pid_plan(iteration):
    return os.getppid()


def logging_plan(path, iteration):
    with open(path, "a") as f:
        f.write(f"{iteration}\n")
    return iteration
