"""FixedBatchPlanner: plans are reused per shape set, and the cache stays bounded."""
from megatron.planner.schedule.fixed import FixedBatchPlanner


def test_plan_cache_reuses_and_is_bounded():
    planner = FixedBatchPlanner("1f1b", 2, 1, lambda shapes: (lambda mb, st: ((shapes[mb][0][1], shapes[mb][0][0], 8),)),
                                "none", "float32")
    first = planner.plans(1, [((2, 16),), ((2, 24),)])
    again = planner.plans(2, [((2, 16),), ((2, 24),)])
    assert [p.instructions for p in first] == [p.instructions for p in again]
    assert [p.iteration for p in again] == [2, 2]
    for s in range(FixedBatchPlanner.CACHE_SIZE + 10):
        planner.plans(3 + s, [((1, 8 * (s + 1)),)])
    assert len(planner._cache) == FixedBatchPlanner.CACHE_SIZE
