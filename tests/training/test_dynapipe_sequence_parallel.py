"""DynaPipe with --sequence-parallel (TP2 x PP2, and stages with their own TP/DP sizes) leaves
exactly the parameters of one single-process step on the whole batch (fp32): its micro-batches
of any padded length are cut along the sequence between the TP ranks and sent between the
stages as sequence shards."""
import json

import pytest

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity
from tests.training.test_dynapipe_training import GPT_COST_MODEL, multitask  # noqa: F401 (fixture: multi-task data)

pytestmark = pytest.mark.parity


def tp_cost_model(path, tp: int = 2) -> str:
    """The shipped CPU cost model (TP 1 only) with every profile copied for TP `tp`: per-rank
    parameter counts, bytes and model state divided by `tp`, times and activation memory left
    as they are. The planner's choices (micro-batches, schedule, recompute) depend on these
    numbers, the training's correctness does not: any plan must give the whole-batch step."""
    with open(GPT_COST_MODEL) as f:
        doc = json.load(f)
    doc["parameters"][str(tp)] = {c: {k: v // tp for k, v in p.items()} for c, p in doc["parameters"]["1"].items()}
    doc["profiles"] += [dict(p, tp=tp, model_state_mb={c: mb / tp for c, mb in p["model_state_mb"].items()})
                        for p in doc["profiles"] if p["tp"] == 1]
    doc["name"] += f"_tp{tp}_copy"
    with open(path, "w") as f:
        json.dump(doc, f)
    return str(path)


def _train(rank, world, data, mode, cost_model=None, stage_parallel=None, stage_layers=None):
    """tests/training/test_dynapipe_training.py's GPT run; 'dynapipe' here is TP2 x PP2 with SP, or with
    `stage_parallel` one pipeline whose stages have their own (TP, DP) sizes."""
    import dataclasses
    from datetime import timedelta

    import torch

    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    from tests.parity_utils import train_and_record
    from tests.training.test_dynapipe_training import VOCAB, _cfg

    tp, pp = (2, 2) if mode == "dynapipe" else (1, 1)
    cfg = _cfg(world, "gpt", data, mode, pp=pp, tp=tp)
    if mode == "dynapipe":  # rebuilt, so the configuration's checks run on the combination
        parallel, training = cfg.parallel, cfg.training
        if stage_parallel:  # as tests/aceso/test_hetero_compose.py's multi-task run lays them out
            parallel = dataclasses.replace(parallel, stage_parallel=stage_parallel, pipeline_stage_layers=stage_layers,
                                           tensor_model_parallel_size=max(t for t, _ in stage_parallel))
            training = dataclasses.replace(training, micro_batch_size=4, global_batch_size=None)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, sequence_parallel=True),
                                  data=dataclasses.replace(cfg.data, dynapipe_cost_model=cost_model),
                                  parallel=parallel, training=training)
    cfg.model.vocab_size = VOCAB
    ps = initialize_parallel(cfg, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    trainer = build_gpt_trainer(cfg, ps, torch.device("cpu"))
    return dict(train_and_record(trainer, world), sp_params=len(trainer.sequence_parallel_params))


def test_tp2_copy_of_the_cpu_cost_model_passes_the_readers_checks(tmp_path):
    from megatron.planner.cost.cost_model import CostModel
    cm = CostModel.load(tp_cost_model(tmp_path / "cm.json"))
    cm.require_tp(2)
    assert cm.tps() == [1, 2] and cm.levels(2) == cm.levels(1)
    assert cm.param_mb("encoder", 2) == pytest.approx(cm.param_mb("encoder", 1) / 2)


@pytest.fixture(scope="module")
def reference(multitask):
    return run_distributed(_train, 1, multitask, "whole")


def _check(ref, outs):
    last = [o for o in outs if o["is_last"]][0]
    assert all(i["planner"] == "dynapipe" for i in last["info"])
    assert any(o["sp_params"] for o in outs)  # layer norms run on sequence shards (at TP > 1)
    assert max(i["num_microbatches"][0] for i in last["info"]) > 1  # really cut into several micro-batches
    assert last["samples"] == [o for o in ref if o["is_last"]][0]["samples"]
    assert_parity(ref, outs)


def test_dynapipe_sequence_parallel_tp2_pp2_equals_whole_batch_step(multitask, reference, tmp_path):
    _check(reference, run_distributed(_train, 4, multitask, "dynapipe", tp_cost_model(tmp_path / "cm.json")))


def test_dynapipe_sequence_parallel_on_heterogeneous_stages_equals_whole_batch_step(multitask, reference, tmp_path):
    """Stages TP2 x DP1 | TP1 x DP2 (an Aceso layout): the planner lowers whole-sequence
    messages and the layout pass cuts each stage's sequence pieces at that stage's own TP."""
    outs = run_distributed(_train, 4, multitask, "dynapipe", tp_cost_model(tmp_path / "cm.json"),
                           [[2, 1], [1, 2]], [1, 3])
    _check(reference, outs)


def test_lengths_are_padded_to_a_multiple_of_every_tp_under_sequence_parallel(tmp_path):
    """Each TP rank holds an equal piece of the sequence, so at a TP that does not divide 8
    (here 3) the trainer pads lengths to lcm(8, TP); the planner refuses a padding that leaves
    pieces of different lengths instead of sending [s // tp, b, h] pieces that do not fit."""
    import numpy as np

    from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
    from megatron.training.supervised import pad_multiple
    from tests.parity_utils import tiny_config
    tp3 = dict(world=3, tp=3, hidden=48, heads=6, seq=48)
    assert pad_multiple(tiny_config(**tp3, arch=dict(sequence_parallel=True))) == 24
    assert pad_multiple(tiny_config(**tp3)) == 8
    cfg = dict(cost_model_path=tp_cost_model(tmp_path / "cm.json", 3), hidden_size=48, num_layers=4,
               pipeline_parallel=2, tensor_parallel=3, sequence_parallel=True, memory_limit_mb=400)
    with pytest.raises(ValueError, match=r"pad_multiple \(8\) must be a multiple of every TP size \(\[3\]\)"):
        DynaPipeConfig(**cfg)
    plan = DynaPipePlanner(DynaPipeConfig(**cfg, pad_multiple=24)).plan(np.random.default_rng(0).integers(5, 60, 40))
    lengths = {s[0][1] for g in plan.groups for s in g.shapes}
    assert len(lengths) > 1 and all(n % 24 == 0 for n in lengths)
