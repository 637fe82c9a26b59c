"""Generated files go under the output folder, never over tracked ones: the grid search writes
its best/control/ablation configs under --out (the shipped experiment_configs/ are inputs), and
a benchmark with no configs of its own reads the shipped ones. Run as a user would, on the
CPU smoke grid that `run_all.sh --simulate` searches (simulated here: seconds, not minutes)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git_status():
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "experiment_configs"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _exp(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron.experiments", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_grid_search_and_benchmark_write_only_under_out(tmp_path):
    before = _git_status()
    smoke = os.path.join("experiment_configs", "cpu_live_smoke.json")
    # benchmark first, into an empty folder: it runs the shipped (tracked) configurations
    r = _exp("benchmark", "--simulate", "--config", smoke, "--out", str(tmp_path / "shipped"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "shipped" / "best_throughput.jsonl").is_file()
    out = tmp_path / "run"
    r = _exp("grid-search", "--simulate", "--config", smoke, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"best configs in {out}/best_configs/cpu_live_smoke/" in r.stdout
    for kind in ("best", "control", "ablation"):
        assert sorted(p.name for p in (out / f"{kind}_configs" / "cpu_live_smoke").iterdir()) == \
            ["tiny_gpt_L256_G2.json", "tiny_t5_L64_G2.json"]
    r = _exp("benchmark", "--simulate", "--config", smoke, "--out", str(out))  # reads the run's own configs
    assert r.returncode == 0, r.stderr
    assert _git_status() == before, "a tracked file under experiment_configs/ was written"
