"""The experiment drivers print progress lines a log file shows (run_all.sh ran 14.5 minutes with
6-minute silences: tqdm draws nothing when stderr is not a terminal)."""
from megatron.experiments.drivers import _Progress


def test_progress_lines_with_skips_and_eta(capsys):
    now = iter([0.0, 5.0, 20.0, 21.0, 40.0])
    p = _Progress(4, "grid search 1/2 gpt_a", every=15.0, clock=lambda: next(now))
    p.step(True)  # t=5: a row that exists, and too soon for a line
    p.step(False, 15.0)  # t=20: 15 s after the last line
    p.step(False, 1.0)  # t=21: quiet
    p.step(False, 19.0)  # t=40: the last one always prints
    assert capsys.readouterr().err.splitlines() == [
        "grid search 1/2 gpt_a: 2/4 jobs (1 skipped: rows exist), 20 s, ETA 30 s",
        "grid search 1/2 gpt_a: 4/4 jobs (1 skipped: rows exist), 40 s"]
