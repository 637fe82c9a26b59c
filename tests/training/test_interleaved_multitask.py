"""Interleaved schedule (--num-layers-per-virtual-pipeline-stage) x multi-task data: packed rows
(--pack-dataset) and fixed-size micro-batches of (input, target) samples batched by tokens give
a number of micro-batches that varies with the data and is often not a multiple of PP. The
static interleaved schedule runs the remainder in the last group of PP
(megatron/planner/schedule/interleaved_order.py); a GPT run at PP 2 with 2 chunks a rank on batches of
odd micro-batch counts gives the losses, gradients and parameters of the same run without
interleaving (fp32, tests/parity_utils bounds)."""
import dataclasses

import pytest

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity
from tests.training.test_dynapipe_training import multitask  # noqa: F401 (the data fixture)

pytestmark = pytest.mark.parity


def _train(rank, world, data, mode, mbs, tokens, vpp_layers=None):
    """tests/test_dynapipe_training._train at PP 2 for 3 iterations (--micro-batch-size `mbs`,
    --tokens-per-global-batch `tokens`), with --num-layers-per-virtual-pipeline-stage
    `vpp_layers` when given; also returns the (schedule, micro-batches, chunks) of every
    static plan built."""
    import megatron.planner.schedule.fixed as training  # where FixedBatchPlanner builds its plans
    import tests.training.test_dynapipe_training as td
    orig_cfg, orig_build, built = td._cfg, training.build_static_plans, []

    def cfg(*a, **k):
        c = orig_cfg(*a, **dict(k, iters=3))
        c.data.dynapipe_cost_model = None
        # (global batch size follows the micro-batch size; multi-task batches go by tokens)
        c.training.micro_batch_size = c.training.global_batch_size = mbs
        c.data.tokens_per_global_batch = tokens
        if vpp_layers is None:
            return c
        return dataclasses.replace(c, parallel=dataclasses.replace(  # replace() re-runs the checks
            c.parallel, num_layers_per_virtual_pipeline_stage=vpp_layers))

    def build(schedule, m, pp, chunks, *a, **k):
        built.append((schedule, m, chunks))
        return orig_build(schedule, m, pp, chunks, *a, **k)
    td._cfg, training.build_static_plans = cfg, build
    try:
        return dict(td._train(rank, world, "gpt", data, mode, pp=2), built=built)
    finally:
        td._cfg, training.build_static_plans = orig_cfg, orig_build


# packing: 2 rows of 64 tokens a micro-batch, 5 micro-batches every batch (groups of 2 and 3);
# fixed: 3 samples a micro-batch, padded to their own length: 6, 9 and 11 micro-batches
@pytest.mark.parametrize("mode,mbs,tokens", [("packing", 2, 480), ("fixed", 3, 600)])
def test_interleaved_multitask_pp2_matches_plain_pipeline(multitask, mode, mbs, tokens):  # noqa: F811
    ref = run_distributed(_train, 2, multitask, mode, mbs, tokens)
    outs = run_distributed(_train, 2, multitask, mode, mbs, tokens, 1)  # 4 layers: 2 chunks of 1 a rank
    last = [o for o in outs if o["is_last"]][0]
    counts = [i["num_microbatches"][0] for i in last["info"]]
    assert all(i["planner"] == mode for i in last["info"])
    assert len([m for m in counts if m % 2 and m > 2]) >= (3 if mode == "packing" else 2), counts
    assert {b[0] for o in outs for b in o["built"]} == {"interleaved"}
    assert {b[2] for o in outs for b in o["built"]} == {2}
    assert {b[0] for o in ref for b in o["built"]} != {"interleaved"}
    assert last["samples"] == [o for o in ref if o["is_last"]][0]["samples"]
    assert_parity(ref, outs)
