"""Run the published Aceso search code (a checkout given by the user, never copied here) as a
subprocess, and price configurations with its cost model, for `bench_aceso.py --paper
--published-aceso DIR`. DIR holds the published repository (its `search/` and
`profiler/profiled-time-eurosys/` folders); it needs only the Python standard library.
"""
from __future__ import annotations

import glob
import os
import re
import resource
import subprocess
import sys
import tempfile
from typing import Dict, Optional, Tuple


def _search_dir(root: str) -> str:
    d = os.path.join(root, "search")
    if not os.path.isfile(os.path.join(d, "aceso_search.py")):
        sys.exit(f"--published-aceso {root}: no search/aceso_search.py there; give a checkout of the "
                 f"published Aceso code")
    return d


def _db(root: str, fallback: str) -> str:
    d = os.path.join(root, "profiler", "profiled-time-eurosys")
    return (d if os.path.isdir(d) else fallback).rstrip("/") + "/"


def _run(cmd, cwd) -> Tuple[str, float]:
    """stdout and the child's CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(["nice", "-n", "10", sys.executable] + cmd, cwd=cwd, capture_output=True,
                         text=True, timeout=3600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if out.returncode:
        raise RuntimeError(f"{cmd[0] if cmd[0] != '-c' else 'published refit'} failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return out.stdout, cpu


def _nodes(gpus: int) -> Tuple[int, int]:
    return (1, gpus) if gpus <= 8 else (gpus // 8, 8)


def search(root: str, fallback_db: str, family: str, size: str, gpus: int, gbs: int, memory_mb: int,
           budget_s: int) -> Tuple[Optional[str], float]:
    """The published search at the paper's settings (micro-batch 1 2 4 8, 7 hops, balance start,
    one process); returns (path of its best config JSON or None, CPU seconds)."""
    n, g = _nodes(gpus)
    work = tempfile.mkdtemp(prefix="aceso_pub_")
    cfg_dir = os.path.join(work, "configs") + "/"
    os.makedirs(cfg_dir + "top_configs")
    os.makedirs(cfg_dir + "csv")
    os.makedirs(os.path.join(work, "logs", "trends"))
    cmd = ["aceso_search.py", "--model-name", family, "--model-size", size, "--global-batch-size", str(gbs),
           "--micro-batch-size", "1", "2", "4", "8", "--num-nodes", str(n), "--num-gpus-per-node", str(g),
           "--memory-limit", str(memory_mb), "--log-path", os.path.join(work, "logs") + "/",
           "--profiled-time-path", _db(root, fallback_db), "--config-save-path", cfg_dir,
           "--config-suffix", "bench", "--max-num-hops", "7", "--time-budget-total", str(budget_s),
           "--initial-point", "balance", "--num-of-saved-configs", "1", "--no-multi-process"]
    _, cpu = _run(cmd, _search_dir(root))
    found = sorted(glob.glob(cfg_dir + "top_configs/*.json"))
    return (found[0] if found else None), cpu


# Runs in the published search folder: load a config, let the published model choose each
# stage's recompute ops itself (its update_recompute), then print its time/memory breakdown.
_REFIT = ("import sys; sys.argv = ['aceso_cost_model.py'] + sys.argv[1:]\n"
          "import aceso_cost_model as m\n"
          "from aceso_utils import read_config_from_json\n"
          "config, d = read_config_from_json(m.args, return_config_dict=True)\n"
          "m.read_profiled_time(d['model_name'], d['model_size'], m.args.profiled_time_path)\n"
          "m.update_recompute(config)\n"
          "m.predict_time_breakdown(config, print_time=True, print_memory=True)\n")


def price(root: str, fallback_db: str, config_json: str, gpus: int, memory_mb: int,
          refit: bool = False) -> Dict[str, float]:
    """The published cost model's iteration time (s) and peak stage memory (MB) of a config;
    ``refit``: with the recompute ops the published model picks for that layout (its own
    memory rule), so a layout that is out of memory as given is compared where it fits."""
    n, g = _nodes(gpus)
    args = ["--initial-point", config_json, "--profiled-time-path", _db(root, fallback_db),
            "--num-nodes", str(n), "--num-gpus-per-node", str(g), "--memory-limit", str(memory_mb)]
    out, _ = _run((["-c", _REFIT] if refit else ["aceso_cost_model.py"]) + args, _search_dir(root))
    t = re.search(r"overall time = ([0-9.]+) ms", out)
    m = re.search(r"max allocated memory = ([0-9.]+) MB", out)
    if not t or not m:
        raise RuntimeError(f"published cost model printed no time/memory for {config_json}")
    return {"s": float(t.group(1)) / 1000, "memory_mb": float(m.group(1))}
