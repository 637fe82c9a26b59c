"""The planners' time models against the clock, on this machine (issue 25, item 2).

For TeraPipe: profile the CPU latency model of the benchmark's layer here
(`megatron.planner.terapipe.latency.profile_cpu_model`), fit its host calibration from plain
unsliced runs (`megatron.profiling.calibrate`: compute slow-down of ranks sharing the cores,
per-slice and per-step overheads; `--no-calibrate` leaves it out), then train the same GPT on 2 CPU ranks
(PP=2) unsliced, with fixed slices and with `--terapipe-slices auto`, each run planned from that
model. Every iteration's log line carries the planner's "simulated / measured iteration ms"; the
bench reports their medians over the timed iterations and the relative error.

How to run (from the repository root; a few minutes on 2 idle cores):

    python benchmarks/bench_time_model.py
    python benchmarks/bench_time_model.py --iters 10 --seq 512 --hidden 128

Output: one JSON object per line.

`"benchmark": "terapipe_calibration"`: the fitted calibration and its fit errors on its own runs.
`"benchmark": "terapipe_time_model"` (one per slicing): slices ("1" = unsliced, "4", "auto"),
chosen (the slicing the planner ran), simulated_ms / measured_ms (medians over the timed
iterations), error (simulated / measured - 1), profile_s (the profiling run's wall time).
`"benchmark": "terapipe_auto_vs_unsliced"`: measured_speedup = unsliced ms / auto ms (>= 1 is
the target: auto slicing never measures slower than no slicing on the machine it was profiled on).

Absolute times on a shared machine are noisy; compare numbers from one run, on idle cores.
DynaPipe's time model against the clock is `benchmarks/bench_packing_cpu.py` (its `error` field:
simulated / measured-without-planning - 1, per batching configuration).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIM = re.compile(r"simulated / measured iteration ms: ([0-9.]+) / ([0-9.]+)")
SLICES = re.compile(r"token slices: (\[[^\]]*\])")


def _run(cmd) -> None:
    """A step of the bench; a refusal (a noisy host, a fit that misses) ends it with the tool's own words."""
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if r.returncode:
        tail = "\n".join(r.stderr.strip().splitlines()[-6:])
        raise SystemExit(f"bench_time_model: `{' '.join(cmd[2:4])}` failed (exit {r.returncode}):\n{tail}")


def profile(out: str, a) -> float:
    t0 = time.perf_counter()
    seqs = sorted({max(8, a.seq // d) for d in (16, 8, 4, 2, 1)})
    ctx = sorted({a.seq // 4, a.seq // 2, a.seq - a.seq // 8})
    _run([sys.executable, "-m", "megatron.planner.terapipe.latency", "--output", out,
          "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads), "--mbs", "1",
          "--seqs", ",".join(map(str, seqs)), "--contexts", ",".join(map(str, ctx)),
          "--repeats", "5", "--max-fit-error", str(a.max_fit_error),
          *(["--min-clean", "0"] if a.any_host else [])])
    return time.perf_counter() - t0


def calibrate(out: str, a) -> float:
    """Fit the host calibration of the fresh latency file (planner/calibration.py) from runs of
    this model inside its grid (micro-batch size 1, as profiled), unsliced and cut into 2, 4 or
    8 uniform slices, none of them a configuration `train` measures (4 sequences per batch where
    the bench trains `--batch`; 4 slices only of half-length sequences)."""
    t0 = time.perf_counter()
    s, h, q, e = a.seq, a.seq // 2, a.seq // 4, max(8, a.seq // 8)
    shapes = [f"1x{e}x16", f"1x{q}x8", f"1x{h}x4", f"1x{s}x4", f"1x{s}x4x2", f"1x{s}x4x8", f"1x{h}x4x4",
              f"1x{h}x8x2"]
    _run([sys.executable, "-m", "megatron.profiling.calibrate", "--terapipe-cost-model", out,
          "--shapes", ",".join(shapes), "--max-spread", str(a.max_spread), "--max-fit-error", str(a.max_fit_error),
          *(["--min-share", "0"] if a.any_host else []), "--", *model_flags(a)])
    return time.perf_counter() - t0


def model_flags(a) -> list:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "512",
            "--max-position-embeddings", str(a.seq)]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


def train(a, slices: str, latency: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "pretrain_gpt.py",
           "--pipeline-model-parallel-size", "2", *model_flags(a), "--seq-length", str(a.seq), "--micro-batch-size", "1",
           "--global-batch-size", str(a.batch), "--train-iters", str(a.iters), "--lr", "1e-3", "--mock-data",
           "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
           "--terapipe", "--terapipe-slices", slices, "--terapipe-cost-model", latency]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    pairs = [(float(s), float(m)) for s, m in SIM.findall(out.stdout)][a.warmup:]
    if not pairs:
        raise RuntimeError("no 'simulated / measured' lines in the log:\n" + out.stdout[-2000:])
    sim = statistics.median(p[0] for p in pairs)
    meas = statistics.median(p[1] for p in pairs)
    chosen = SLICES.findall(out.stdout)
    return {"benchmark": "terapipe_time_model", "slices": slices, "chosen": chosen[-1] if chosen else None,
            "seq": a.seq, "hidden": a.hidden, "layers": a.layers, "batch": a.batch, "pp": 2,
            "simulated_ms": round(sim, 1), "measured_ms": round(meas, 1), "error": round(sim / meas - 1, 3),
            "iters_timed": len(pairs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="sequences per iteration (micro-batches of 1)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of the medians")
    p.add_argument("--fixed", default="4", help="the fixed slice count compared besides 1 and auto")
    p.add_argument("--max-spread", type=float, default=0.5,
                   help="passed to calibrate: noisier runs are re-run, then refused")
    p.add_argument("--max-fit-error", type=float, default=0.15, help="passed to the profiler and calibrate")
    p.add_argument("--any-host", action="store_true",
                   help="skip the profiler's and calibrate's host probe (they refuse a busy host at once otherwise)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="leave the latency file uncalibrated (the table's layer times alone)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        lat = os.path.join(tmp, "latency.json")
        prof_s = profile(lat, a)
        cal_s = calibrate(lat, a) if a.calibrate else 0.0
        cal = json.load(open(lat)).get("calibration")
        print(json.dumps({"benchmark": "terapipe_calibration", "seconds": round(cal_s, 1), "calibration": cal}),
              flush=True)
        rows = {}
        for slices in ("1", a.fixed, "auto"):
            rows[slices] = train(a, slices, lat)
            rows[slices]["profile_s"] = round(prof_s, 1)
            rows[slices]["cores"] = len(os.sched_getaffinity(0))
            print(json.dumps(rows[slices]), flush=True)
    print(json.dumps({"benchmark": "terapipe_auto_vs_unsliced", "auto_chosen": rows["auto"]["chosen"],
                      "unsliced_ms": rows["1"]["measured_ms"], "auto_ms": rows["auto"]["measured_ms"],
                      "measured_speedup": round(rows["1"]["measured_ms"] / rows["auto"]["measured_ms"], 3)}),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
