"""profiling/noise.py and the four profilers that use it, with timings injected (a fake clock or
fake runs): deterministic, whatever else the host is doing."""
import itertools
import json

import numpy as np
import pytest

from megatron.profiling import noise


class FakeClock:
    """noise.clock replaced: call i advances the time by step(i) seconds."""

    def __init__(self, step):
        self.step, self.i, self.t = step, 0, 0.0

    def __call__(self):
        self.t += self.step(self.i)
        self.i += 1
        return self.t


def two_call(durations_ms):
    """For profilers that read the clock twice per sample (start, end): the samples' durations
    cycle through `durations_ms`."""
    cyc = itertools.cycle(durations_ms)
    return FakeClock(lambda i: 0.0 if i % 2 == 0 else next(cyc) / 1e3)


def test_quiet_cells_take_one_round():
    t = noise.repeat(lambda i: (1.0, 2.0), 1, 4)
    assert t.values == (1.0, 2.0) and t.spread == 0.0 and t.rounds == 1 and not t.noisy


def test_a_noisy_round_is_measured_again_and_the_quiet_one_kept():
    rounds = iter([[9, 1, 9, 9], [1, 1, 1.1, 1]])  # warm-up, then 3 timed, per round
    cur = []

    def sample(i):
        if i == 0:
            cur[:] = next(rounds)
        return (cur[i],)
    t = noise.repeat(sample, 1, 3, max_spread=0.5, remeasure=2)
    assert t.rounds == 2 and not t.noisy and t.spread == pytest.approx(0.0) and t.values == (1.0,)


def test_a_cell_that_stays_noisy_is_marked_with_its_numbers():
    vals = itertools.cycle([1.0, 5.0, 5.0])
    calls = []
    t = noise.repeat(lambda i: (next(vals),), 0, 3, max_spread=0.5, remeasure=2,
                     agree=lambda flag: calls.append(flag) or flag)
    assert t.noisy and t.rounds == 3 and t.spread == pytest.approx(4.0) and calls == [True] * 3
    log = noise.NoiseLog(0.5)
    log.add("cell A", t)
    msg = log.refusal("tool")
    assert "1 of 1 cells" in msg and "cell A: spread 400% (min 1 ms, median 5 ms)" in msg and "--max-spread" in msg
    assert noise.NoiseLog().refusal("tool") is None


def test_a_cell_far_above_its_neighbours_is_implausible():
    grid = np.array([[1.0, 1.2, 1.5], [1.1, 204.0, 1.8], [1.3, 1.7, 2.4]])
    (idx, v, m), = noise.implausible(grid)
    assert idx == (1, 1) and v == 204.0 and m == pytest.approx(1.45)
    line, = noise.implausible_lines(grid, [[1, 2, 4], [8, 16, 32]], ["b", "l"], "t(b, l, 0)")
    assert "t(b, l, 0) at b=2, l=16 is 204 ms, 141x its neighbours (median 1.45 ms)" in line
    smooth = np.outer([1, 2, 4], [1, 2, 4, 8]).astype(float)  # times grow with the shape
    smooth[0, 0] = np.nan
    assert noise.implausible(smooth) == []


def test_progress_eta_and_threads(monkeypatch):
    now = iter([0.0, 10.0, 30.0])
    p = noise.Progress(4, clock_fn=lambda: next(now))
    assert p.next() == "[1/4]"
    assert p.next() == "[2/4, ETA 30s]"  # 10 s for one cell, three to go
    assert p.next() == "[3/4, ETA 30s]"  # 15 s a cell, two to go
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert noise.threads_for(ranks=2, cores=2) == 1 and noise.threads_for(ranks=1, cores=8) == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert noise.threads_for(ranks=2, cores=2) == 3
    assert noise.host_load_line(cores=2, load=1.5) is None
    assert "load average 7.0 on 2 cores" in noise.host_load_line(cores=2, load=7.0)


# ------------------------------------------------------------------ TeraPipe's latency profile
TP_ARGS = ["--mbs", "1,2", "--seqs", "8,16,32", "--contexts", "8,16", "--repeats", "4", "--hidden-size", "32"]
BUSY = noise.HostNoise(share=0.24, clean=0.01, samples=400, seconds=2.0, load=26.5)
IDLE = noise.HostNoise(share=1.0, clean=0.9, samples=400, seconds=2.0, load=0.5)


def truth(b, l, c):
    """A layer's ms: launch + per-token + attention, and a context term of known coefficients."""
    return 0.5 + 0.002 * b * l + 5e-5 * b * l * l + 0.001 * b * l + 5e-4 * b * c + 2e-5 * b * l * c * (c > 0) \
        - 0.001 * b * l * (c == 0)


def busy_sampler(seed=0, p_slow=0.6):
    """truth() plus what a busy host adds: most samples slowed 1-5x, the rest within 2 %."""
    rng = np.random.default_rng(seed)
    return lambda b, l, c: truth(b, l, c) * (rng.uniform(1, 5) if rng.random() < p_slow else rng.uniform(1, 1.02))


def test_probe_measures_the_share_of_a_core_and_the_undisturbed_samples(monkeypatch):
    now, cpu = [0.0], [0.0]
    walls = iter([1e-3, 1e-3, 5e-3, 1.05e-3, 9e-3] * 4)  # warm-up, then 3 of 5 within 10 % of the fastest

    def kernel():
        w = next(walls)
        now[0] += w
        cpu[0] += 1e-3  # a millisecond of work, whatever the wall time
    monkeypatch.setattr(noise, "clock", lambda: now[0])
    monkeypatch.setattr(noise, "cpu_clock", lambda: cpu[0])
    h = noise.probe(seconds=0.0, max_samples=10, kernel=kernel)
    assert h.samples == 10 and h.clean == pytest.approx(0.6) and h.share == pytest.approx(10e-3 / 34.1e-3)
    assert h.repeats_for() == 6 and noise.HostNoise(1, 0.01, 400, 2).repeats_for() == 459
    assert "60% of 10 probe samples undisturbed, 29% of a core for this process" in h.describe()


def test_terapipe_profile_on_a_busy_host_refuses_in_one_line_before_profiling(tmp_path, monkeypatch, capsys):
    from megatron.planner.terapipe import latency as terapipe_latency
    monkeypatch.setattr(noise, "probe", lambda: BUSY)
    monkeypatch.setattr(terapipe_latency, "profile_cpu_model", lambda *a, **k: pytest.fail("profiled anyway"))
    out = tmp_path / "lat.json"
    assert terapipe_latency.main(["--output", str(out), *TP_ARGS]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert not out.exists()
    assert err[-1].startswith("terapipe_latency: error: host too busy to profile (1% of 400 probe samples "
                              "undisturbed, 24% of a core for this process, load average 26.5")
    assert "459 repeats a cell" in err[-1] and "idle host, or pass --min-clean 0.005" in err[-1]


def test_interleaved_rounds_visit_every_cell_then_only_the_ones_that_do_not_reproduce():
    order = []
    vals = {0: itertools.cycle([1.0]), 1: iter([9.0, 1.0, 2.0, 5.0, 1.0])}

    def sample(i):
        order.append(i)
        return next(vals[i])
    cells = noise.interleaved(["a", "b"], sample, 2, max_disagreement=0.1, extra_rounds=2)
    # warm-up round, 2 rounds over both cells, 2 extra rounds of the cell whose minima disagree
    assert order == [0, 1, 0, 1, 0, 1, 1, 1]
    assert cells[0].samples == [1.0, 1.0] and cells[1].samples == [1.0, 2.0, 5.0, 1.0]
    assert cells[1].value == 1.0 and cells[1].disagreement == 0.0


def _cfg():
    from megatron.config.core import ModelConfig
    return ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=64, vocab_size=128,
                       max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


def test_terapipe_fit_on_busy_synthetic_timings_recovers_the_layer(monkeypatch):
    """60 % of the samples slowed 1-5x: the minimum over 12 interleaved rounds recovers the table
    within 2 % and the context coefficients, and the held-out check passes."""
    from megatron.planner.terapipe.latency import profile_cpu_model
    mbs, seqs, ctx = [1, 2, 4], [8, 16, 32, 64], [16, 32, 64]
    lines = []
    m = profile_cpu_model(_cfg(), mbs, seqs, ctx, repeats=12, sampler=busy_sampler(), log=lines.append)
    want = np.array([[truth(b, l, 0) for l in seqs] for b in mbs])
    assert np.max(np.abs(np.asarray(m.t0_ms) / want - 1)) < 0.02
    assert m.coef == pytest.approx([0.001, 5e-4, 2e-5], rel=0.3, abs=2e-4)
    assert m.meta["held_out_rms_error"] < 0.03
    assert any(x.startswith("fit on held-out cells: ") for x in lines)


def test_terapipe_fit_that_misses_held_out_cells_is_not_written(tmp_path, monkeypatch, capsys):
    """Every sample of one cell 300 ms among ~1 ms neighbours (a host that was busy for exactly that
    cell): the held-out check refuses the profile, the neighbour check names the cell, nothing is
    written, the last line says what to do."""
    from megatron.planner.terapipe import latency as terapipe_latency
    monkeypatch.setattr(noise, "probe", lambda: IDLE)
    monkeypatch.setattr(terapipe_latency, "slice_sampler",
                        lambda layer, h: lambda b, l, c: 300.0 if (b, l, c) == (2, 8, 0) else truth(b, l, c))
    out = tmp_path / "lat.json"
    assert terapipe_latency.main(["--output", str(out), *TP_ARGS, "--time-limit", "0.5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert not out.exists()
    assert err[-1].startswith("terapipe_latency: error: the fit misses held-out cells by ")
    assert "past --max-fit-error 0.15; worst t(b=" in err[-1] and "interleaved rounds" in err[-1]
    assert any(x.startswith("WARNING: t(b, l, 0) at b=2, l=8 is 300 ms") for x in err)
    assert "Re-run on an idle host, or with more --repeats / --time-limit." in err[-1]


def test_terapipe_profile_quiet_host_writes_and_flags_a_context_term_of_nothing(tmp_path, monkeypatch, capsys):
    from megatron.planner.terapipe import latency as terapipe_latency
    monkeypatch.setattr(noise, "probe", lambda: IDLE)
    monkeypatch.setattr(terapipe_latency, "slice_sampler",
                        lambda layer, h: lambda b, l, c: 0.5 + 0.01 * b * l)  # context costs nothing
    out = tmp_path / "lat.json"
    assert terapipe_latency.main(["--output", str(out), *TP_ARGS]) == 0
    err = capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["context_coef"] == pytest.approx([0.0, 0.0, 0.0], abs=1e-9) and doc["meta"]["threads"] == 1
    assert "WARNING: the context term fitted to context_coef [0, 0, 0]" in err and "12 of 12 measured" in err
    assert "90% of 400 probe samples undisturbed" in doc["meta"]["host"]


# ------------------------------------------------------------------ DynaPipe's profile_model
def test_profile_model_on_a_busy_host_writes_nothing(tmp_path, monkeypatch, capsys):
    from megatron.profiling import profile_model
    # three clock reads per iteration (start, after forward, after backward): 2 of 3 iterations slow
    def step(i):
        k, it = i % 3, i // 3
        return 0.0 if k == 0 else (1e-3 if it % 3 == 0 else 0.1)
    monkeypatch.setattr(noise, "clock", FakeClock(step))
    out = tmp_path / "cm.json"
    rc = profile_model.main(["--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "100",
                             "--micro-batch-sizes", "1", "--seq-lengths", "16", "--recompute", "none",
                             "--num-layers-profiled", "1", "--warmup", "0", "--iters", "3", "--device", "cpu",
                             "--remeasure", "1", "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and not out.exists()
    assert "profile_model: error:" in err and "stayed noisier than --max-spread 0.5" in err
    assert "tp1 none encoder [1, 16]" in err and "(2 rounds) NOISY" in err and "[1/1]" in err


def test_profile_model_on_a_busy_host_refuses_before_profiling(tmp_path, monkeypatch, capsys):
    from megatron.profiling import profile_model, profiler
    monkeypatch.setattr(profile_model, "probe_host", lambda: BUSY)
    monkeypatch.setattr(profiler, "run_profile", lambda *a: pytest.fail("profiled anyway"))
    out = tmp_path / "cm.json"
    assert profile_model.main(["--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "100",
                               "--micro-batch-sizes", "1", "--seq-lengths", "16", "--device", "cpu",
                               "--output", str(out)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert not out.exists()
    assert last.startswith("profile_model: error: host too busy to profile (1% of 400 probe samples undisturbed, "
                           "24% of a core") and "--min-share 0 to try anyway" in last


def test_profile_model_quiet_host_records_the_spread(tmp_path, monkeypatch):
    from megatron.profiling import profile_model
    monkeypatch.setattr(noise, "clock", FakeClock(lambda i: 0.0 if i % 3 == 0 else 1e-3))
    out = tmp_path / "cm.json"
    assert profile_model.main(["--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "100",
                               "--micro-batch-sizes", "1,2", "--seq-lengths", "16", "--recompute", "none",
                               "--num-layers-profiled", "1", "--warmup", "0", "--iters", "3", "--device", "cpu",
                               "--quiet", "--output", str(out)]) == 0
    meta = json.loads(out.read_text())  # meta is stored at the top level
    assert meta["profiler"]["max_spread"] == 0.5 and "0 re-measured, 0 still past" in meta["noise"]["summary"]


# ------------------------------------------------------------------ Aceso's profile
def test_aceso_profile_on_a_busy_host_keeps_no_table(tmp_path, monkeypatch, capsys):
    from megatron.aceso.__main__ import main
    monkeypatch.setattr(noise, "clock", two_call([1.0, 50.0, 50.0]))
    out = tmp_path / "db"
    rc = main(["profile", "--out", str(out), "--size", "t", "--num-layers", "1", "--hidden-size", "32",
               "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--mbs", "1",
               "--repeats", "3", "--remeasure", "0"])
    err = capsys.readouterr().err
    assert rc == 1 and list(out.iterdir()) == []
    assert "python -m megatron.aceso profile: error: 26 of 26 cells stayed noisier" in err and "mbs1 enc" in err


def test_aceso_profile_on_a_busy_host_refuses_before_profiling(tmp_path, monkeypatch, capsys):
    from megatron.aceso import __main__ as aceso_main
    from megatron.aceso import profiler
    monkeypatch.setattr(aceso_main, "probe_host", lambda: BUSY)
    monkeypatch.setattr(profiler, "profile_gpt", lambda *a, **k: pytest.fail("profiled anyway"))
    out = tmp_path / "db"
    assert aceso_main.main(["profile", "--out", str(out), "--size", "t", "--num-layers", "1", "--hidden-size", "32",
                            "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m megatron.aceso profile: error: host too busy to profile (1% of 400")
    assert "--min-share 0 to try anyway" in last and not out.exists()


def test_aceso_profile_quiet_host_writes_the_tables(tmp_path, monkeypatch, capsys):
    from megatron.aceso.__main__ import main
    monkeypatch.setattr(noise, "clock", two_call([1.0]))
    out = tmp_path / "db"
    assert main(["profile", "--out", str(out), "--size", "t", "--num-layers", "1", "--hidden-size", "32",
                 "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--mbs", "1", "2",
                 "--repeats", "3"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["gpt_t_mbs1_tp1_algo0.csv", "gpt_t_mbs2_tp1_algo0.csv"]
    assert "[26/26, ETA" in capsys.readouterr().err


def test_spread_of_tiny_cells_is_relative_to_a_floor():
    """20 us vs 30 us is interpreter jitter, not a busy host; 1 ms vs 5 ms is one."""
    assert noise.spread([0.02, 0.03, 0.03]) == pytest.approx(0.1)
    assert noise.spread([1.0, 5.0, 5.0]) == pytest.approx(4.0)
