"""Live back-end: each job is a `torchrun pretrain_gpt.py / pretrain_t5.py` run with the grid's
model flags, the job's layout and system flags; the per-iteration log lines become the row.

The grid's "live" object (all optional): "extra_flags" (list, added to every run),
"warmup_iters" (iterations left out of the means, default 1), "timeout_s" (per run, default 600),
"nproc" ("gpus": one process per device of the setting, the default).
A run that exits non-zero, times out or logs no iteration is a row with status "failed" and the
log tail; the sweep goes on.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import List

import numpy as np

from megatron.experiments.backends import Backend, Job
from megatron.experiments.config import ROOT, Grid, ModelSpec
from megatron.experiments.logparse import parse_log

RECOMPUTE_FLAGS = {"none": [], "selective": ["--recompute-granularity", "selective"],
                   "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "1"]}


def command(grid: Grid, job: Job, spec: ModelSpec) -> List[str]:
    if spec.script is None:
        raise ValueError(f"{grid.path}: models.{spec.name}: missing field 'script' (needed by --live)")
    s = job.setting
    seq = (["--seq-length", str(s.max_len)] if spec.kind == "gpt" else
           ["--encoder-seq-length", str(s.max_len), "--decoder-seq-length", str(s.max_len)])
    iters = job.batches + int(grid.live.get("warmup_iters", 1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(s.gpus),
           str(ROOT / spec.script), *spec.flags, *seq,
           "--tensor-model-parallel-size", str(job.tp), "--pipeline-model-parallel-size", str(job.pp),
           "--tokens-per-global-batch", str(s.tokens), "--train-iters", str(iters), "--log-interval", "1",
           *[str(x) for x in grid.live.get("extra_flags", [])]]
    if spec.kind == "t5" and job.pp > 1:
        cmd += ["--pipeline-model-parallel-split-rank", str(job.pp // 2)]
    if job.system == "dynapipe":
        cm = str(ROOT / spec.cost_model) if (ROOT / spec.cost_model).is_file() else spec.cost_model
        cmd += ["--dynapipe", "--dynapipe-cost-model", cm, "--dynapipe-memory-limit", f"{grid.memory_limit_mb:g}"]
    else:
        cmd += ["--micro-batch-size", str(job.micro_batch_size)] + RECOMPUTE_FLAGS[job.recompute or "none"]
        if job.system in ("packing", "packing_varlen"):  # the trainer's packing is per-document
            cmd.append("--pack-dataset")
    return cmd


def rows_from_log(text: str, warmup: int) -> dict:
    """Row fields from a run's log (iterations after the first `warmup`)."""
    its = [r for r in parse_log(text) if r["iteration"] > warmup]
    if not its:
        return {}
    ms = [r["elapsed_ms"] for r in its]
    tokens = sum(r["tokens_per_s"] * r["elapsed_ms"] / 1e3 for r in its)
    out = {"iterations": len(its), "iteration_ms": float(np.mean(ms)), "measured_ms": ms,
           "tokens_per_s": tokens / (sum(ms) / 1e3)}
    pl = [r["planner"] for r in its if r["planner"]]
    if pl:
        if all("padding_efficiency" in p for p in pl):
            out["padding_efficiency"] = float(np.mean([p["padding_efficiency"] for p in pl]))
        if all("simulated_ms" in p for p in pl):
            out["predicted_ms"] = [p["simulated_ms"] for p in pl]
        if all("planning_ms" in p for p in pl):
            out["planning_ms"] = [p["planning_ms"] for p in pl]
        if all("predicted_peak_mb" in p for p in pl):
            out["predicted_peak_mb"] = [max(p["predicted_peak_mb"]) for p in pl]
        meas = [p.get("measured_peak_mb") for p in pl]
        if all(m is not None for m in meas):
            out["measured_peak_mb"] = meas
        rcs = [p["recompute"] for p in pl if "recompute" in p]
        if rcs:
            out["recompute"] = max(set(rcs), key=rcs.count)
        sch = [p["schedule"] for p in pl if "schedule" in p]
        if sch:
            out["schedules"] = {k: sch.count(k) for k in sorted(set(sch))}
    return out


class LiveBackend(Backend):
    name = "live"

    def run(self, grid: Grid, job: Job) -> dict:
        spec = grid.models[job.setting.model]
        if job.variant not in ("", "dynapipe"):
            raise ValueError(f"ablation variant {job.variant!r} changes planner internals that the trainer has "
                             "no flag for; run the ablation with --simulate")
        if job.system == "packing_balanced":  # recorded, so that the sweep goes on
            return job.row(grid, self.name, status="infeasible", iterations=0,
                           error="packing_balanced (WLB-LLM's cost-balanced packing) has no trainer flag; "
                                 "it is simulated only (--simulate)")
        cmd = command(grid, job, spec)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        timeout = float(grid.live.get("timeout_s", 600))
        with tempfile.TemporaryFile("w+") as log:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
                why = None if rc == 0 else f"exit status {rc}"
            except subprocess.TimeoutExpired:
                why = f"timed out after {timeout:.0f} s"
            log.seek(0)
            text = log.read()
        fields = rows_from_log(text, int(grid.live.get("warmup_iters", 1)))
        if why is None and not fields:
            why = "no iteration line after the warm-up iterations"
        lines = text.splitlines()
        # The root cause (a flag error, a planner error) often sits above torchrun's own report.
        causes = list(dict.fromkeys(ln for ln in lines if "error" in ln.lower() and "ChildFailedError" not in ln))[:5]
        tail = "\n".join(causes + ["..."] + lines[-20:])
        if why is not None:
            return job.row(grid, self.name, status="failed", iterations=0,
                           error=f"{why}: {' '.join(cmd[5:])}", log_tail=tail)
        return job.row(grid, self.name, status="ok", **fields)
