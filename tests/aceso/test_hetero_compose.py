"""Stages with their own TP/DP sizes (Aceso layouts) composed with other plan and data features:
each trains exactly like the single-process run of the same batches (fp32, derived bounds)."""
import pytest

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout
from tests.training.test_dynapipe_training import multitask  # noqa: F401 (fixture: multi-task data)

pytestmark = pytest.mark.parity

HETERO = dict(pp=2, stage_parallel=[[2, 1], [1, 2]], stage_layers=[1, 3])  # TP2 -> DP2 on 4 ranks


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, dict(iters=2))


def test_gpipe_on_heterogeneous_stages_matches_single_process(reference):
    """GPipe's orders (all forwards, then all backwards) lowered through the hetero pass."""
    outs = run_distributed(run_layout, 4, dict(HETERO, schedule="gpipe", iters=2))
    assert_parity(reference, outs)


def _train_multitask(rank, world, data, mode, stage_parallel=None, stage_layers=None, kind="gpt"):
    """tests/training/test_dynapipe_training.py's multi-task run (token-budget batches), on stages with
    their own TP/DP sizes when `stage_parallel` is given ('whole' = one micro-batch, 1 rank)."""
    import dataclasses
    from datetime import timedelta

    import torch

    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    from megatron.training.t5_builder import build_t5_trainer
    from tests.parity_utils import train_and_record
    from tests.training.test_dynapipe_training import VOCAB, _cfg
    from tests.training.test_t5_parity import _shards

    cfg = _cfg(world, kind, data, mode)
    if stage_layers:  # rebuilt, so the configuration's checks run on the combination
        cfg = dataclasses.replace(
            cfg, parallel=dataclasses.replace(cfg.parallel, stage_parallel=stage_parallel, pipeline_stage_layers=stage_layers,
                                              pipeline_model_parallel_size=len(stage_layers),
                                              pipeline_model_parallel_split_rank=None,
                                              tensor_model_parallel_size=max(t for t, _ in stage_parallel or [(1, 1)])),
            # the pipeline micro-batch: a multiple of every stage's DP
            training=dataclasses.replace(cfg.training, micro_batch_size=4, global_batch_size=None))
    cfg.model.vocab_size = VOCAB
    ps = initialize_parallel(cfg, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    trainer = (build_gpt_trainer if kind == "gpt" else build_t5_trainer)(cfg, ps, torch.device("cpu"))
    return train_and_record(trainer, world, None if kind == "gpt" else (lambda what: _shards(trainer, what)[0]))


@pytest.fixture(scope="module")
def multitask_reference(multitask):
    return run_distributed(_train_multitask, 1, multitask, "whole")


@pytest.mark.parametrize("mode", ["fixed", "packing"])
def test_multitask_data_on_heterogeneous_stages_matches_whole_batch_step(multitask, multitask_reference, mode):
    """--targets-data-path token-budget batches (fixed micro-batches or --pack-dataset rows with
    per-document attention) on stages TP2xDP1 | TP1xDP2: each rank takes its rows of every
    pipeline micro-batch; a short last micro-batch gets loss-free filler rows."""
    outs = run_distributed(_train_multitask, 4, multitask, mode, HETERO["stage_parallel"], HETERO["stage_layers"])
    last = [o for o in outs if o["is_last"]][0]
    assert last["samples"] == [o for o in multitask_reference if o["is_last"]][0]["samples"]
    assert all(i["planner"] == mode for i in last["info"])
    if mode == "fixed":  # a short micro-batch met the filler rows
        assert any(s[0] % 2 for i in last["info"] for s in i["microbatch_shapes"])
    assert_parity(multitask_reference, outs)


def test_terapipe_on_heterogeneous_stages_matches_single_process(reference):
    """TeraPipe token slices on an Aceso layout: the slices' messages also carry batch_slice rows
    (TP2xDP1 -> TP1xDP2), and the layers' per-layer recompute (none / selective) still applies."""
    from tests.training.test_terapipe_training import run_terapipe
    outs = run_distributed(run_terapipe, 4, "1,5,2,8", iters=2, recompute_layers=["none", "selective", "none", "selective"],
                           **HETERO)
    assert_parity(reference, outs)


def test_terapipe_plans_lowered_onto_heterogeneous_stages_carry_both_attributes():
    from megatron.pipeline import instructions as I
    from megatron.pipeline.validator import validate_plans
    from megatron.planner.passes.layout import split_plans
    from megatron.planner.terapipe.lowering import build_terapipe_plans
    plans = split_plans(build_terapipe_plans([[4, 12], [16]], [((4, 16),), ((4, 16),)], 2, 32), ((2, 1), (1, 2)))
    validate_plans(plans)
    assert [p.batch_split for p in plans] == [(0, 1), (0, 1), (0, 2), (1, 2)]
    comms = [i for p in plans for i in p.instructions if isinstance(i, I.CommInstruction)]
    assert comms and all(i.token_slice and i.batch_slice for i in comms)
    # rank 0 (TP0 of stage 0) sends each slice's rows 0-1 to rank 2 and rows 2-3 to rank 3
    sends = [(i.token_slice, i.peer, i.batch_slice) for i in plans[0].instructions if isinstance(i, I.SendActivationStart)]
    assert sends[:2] == [((0, 0, 4), 2, (0, 2)), ((0, 0, 4), 3, (2, 2))]


def test_dynapipe_on_heterogeneous_stages_matches_whole_batch_step(multitask, multitask_reference):
    """DynaPipe plans one pipeline whose stages have their own DP sizes (DP2 with 1 layer, then one
    rank with 3): micro-batches of any size are costed on each stage's rows (padded to a multiple
    of every DP) and lowered onto the ranks; the shipped CPU cost table has TP 1 only."""
    outs = run_distributed(_train_multitask, 3, multitask, "dynapipe", [[1, 2], [1, 1]], [1, 3])
    last = [o for o in outs if o["is_last"]][0]
    assert all(i["planner"] == "dynapipe" for i in last["info"])
    assert max(i["num_microbatches"][0] for i in last["info"]) > 1
    assert_parity(multitask_reference, outs)


def test_aceso_config_with_dynapipe_leaves_recompute_to_dynapipe(tmp_path, capsys):
    import json

    from megatron.cli.arguments import parse_args
    from tests.aceso.test_runtime import FULL, NONE, _args, hetero_dict
    path = str(tmp_path / "h.json")
    flags = ["--dynapipe", "--dynapipe-cost-model", "cost_models/cpu_tiny_gpt.json", "--dynapipe-cost-model-any",
             "--data-path", "x", "--targets-data-path", "y", "--tokens-per-global-batch", "600",
             "--tokenizer-type", "NullTokenizer"]
    args = [a for a in _args(path) if a != "--mock-data"] + flags
    json.dump(hetero_dict([1, 3], [(2, 1), (1, 2)], mbs=4), open(path, "w"))
    cfg = parse_args(args, world_size=4)
    assert cfg.data.dynapipe and cfg.parallel.stage_parallel == [[2, 1], [1, 2]]
    assert cfg.parallel.pipeline_stage_layers == [1, 3] and cfg.training.recompute_layers is None
    json.dump(hetero_dict([1, 3], [(2, 1), (1, 2)], mbs=4, rec=[FULL, NONE, NONE, NONE]), open(path, "w"))
    with pytest.raises(SystemExit):
        parse_args(args, world_size=4)
    assert "--dynapipe chooses each iteration's recompute level itself" in capsys.readouterr().err


@pytest.mark.slow  # T5's own path is tested in test_hetero_t5.py; this adds T5's multi-task rows
def test_t5_multitask_data_on_heterogeneous_stages_matches_whole_batch_step(multitask):
    """T5 pairs (fixed micro-batches of token-budget batches) on TP2xDP1 | TP1xDP2, the second
    stage ending the encoder and holding the decoder: encoder/decoder masks are cut by rows too."""
    from tests.training.test_t5_parity import _assemble
    ref = run_distributed(_train_multitask, 1, multitask, "whole", kind="t5")
    outs = run_distributed(_train_multitask, 4, multitask, "fixed", HETERO["stage_parallel"], [1, 3], kind="t5")
    assert_parity(ref, outs, assemble_fn=_assemble)


def test_t5_dynapipe_on_heterogeneous_stages_matches_whole_batch_step(multitask):
    """DynaPipe for T5 on DP2 | 1 rank where stage 1 ends the encoder and holds the decoder (not
    the half/half split DynaPipe's T5 model assumed before): the stage costs follow the layout."""
    from tests.training.test_t5_parity import _assemble
    ref = run_distributed(_train_multitask, 1, multitask, "whole", kind="t5")
    outs = run_distributed(_train_multitask, 3, multitask, "dynapipe", [[1, 2], [1, 1]], [1, 3], kind="t5")
    assert all(i["planner"] == "dynapipe" for i in [o for o in outs if o["is_last"]][0]["info"])
    assert_parity(ref, outs, assemble_fn=_assemble)


def test_dynapipe_with_uneven_stage_layers_matches_whole_batch_step(multitask, multitask_reference):
    """--dynapipe with --pipeline-stage-layers (what an Aceso config of one TP/DP size sets): each
    stage is priced with its own layer count (1 + 3 here) instead of an even split."""
    outs = run_distributed(_train_multitask, 2, multitask, "dynapipe", None, [1, 3])
    assert all(i["planner"] == "dynapipe" for i in [o for o in outs if o["is_last"]][0]["info"])
    assert_parity(multitask_reference, outs)
