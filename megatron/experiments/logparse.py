"""Parse the trainer's per-iteration log lines (`megatron.training.logging`): the Megatron-style
iteration line and, with a planner, the planner line that follows it."""
from __future__ import annotations

import re
from typing import List

_ITER = re.compile(r"^\s*iteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_PLANNER = re.compile(r"^\s*planner:\s*(\S+)\s*\|(.*)$")
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def _fields(rest: str) -> dict:
    out = {}
    for part in rest.split("|"):
        if ":" in part:
            k, v = part.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def _float(v):
    m = re.match(_NUM, v or "")
    return float(m.group(0)) if m else None


def _floats(v):
    return [float(x) for x in re.findall(_NUM, v or "")]


def parse_log(text: str) -> List[dict]:
    """One dict per logged iteration: iteration, train_iters, elapsed_ms, tokens_per_s,
    consumed_tokens, global_batch_size, loss, and `planner` (dict or None): name,
    num_microbatches, padding_efficiency, recompute, schedule, planning_ms, simulated_ms,
    measured_ms, predicted_peak_mb (per stage), measured_peak_mb (None when n/a)."""
    rows = []
    for line in text.splitlines():
        m = _ITER.match(line)
        if m:
            f = _fields(m.group(3))
            rows.append({
                "iteration": int(m.group(1)), "train_iters": int(m.group(2)),
                "elapsed_ms": _float(f.get("elapsed time per iteration (ms)")),
                "tokens_per_s": _float(f.get("tokens/s")),
                "consumed_tokens": _float(f.get("consumed tokens")),
                "global_batch_size": _float(f.get("global batch size")),
                "loss": _float(f.get("lm loss")), "planner": None})
            continue
        m = _PLANNER.match(line)
        if m and rows and rows[-1]["planner"] is None:
            f = _fields(m.group(2))
            info = {"name": m.group(1)}
            if "micro-batches per DP group" in f:
                info["num_microbatches"] = [int(x) for x in _floats(f["micro-batches per DP group"])]
            if "padding efficiency" in f:
                info["padding_efficiency"] = _float(f["padding efficiency"])
            if "micro-batches per CP size" in f:  # "1:5, 2:1"
                info["cp_size_counts"] = {int(c): int(n) for c, n in
                                          (x.split(":") for x in f["micro-batches per CP size"].split(", "))}
            for k in ("recompute", "schedule"):
                if k in f:
                    info[k] = f[k]
            if "planning ms" in f:
                nums = _floats(f["planning ms"])  # "planning ms: P (waited W)"
                info["planning_ms"] = nums[0] if nums else None
                info["plan_wait_ms"] = nums[1] if len(nums) > 1 else None
            if "simulated / measured iteration ms" in f:
                sim, meas = (_floats(f["simulated / measured iteration ms"]) + [None, None])[:2]
                info["simulated_ms"], info["measured_ms"] = sim, meas
            if "predicted peak activation MB per stage" in f:
                info["predicted_peak_mb"] = _floats(f["predicted peak activation MB per stage"])
            key = "measured peak activation MB (this stage)"
            if key in f:
                info["measured_peak_mb"] = _float(f[key])  # None for "n/a on CPU"
            rows[-1]["planner"] = info
    return rows
