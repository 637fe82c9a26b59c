"""Grid search, benchmark and ablation sweeps. Resumable: a job whose row (same key, same
back-end) is already in the output file is skipped unless `force`."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional

from megatron.experiments.backends import VARIANTS, Backend, Job
from megatron.experiments.config import (ROOT, Grid, Setting, load_setting_config, setting_doc,
                                         write_config)
from megatron.experiments.rows import append_rows, read_rows, row_key

CONFIG_DIR = ROOT / "experiment_configs"


class _Progress:
    """One stderr line per job that takes a while, at most one every `every` seconds otherwise,
    and one at the end: ``desc: k/N jobs (s skipped: rows exist), T s, ETA E s``. Lines, not a
    redrawn bar: a bar is invisible when stderr is a log file (run_all.sh's usual home)."""

    def __init__(self, total: int, desc: str, every: float = 15.0, clock=None):
        import time
        self.total, self.desc, self.every = total, desc, every
        self.clock = clock or time.monotonic
        self.t0 = self.last = self.clock()
        self.done = self.skipped = 0
        self.ran_s = 0.0

    def step(self, skipped: bool, seconds: float = 0.0) -> None:
        self.done += 1
        self.skipped += skipped
        self.ran_s += seconds
        now = self.clock()
        if self.done == self.total or now - self.last >= self.every:
            self.last = now
            ran = self.done - self.skipped
            left = self.total - self.done
            eta = f", ETA {self.ran_s / ran * left:.0f} s" if ran and left else ""
            skip = f" ({self.skipped} skipped: rows exist)" if self.skipped else ""
            print(f"{self.desc}: {self.done}/{self.total} jobs{skip}, {now - self.t0:.0f} s{eta}",
                  file=sys.stderr, flush=True)


def run_jobs(grid: Grid, backend: Backend, jobs: List[Job], out: Path, force: bool, desc: str,
             reuse: Optional[List[Path]] = None) -> List[dict]:
    """Rows for `jobs` (in order), running only those without a row in `out`. `reuse`: another
    results files whose rows with the same key and iteration count can be copied instead of rerun."""
    # Failed (live) rows are retried: a failure may be transient; infeasible ones are results.
    have = {} if force else {row_key(r): r for r in read_rows(out) if r["status"] != "failed"}
    donor = {}
    for path in reuse or []:
        for r in read_rows(path):
            donor[row_key(dict(r, experiment=""))] = r
    rows = []
    progress = _Progress(len(jobs), desc)
    for job in jobs:
        probe = job.row(grid, backend.name, status="ok", iterations=0)
        k = row_key(probe)
        if k in have:
            rows.append(have[k])
            progress.step(True)
            continue
        t0 = progress.clock()
        d = donor.get(row_key(dict(probe, experiment="")))
        if d is not None and d["iterations"] == job.batches and d["status"] == "ok":
            row = dict(d, experiment=job.experiment)
        else:
            row = backend.run(grid, job)
        append_rows(out, [row])
        have[k] = row
        rows.append(row)
        progress.step(False, progress.clock() - t0)
    return rows


# ---- grid search -------------------------------------------------------------------------------

def grid_jobs(grid: Grid, s: Setting) -> List[Job]:
    spec = grid.models[s.model]
    jobs = []
    for lay in grid.layouts(spec, s.gpus):
        for system in spec.systems:
            if system == "dynapipe":
                jobs.append(Job("grid_search", s, system, batches=grid.search_batches, **lay))
                continue
            for b in grid.micro_batch_sizes:
                for rc in grid.recompute:
                    jobs.append(Job("grid_search", s, system, micro_batch_size=b, recompute=rc,
                                    batches=grid.search_batches, **lay))
    return jobs


def _best(rows, verify=None, **match) -> Optional[dict]:
    """Highest-throughput ok row matching `match` (ties keep the first in grid order: smaller PP,
    TP first). `verify(row) -> bool`: candidates are tried best first until one passes."""
    ok = [r for r in rows if r["status"] == "ok" and all(r[k] == v for k, v in match.items())]
    ranked = sorted(ok, key=lambda r: -r["tokens_per_s"])  # stable: grid order among ties
    for r in ranked:
        if verify is None or verify(r):
            return r
    return None


def _verifier(grid: Grid, backend: Backend, s: Setting, out_dir: Path, force: bool):
    """A configuration found on `search_batches` batches must also fit every one of the
    benchmark's `benchmark_batches` (a longer batch can exceed the memory limit): checked with a
    benchmark-sized job, recorded in grid_verify.jsonl (resumable)."""
    if grid.benchmark_batches <= grid.search_batches:
        return None

    def verify(r: dict) -> bool:
        job = Job("grid_verify", s, r["system"], r["pp"], r["tp"], r["dp"],
                  micro_batch_size=r["micro_batch_size"],
                  recompute=None if r["system"] == "dynapipe" else r["recompute"],
                  batches=grid.benchmark_batches)
        return run_jobs(grid, backend, [job], out_dir / "grid_verify.jsonl", force, "verify")[0]["status"] == "ok"
    return verify


def _system_doc(r: Optional[dict]) -> Optional[dict]:
    if r is None:
        return None
    d = {"pp": r["pp"], "tp": r["tp"], "dp": r["dp"], "tokens_per_s": round(r["tokens_per_s"], 3)}
    if r["system"] != "dynapipe":
        d.update(micro_batch_size=r["micro_batch_size"], recompute=r["recompute"])
    return d


def config_paths(grid: Grid, s: Setting, config_dir: Path = CONFIG_DIR) -> Dict[str, Path]:
    return {k: Path(config_dir) / f"{k}_configs" / grid.name / f"{s.key}.json" for k in ("best", "control", "ablation")}


def grid_search(grid: Grid, backend: Backend, out_dir: Path, force: bool = False,
                config_dir: Optional[Path] = None) -> List[dict]:
    """Rows -> out_dir/grid_search.jsonl; the winners -> config_dir (default: out_dir) /
    {best,control,ablation}_configs/. The shipped experiment_configs/ are inputs: a run never
    writes over them unless config_dir names that folder."""
    config_dir = out_dir if config_dir is None else config_dir
    out = out_dir / "grid_search.jsonl"
    all_rows = []
    settings = list(grid.settings())
    for i, s in enumerate(settings, 1):
        systems = grid.models[s.model].systems
        rows = run_jobs(grid, backend, grid_jobs(grid, s), out, force, f"grid search {i}/{len(settings)} {s.key}")
        all_rows += rows
        verify = _verifier(grid, backend, s, out_dir, force)
        best = {sys_: _best(rows, verify, system=sys_) for sys_ in systems}
        paths = config_paths(grid, s, config_dir)
        write_config(paths["best"], dict(setting_doc(grid, s), backend=backend.name,
                                         systems={k: _system_doc(v) for k, v in best.items()}))
        dyn = best.get("dynapipe")
        control = {"dynapipe": _system_doc(dyn)}
        for sys_ in systems:
            if sys_ != "dynapipe":
                control[sys_] = None if dyn is None else _system_doc(
                    _best(rows, verify, system=sys_, pp=dyn["pp"], tp=dyn["tp"], dp=dyn["dp"]))
        write_config(paths["control"], dict(setting_doc(grid, s), backend=backend.name, systems=control))
        write_config(paths["ablation"], dict(setting_doc(grid, s), backend=backend.name,
                                             systems={"dynapipe": _system_doc(dyn)}, variants=list(VARIANTS)))
    return all_rows


# ---- benchmark and ablation --------------------------------------------------------------------

def setting_config_path(grid: Grid, s: Setting, kind: str, config_dir: Path) -> Path:
    """The config a benchmark / ablation reads: this run's grid search (config_dir), else the
    shipped one (experiment_configs/, the published search) for the same grid and setting."""
    path = config_paths(grid, s, config_dir)[kind]
    shipped = config_paths(grid, s, CONFIG_DIR)[kind]
    if path.is_file() or not shipped.is_file():
        return path
    return shipped


def _setting_jobs(grid: Grid, kind: str, experiment: str, config_dir: Path) -> List[Job]:
    jobs = []
    for s in grid.settings():
        path = setting_config_path(grid, s, kind, config_dir)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; run the grid search first "
                                    f"(experiment_scripts/run_grid_search.sh or "
                                    f"`python -m megatron.experiments grid-search`)")
        doc = load_setting_config(path, grid)
        for system, d in doc["systems"].items():
            if d is None:
                continue
            lay = {k: d[k] for k in ("pp", "tp", "dp")}
            if kind == "ablation":
                for v in doc.get("variants", list(VARIANTS)):
                    if v not in VARIANTS:
                        raise ValueError(f"{path}: variants: unknown variant {v!r} (choose from {list(VARIANTS)})")
                    jobs.append(Job(experiment, s, "dynapipe", variant=v, batches=grid.benchmark_batches, **lay))
            elif system == "dynapipe":
                jobs.append(Job(experiment, s, system, batches=grid.benchmark_batches, **lay))
            else:
                jobs.append(Job(experiment, s, system, micro_batch_size=d["micro_batch_size"],
                                recompute=d["recompute"], batches=grid.benchmark_batches, **lay))
    return jobs


def benchmark(grid: Grid, backend: Backend, out_dir: Path, force: bool = False,
              config_dir: Optional[Path] = None) -> Dict[str, List[dict]]:
    config_dir = out_dir if config_dir is None else config_dir
    reuse = [out_dir / "grid_search.jsonl", out_dir / "grid_verify.jsonl"]
    # Both config sets are read and checked before any job runs (a bad control_configs file
    # used to surface only after every best-throughput run).
    best_jobs = _setting_jobs(grid, "best", "best_throughput", config_dir)
    ctrl_jobs = _setting_jobs(grid, "control", "controlled_baseline", config_dir)
    best = run_jobs(grid, backend, best_jobs, out_dir / "best_throughput.jsonl", force, "best throughput", reuse)
    ctrl = run_jobs(grid, backend, ctrl_jobs, out_dir / "controlled_baseline.jsonl", force, "controlled baseline",
                    reuse)
    return {"best_throughput": best, "controlled_baseline": ctrl}


def ablation(grid: Grid, backend: Backend, out_dir: Path, force: bool = False,
             config_dir: Optional[Path] = None) -> List[dict]:
    config_dir = out_dir if config_dir is None else config_dir
    if backend.name == "live":
        raise ValueError("the ablation variants (partition algorithm, schedule, ordering, recompute choice) are "
                         "planner internals with no trainer flag: run the ablation with --simulate")
    return run_jobs(grid, backend, _setting_jobs(grid, "ablation", "ablation", config_dir), out_dir / "ablation.jsonl",
                    force, "ablation")


# ---- text tables -------------------------------------------------------------------------------

def speedup_table(rows: List[dict]) -> str:
    """Per setting: throughput of each system (tokens/s) and DynaPipe's speed-ups."""
    by = {}
    for r in rows:
        if not r["variant"]:
            by.setdefault((r["backend"], r["model"], r["gpus"], r["max_len"]), {})[r["system"]] = r
    lines = [f"{'backend':8s} {'model':10s} {'gpus':>4s} {'max_len':>7s} {'dynapipe tok/s':>14s} "
             f"{'packing tok/s':>13s} {'fixed tok/s':>11s} {'vs packing':>10s} {'vs fixed':>8s} "
             f"{'vs varlen':>9s} {'vs balanced':>11s}"]
    for (be, m, g, L), d in sorted(by.items()):
        tp = {k: (v["tokens_per_s"] if v["status"] == "ok" else None) for k, v in d.items()}

        def f(x, w):
            return f"{x:{w}.0f}" if x else f"{'n/a':>{w}s}"

        def sp(b):
            return f"{tp['dynapipe'] / tp[b]:.2f}x" if tp.get("dynapipe") and tp.get(b) else "n/a"
        lines.append(f"{be:8s} {m:10s} {g:4d} {L:7d} {f(tp.get('dynapipe'), 14)} {f(tp.get('packing'), 13)} "
                     f"{f(tp.get('fixed'), 11)} {sp('packing'):>10s} {sp('fixed'):>8s} "
                     f"{sp('packing_varlen'):>9s} {sp('packing_balanced'):>11s}")
    return "\n".join(lines)


def ablation_table(rows: List[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["gpus"], r["max_len"]), {})[r["variant"]] = r
    names = list(VARIANTS)
    lines = [f"{'model':10s} {'gpus':>4s} {'max_len':>7s} " + " ".join(f"{n:>20s}" for n in names)]
    for (m, g, L), d in sorted(by.items()):
        base = d.get("dynapipe")
        cells = []
        for n in names:
            r = d.get(n)
            ok = r is not None and r["status"] == "ok" and base is not None and base["status"] == "ok"
            cells.append(f"{r['tokens_per_s'] / base['tokens_per_s']:20.3f}" if ok else f"{'n/a':>20s}")
        lines.append(f"{m:10s} {g:4d} {L:7d} " + " ".join(cells))
    return "relative throughput (variant / full DynaPipe)\n" + "\n".join(lines)
