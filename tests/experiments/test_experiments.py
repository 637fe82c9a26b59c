"""Experiment drivers: config validation, the simulate back-end's grid search, the shared row
schema, the live log parser (recorded lines and one real 2-rank CPU run), figures, resumability."""
import json
import os
import shutil
from pathlib import Path

import pytest

from megatron.experiments import drivers
from megatron.experiments.backends import Job, SimulateBackend
from megatron.experiments.config import ROOT, ExperimentConfigError, load_grid, load_setting_config
from megatron.experiments.live import LiveBackend, command, rows_from_log
from megatron.experiments.logparse import parse_log
from megatron.experiments.rows import ROW_FIELDS, read_rows, validate_row

HERE = Path(__file__).parent


def tiny_grid(tmp_path, **over):
    """Tiny GPT on the CPU cost model: 4 layers, 4 devices; the lengths file is the fixture."""
    doc = {
        "name": "tiny",
        "models": {"tiny_gpt": {"kind": "gpt", "cost_model": "cost_models/cpu_tiny_gpt.json", "hidden_size": 64,
                                "num_layers": 4, "max_lens": [256]}},
        "cluster_sizes": [4], "tokens_per_gpu": 512, "memory_limit_mb": 200,
        "grid": {"pp": [1, 2, 4], "tp": [1], "micro_batch_sizes": [1, 4], "recompute": ["none", "full"]},
        "search_batches": 2, "benchmark_batches": 3, "seed": 3,
        "lengths_file": str(HERE / "lengths_fixture.txt"),
    }
    doc.update(over)
    p = tmp_path / "grid.json"
    p.write_text(json.dumps(doc))
    return p


# ---- configs -----------------------------------------------------------------------------------

def test_shipped_grids_load():
    for name in ("a100_sim.json", "a100_sim_multinode.json", "cpu_live_smoke.json"):
        g = load_grid(ROOT / "experiment_configs" / name)
        assert g.settings()
        for s in g.settings():
            assert g.layouts(g.models[s.model], s.gpus)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.pop("tokens_per_gpu"), "tokens_per_gpu"),
    (lambda d: d["models"]["tiny_gpt"].pop("num_layers"), "num_layers"),
    (lambda d: d["models"]["tiny_gpt"].update(kind="bert"), "kind"),
    (lambda d: d["models"]["tiny_gpt"].update(cost_model="cost_models/nope.json"), "cost_model"),
    (lambda d: d["grid"].update(recompute=["sometimes"]), "recompute"),
    (lambda d: d["grid"].update(micro_batch_sizes=[]), "micro_batch_sizes"),
])
def test_bad_grid_names_file_and_field(tmp_path, edit, field):
    p = tiny_grid(tmp_path)
    doc = json.loads(p.read_text())
    edit(doc)
    p.write_text(json.dumps(doc))
    with pytest.raises(ExperimentConfigError) as e:
        load_grid(p)
    assert str(p) in str(e.value) and field in str(e.value)


def test_setting_config_unknown_model_and_missing_field(tmp_path):
    g = load_grid(tiny_grid(tmp_path))
    p = tmp_path / "best.json"
    p.write_text(json.dumps({"model": "gpt_175b", "max_len": 256, "gpus": 4, "tokens": 2048, "systems": {}}))
    with pytest.raises(ExperimentConfigError, match="unknown model 'gpt_175b'"):
        load_setting_config(p, g)
    p.write_text(json.dumps({"model": "tiny_gpt", "max_len": 256, "gpus": 4, "tokens": 2048,
                             "systems": {"packing": {"pp": 2, "tp": 1, "dp": 2, "recompute": "none"}}}))
    with pytest.raises(ExperimentConfigError, match=r"systems.packing: missing field 'micro_batch_size'"):
        load_setting_config(p, g)


def test_cli_bad_config_exits_2_before_running(tmp_path, capsys):
    from megatron.experiments.__main__ import main
    p = tiny_grid(tmp_path)
    doc = json.loads(p.read_text())
    del doc["grid"]
    p.write_text(json.dumps(doc))
    assert main(["grid-search", "--simulate", "--config", str(p), "--out", str(tmp_path / "res")]) == 2
    assert "missing field 'grid'" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


# ---- simulate back-end -------------------------------------------------------------------------

class Counting(SimulateBackend):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = 0

    def run(self, grid, job):
        self.calls += 1
        return super().run(grid, job)


def test_simulated_grid_search_picks_best_and_resumes(tmp_path):
    g = load_grid(tiny_grid(tmp_path))
    cfgs, out = tmp_path / "configs", tmp_path / "res"
    be = Counting()
    rows = drivers.grid_search(g, be, out, config_dir=cfgs)
    n_jobs = len(drivers.grid_jobs(g, g.settings()[0]))
    n_verify = len(read_rows(out / "grid_verify.jsonl"))
    assert n_jobs == len(rows) == 3 + 3 * 4 * 2 * 2  # 3 layouts x (dynapipe + 4 baselines x 2 mbs x 2 rc)
    assert be.calls == n_jobs + n_verify
    for r in rows:
        validate_row(r)
        assert r["backend"] == "simulate" and r["git_commit"]
    # Brute force, independently: a fresh back-end evaluates every job; the best row per system wins.
    fresh = SimulateBackend()
    truth = {}
    for job in drivers.grid_jobs(g, g.settings()[0]):
        r = fresh.run(g, job)
        if r["status"] == "ok" and r["tokens_per_s"] > truth.get(job.system, (0, None))[0]:
            truth[job.system] = (r["tokens_per_s"], job)
    best = json.loads((cfgs / "best_configs" / "tiny" / "tiny_gpt_L256_G4.json").read_text())
    assert set(truth) == {"dynapipe", "packing", "packing_varlen", "packing_balanced", "fixed"}
    # DynaPipe (which also searches packed rows) beats every baseline's best configuration
    assert all(truth["dynapipe"][0] >= tps for tps, _ in truth.values())
    for system, (tps, job) in truth.items():
        got = best["systems"][system]
        assert (got["pp"], got["tp"], got["dp"]) == (job.pp, job.tp, job.dp)
        assert got["tokens_per_s"] == pytest.approx(tps, abs=1e-3)  # deterministic: same batches, same plans
        if system != "dynapipe":
            assert (got["micro_batch_size"], got["recompute"]) == (job.micro_batch_size, job.recompute)
    # The grid is not trivially flat: layouts differ in throughput.
    dyn = [r["tokens_per_s"] for r in rows if r["system"] == "dynapipe" and r["status"] == "ok"]
    assert len(dyn) >= 2 and max(dyn) > 1.05 * min(dyn)
    control = json.loads((cfgs / "control_configs" / "tiny" / "tiny_gpt_L256_G4.json").read_text())
    for system in ("packing", "fixed"):
        c = control["systems"][system]
        assert (c["pp"], c["tp"], c["dp"]) == (best["systems"]["dynapipe"]["pp"], 1,
                                               best["systems"]["dynapipe"]["dp"])
    # The winners were re-checked on the benchmark's 3 batches (grid_verify.jsonl).
    verified = read_rows(out / "grid_verify.jsonl")
    assert verified and all(r["iterations"] == 3 for r in verified if r["status"] == "ok")
    # Resumable: a second run does nothing, --force reruns.
    again = Counting()
    rows2 = drivers.grid_search(g, again, out, config_dir=cfgs)
    assert again.calls == 0 and len(read_rows(out / "grid_search.jsonl")) == n_jobs
    assert [r["tokens_per_s"] for r in rows2] == [r["tokens_per_s"] for r in rows]

    # Benchmark + ablation end to end on the written configs, then every figure from the rows.
    res = drivers.benchmark(g, be, out, config_dir=cfgs)
    assert {r["system"] for r in res["best_throughput"]} == {"dynapipe", "packing", "packing_varlen",
                                                             "packing_balanced", "fixed"}
    abl = drivers.ablation(g, be, out, config_dir=cfgs)
    assert {r["variant"] for r in abl} >= {"dynapipe", "partition=token", "schedule=1f1b"}
    assert "vs balanced" in drivers.speedup_table(res["best_throughput"])
    pytest.importorskip("matplotlib")
    from megatron.experiments.figures import draw
    figs = tmp_path / "figs"
    assert draw(out, figs, [13, 14, 15, 16, 17], "simulate") == 0
    for n in (13, 14, 15, 16, 17):
        pngs = list(figs.glob(f"fig{n}_*.png"))
        assert pngs and all(p.stat().st_size > 5000 for p in pngs), n
        assert all(p.with_suffix(".csv").stat().st_size > 0 for p in pngs)


def test_dynapipe_beats_baselines_on_shipped_a100_table(tmp_path):
    """One setting of the real grid at one layout: DynaPipe's simulated throughput exceeds the
    best fixed micro-batch configuration's (the direction Fig 13 reports)."""
    g = load_grid(ROOT / "experiment_configs" / "a100_sim.json")
    s = [x for x in g.settings() if x.key == "gpt_6.7b_L2048_G8"][0]
    be = SimulateBackend(str(HERE / "lengths_fixture.txt"))
    dyn = be.run(g, Job("t", s, "dynapipe", 4, 1, 2, batches=1))
    fixed = [be.run(g, Job("t", s, "fixed", 4, 1, 2, micro_batch_size=b, recompute=rc, batches=1))
             for b in (1, 2) for rc in ("selective", "full")]
    assert dyn["status"] == "ok"
    assert dyn["tokens_per_s"] > max(r["tokens_per_s"] or 0 for r in fixed)


# ---- live back-end -----------------------------------------------------------------------------

RECORDED = (HERE / "trainer_log_fixture.txt").read_text()


def test_log_parser_on_recorded_trainer_lines():
    its = parse_log(RECORDED)
    assert [r["iteration"] for r in its] == [1, 2, 3, 4]
    assert its[1]["elapsed_ms"] == 6250.2 and its[1]["tokens_per_s"] == 647.5
    p = its[1]["planner"]
    assert p["name"] == "dynapipe" and p["num_microbatches"] == [11]
    assert p["simulated_ms"] == 450.9 and p["measured_ms"] == 6250.2 and p["planning_ms"] == 713.1
    assert p["plan_wait_ms"] == 11.0
    assert p["predicted_peak_mb"] == [122.4, 32.1] and p["measured_peak_mb"] is None
    assert (p["recompute"], p["schedule"], p["padding_efficiency"]) == ("none", "adaptive", 0.949)
    fields = rows_from_log(RECORDED, warmup=1)
    assert fields["iterations"] == 3 and fields["measured_ms"] == [6250.2, 6989.1, 5335.0]
    assert fields["predicted_ms"] == [450.9, 425.6, 399.3]
    assert fields["predicted_peak_mb"] == [122.4, 60.0, 109.7]
    assert "measured_peak_mb" not in fields  # n/a on CPU


def test_live_and_simulate_rows_share_the_schema(tmp_path):
    g = load_grid(tiny_grid(tmp_path))
    s = g.settings()[0]
    job = Job("best_throughput", s, "dynapipe", 2, 1, 2, batches=2)
    sim = SimulateBackend().run(g, job)
    live = job.row(g, "live", status="ok", **rows_from_log(RECORDED, warmup=2))
    for r in (sim, live):
        validate_row(r)
        assert set(r) == set(ROW_FIELDS)
    assert sim["predicted_ms"] and live["predicted_ms"] and live["measured_ms"]
    cmd = command(load_grid(ROOT / "experiment_configs" / "cpu_live_smoke.json"),
                  Job("x", load_grid(ROOT / "experiment_configs" / "cpu_live_smoke.json").settings()[0],
                      "packing", 2, 1, 1, micro_batch_size=4, recompute="full", batches=2), 
                  load_grid(ROOT / "experiment_configs" / "cpu_live_smoke.json").models["tiny_gpt"])
    assert "--pack-dataset" in cmd and "--recompute-granularity" in cmd and "full" in cmd
    assert cmd[cmd.index("--train-iters") + 1] == "3"


def test_live_failed_run_is_recorded_and_sweep_goes_on(tmp_path, monkeypatch):
    """A run that exits non-zero becomes a 'failed' row with the log tail; the next job still runs.
    (The launcher is replaced by a process that fails at once: torchrun start-up is slow here.)"""
    import sys

    import megatron.experiments.live as live
    calls = []

    def fake_command(grid, job, spec):
        calls.append(job.system)
        if job.system == "packing":
            return [sys.executable, "-c", "import sys; print('Traceback: boom'); sys.exit(3)"]
        return [sys.executable, "-c", "print(open(%r).read())" % str(HERE / "trainer_log_fixture.txt")]
    monkeypatch.setattr(live, "command", fake_command)
    g = load_grid(tiny_grid(tmp_path, grid={"pp": [2], "tp": [1], "micro_batch_sizes": [4], "recompute": ["none"]},
                            cluster_sizes=[2]))
    rows = drivers.run_jobs(g, LiveBackend(), drivers.grid_jobs(g, g.settings()[0]), tmp_path / "r.jsonl",
                            False, "t")
    assert calls == ["dynapipe", "packing", "packing_varlen", "fixed"]  # packing_balanced: no trainer flag
    st = {r["system"]: r for r in rows}
    assert st["packing"]["status"] == "failed" and "exit status 3" in st["packing"]["error"]
    assert "boom" in st["packing"]["log_tail"]
    assert st["dynapipe"]["status"] == st["fixed"]["status"] == "ok"
    assert st["dynapipe"]["measured_ms"] == [6250.2, 6989.1, 5335.0]
    assert st["packing_balanced"]["status"] == "infeasible" and "no trainer flag" in st["packing_balanced"]["error"]
    assert len(read_rows(tmp_path / "r.jsonl")) == 5


@pytest.mark.slow  # torchrun start-up + 3 iterations: ~20 s on a quiet 2-core box, minutes on a loaded one
@pytest.mark.skipif(not (ROOT / "data/cache/kjv_tasks_sp4k_inputs_document.idx").exists(),
                    reason="sample data not built (bash data/build_sample_data.sh)")
def test_live_real_two_rank_cpu_run(tmp_path):
    """One real torchrun job: tiny GPT, PP=2 over 2 gloo ranks, DynaPipe, 2 measured iterations."""
    doc = json.loads((ROOT / "experiment_configs" / "cpu_live_smoke.json").read_text())
    doc["models"] = {"tiny_gpt": dict(doc["models"]["tiny_gpt"], max_lens=[128])}
    doc["tokens_per_gpu"] = 256
    p = tmp_path / "live.json"
    p.write_text(json.dumps(doc))
    g = load_grid(p)
    row = LiveBackend().run(g, Job("best_throughput", g.settings()[0], "dynapipe", 2, 1, 1, batches=2))
    assert row["status"] == "ok", row["log_tail"]
    validate_row(row)
    assert row["iterations"] == 2 and len(row["measured_ms"]) == 2 and len(row["predicted_ms"]) == 2
    assert all(t > 0 for t in row["measured_ms"] + row["predicted_ms"]) and row["tokens_per_s"] > 0
    assert 0 < row["padding_efficiency"] <= 1 and row["predicted_peak_mb"]


def test_fig18_from_fixture_rows(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron.experiments.figures import draw
    g = load_grid(tiny_grid(tmp_path))
    job = Job("best_throughput", g.settings()[0], "dynapipe", 2, 1, 2, batches=3)
    row = job.row(g, "live", status="ok", **rows_from_log(RECORDED, warmup=1))
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "best_throughput.jsonl").write_text(json.dumps(row) + "\n")
    assert draw(tmp_path / "res", tmp_path / "figs", [18], "simulate") == 0
    for name in ("fig18_time.png", "fig18_memory.png", "fig18_time.csv"):
        assert (tmp_path / "figs" / name).stat().st_size > 100
    assert len((tmp_path / "figs" / "fig18_time.csv").read_text().splitlines()) == 4


def test_figures_without_matplotlib_write_csv_and_say_so(tmp_path, monkeypatch, capsys):
    import megatron.experiments.figures as figures
    monkeypatch.setattr(figures, "_plt", lambda: None)
    g = load_grid(tiny_grid(tmp_path))
    job = Job("best_throughput", g.settings()[0], "dynapipe", 2, 1, 2, batches=3)
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "best_throughput.jsonl").write_text(
        json.dumps(job.row(g, "live", status="ok", **rows_from_log(RECORDED, warmup=1))) + "\n")
    assert figures.draw(tmp_path / "res", tmp_path / "figs", [13, 18], "live") == 3
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert (tmp_path / "figs" / "fig18_time.csv").is_file() and not list((tmp_path / "figs").glob("*.png"))
    assert (tmp_path / "figs" / "fig13_tiny_tiny_gpt_G4.csv").is_file()


def test_benchmark_checks_every_config_before_running(tmp_path):
    """A bad control_configs file stops the benchmark before any best-throughput job runs."""
    g = load_grid(tiny_grid(tmp_path))
    cfgs = tmp_path / "configs"
    drivers.grid_search(g, SimulateBackend(), tmp_path / "search", config_dir=cfgs)
    ctrl = cfgs / "control_configs" / "tiny" / "tiny_gpt_L256_G4.json"
    doc = json.loads(ctrl.read_text())
    del doc["systems"]["fixed"]["recompute"]
    ctrl.write_text(json.dumps(doc))
    be = Counting()
    with pytest.raises(ExperimentConfigError, match=r"control_configs.*systems.fixed: missing field 'recompute'"):
        drivers.benchmark(g, be, tmp_path / "res", config_dir=cfgs)
    assert be.calls == 0 and not (tmp_path / "res" / "best_throughput.jsonl").exists()


def test_line_figures_leave_a_gap_where_a_system_has_no_configuration(tmp_path):
    """A system with no feasible configuration at one max length (null in the configs, so no
    row) is a gap and a marked point, not a line drawn through the missing length."""
    g = load_grid(tiny_grid(tmp_path, models={"tiny_gpt": {
        "kind": "gpt", "cost_model": "cost_models/cpu_tiny_gpt.json", "hidden_size": 64, "num_layers": 4,
        "max_lens": [128, 256, 512]}}))
    rows = []
    for s in g.settings():
        for system in ("dynapipe", "packing"):
            if system == "packing" and s.max_len == 256:
                continue
            rows.append(Job("best_throughput", s, system, 2, 1, 2, micro_batch_size=None if system == "dynapipe"
                            else 4, recompute=None if system == "dynapipe" else "none", batches=1)
                        .row(g, "simulate", status="ok", iterations=1, tokens_per_s=1000.0 + s.max_len,
                             padding_efficiency=0.9))
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "best_throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import megatron.experiments.figures as figures
    plotted = []
    if figures._plt() is not None:
        real = figures._plt()

        class Spy:  # records each line's y values, draws as usual
            def __getattr__(self, k):
                return getattr(real, k)

            def subplots(self, *a, **k):
                fig, ax = real.subplots(*a, **k)
                orig = ax.plot

                def plot(xs, ys, *pa, **pk):
                    plotted.append((list(xs), list(ys), pk.get("label")))
                    return orig(xs, ys, *pa, **pk)
                ax.plot = plot
                return fig, ax
        figures_plt = Spy()
    else:
        figures_plt = None
    import unittest.mock as mock
    with mock.patch.object(figures, "_plt", lambda: figures_plt):
        figures.draw(tmp_path / "res", tmp_path / "figs", [13], "simulate")
    csv = (tmp_path / "figs" / "fig13_tiny_tiny_gpt_G4.csv").read_text().splitlines()
    assert any(line.startswith("packing,256,") and "no feasible configuration" in line for line in csv)
    if figures_plt is not None:
        packing = [ys for xs, ys, label in plotted if label == "Megatron + packing (dense rows, paper)"][0]
        assert packing[0] == 1128.0 and packing[1] != packing[1] and packing[2] == 1512.0  # NaN in the middle


def test_log_parser_reads_the_cp_size_counts_the_trainer_prints():
    from megatron.training.logging import planner_line
    line = " iteration        2/       4 | elapsed time per iteration (ms): 100.0 | lm loss: 1.0 |"
    info = {"planner": "dynapipe", "num_microbatches": [2, 2], "cp_size_counts": {1: 5, 4: 2},
            "simulated_ms": 10.0}
    p = parse_log(line + "\n" + planner_line(info, 0.1))[0]["planner"]
    assert p["cp_size_counts"] == {1: 5, 4: 2} and p["simulated_ms"] == 10.0
