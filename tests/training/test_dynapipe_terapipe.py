"""DynaPipe x TeraPipe (`--dynapipe --terapipe`): DynaPipe's variable micro-batches of GPT
multi-task data (inputs + targets, loss on the targets only, right-padded) cut into token
slices give the losses and gradients of plain --dynapipe on the same batches (fp32, PP=2)."""
import dataclasses
import multiprocessing as mp

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, train_and_record
from tests.training.test_dynapipe_training import VOCAB, _cfg, multitask  # noqa: F401 (fixture)

pytestmark = pytest.mark.parity


def _train(rank, world, data, slices, pp=2, workers=0, compress=False):
    from datetime import timedelta

    from megatron.config.core import CompressionConfig, TeraPipeConfig
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.pretrain import build_gpt_trainer

    mp.current_process().daemon = False
    cfg = _cfg(world, "gpt", data, "dynapipe", pp=pp, iters=3, workers=workers)
    if slices is not None:  # replace() re-runs the configuration checks
        cfg = dataclasses.replace(cfg, terapipe=TeraPipeConfig(enabled=True, slices=slices, with_dynapipe=True))
    counts = None
    if compress:  # compressed backpropagation + LEP at full rank: exact (tests/compression/lossless.py)
        from tests.compression import lossless as L
        L.lossless()
        counts = L.counting()
        cfg = dataclasses.replace(cfg, compression=CompressionConfig(inter_grad_comp=True, inter_grad_comp_rank=64,
                                                                     use_error_feedback=True))
    cfg.model.vocab_size = VOCAB
    ps = initialize_model_parallel(1, pp, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    trainer = build_gpt_trainer(cfg, ps, torch.device("cpu"))
    return dict(train_and_record(trainer, world), counts=counts)


@pytest.fixture(scope="module")
def plain_dynapipe(multitask):  # noqa: F811
    return run_distributed(_train, 2, multitask, None)


def _last(outs):
    return [o for o in outs if o["is_last"]][0]


def test_dynapipe_terapipe_two_slices_equals_plain_dynapipe(multitask, plain_dynapipe):  # noqa: F811
    outs = run_distributed(_train, 2, multitask, "2", 2, 1)  # through the plan service (1 worker)
    ref, info = _last(plain_dynapipe)["info"], _last(outs)["info"]
    # every micro-batch runs as (up to) two slices
    assert all(i["token_slices"] and i["token_slices"] > len(i["microbatch_shapes"]) for i in info)
    assert all(i["token_slices"] is None for i in ref)
    assert_parity(plain_dynapipe, outs)


def test_dynapipe_terapipe_auto_equals_plain_dynapipe(multitask, plain_dynapipe):  # noqa: F811
    """auto: the planner picks partition, slicing and schedule (it may differ from plain
    DynaPipe's, and it keeps an unsliced plan where slicing does not pay on the CPU table: the
    sliced runtime's exactness is the fixed-slices tests'); the step is still the whole batch's."""
    outs = run_distributed(_train, 2, multitask, "auto")
    assert all("token_slices" in i for i in _last(outs)["info"])  # planned by the sliced planner
    assert_parity(plain_dynapipe, outs)


def test_dynapipe_terapipe_with_compressed_backprop_equals_plain_dynapipe(multitask, plain_dynapipe):  # noqa: F811
    """Token slices of DynaPipe micro-batches, each slice's gradient message compressed with LEP
    (residuals keyed by stage, tensor, token offset and shape): exact at full rank."""
    outs = run_distributed(_train, 2, multitask, "2", 2, 0, True)
    assert all(i["token_slices"] for i in _last(outs)["info"])
    assert outs[1]["counts"]["pipeline"] > 0  # the slices' gradients really went compressed
    # A stage-0 gradient of slice i crosses its own decoded message and, through the key/value
    # cache's gradients, those of the later slice of its micro-batch: two codec roundings.
    assert_parity(plain_dynapipe, outs, codec_roundings=2)


def test_dynapipe_terapipe_refusals_name_the_flag(multitask):  # noqa: F811
    from megatron.config.core import ConfigError, TeraPipeConfig
    cfg = _cfg(2, "gpt", multitask, "dynapipe", pp=2)
    ok = dataclasses.replace(cfg, terapipe=TeraPipeConfig(enabled=True, slices="auto", with_dynapipe=True))
    assert ok.terapipe.enabled and ok.data.dynapipe  # multi-task data and auto without a latency model
    with pytest.raises(ConfigError, match="--terapipe-slices 16,48 with --dynapipe"):
        dataclasses.replace(cfg, terapipe=TeraPipeConfig(enabled=True, slices="16,48", with_dynapipe=True))
    packed = _cfg(2, "gpt", multitask, "dynapipe_packed", pp=2)
    with pytest.raises(ConfigError, match="--dynapipe-packed-rows with --terapipe"):
        dataclasses.replace(packed, terapipe=TeraPipeConfig(enabled=True, slices="2", with_dynapipe=True))
    vpp = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, num_layers_per_virtual_pipeline_stage=1))
    with pytest.raises(ConfigError, match="drop --num-layers-per-virtual-pipeline-stage, or drop --dynapipe"):
        dataclasses.replace(vpp, terapipe=TeraPipeConfig(enabled=True, slices="2", with_dynapipe=True))
    sp = _cfg(4, "gpt", multitask, "dynapipe", pp=2, tp=2)  # accepted (tests/training/test_dynapipe_terapipe_sp.py runs it)
    sp = dataclasses.replace(sp, model=dataclasses.replace(sp.model, sequence_parallel=True))
    assert dataclasses.replace(sp, terapipe=TeraPipeConfig(enabled=True, slices="2", with_dynapipe=True)).terapipe.enabled


def test_dynapipe_terapipe_flags_reach_the_planner():
    from megatron.cli.arguments import parse_args
    from megatron.training.supervised import dynapipe_planner_config
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--data-path", "x",
            "--targets-data-path", "y", "--dynapipe", "--dynapipe-cost-model", "cost_models/cpu_tiny_gpt.json",
            "--dynapipe-cost-model-any", "--tokenizer-type", "NullTokenizer", "--vocab-size", "97",
            "--pipeline-model-parallel-size", "2", "--tokens-per-global-batch", "600", "--terapipe"]

    class PS:
        pp_size, dp_size, tp_size, cp_size, stage_layouts = 2, 1, 1, 1, ()
    for spec, want in (("auto", -1), ("3", 3)):
        cfg = parse_args(base + ["--terapipe-slices", spec], world_size=2)
        assert dynapipe_planner_config(cfg, PS).token_slices == want


@pytest.mark.slow
def test_dynapipe_terapipe_pp2_dp2_equals_plain_dynapipe(multitask):  # noqa: F811
    """Two DP groups, each with its own sliced plan (4 gloo ranks)."""
    ref = run_distributed(_train, 4, multitask, None)
    outs = run_distributed(_train, 4, multitask, "2")
    assert all(i["token_slices"] for i in _last(outs)["info"])
    assert_parity(ref, outs)
