"""The CP size chosen per micro-batch (`--dynapipe-cp-sizes`) trains exactly the single-process
whole-batch step (fp32, parity_utils' derived bounds) on multi-task data: within each CP group of
N ranks, short micro-batches run whole on one rank (extra data parallelism) and long ones cut over
a nested sub-group, each rank running its own lane of the plan. The plan really mixes sizes (a
memory limit under which the longest micro-batches fit only on a CP group); the planner's own
checks are in tests/planner/dynapipe/test_variable_cp_planner.py."""
import dataclasses

import pytest

from tests.dist_harness import run_distributed
from tests.parity_utils import train_and_record
from tests.training.test_dynapipe_training import multitask  # noqa: F401 (the data fixture)

pytestmark = pytest.mark.parity
TOKENS = 700  # global batches where plans mix sizes on this table (a long micro-batch on a CP group beside short ones)


@pytest.fixture(scope="module")
def whole_reference(multitask):  # noqa: F811
    """One process, each global batch as one micro-batch."""
    return run_distributed(_whole, 1, multitask, TOKENS)


def _whole(rank, world, data, tokens):
    """The single-process whole-batch step at another token budget (test_dynapipe_training._train's)."""
    from datetime import timedelta

    import torch

    import tests.training.test_dynapipe_training as td
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    cfg = td._cfg(1, "gpt", data, "whole")
    cfg.data = dataclasses.replace(cfg.data, tokens_per_global_batch=tokens)
    cfg.model.vocab_size = td.VOCAB
    ps = initialize_model_parallel(1, 1, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    return train_and_record(build_gpt_trainer(cfg, ps, torch.device("cpu")), 1)


def _variable_cp(rank, world, data, cp, sizes, memory_mb, comm, workers, pp=1, tokens=None):
    import multiprocessing as mp
    from datetime import timedelta

    import torch

    import tests.training.test_dynapipe_training as td
    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    mp.current_process().daemon = False  # rank 0 may start planner worker processes
    cfg = td._cfg(world, "gpt", data, "dynapipe", pp=pp, workers=workers)
    cfg.data = dataclasses.replace(cfg.data, dynapipe_cp_sizes=tuple(sizes), dynapipe_memory_limit=memory_mb,
                                   tokens_per_global_batch=tokens or cfg.data.tokens_per_global_batch)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context_parallel_size=cp,
                                                                cp_comm_type=comm))
    cfg.model.vocab_size = td.VOCAB
    ps = initialize_parallel(cfg, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    out = train_and_record(build_gpt_trainer(cfg, ps, torch.device("cpu")), world)
    out["cp_rank"] = ps.cp_rank
    return out


@pytest.mark.parametrize("world,cp,sizes,comm,workers,pp", [
    (2, 2, (1, 2), "p2p", 0, 1), (4, 4, (1, 2, 4), "all_gather", 0, 1),
    (4, 2, (1, 2), "p2p", 1, 1),  # plans made by a planner worker, shipped over the plan service's wire
    (4, 2, (1, 2), "p2p", 0, 2),  # CP 2 x PP 2: each lane a pipeline, all forwards then all backwards
], ids=["cp2_sizes12", "cp4_sizes124", "dp2_cp2_sizes12_plan_service", "cp2_pp2_sizes12"])
def test_variable_cp_equals_whole_batch_step(multitask, whole_reference, world, cp, sizes, comm, workers,  # noqa: F811
                                             pp):
    import tests.training.test_dynapipe_training as td
    ref = whole_reference
    memory_mb = 48.0 / pp  # a stage holds 1/PP of the layers
    outs = run_distributed(_variable_cp, world, multitask, cp, sizes, memory_mb, comm, workers, pp, TOKENS,
                           timeout_s=240)
    td._check(ref, outs)
    # every rank ran its own lane; over the run the plans used more than one CP size, and a
    # micro-batch at CP 1 ran on one rank alone
    used = {c for o in outs for i in o["info"] for c in i["cp_sizes"]}
    assert len(used) > 1 and 1 in used, used
    # and at least one plan mixed sizes: sub-groups of different sizes side by side
    assert any(len(i["cp_size_counts"]) > 1 for o in outs for i in o["info"]), [o["info"] for o in outs]
    assert all(i["planner"] == "dynapipe" for o in outs for i in o["info"])
