"""Run a test function on N gloo ranks on loopback (megatron.core.launch, forked ranks).

Forked ranks start in 0.1-0.3 s instead of ~8 s for spawn, with one intra-op thread each;
they are killed when the test ends or times out, so nothing is left behind. A failure on any
rank is re-raised in the test process as `RankFailed` (an assertion) with that rank's traceback.
"""
from __future__ import annotations

from megatron.core.launch import free_port, run_ranks

__all__ = ["RankFailed", "free_port", "run_distributed"]


class RankFailed(AssertionError):
    pass


def run_distributed(fn, world: int = 2, *args, timeout_s: float = 60.0, env=None, **kwargs):
    """Run `fn(rank, world, *args, **kwargs)` on `world` forked gloo ranks.

    Returns the list of per-rank return values (must be picklable). Raises `RankFailed`
    with the first failing rank's traceback, or on timeout, naming the ranks still running.
    """
    return run_ranks(fn, world, *args, kwargs=kwargs, timeout_s=timeout_s, slack_s=10.0, env=env, error=RankFailed)
