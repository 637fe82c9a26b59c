"""DynaPipe x interleaved schedule (`--dynapipe --num-layers-per-virtual-pipeline-stage`): DynaPipe
plans over PP * v virtual stages (stage s on rank s % PP) on GPT multi-task data give the losses,
gradients and parameters of plain --dynapipe on the same batches (fp32, PP=2, 2 chunks a rank)."""
import dataclasses
import multiprocessing as mp

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import RTOL_64, assert_parity, train_and_record
from tests.training.test_dynapipe_runtime import data  # noqa: F401 (fixture)
from tests.training.test_dynapipe_training import VOCAB, _cfg, multitask  # noqa: F401 (fixture)

pytestmark = pytest.mark.parity


def _train(rank, world, data, vpp_layers, pp=2, workers=0):
    from datetime import timedelta

    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.pretrain import build_gpt_trainer

    mp.current_process().daemon = False
    cfg = _cfg(world, "gpt", data, "dynapipe", pp=pp, iters=3, workers=workers)
    if vpp_layers is not None:  # replace() re-runs the configuration checks
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, num_layers_per_virtual_pipeline_stage=vpp_layers))
    cfg.model.vocab_size = VOCAB
    ps = initialize_model_parallel(1, pp, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    trainer = build_gpt_trainer(cfg, ps, torch.device("cpu"))
    return dict(train_and_record(trainer, world), stages=sorted(trainer.stages))


def test_dynapipe_interleaved_equals_plain_dynapipe(multitask):  # noqa: F811
    ref = run_distributed(_train, 2, multitask, None)
    outs = run_distributed(_train, 2, multitask, 1, 2, 1)  # 4 layers: 2 chunks of 1 per rank; plan service
    assert [o["stages"] for o in outs] == [[0, 2], [1, 3]]
    assert all(i["schedule"] == "interleaved" for o in outs for i in o["info"])
    assert all(i["schedule"] != "interleaved" for o in ref for i in o["info"])
    assert_parity(ref, outs)


def _evaluate(rank, world, data, pp, vpp_layers):  # noqa: F811
    from datetime import timedelta

    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.pretrain import build_gpt_trainer

    cfg = _cfg(world, "gpt", data, "dynapipe", pp=pp, iters=1)
    cfg.data.split, cfg.training.eval_iters = "70,30,0", 2
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, num_layers_per_virtual_pipeline_stage=vpp_layers))
    cfg.model.vocab_size = VOCAB
    ps = initialize_model_parallel(1, pp, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    trainer = build_gpt_trainer(cfg, ps, torch.device("cpu"))
    plans = trainer.valid_source
    loss = trainer.evaluate(plans, 2)
    return {"loss": loss, "last": ps.rank == world - 1,
            "schedules": [g.schedule for k in sorted(plans._plans) for g in plans._plans[k].groups]}


def test_dynapipe_interleaved_evaluation_equals_single_process(data):  # noqa: F811
    """Validation batches are planned on virtual stages too and run forward-only on the chunks."""
    one = run_distributed(_evaluate, 1, data, 1, None)[0]
    outs = run_distributed(_evaluate, 2, data, 2, 1)
    last = [o for o in outs if o["last"]][0]
    assert set(last["schedules"]) == {"interleaved"}
    assert last["loss"] == pytest.approx(one["loss"], rel=RTOL_64)


def test_dynapipe_interleaved_flags_reach_the_planner(multitask):  # noqa: F811
    from megatron.cli.arguments import parse_args
    from megatron.config.core import ConfigError
    from megatron.training.supervised import dynapipe_planner_config
    base = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--data-path", "x",
            "--targets-data-path", "y", "--dynapipe", "--dynapipe-cost-model", "cost_models/cpu_tiny_gpt.json",
            "--dynapipe-cost-model-any", "--tokenizer-type", "NullTokenizer", "--vocab-size", "97",
            "--pipeline-model-parallel-size", "2", "--tokens-per-global-batch", "600"]

    class PS:
        pp_size, dp_size, tp_size, cp_size, stage_layouts = 2, 1, 1, 1, ()
    assert dynapipe_planner_config(parse_args(base, world_size=2), PS).virtual_stages == 1
    cfg = parse_args(base + ["--num-layers-per-virtual-pipeline-stage", "2"], world_size=2)
    assert dynapipe_planner_config(cfg, PS).virtual_stages == 2
    packed = _cfg(2, "gpt", multitask, "dynapipe_packed", pp=2)
    with pytest.raises(ConfigError, match="--dynapipe-packed-rows searches one-stage-per-rank"):
        dataclasses.replace(packed, parallel=dataclasses.replace(packed.parallel, num_layers_per_virtual_pipeline_stage=1))
    t5 = _cfg(2, "t5", multitask, "dynapipe", pp=2)
    with pytest.raises(ConfigError, match="--dynapipe with T5 gives the encoder and the decoder whole pipeline ranks"):
        dataclasses.replace(t5, parallel=dataclasses.replace(t5.parallel, num_layers_per_virtual_pipeline_stage=1))


@pytest.mark.slow
def test_dynapipe_interleaved_pp2_dp2_equals_plain_dynapipe(multitask):  # noqa: F811
    """Two DP groups, each with its own interleaved plan (4 gloo ranks)."""
    ref = run_distributed(_train, 4, multitask, None)
    outs = run_distributed(_train, 4, multitask, 1)
    assert all(i["schedule"] == "interleaved" for o in outs for i in o["info"])
    assert_parity(ref, outs)
