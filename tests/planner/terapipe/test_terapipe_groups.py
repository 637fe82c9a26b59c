"""TeraPipe's two-level DP (uneven batch groups, each with its own slicing) equals brute force
over every grouping and slicing, is never slower than equal micro-batches, and respects memory."""
import itertools
import random

import numpy as np
import pytest

from megatron.planner.terapipe.lowering import EXACT_MAX_TOKENS, default_cap_tolerance, pipeline_score, plan_batch
from megatron.planner.terapipe.groups import plan_batch_groups


def _t(rng):
    a, b, c, d = (rng.uniform(0.1, 3.0) for _ in range(4))
    e = rng.uniform(0, 0.02)
    p = rng.uniform(0.5, 1.0)  # sub-linear in the group size: bigger groups amortise overheads
    return lambda bb, l, ctx: a + bb ** p * (b * l + c * l * l / 64 + d * e * l * ctx)


def _partitions(n, largest=None):
    largest = largest or n
    if n == 0:
        yield []
        return
    for b in range(min(n, largest), 0, -1):
        for rest in _partitions(n - b, b):
            yield [b] + rest


def _slicings(seq, grid):
    inner = list(range(grid, seq, grid))
    for mask in range(1 << len(inner)):
        cuts = [0] + [p for i, p in enumerate(inner) if mask >> i & 1] + [seq]
        yield [b - a for a, b in zip(cuts, cuts[1:])]


def _brute(batch, seq, K, t, grid, mem_ok=None):
    best = np.inf
    sl = list(_slicings(seq, grid))
    for part in _partitions(batch):
        for combo in itertools.product(sl, repeat=len(part)):
            if mem_ok and not all(mem_ok(b, s) for b, s in zip(part, combo)):
                continue
            times = [t(b, ln, c) for b, s in zip(part, combo) for ln, c in zip(s, np.cumsum([0] + s[:-1]))]
            best = min(best, pipeline_score(times, K))
    return best


def _check(plan, batch, seq, K, t):
    assert sum(b for b, _ in plan.groups) == batch and all(sum(s) == seq for _, s in plan.groups)
    times = [t(b, ln, c) for b, s in plan.groups for ln, c in zip(s, np.cumsum([0] + s[:-1]))]
    assert plan.score == pytest.approx(pipeline_score(times, K), rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("batch,K", [(3, 4), (4, 2), (5, 8)])
def test_groups_equal_brute_force(seed, batch, K):
    t = _t(random.Random(seed * 31 + batch * 7 + K))
    plan = plan_batch_groups(batch, 32, K, t, grid=8, cap_tolerance=0.0)
    _check(plan, batch, 32, K, t)
    assert plan.score == pytest.approx(_brute(batch, 32, K, t, 8), rel=1e-12)
    assert plan.score <= plan.uniform_score + 1e-12


def test_uneven_groups_can_beat_equal_micro_batches():
    wins = 0
    for seed in range(40):
        t = _t(random.Random(seed))
        plan = plan_batch_groups(5, 32, 4, t, grid=8, cap_tolerance=0.0)
        _, uni = plan_batch(5, 32, 4, t, grid=8, cap_tolerance=0.0)
        assert plan.uniform_score == pytest.approx(uni.score)
        wins += plan.score < uni.score * (1 - 1e-9)
    assert wins > 0  # 5 sequences: equal groups are 5 x 1 or 1 x 5; 2 + 3 is sometimes better


def test_memory_limit_is_respected():
    t = _t(random.Random(3))
    mem_ok = lambda b, s: b * max(s) <= 48  # noqa: E731  (a group's largest slice bounds its memory)
    plan = plan_batch_groups(4, 32, 4, t, grid=8, mem_ok=mem_ok, cap_tolerance=0.0)
    assert all(mem_ok(b, s) for b, s in plan.groups)
    assert plan.score == pytest.approx(_brute(4, 32, 4, t, 8, mem_ok), rel=1e-12)


def test_default_tolerance_is_exact_for_short_sequences():
    assert default_cap_tolerance(EXACT_MAX_TOKENS) == 0.0 and 0 < default_cap_tolerance(4096) <= 0.001
