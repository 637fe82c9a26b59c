"""--terapipe trains exactly like the unsliced single-process run: losses, grad norms, first-step
gradients and parameters after several steps, at PP=2, TP=2 and PP2 x DP2; bad flag
combinations are refused with a message naming the flag."""
import dataclasses

import pytest

from megatron.config.core import ConfigError, TeraPipeConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import run_layout, shards
from tests.training.test_training_parity import _compare

pytestmark = pytest.mark.parity

SEQ = 16


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, dict(seq=SEQ))


def run_terapipe(rank, world, slices, **kw):
    import tests.parity_utils as pu
    orig = pu.tiny_config

    def with_terapipe(**k):
        return dataclasses.replace(orig(**k), terapipe=TeraPipeConfig(enabled=True, slices=slices))
    pu.tiny_config = with_terapipe
    try:
        out = run_layout(rank, world, dict(seq=SEQ, **kw))
    finally:
        pu.tiny_config = orig
    return out


@pytest.mark.parametrize("world,slices,kw", [
    (2, "1,5,2,8", dict(pp=2)),
    (2, "4", dict(tp=2)),
    (4, "9,7", dict(pp=2)),      # PP2 x DP2
])
def test_terapipe_matches_single_process(reference, world, slices, kw):
    _compare(reference, run_distributed(run_terapipe, world, slices, **kw))


def test_terapipe_dropout_tp2_sliced_matches_one_slice_single_process():
    # Slice-keyed dropout masks depend on (seed, iteration, sequence, position, row, channel or
    # global head), not on the slicing or the TP layout.
    ref = run_distributed(run_terapipe, 1, "1", dropout=0.2)
    _compare(ref, run_distributed(run_terapipe, 2, "3,1,12", tp=2, dropout=0.2))


def test_planner_line_shows_slices_and_predicted_time(tmp_path):
    from megatron.training.logging import planner_line
    from megatron.planner.terapipe.latency import SliceLatencyModel
    from megatron.planner.terapipe.planner import TeraPipePlanner
    from tests.parity_utils import tiny_config
    # t(b, l, 0) linear in b*l, a small context term: two slices beat one at PP=2
    lat = SliceLatencyModel([1, 2], [8, 16], [[1.0, 2.0], [2.0, 4.0]], (0.0, 0.0, 0.001), hidden_size=32)
    lat.save(tmp_path / "lat.json")
    cfg = dataclasses.replace(tiny_config(seq=SEQ, pp=2, world=2), terapipe=TeraPipeConfig(
        enabled=True, slices="auto", cost_model=str(tmp_path / "lat.json")))
    planner = TeraPipePlanner(cfg, 2, SliceLatencyModel.load(tmp_path / "lat.json"))
    plans = planner.plans(5, [((2, SEQ),)] * 4)
    assert len(plans) == 2 and plans[0].iteration == 5
    assert planner.info["slices"] == [8, 8]
    line = planner_line(planner.info, 0.05)
    assert "token slices: [8, 8]" in line and "simulated / measured iteration ms" in line


def _cfg(**changes):
    from tests.parity_utils import tiny_config
    return dataclasses.replace(tiny_config(seq=SEQ), **changes)


def test_bad_flag_combinations_are_refused():
    from tests.parity_utils import tiny_config
    base = tiny_config(seq=SEQ)
    with pytest.raises(ConfigError, match="--terapipe-cost-model"):
        dataclasses.replace(base, terapipe=TeraPipeConfig(enabled=True, slices="auto"))
    with pytest.raises(ConfigError, match="--terapipe-slices"):
        dataclasses.replace(base, terapipe=TeraPipeConfig(enabled=True, slices="8,4"))
    with pytest.raises(ConfigError, match="multiples of 2"):
        dataclasses.replace(tiny_config(seq=SEQ, tp=2, world=2, arch=dict(sequence_parallel=True)),
                            terapipe=TeraPipeConfig(enabled=True, slices="3,13"))


def test_cli_flags_and_t5_error(capsys):
    from megatron.cli.arguments import parse_args
    gpt = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--mock-data",
           "--vocab-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0"]
    cfg = parse_args(gpt + ["--terapipe", "--terapipe-slices", "4,12"], world_size=1)
    assert cfg.terapipe.enabled and cfg.terapipe.slices == "4,12"
    assert not parse_args(gpt, world_size=1).terapipe.enabled
    t5 = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "32",
          "--num-attention-heads", "4", "--encoder-seq-length", "16", "--decoder-seq-length", "8",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1", "--mock-data",
          "--vocab-size", "64", "--terapipe", "--terapipe-slices", "2"]
    with pytest.raises(SystemExit):
        parse_args(t5, model_type="t5", world_size=1)
    assert "T5" in capsys.readouterr().err
