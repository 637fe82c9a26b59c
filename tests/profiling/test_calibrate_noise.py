"""calibrate on a noisy host, with the README's own tables and defaults, and with a trainer that
refuses its flags: runs faked (iteration times injected), so nothing depends on the host."""
import json
from pathlib import Path

import numpy as np
import pytest

from megatron.planner.terapipe.latency import SliceLatencyModel
from megatron.profiling import calibrate

CM = Path(__file__).resolve().parents[2] / "cost_models"
# the README's calibration example's model
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--max-position-embeddings", "512", "--vocab-size", "4096"]

TORCHRUN_FAILURE = """pretrain_gpt.py: error: --mock-data needs --vocab-size (or a tokenizer) to know the vocabulary
W1127 08:34:26.689000 10768 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 10904 closing signal SIGTERM
E1127 08:34:26.695000 10768 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pretrain_gpt.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 10903)
============================================================"""


def _copy(tmp_path, name):
    doc = json.loads((CM / name).read_text())
    doc.pop("calibration", None)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _args(*extra):
    args = calibrate.build_parser().parse_args([*extra, "--", *MODEL])
    args.trainer_args = args.trainer_args[1:]
    return args


def test_default_shapes_fit_the_readme_tables():
    """Today's defaults on the shipped TeraPipe file: a run longer than its longest slice (64) is
    cut into token slices; the one micro-batch size past its grid (8) is left out."""
    args = _args()
    tera = calibrate.default_shapes(args, [("terapipe", str(CM / "terapipe_cpu_tiny_gpt.json"))])
    assert [calibrate.shape_name(s) for s in tera] == ["1x256x4x4", "1x128x8x2", "2x128x4x2", "2x64x12", "4x64x6",
                                                       "4x32x16", "1x64x16"]
    dyn = calibrate.default_shapes(args, [("dynapipe", str(CM / "cpu_tiny_gpt.json"))])
    assert calibrate.shape_name(dyn[0]) == "1x256x4" and len(dyn) == 8


def test_readme_terapipe_calibration_runs_with_defaults(tmp_path, monkeypatch):
    path = _copy(tmp_path, "terapipe_cpu_tiny_gpt.json")
    args = _args()
    shapes = calibrate.default_shapes(args, [("terapipe", str(path))])
    truth = np.asarray(calibrate.terapipe_predictor(str(path), args, shapes)(1.2, 0.9)) + 12.0
    fake = dict(zip(shapes, truth))
    monkeypatch.setattr(calibrate, "run_times", lambda a, b, s, n, k: [fake[(b, s, n, k)]] * 5)
    assert calibrate.main(["--terapipe-cost-model", str(path), "--", *MODEL]) == 0
    cal = SliceLatencyModel.load(path).calibration
    assert cal.meta["rms_error"] < 0.01 and cal.compute_scale == pytest.approx(1.2, abs=0.15)


def test_a_noisy_run_is_run_again_then_refused(tmp_path, monkeypatch, capsys):
    path = _copy(tmp_path, "cpu_tiny_gpt.json")
    before = path.read_bytes()
    runs = []

    def noisy(a, b, s, n, k):  # 2 of 5 iterations at 100 ms, 3 at 400 ms: spread 300 %
        runs.append((b, s))
        return [100.0, 400.0, 400.0, 100.0, 400.0]
    monkeypatch.setattr(calibrate, "run_times", noisy)
    assert calibrate.main(["--dynapipe-cost-model", str(path), "--shapes", "1x64x4,2x64x12,4x32x16", "--",
                           *MODEL]) == 1
    err = capsys.readouterr().err
    assert runs == [(1, 64), (1, 64), (2, 64), (2, 64), (4, 32), (4, 32)]  # each shape once more (--remeasure 1)
    assert "3 of 3 runs stayed noisier than --max-spread 0.5" in err and "spread 300%" in err
    assert "calibrate: [2/3, ETA" in err and path.read_bytes() == before

    quiet_second = iter([[100.0, 400.0, 400.0], [100.0, 101.0, 102.0]] * 3)
    monkeypatch.setattr(calibrate, "run_times", lambda a, b, s, n, k: next(quiet_second))
    t = calibrate.measure(_args(), 1, 64, 4)
    assert not t.noisy and t.rounds == 2 and t.values == (101.0,)


def test_a_fit_that_misses_the_runs_is_not_stored(tmp_path, monkeypatch, capsys):
    """The issue's case: a table profiled on a busy host predicts 4876.8 ms where a run takes
    56.4: no calibration explains that, so none is stored, and the numbers are shown."""
    path = _copy(tmp_path, "cpu_tiny_gpt.json")
    before = path.read_bytes()
    shapes = "1x64x4,2x64x12,4x32x16,4x16x8"
    args = _args("--shapes", shapes)
    pred = np.asarray(calibrate.dynapipe_predictor(str(path), args, args.shapes)(1.0, 0.0))
    wild = dict(zip(args.shapes, pred * np.array([1.0, 40.0, 1.0, 0.05])))
    monkeypatch.setattr(calibrate, "measure", lambda a, b, s, n, k: wild[(b, s, n, k)])
    assert calibrate.main(["--dynapipe-cost-model", str(path), "--shapes", shapes, "--", *MODEL]) == 1
    err = capsys.readouterr().err
    assert "calibrate: error: the fit for" in err and "past --max-fit-error 0.15" in err
    assert "predicted" in err and "ms measured" in err and "not stored" in err
    assert path.read_bytes() == before


def test_bad_trainer_flags_are_one_line_before_any_run(tmp_path, monkeypatch):
    path = _copy(tmp_path, "cpu_tiny_gpt.json")
    monkeypatch.setattr(calibrate, "run_times", lambda *a: pytest.fail("a run started"))
    no_vocab = [x for i, x in enumerate(MODEL) if "--vocab-size" not in MODEL[max(i - 1, 0):i + 1]]
    with pytest.raises(SystemExit, match="--mock-data needs --vocab-size"):
        calibrate.main(["--dynapipe-cost-model", str(path), "--", *no_vocab])
    with pytest.raises(SystemExit, match="trainer flags after -- are refused: .*--no-such-flag"):
        calibrate.main(["--dynapipe-cost-model", str(path), "--", *MODEL, "--no-such-flag"])


def test_a_failed_run_shows_the_trainers_error_not_torchruns():
    tail = calibrate.child_error(TORCHRUN_FAILURE)
    assert tail == "pretrain_gpt.py: error: --mock-data needs --vocab-size (or a tokenizer) to know the vocabulary"
    assert calibrate.child_error("rank 1: RuntimeError: boom\n") == "rank 1: RuntimeError: boom"


def test_a_busy_host_is_refused_in_one_line_before_any_run(tmp_path, monkeypatch, capsys):
    """The issue's case: load 10-40 on 2 cores, calibrate spent 380 s and stored nothing. Now the
    probe's measurement (injected) refuses before the first run, naming it and the flag."""
    from megatron.profiling import noise
    path = _copy(tmp_path, "cpu_tiny_gpt.json")
    before = path.read_bytes()
    monkeypatch.setattr(calibrate, "probe_host", lambda: noise.HostNoise(0.24, 0.01, 400, 2.0, 26.5))
    monkeypatch.setattr(calibrate, "run_times", lambda *a: pytest.fail("a run started"))
    assert calibrate.main(["--dynapipe-cost-model", str(path), "--", *MODEL]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("calibrate: error: host too busy to calibrate (1% of 400 probe samples undisturbed, "
                           "24% of a core for this process, load average 26.5")
    assert "under --min-share 0.6, 8 runs of 2 ranks" in last and "--min-share 0 to try anyway" in last
    assert path.read_bytes() == before
