"""The simulator times compressed gradient messages at their compressed size."""
import numpy as np

from megatron.planner.schedule.schedules import one_f_one_b
from megatron.planner.schedule.simulator import PipelineCosts, simulate


def _costs(grad_comm=None, epilogue=False, S=4, K=8):
    ones = np.ones((S, K))
    return PipelineCosts(ones, 2 * ones, ones, ones, 3.0 * ones, grad_comm=grad_comm,
                         grad_comm_epilogue_only=epilogue)


def test_compressed_gradients_shorten_the_pipeline_and_epilogue_only_sits_between():
    S, K = 4, 8
    orders = one_f_one_b(S, list(range(K)))
    base = simulate(_costs(), orders)
    fast = simulate(_costs(0.5 * np.ones((S, K))), orders)
    epi = simulate(_costs(0.5 * np.ones((S, K)), epilogue=True), orders)
    assert fast.makespan < epi.makespan < base.makespan
    grads = [t for t in epi.comm if t[0] == "grad"]
    # Rank r's drain is its last S - r backwards: those gradients take 0.5 ms, the rest 3 ms.
    for kind, mb, stage, src, dst, t0, t1 in grads:
        drain = mb >= K - (S - stage)
        assert abs((t1 - t0) - (0.5 if drain else 3.0)) < 1e-9, (mb, stage)
    # Subsets keep the compressed table.
    sub = _costs(0.5 * np.ones((S, K)), epilogue=True).subset([0, 2])
    assert sub.grad_comm.shape == (S, 2) and sub.grad_comm_epilogue_only
