"""--ckpt-format against the run's layout at start-up (issue 48): a layout the format cannot write
is refused in one line naming the flags before anything trains; what it can write is accepted."""
import pytest

from megatron.cli.arguments import parse_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--mock-data", "--vocab-size", "100", "--micro-batch-size", "1", "--global-batch-size", "4"]
LEGACY = ["--ckpt-format", "megatron-legacy"]


@pytest.mark.parametrize("world,extra,needle", [
    (1, ["--pipeline-schedule", "zb-v"], "--pipeline-schedule zb-v"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v"], "--pipeline-schedule zb-v"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "1,3"], "--pipeline-stage-layers 1 3"),
])
def test_megatron_legacy_refuses_layouts_it_cannot_write(capsys, world, extra, needle):
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + LEGACY + extra, world_size=world)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--ckpt-format megatron-legacy" in err and needle in err and "--ckpt-format torch" in err, err


@pytest.mark.parametrize("world,extra", [
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "2,2"]),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    (2, ["--context-parallel-size", "2"]),
])
def test_megatron_legacy_accepts_layouts_it_writes(world, extra):
    assert parse_args(BASE + LEGACY + extra, world_size=world).checkpoint.ckpt_format == "megatron-legacy"


def test_zb_v_with_torch_formats_is_accepted():
    for fmt in ("torch", "torch_dist"):
        cfg = parse_args(BASE + ["--ckpt-format", fmt, "--pipeline-model-parallel-size", "2",
                                 "--pipeline-schedule", "zb-v"], world_size=2)
        assert cfg.parallel.pipeline_schedule == "zb-v"
