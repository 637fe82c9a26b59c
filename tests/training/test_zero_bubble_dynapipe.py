"""DynaPipe with the split backward (--dynapipe --pipeline-schedule zb-h1) trains like the
whole-batch step: its plans place weight-gradient passes of variable micro-batches into the
bubbles, and the executor runs them (parity bounds of tests/parity_utils)."""
import dataclasses

import pytest

from tests.dist_harness import run_distributed
from tests.training.test_dynapipe_training import _check, gpt_reference, multitask  # noqa: F401 (fixtures)

pytestmark = pytest.mark.parity


def _train(rank, world, data):
    import megatron.pipeline.executor as ex
    import tests.training.test_dynapipe_training as td
    orig_cfg, orig_w = td._cfg, ex.PipelineExecutor._HANDLERS[ex.I.BackwardWeight]
    weights = []

    def cfg(*a, **k):
        c = orig_cfg(*a, **k)
        return dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, pipeline_schedule="zb-h1"))

    def count(self, ins):
        weights.append((ins.microbatch, ins.stage))
        return orig_w(self, ins)
    td._cfg = cfg
    ex.PipelineExecutor._HANDLERS[ex.I.BackwardWeight] = count  # (this rank's process only)
    try:
        return dict(td._train(rank, world, "gpt", data, "dynapipe", pp=2), weight_passes=len(weights))
    finally:
        td._cfg = orig_cfg
        ex.PipelineExecutor._HANDLERS[ex.I.BackwardWeight] = orig_w


def test_gpt_dynapipe_split_backward_pp2_equals_whole_batch_step(multitask, gpt_reference):  # noqa: F811
    outs = run_distributed(_train, 2, multitask)
    assert all(i["planner"] == "dynapipe" for o in outs for i in o["info"])
    assert sum(o["weight_passes"] for o in outs) > 0  # the planner did split some backwards
    _check(gpt_reference, outs)
