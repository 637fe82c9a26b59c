"""The result row both back-ends write (one JSON object per line in experiments/*.jsonl)."""
from __future__ import annotations

import json
import subprocess
import time
from functools import lru_cache
from pathlib import Path
from typing import Iterable, List

from megatron.experiments.config import ROOT

# field -> (types, meaning). Per-iteration lists cover the measured iterations only.
ROW_FIELDS = {
    "experiment": (str, "grid_search | grid_verify | best_throughput | controlled_baseline | ablation"),
    "backend": (str, "simulate | live"),
    "git_commit": (str, "commit of the code that produced the row (+dirty)"),
    "grid": (str, "grid name (experiment_configs/<file>.json 'name')"),
    "setting": (str, "<model>_L<max_len>_G<gpus>"),
    "model": (str, "model name in the grid"),
    "kind": (str, "gpt | t5"),
    "max_len": (int, "max sequence length"),
    "gpus": (int, "devices (PP x TP x DP)"),
    "tokens_per_batch": (int, "global batch token budget"),
    "system": (str, "dynapipe | packing | packing_varlen | packing_balanced | fixed"),
    "variant": (str, "ablation variant, '' elsewhere"),
    "pp": (int, "pipeline stages"), "tp": (int, "tensor parallel"), "dp": (int, "data parallel"),
    "micro_batch_size": ((int, type(None)), "baselines: samples/rows per micro-batch; dynapipe: None"),
    "recompute": ((str, type(None)), "recompute level (baselines: fixed; dynapipe: most frequent choice)"),
    "status": (str, "ok | infeasible (no plan fits memory) | failed (live run error)"),
    "iterations": (int, "measured iterations"),
    "iteration_ms": ((float, type(None)), "mean iteration time, ms (measured on live, simulated on simulate)"),
    "tokens_per_s": ((float, type(None)), "real (unpadded) tokens per second"),
    "padding_efficiency": ((float, type(None)), "real tokens / computed tokens"),
    "planning_ms": ((list, type(None)), "dynapipe: planning time per iteration, ms"),
    "predicted_ms": ((list, type(None)), "planner's simulated iteration time per iteration, ms"),
    "measured_ms": ((list, type(None)), "live: measured iteration time per iteration, ms"),
    "predicted_peak_mb": ((list, type(None)), "planner's predicted peak activation MB (max over stages) per iteration"),
    "measured_peak_mb": ((list, type(None)), "live on GPU: measured peak activation MB; None on CPU"),
    "schedules": ((dict, type(None)), "schedule choice counts (dynapipe)"),
    "error": ((str, type(None)), "why a row is infeasible or failed"),
    "log_tail": ((str, type(None)), "live: last lines of the run's log when it failed"),
    "time": (str, "UTC timestamp"),
}

KEY_FIELDS = ("experiment", "backend", "grid", "setting", "system", "variant", "pp", "tp", "dp",
              "micro_batch_size", "recompute")


@lru_cache(maxsize=1)
def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("+dirty" if dirty else "")


def make_row(**kw) -> dict:
    row = {k: kw.pop(k, None) for k in ROW_FIELDS}
    if kw:
        raise KeyError(f"unknown result-row fields {sorted(kw)}")
    row["variant"] = row["variant"] or ""
    row["git_commit"] = row["git_commit"] or git_commit()
    row["time"] = row["time"] or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    validate_row(row)
    return row


def validate_row(row: dict) -> None:
    missing = [k for k in ROW_FIELDS if k not in row]
    extra = [k for k in row if k not in ROW_FIELDS]
    if missing or extra:
        raise ValueError(f"result row: missing {missing}, unknown {extra}")
    for k, (typ, _) in ROW_FIELDS.items():
        v = row[k]
        if isinstance(v, bool) or not isinstance(v, typ):
            if isinstance(v, int) and typ in (float, (float, type(None))):
                continue
            raise ValueError(f"result row field {k!r}: {v!r} is not {typ}")
    if row["status"] not in ("ok", "infeasible", "failed"):
        raise ValueError(f"result row field 'status': {row['status']!r}")
    if row["backend"] not in ("simulate", "live"):
        raise ValueError(f"result row field 'backend': {row['backend']!r}")


def row_key(row: dict) -> tuple:
    """Identity of the job behind a row (DynaPipe's recompute is its choice, not part of the job)."""
    return tuple(None if (k == "recompute" and row.get("system") == "dynapipe") else row.get(k)
                 for k in KEY_FIELDS)


def read_rows(path) -> List[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not a JSON row ({e})") from None
    return out


def append_rows(path, rows: Iterable[dict]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a") as f:
        for r in rows:
            validate_row(r)
            f.write(json.dumps(r) + "\n")
        f.flush()
