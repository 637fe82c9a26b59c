"""`python -m megatron.profiling.calibrate`: runs -> fit -> stored in the table (runs faked here;
the real ones are torchrun jobs of a minute, measured in benchmarks/bench_packing_cpu.py)."""
import json
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.cost.cost_model import CostModel
from megatron.planner.terapipe.latency import SliceLatencyModel
from megatron.profiling import calibrate

CM = Path(__file__).resolve().parents[2] / "cost_models"
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--max-position-embeddings", "512", "--vocab-size", "4096"]
SHAPES = "1x64x4,2x64x12,4x32x16,4x16x8"  # inside both tables' grids


def _tables(tmp_path):
    out = {}
    for kind, name in (("dynapipe", "cpu_tiny_gpt.json"), ("terapipe", "terapipe_cpu_tiny_gpt.json")):
        doc = json.loads((CM / name).read_text())
        doc.pop("calibration", None)
        out[kind] = tmp_path / name
        out[kind].write_text(json.dumps(doc))
    return out


def test_fit_is_written_into_both_files(tmp_path, monkeypatch, capsys):
    t = _tables(tmp_path)
    args = calibrate.build_parser().parse_args(["--shapes", SHAPES, "--", *MODEL])
    args.trainer_args = args.trainer_args[1:]
    truth = calibrate.dynapipe_predictor(str(t["dynapipe"]), args, args.shapes)(1.25, 1.5)
    fake = dict(zip(args.shapes, np.asarray(truth) + 20.0))
    monkeypatch.setattr(calibrate, "measure", lambda a, b, s, n, k: fake[(b, s, n, k)])
    assert calibrate.main(["--dynapipe-cost-model", str(t["dynapipe"]), "--terapipe-cost-model", str(t["terapipe"]),
                           "--shapes", SHAPES, "--", *MODEL]) == 0
    cal = CostModel.load(t["dynapipe"]).calibration
    assert cal.compute_scale == pytest.approx(1.25, abs=0.011) and cal.op_overhead_ms == pytest.approx(1.5, abs=0.051)
    assert cal.step_overhead_ms == pytest.approx(20.0, abs=1.0)
    assert cal.meta["shapes"] == SHAPES.split(",") and len(cal.meta["measured_ms"]) == 4
    lat = SliceLatencyModel.load(t["terapipe"])  # the other table's own fit of the same runs
    assert not lat.calibration.identity and lat.calibration.meta["runs"] == 4
    assert not list(tmp_path.glob("*.tmp"))
    assert '"calibration"' in capsys.readouterr().out


def test_dry_run_writes_nothing(tmp_path, monkeypatch):
    t = _tables(tmp_path)
    before = t["dynapipe"].read_bytes()
    monkeypatch.setattr(calibrate, "measure", lambda a, b, s, n, k: 100.0 + 10 * n)
    assert calibrate.main(["--dynapipe-cost-model", str(t["dynapipe"]), "--shapes", SHAPES, "--dry-run",
                           "--", *MODEL]) == 0
    assert t["dynapipe"].read_bytes() == before


@pytest.mark.parametrize("argv,msg", [
    (["--shapes", "1x2"], "MBSxSEQxCOUNT"),
    (["--shapes", "1x2x3x4x5,1x2x4,1x1x1"], "MBSxSEQxCOUNT"),
    (["--shapes", "1x2x3,1x2x4"], "at least 3"),
    (["--shapes", "0x2x3,1x2x4,1x1x1"], "below 1"),
])
def test_bad_shapes_are_refused(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        calibrate.build_parser().parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_needs_a_table_and_the_model(tmp_path, capsys):
    assert calibrate.main(["--", *MODEL]) == 2
    assert "--dynapipe-cost-model" in capsys.readouterr().err
    t = _tables(tmp_path)
    with pytest.raises(SystemExit, match="--num-layers"):
        calibrate.main(["--dynapipe-cost-model", str(t["dynapipe"]), "--", "--hidden-size", "64"])
    with pytest.raises(SystemExit, match="positive integer"):
        calibrate.main(["--dynapipe-cost-model", str(t["dynapipe"]), "--", *MODEL[:1], "four", *MODEL[2:]])
    with pytest.raises(SystemExit, match="calibration runs GPT"):
        calibrate.main(["--dynapipe-cost-model", str(CM / "cpu_tiny_t5.json"), "--", *MODEL])


def test_shapes_outside_the_table_are_named(tmp_path):
    t = _tables(tmp_path)
    with pytest.raises(SystemExit, match="64x2048"):
        calibrate.main(["--dynapipe-cost-model", str(t["dynapipe"]), "--shapes", "64x2048x2,1x32x2,1x64x2",
                        "--", *MODEL])
    with pytest.raises(SystemExit, match="8x32.*its grid"):
        calibrate.main(["--terapipe-cost-model", str(t["terapipe"]), "--shapes", "8x32x2,1x32x2,1x64x2",
                        "--", *MODEL])


def test_sliced_runs_calibrate_the_latency_file(tmp_path, monkeypatch):
    """Runs cut into token slices price each slice with its context (the planner's own units),
    so their per-slice overhead is fitted too; they are refused for a DynaPipe table."""
    t = _tables(tmp_path)
    shapes = "1x64x4,1x64x4x4,1x32x8x2,2x64x2x8"
    args = calibrate.build_parser().parse_args(["--shapes", shapes, "--", *MODEL])
    args.trainer_args = args.trainer_args[1:]
    predict = calibrate.terapipe_predictor(str(t["terapipe"]), args, args.shapes)
    one, four = predict(1.0, 0.0)[:2]
    assert four > one  # four slices of 16 pay their context terms and p2p four times
    with_op = predict(1.0, 1.0)
    assert with_op[1] - four == pytest.approx(2 * 1.0 * (4 * 4 + 1), rel=1e-6)  # 2 ops a unit: 16 units + (pp - 1) max
    truth = np.asarray(predict(1.1, 0.8)) + 5.0
    fake = dict(zip(args.shapes, truth))
    monkeypatch.setattr(calibrate, "measure", lambda a, b, s, n, k: fake[(b, s, n, k)])
    assert calibrate.main(["--terapipe-cost-model", str(t["terapipe"]), "--shapes", shapes, "--", *MODEL]) == 0
    cal = SliceLatencyModel.load(t["terapipe"]).calibration
    assert (cal.compute_scale, cal.op_overhead_ms) == pytest.approx((1.1, 0.8), abs=0.051)
    assert cal.meta["shapes"] == shapes.split(",")
    assert calibrate.main(["--dynapipe-cost-model", str(t["dynapipe"]), "--shapes", shapes, "--", *MODEL]) == 2


def test_a_failed_run_is_named_with_its_log_tail(monkeypatch):
    """A calibration run that dies (a rank crashed, a bad trainer flag) stops the fit with the
    shape and the end of the trainer's log, not a fit of whatever came back."""
    import subprocess
    from types import SimpleNamespace
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(
        returncode=1, stdout="", stderr="rank 1: RuntimeError: boom\n"))
    args = calibrate.build_parser().parse_args(["--", *MODEL])
    args.trainer_args = args.trainer_args[1:]
    with pytest.raises(SystemExit, match=r"run at 2x64x12 failed \(exit 1\):\nrank 1: RuntimeError: boom"):
        calibrate.measure(args, 2, 64, 12)
