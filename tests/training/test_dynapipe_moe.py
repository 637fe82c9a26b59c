"""DynaPipe at expert parallelism (issue 47): EP ranks are DP ranks and exchange tokens every
pass, so the planner gives every DP group the same number of micro-batches and 1F1B passes
(megatron/planner/dynapipe/lockstep.py). Exact: EP 2 (world 2, DP 2; and PP 2 x DP 2) with per-batch DynaPipe
plans on heavy-tailed multi-task data leaves the losses, gradients and parameters of one
single-process whole-batch step, for both token dispatchers. Dropless routing without the aux
and z-losses: those are per micro-batch by Megatron's definition, so they change with the cut."""
import multiprocessing as mp

import pytest
from megatron.config.moe import MoEConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, make_trainer, train_and_record
from tests.training.test_dynapipe_training import VOCAB, _cfg, multitask  # noqa: F401 (fixture)
from tests.training.test_moe_parity import moe_shards

pytestmark = pytest.mark.parity


def _train(rank, world, data, mode, ep=1, dispatcher="alltoall", pp=1):
    mp.current_process().daemon = False
    cfg = _cfg(world, "gpt", data, mode, pp=pp)
    cfg.model.vocab_size = VOCAB
    cfg.model.moe = MoEConfig(num_experts=4, router_topk=2, aux_loss_coeff=0.0, z_loss_coeff=0.0,
                              expert_model_parallel_size=ep, token_dispatcher_type=dispatcher)
    trainer = make_trainer(cfg)
    return train_and_record(trainer, world, get=lambda what: moe_shards(trainer, what))


@pytest.fixture(scope="module")
def reference(multitask):  # noqa: F811
    return run_distributed(_train, 1, multitask, "whole")


@pytest.mark.parametrize("dispatcher,pp", [("alltoall", 1), ("allgather", 1), ("alltoall", 2)])
def test_dynapipe_ep2_equals_whole_batch_step(multitask, reference, dispatcher, pp):  # noqa: F811
    outs = run_distributed(_train, 2 * pp, multitask, "dynapipe", 2, dispatcher, pp)
    last = [o for o in outs if o["is_last"]][0]
    assert last["samples"] == [o for o in reference if o["is_last"]][0]["samples"]
    counts = [i["num_microbatches"] for i in last["info"]]  # per iteration, per DP group
    assert all(len(c) == 2 and c[0] == c[1] > 1 for c in counts), counts
    assert_parity(reference, outs)
