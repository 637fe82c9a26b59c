"""Fit what a cost table leaves out of a training step on this host, and store it in the table.

    python -m megatron.profiling.calibrate --dynapipe-cost-model cost_models/cpu_tiny_gpt.json \\
        --pipeline-model-parallel-size 2 -- --num-layers 4 --hidden-size 64 --num-attention-heads 4 \\
        --ffn-hidden-size 256 --max-position-embeddings 512 --vocab-size 4096

Runs `pretrain_gpt.py` (torchrun, mock data, plain 1F1B, data-parallel size 1) at several uniform
micro-batch shapes and counts (`--shapes`), takes each run's median iteration time after
`--warmup` iterations, and fits `planner.calibration.HostCalibration` (compute slow-down of
ranks sharing the host, per-instruction overhead, per-iteration overhead) so that the table's
simulated 1F1B time matches. The fit is written into the given file(s) (`"calibration"`),
atomically; the planners then apply it to every op they price. Flags after `--` go to the
trainer unchanged: give it the model the table was profiled for (and the dropout, precision
and recompute you train with). `--terapipe-cost-model` calibrates a TeraPipe latency file the
same way (its prediction of an unsliced run: `planner.terapipe.planner.pipelined_ms`).

Re-run it after re-profiling: the fit belongs to the table, the model and the host together.

On a noisy host (megatron/profiling/noise.py): a run whose iteration times spread past
`--max-spread` is run again (`--remeasure`), then refused; a fit whose rms relative error over
the runs is past `--max-fit-error` is shown with its worst run and not stored (exit 1). The
trainer flags are checked in-process before the first run, and a run that fails shows the
trainer's own error, not torchrun's report of it. Before any run, a 2 s host probe
(`noise.probe`) measures the share of a core this process gets: under `--min-share` (default
0.6) the runs (each rank wanting a core, for minutes) would be slowed several-fold and uneven,
so calibrate refuses at once, in one line with the numbers; measured on the project's 2-core
box at load average 20-25 (other jobs): 24-27 % of a core, where an idle host gives 95-100 %.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from megatron.atomic import write_json
from megatron.profiling import noise

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SHAPES = "1x256x4,1x128x8,2x128x4,2x64x12,4x64x6,4x32x16,8x32x8,1x64x16"


def parse_shapes(text: str) -> list:
    """MBSxSEQxCOUNT[xSLICES] -> [(b, s, n, slices)]; slices > 1 runs --terapipe with that many."""
    out = []
    for part in text.split(","):
        try:
            vals = [int(x) for x in part.lower().split("x")]
            if len(vals) not in (3, 4):
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shapes: {part!r} is not MBSxSEQxCOUNT[xSLICES] (e.g. 2x128x8, "
                                             "1x512x2x4)") from None
        if min(vals) < 1:
            raise argparse.ArgumentTypeError(f"--shapes: {part!r} has a value below 1")
        out.append(tuple(vals) + ((1,) if len(vals) == 3 else ()))
    if len(out) < 3:
        raise argparse.ArgumentTypeError("--shapes: at least 3 shapes (three numbers are fitted)")
    return out


def shape_name(shape) -> str:
    return "x".join(map(str, shape if shape[3] > 1 else shape[:3]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron.profiling.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--dynapipe-cost-model", help="cost-model JSON to calibrate (DynaPipe / packing planners)")
    p.add_argument("--terapipe-cost-model", help="TeraPipe latency JSON to calibrate")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=2, help="ranks of the calibration runs (PP)")
    p.add_argument("--shapes", type=parse_shapes, default=None,
                   help=f"runs as MBSxSEQxMICROBATCHES[xTOKEN_SLICES], comma-separated "
                        f"(default: those of {DEFAULT_SHAPES} "
                        "the table(s) can price; for a TeraPipe file alone, a run longer than its longest slice is cut "
                        "into uniform token slices); token slices (TeraPipe, uniform) only with --terapipe-cost-model "
                        "alone")
    p.add_argument("--iters", type=int, default=7, help="iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="first iterations of a run left out of its median")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--max-spread", type=float, default=noise.MAX_SPREAD,
                   help="a run whose iteration times spread more ((median - min) / min) is run again, up to "
                        "--remeasure times, then refused (default %(default)s)")
    p.add_argument("--remeasure", type=int, default=1, help="extra runs of a noisy shape (default %(default)s)")
    p.add_argument("--max-fit-error", type=float, default=noise.MAX_FIT_ERROR,
                   help="a fit whose rms relative error over the runs is larger is not stored (default %(default)s)")
    p.add_argument("--min-share", type=float, default=noise.MIN_SHARE,
                   help="refuse at once when the host probe gets less of a core than this (default %(default)s; "
                        "0 runs on any host)")
    p.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="after --: pretrain_gpt.py model flags")
    return p


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def child_error(text: str, lines: int = 12) -> str:
    """The end of a torchrun job's output without torchrun's own report of the failure (its
    traceback and summary say only "exitcode: 2"): what the trainer itself printed."""
    out = text.splitlines()
    for i in range(len(out) - 1, -1, -1):  # torchrun's ChildFailedError traceback, to the end
        if out[i].startswith("Traceback (most recent call last):") and \
                any("torch/distributed/run.py" in x or "ChildFailedError" in x for x in out[i:i + 40]):
            out = out[:i]
            break
    out = [x for x in out if not re.match(r"^[DIWEF]\d{4} [\d:.]+ +\d+ .*torch/distributed/", x)
           and not x.startswith(("WARNING:torch.distributed", "*****", "Setting OMP_NUM_THREADS"))]
    return "\n".join((out or text.splitlines())[-lines:]).strip("\n")


def run_times(args, b: int, s: int, n: int, k: int = 1) -> list:
    """Iteration ms (after --warmup) of one plain run at micro-batches of b x s, n per iteration
    (k > 1: each cut into k uniform token slices by --terapipe)."""
    from megatron.experiments.logparse import parse_log
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.pipeline_model_parallel_size), str(ROOT / "pretrain_gpt.py"), *trainer_argv(args, b, s, n, k)]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=args.timeout)
    rows = parse_log(out.stdout)
    times = [r["elapsed_ms"] for r in rows if r["iteration"] > args.warmup and r.get("elapsed_ms")]
    if out.returncode or not times:
        tail = child_error((out.stdout or "") + "\n" + (out.stderr or ""))
        raise SystemExit(f"calibrate: the run at {shape_name((b, s, n, k))} failed (exit {out.returncode}):\n{tail}")
    return times


def trainer_argv(args, b: int, s: int, n: int, k: int = 1) -> list:
    cmd = [*args.trainer_args,
           "--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size), "--micro-batch-size", str(b),
           "--seq-length", str(s), "--global-batch-size", str(b * n), "--train-iters", str(args.iters),
           "--mock-data", "--log-interval", "1", "--eval-interval", "1000000", "--eval-iters", "0", "--lr", "1e-4"]
    return cmd + (["--terapipe", "--terapipe-slices", str(k)] if k > 1 else [])


def check_trainer_args(args, shapes) -> None:
    """The trainer's own argument checks, here and before any run, for every shape: a bad flag
    after -- is one line now, not a torchrun failure after a minute."""
    import contextlib
    import io

    from megatron.cli.arguments import build_parser as trainer_parser
    from megatron.cli.arguments import config_from_args
    from megatron.config.core import ConfigError
    for shape in shapes:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = trainer_parser("gpt").parse_args(trainer_argv(args, *shape))
            config_from_args(ns, "gpt", world_size=args.pipeline_model_parallel_size)
        except SystemExit:
            msg = (err.getvalue().strip().splitlines() or ["bad flags"])[-1]
            raise SystemExit(f"calibrate: the trainer flags after -- are refused: {msg}") from None
        except ConfigError as e:
            raise SystemExit(f"calibrate: the run at {shape_name(shape)} would be refused by pretrain_gpt.py: "
                             f"{e}") from None


def measure(args, b: int, s: int, n: int, k: int = 1) -> noise.Timing:
    """Median iteration ms of a run (`run_times`) with its spread: a run past --max-spread is
    run again, up to --remeasure times; the quietest run is kept (`noisy` if it stays past)."""
    best = None
    for rnd in range(1, max(0, args.remeasure) + 2):
        ts = run_times(args, b, s, n, k)
        t = noise.Timing((statistics.median(ts),), noise.spread(ts), rnd, samples=[(x,) for x in ts])
        if best is None or t.spread < best.spread:
            best = t
        best.rounds = rnd
        if best.spread <= args.max_spread:
            return best
    best.noisy = True
    return best


class Unpriced(SystemExit):
    """A run the table cannot price (outside its grid); `shape` names it."""

    def __init__(self, shape, message: str):
        super().__init__(message)
        self.shape = shape


def default_shapes(args, targets) -> list:
    """DEFAULT_SHAPES as far as every table prices them: for a TeraPipe file alone, a run longer
    than the file's longest slice is cut into 2, 4 or 8 uniform token slices (sliced runs also
    calibrate the per-slice overhead); a run no table can price is left out."""
    sliced = [k for k, _ in targets] == ["terapipe"]
    shapes = []
    for b, s, n, _ in parse_shapes(DEFAULT_SHAPES):
        for k in ((1, 2, 4, 8) if sliced else (1,)):
            if s % k == 0 and _prices(args, targets, (b, s, n, k)):
                shapes.append((b, s, n, k))
                break
    if len(shapes) < 3:
        raise SystemExit(f"calibrate: the table(s) price only {len(shapes)} of the default runs {DEFAULT_SHAPES}; "
                         "give --shapes MBSxSEQxCOUNT,... inside the profiled grid (3 at least)")
    return shapes


def _prices(args, targets, shape) -> bool:
    try:
        for kind, path in targets:
            (dynapipe_predictor if kind == "dynapipe" else terapipe_predictor)(path, args, [shape])
    except Unpriced:
        return False
    return True


def dynapipe_predictor(path: str, args, shapes):
    """predict(scale, overhead) -> simulated 1F1B ms of every run under the table at `path`."""
    from megatron.planner.dynapipe.baselines import group_costs
    from megatron.planner.cost.calibration import IDENTITY, HostCalibration
    from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
    from megatron.planner.schedule.schedules import one_f_one_b
    from megatron.planner.schedule.simulator import PipelineCosts, simulate
    layers, hidden = _flag(args.trainer_args, "--num-layers"), _flag(args.trainer_args, "--hidden-size")
    try:  # the calibration runs are pretrain_gpt.py jobs: a GPT table's
        planner = DynaPipePlanner(DynaPipeConfig(cost_model_path=path, model_kind="gpt", hidden_size=hidden,
                                                 num_layers=layers, pipeline_parallel=args.pipeline_model_parallel_size,
                                                 memory_limit_mb=1e12, emit_plans=False))
    except ValueError as e:
        raise SystemExit(f"calibrate: --dynapipe-cost-model {path}: {e} (calibration runs GPT; a T5 table takes "
                         "the calibration of the GPT table of the same layer shape and host)") from None
    planner.calibration = IDENTITY  # the table's own times; the fit applies its candidates below
    base = []
    for b, s, n, _ in shapes:
        c = group_costs(planner, "gpt", [(b, s)] * n, "none")
        if c is None:
            raise Unpriced((b, s, n, 1), f"calibrate: {path} has no finite cost for micro-batches of {b}x{s}; pick "
                                         "--shapes inside its profiled grid")
        base.append((c, one_f_one_b(planner.S, list(range(n)))))

    def predict(scale, overhead):
        cal = HostCalibration(scale, overhead)  # applied as stage_costs applies a stored one
        return [simulate(PipelineCosts(cal.op_ms(c.fwd), cal.op_ms(c.bwd), c.stored, c.transient, c.comm),
                         order).makespan for c, order in base]
    return predict


def terapipe_predictor(path: str, args, shapes):
    from megatron.planner.cost.calibration import HostCalibration
    from megatron.planner.terapipe.latency import SliceLatencyModel
    from megatron.config.terapipe import uniform_slices
    from megatron.planner.terapipe.planner import pipelined_ms, slice_times
    model = SliceLatencyModel.load(path)
    pp = args.pipeline_model_parallel_size
    per_stage = -(-_flag(args.trainer_args, "--num-layers") // pp)

    def predict(scale, overhead):
        model.calibration = HostCalibration(scale, overhead, 0.0)
        stage_ms = lambda b, ln, c: model.stage_ms(b, ln, c, per_stage)  # noqa: E731
        return [pipelined_ms(slice_times(stage_ms, b, uniform_slices(s, k)) * n, pp) for b, s, n, k in shapes]
    for (b, s, n, k), ms in zip(shapes, predict(1.0, 0.0)):
        if not np.isfinite(ms):
            raise Unpriced((b, s, n, k), f"calibrate: {path} has no finite latency for micro-batches of {b}x{s} "
                             f"(its grid: micro-batch sizes {model.mbs}, lengths {model.seq}); pick --shapes inside it")
    return predict


def _flag(argv, name) -> int:
    if name not in argv or argv.index(name) + 1 >= len(argv):
        raise SystemExit(f"calibrate: give the trainer's {name} after -- (the model the table was profiled for)")
    value = argv[argv.index(name) + 1]
    if not value.isdigit():
        raise SystemExit(f"calibrate: the trainer's {name} must be a positive integer, got {value!r}")
    return int(value)


def probe_host() -> noise.HostNoise:
    """The host probe before any run (tests replace it)."""
    return noise.probe()


def write_calibration(path: str, cal) -> None:
    """Store `cal` in the JSON file at `path` (rename over it: never half a file)."""
    doc = json.loads(Path(path).read_text())
    doc["calibration"] = cal.to_dict()
    # cost tables are stored compact, latency files indented
    write_json(path, doc, mode=0o644, **({"separators": (",", ":")} if "profiles" in doc else {"indent": 1}))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.trainer_args[:1] == ["--"]:
        args.trainer_args = args.trainer_args[1:]
    targets = [(k, p) for k, p in (("dynapipe", args.dynapipe_cost_model), ("terapipe", args.terapipe_cost_model)) if p]
    if not targets:
        print("calibrate: error: give --dynapipe-cost-model and/or --terapipe-cost-model", file=sys.stderr)
        return 2
    if args.iters <= args.warmup:
        print("calibrate: error: --iters must exceed --warmup", file=sys.stderr)
        return 2
    if not args.max_spread > 0 or args.remeasure < 0 or not args.max_fit_error > 0:
        print("calibrate: error: --max-spread and --max-fit-error must be > 0, --remeasure >= 0", file=sys.stderr)
        return 2
    if args.shapes is None:
        _flag(args.trainer_args, "--num-layers")  # the model first: its absence is the clearer message
        args.shapes = default_shapes(args, targets)
    if args.dynapipe_cost_model and any(k > 1 for *_, k in args.shapes):
        print("calibrate: error: --shapes with token slices (a 4th number) calibrate a TeraPipe latency file; "
              "give --terapipe-cost-model alone, or drop the slices for --dynapipe-cost-model", file=sys.stderr)
        return 2
    from megatron.planner.cost.calibration import fit
    predictors = {k: (dynapipe_predictor if k == "dynapipe" else terapipe_predictor)(p, args, args.shapes)
                  for k, p in targets}
    check_trainer_args(args, args.shapes)
    host = probe_host()
    print(f"calibrate: host probe: {host.describe()}", file=sys.stderr, flush=True)
    if host.share < args.min_share:
        print(f"calibrate: error: host too busy to calibrate ({host.describe()}; under --min-share "
              f"{args.min_share:g}, {len(args.shapes)} runs of {args.pipeline_model_parallel_size} ranks would take "
              "minutes and time other jobs): nothing run, nothing written. Run it on an idle host, or pass "
              "--min-share 0 to try anyway.", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    measured, noisy = [], []
    progress = noise.Progress(len(args.shapes))
    for b, s, n, k in args.shapes:
        step = progress.next()
        m = measure(args, b, s, n, k)
        t = m if isinstance(m, noise.Timing) else noise.Timing((float(m),), 0.0)
        measured.append(t.values[0])
        if t.noisy:
            noisy.append(f"{shape_name((b, s, n, k))}: spread {t.spread:.0%} over {len(t.samples)} iterations "
                         f"(min {min(x for x, in t.samples):.1f} ms, median {t.values[0]:.1f} ms)")
        print(json.dumps({"run": shape_name((b, s, n, k)), "measured_ms": round(measured[-1], 1),
                          "spread": round(t.spread, 3), "runs": t.rounds}), flush=True)
        print(f"calibrate: {step} run {shape_name((b, s, n, k))}: {measured[-1]:.1f} ms, spread {t.spread:.0%}",
              file=sys.stderr, flush=True)
    if noisy:
        print(f"calibrate: error: {len(noisy)} of {len(measured)} runs stayed noisier than --max-spread "
              f"{args.max_spread:g} after {args.remeasure} re-run(s) ({'; '.join(noisy[:3])}); the host is busy, "
              "nothing written. Re-run when it is idle, or pass a larger --max-spread.", file=sys.stderr)
        return 1
    status = 0
    for kind, path in targets:
        cal = fit(measured, predictors[kind])
        pred = np.asarray(predictors[kind](cal.compute_scale, cal.op_overhead_ms)) + cal.step_overhead_ms
        cal.meta.update({"shapes": [shape_name(sh) for sh in args.shapes],
                         "measured_ms": [round(m, 1) for m in measured],
                         "predicted_ms": [round(float(p), 1) for p in pred],
                         "pipeline_parallel": args.pipeline_model_parallel_size,
                         "trainer_args": " ".join(args.trainer_args), "seconds": round(time.perf_counter() - t0, 1),
                         "source": "megatron.profiling.calibrate"})
        print(json.dumps({"file": path, "calibration": cal.to_dict()}), flush=True)
        rms = cal.meta["rms_error"]
        if rms > args.max_fit_error:
            i = int(np.argmax(np.abs(pred - np.asarray(measured)) / np.asarray(measured)))
            print(f"calibrate: {'warning' if args.dry_run else 'error'}: the fit for {path} misses the runs by "
                  f"{rms:.1%} rms (past --max-fit-error {args.max_fit_error:g}; worst {shape_name(args.shapes[i])}: "
                  f"predicted {pred[i]:.1f} ms vs {measured[i]:.1f} ms measured): the table does not describe this "
                  "model on this host (profiled on a busy host, or for another model?)"
                  + ("" if args.dry_run else "; not stored") + ". Re-profile it here when the host is idle.",
                  file=sys.stderr, flush=True)
            status = status if args.dry_run else 1
            continue
        if not args.dry_run:
            write_calibration(path, cal)
    return status


if __name__ == "__main__":
    sys.exit(main())
