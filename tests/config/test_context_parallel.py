"""--context-parallel-size: accepted layouts, and one line naming the flag for what CP cannot run."""
import pytest

from megatron.cli.arguments import parse_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--mock-data", "--vocab-size", "100"]


def _error(capsys, argv, world=4, model_type="gpt"):
    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=world, model_type=model_type)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_cp_layout_sizes():
    cfg = parse_args(BASE + ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                             "--cp-comm-type", "p2p"], world_size=8)
    p = cfg.parallel
    assert (p.context_parallel_size, p.cp_comm_type, p.data_parallel_size) == (2, "p2p", 2)
    assert cfg.num_microbatches == cfg.training.global_batch_size // (cfg.training.micro_batch_size * 2)


@pytest.mark.parametrize("extra,world,needles", [
    (["--context-parallel-size", "3"], 4, ["world size (4)", "--context-parallel-size (3)"]),
    (["--context-parallel-size", "2", "--seq-length", "30"], 2, ["--context-parallel-size 2", "--seq-length (30)"]),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--seq-length", "36"], 4, ["--seq-length (36)", "2 x CP x TP"]),
    (["--context-parallel-size", "2", "--terapipe", "--terapipe-slices", "2", "--pipeline-model-parallel-size", "2"], 4,
     ["--context-parallel-size 2 with --terapipe"]),
    (["--context-parallel-size", "2", "--ckpt-format", "torch_dist"], 2, ["--ckpt-format torch_dist"]),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], 2, ["--cp-comm-type"]),
    (["--context-parallel-size", "4", "--pipeline-model-parallel-size", "2"], 4, ["= 8"]),
])
def test_cp_refusals_name_the_flag(capsys, extra, world, needles):
    err = _error(capsys, BASE + extra, world)
    for n in needles:
        assert n in err, err


def test_t5_refuses_cp_and_says_why(capsys):
    t5 = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
          "4", "--encoder-seq-length", "32", "--decoder-seq-length", "16", "--mock-data", "--vocab-size", "100"]
    err = _error(capsys, t5 + ["--context-parallel-size", "2"], 2, "t5")
    assert "--context-parallel-size 2 is implemented for GPT" in err and "cross-attends" in err


DYNAPIPE = ["--data-path", "in", "--targets-data-path", "out", "--tokens-per-global-batch", "600", "--dynapipe",
            "--dynapipe-cost-model", "cost_models/cpu_tiny_gpt.json", "--tokenizer-type", "NullTokenizer",
            "--hidden-dropout", "0", "--attention-dropout", "0"]
NO_MOCK = [a for a in BASE if a != "--mock-data"]


def test_variable_cp_sizes_parse():
    cfg = parse_args(NO_MOCK + DYNAPIPE + ["--context-parallel-size", "4", "--dynapipe-cp-sizes", "1,2,4"],
                     world_size=4)
    assert cfg.data.dynapipe_cp_sizes == (1, 2, 4)


@pytest.mark.parametrize("extra,needles", [
    (["--context-parallel-size", "4", "--dynapipe-cp-sizes", "1,3,4"], ["--dynapipe-cp-sizes 1,3,4", "divide"]),
    (["--context-parallel-size", "4", "--dynapipe-cp-sizes", "1,2"], ["4 must be one of them"]),
    (["--context-parallel-size", "2", "--dynapipe-cp-sizes", "1,2", "--tensor-model-parallel-size", "2"],
     ["TP 1 and one stage per pipeline rank"]),
    (["--context-parallel-size", "2", "--dynapipe-cp-sizes", "1,2", "--hidden-dropout", "0.1"], ["with dropout"]),
    (["--dynapipe-cp-sizes", "1,2"], ["needs --dynapipe and --context-parallel-size"]),
])
def test_variable_cp_refusals_name_the_flag(capsys, extra, needles):
    err = _error(capsys, NO_MOCK + DYNAPIPE + extra, 4)
    for n in needles:
        assert n in err, err
