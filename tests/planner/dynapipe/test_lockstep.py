"""DynaPipe for expert parallelism (megatron/planner/dynapipe/lockstep.py): every DP group the same
number of micro-batches and the same 1F1B passes, on a batch where the plain planner gives the
groups different counts (an EP run of that plan would pair one group's forward with another's
backward, or wait forever)."""
import numpy as np
import pytest

from megatron.planner.dynapipe import lockstep
from megatron.planner.dynapipe.partitioner import Partition, PartitionError
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner


def _lengths():  # the multi-task batches of tests/training/test_dynapipe_training.py (GPT: input + target - 1)
    rng = np.random.RandomState(0)
    lin = np.clip(rng.lognormal(2.6, 0.8, 400).astype(int), 2, 60)
    lout = np.clip(rng.lognormal(1.8, 0.7, 400).astype(int), 1, 30)
    return np.minimum(lin + lout - 1, 64)


def _planner(lock: bool, pp: int = 1) -> DynaPipePlanner:
    return DynaPipePlanner(DynaPipeConfig(model_kind="gpt", num_layers=4, hidden_size=32, pipeline_parallel=pp,
                                          cost_model_path="cost_models/cpu_tiny_gpt.json", data_parallel=2,
                                          memory_limit_mb=400.0, lockstep_groups=lock, schedules=("1f1b",)))


@pytest.mark.parametrize("pp", [1, 2])
def test_lockstep_plans_equal_counts_and_passes_where_the_plain_plan_does_not(pp):
    lengths, plain, lock = _lengths(), _planner(False, pp), _planner(True, pp)
    uneven = 0
    for it in range(4):
        batch = lengths[it * 20:(it + 1) * 20].tolist()
        uneven += len({len(g.microbatches) for g in plain.plan(batch, it).groups}) > 1
        got = lock.plan(batch, it)
        assert len({len(g.microbatches) for g in got.groups}) == 1
        assert sorted(i for g in got.groups for mb in g.microbatches for i in mb) == list(range(len(batch)))
        lockstep.check_lockstep(got)
    assert uneven  # the data needs it


def test_check_lockstep_names_the_group_whose_passes_differ():
    plan = _planner(True).plan(_lengths()[:20].tolist())
    ops = plan.groups[1].compute_orders[0]
    plan.groups[1].compute_orders[0] = [ops[1], ops[0]] + ops[2:]  # B before F
    with pytest.raises(RuntimeError, match="DP group 1's pipeline rank 0"):
        lockstep.check_lockstep(plan)


def test_equalize_splits_the_micro_batch_with_most_samples_and_rereads_its_time():
    seg = np.add.outer(np.arange(6.0), np.arange(1.0, 7.0))  # [i, m-1]: i + m
    p = lockstep.equalize(Partition([0, 1, 4, 6], [1.0, 4.0, 6.0], 0.0), seg, 2)
    assert p.boundaries == [0, 1, 2, 4, 6] and p.times == [1.0, 2.0, 4.0, 6.0]
    with pytest.raises(PartitionError, match="single-sample"):
        lockstep.equalize(Partition([0, 1, 2, 3], [1.0] * 3, 0.0), seg, 2)


def test_balance_equal_deals_equal_counts_of_similar_time():
    times = [9.0, 1.0, 1.0, 1.0, 5.0, 4.0]
    groups = lockstep.balance_equal(times, 2)
    assert sorted(i for g in groups for i in g) == list(range(6)) and [len(g) for g in groups] == [3, 3]
    assert abs(sum(times[i] for i in groups[0]) - sum(times[i] for i in groups[1])) <= 1.0
    with pytest.raises(PartitionError):
        lockstep.balance_equal(times[:5], 2)


def test_lockstep_refuses_what_it_does_not_plan():
    with pytest.raises(ValueError, match="lockstep_groups"):
        DynaPipeConfig(model_kind="gpt", num_layers=4, hidden_size=32, cost_model_path="x.json",
                       lockstep_groups=True)  # the default schedules include adaptive
