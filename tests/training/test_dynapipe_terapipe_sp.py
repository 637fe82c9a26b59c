"""DynaPipe x TeraPipe x sequence parallelism (`--dynapipe --terapipe --sequence-parallel`, TP2 x
PP2, 4 gloo ranks): DynaPipe's variable micro-batches of GPT multi-task data cut into token
slices whose stage messages are [l / TP, b, h] sequence shards give the losses and gradients of
plain `--dynapipe --sequence-parallel` on the same batches (fp32), with N slices and with auto."""
import pytest

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity
from tests.training.test_dynapipe_sequence_parallel import tp_cost_model
from tests.training.test_dynapipe_training import multitask  # noqa: F401 (fixture: multi-task data)

pytestmark = pytest.mark.parity


def _train(rank, world, data, cost_model, slices, stage_parallel=None, stage_layers=None):
    """TP2 x PP2 --dynapipe --sequence-parallel on the TP-2 copy of the CPU cost model;
    `slices` (None: unsliced) turns on --terapipe with that --terapipe-slices; `stage_parallel`:
    one pipeline whose stages have their own (TP, DP) sizes (an Aceso layout)."""
    import dataclasses
    import multiprocessing as mp
    from datetime import timedelta

    import torch

    from megatron.config.core import TeraPipeConfig
    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    from tests.parity_utils import train_and_record
    from tests.training.test_dynapipe_training import VOCAB, _cfg

    mp.current_process().daemon = False
    cfg = _cfg(world, "gpt", data, "dynapipe", pp=2, tp=2)
    parallel, training = cfg.parallel, cfg.training
    if stage_parallel:  # as tests/training/test_dynapipe_sequence_parallel.py lays them out
        parallel = dataclasses.replace(parallel, stage_parallel=stage_parallel, pipeline_stage_layers=stage_layers)
        training = dataclasses.replace(training, micro_batch_size=4, global_batch_size=None)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, sequence_parallel=True),
                              data=dataclasses.replace(cfg.data, dynapipe_cost_model=cost_model),
                              parallel=parallel, training=training)
    if slices is not None:  # replace() re-runs the configuration checks on the combination
        cfg = dataclasses.replace(cfg, terapipe=TeraPipeConfig(enabled=True, slices=slices, with_dynapipe=True))
    cfg.model.vocab_size = VOCAB
    ps = initialize_parallel(cfg, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    trainer = build_gpt_trainer(cfg, ps, torch.device("cpu"))
    return dict(train_and_record(trainer, world), sp_params=len(trainer.sequence_parallel_params))


@pytest.fixture(scope="module")
def cost_model(tmp_path_factory):
    return tp_cost_model(tmp_path_factory.mktemp("cm") / "cm.json")


@pytest.fixture(scope="module")
def plain_sp(multitask, cost_model):  # noqa: F811
    return run_distributed(_train, 4, multitask, cost_model, None)


def _last(outs):
    return [o for o in outs if o["is_last"]][0]


def test_dynapipe_terapipe_sequence_parallel_two_slices_equals_plain_dynapipe(multitask, cost_model,  # noqa: F811
                                                                              plain_sp):
    outs = run_distributed(_train, 4, multitask, cost_model, "2")
    info = _last(outs)["info"]
    assert all(i["token_slices"] and i["token_slices"] > len(i["microbatch_shapes"]) for i in info)
    assert all(i["token_slices"] is None for i in _last(plain_sp)["info"])
    assert any(o["sp_params"] for o in outs)  # layer norms run on sequence shards
    assert _last(outs)["samples"] == _last(plain_sp)["samples"]
    assert_parity(plain_sp, outs)


def test_dynapipe_terapipe_sequence_parallel_auto_equals_plain_dynapipe(multitask, cost_model,  # noqa: F811
                                                                        plain_sp):
    """auto: the sliced planner picks partition, slicing (on the lcm(8, TP) grid) and schedule."""
    outs = run_distributed(_train, 4, multitask, cost_model, "auto")
    assert all("token_slices" in i for i in _last(outs)["info"])  # planned by the sliced planner
    assert _last(outs)["samples"] == _last(plain_sp)["samples"]
    assert_parity(plain_sp, outs)


def test_dynapipe_terapipe_on_heterogeneous_stages_equals_plain_dynapipe(multitask, cost_model,  # noqa: F811
                                                                         plain_sp):
    """Stages TP2 x DP1 | TP1 x DP2 (an Aceso layout), with SP: the sliced plans are lowered on
    whole-sequence slices and cut onto each stage's ranks (rows, and tokens at that stage's TP)
    by the layout pass, as DynaPipe's own plans are."""
    outs = run_distributed(_train, 4, multitask, cost_model, "2", [[2, 1], [1, 2]], [1, 3])
    assert all(i["token_slices"] and i["token_slices"] > len(i["microbatch_shapes"]) for i in _last(outs)["info"])
    assert _last(outs)["samples"] == _last(plain_sp)["samples"]
    assert_parity(plain_sp, outs)
