"""python -m megatron.experiments {grid-search,benchmark,ablation,figures,table,all} [options]

Back-ends: --simulate (default when no CUDA device is visible) or --live (torchrun runs).
Results go to --out (default experiments/), figures to --figures (default reproduced_figures/).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.experiments.config import ROOT, ExperimentConfigError, load_grid

DEFAULT_GRID = {"simulate": "experiment_configs/a100_sim.json", "live": "experiment_configs/cpu_live_smoke.json"}


def _default_backend() -> str:
    try:
        import torch
        return "live" if torch.cuda.is_available() else "simulate"
    except ImportError:
        return "simulate"


def build_parser():
    p = argparse.ArgumentParser(prog="python -m megatron.experiments", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("grid-search", "benchmark", "ablation", "figures", "table", "all"))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--simulate", dest="backend", action="store_const", const="simulate")
    mode.add_argument("--live", dest="backend", action="store_const", const="live")
    p.add_argument("--config", default=None, help="grid file (default: experiment_configs/a100_sim.json with "
                                                    "--simulate, experiment_configs/cpu_live_smoke.json with --live)")
    p.add_argument("--out", default=str(ROOT / "experiments"), help="results folder (*.jsonl)")
    p.add_argument("--configs-dir", default=None,
                   help="where the grid search writes best_configs/, control_configs/, ablation_configs/ "
                        "(default: the --out folder); benchmark and ablation read them there, else the shipped "
                        "ones in experiment_configs/ (inputs: never written unless named here)")
    p.add_argument("--figures-dir", default=str(ROOT / "reproduced_figures"))
    p.add_argument("--fig", default="13,14,15,16,17,18", help="figures to draw (figures command)")
    p.add_argument("--lengths-file", default=None, help="sample lengths, one 'input target' pair per line")
    p.add_argument("--force", action="store_true", help="rerun jobs whose rows exist")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    backend_name = args.backend or _default_backend()
    out = Path(args.out)
    configs_dir = Path(args.configs_dir) if args.configs_dir else out
    if args.command == "figures":
        from megatron.experiments.figures import draw
        return draw(out, Path(args.figures_dir), [int(x) for x in args.fig.split(",")], backend_name)
    try:
        grid = load_grid(args.config or ROOT / DEFAULT_GRID[backend_name])
    except ExperimentConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from megatron.experiments import drivers
    if backend_name == "live":
        from megatron.experiments.live import LiveBackend
        backend = LiveBackend()
    else:
        from megatron.experiments.backends import SimulateBackend
        backend = SimulateBackend(args.lengths_file)
    cmds = ["grid-search", "benchmark", "ablation"] if args.command == "all" else [args.command]
    try:
        for c in cmds:
            if c == "grid-search":
                rows = drivers.grid_search(grid, backend, out, args.force, configs_dir)
                print(f"grid search ({backend.name}, {grid.name}): {len(rows)} jobs, "
                      f"{sum(r['status'] == 'ok' for r in rows)} feasible; best configs in "
                      f"{configs_dir}/best_configs/{grid.name}/")
            elif c == "benchmark":
                res = drivers.benchmark(grid, backend, out, args.force, configs_dir)
                print("best throughput\n" + drivers.speedup_table(res["best_throughput"]))
                print("controlled baseline (DynaPipe's parallelism)\n"
                      + drivers.speedup_table(res["controlled_baseline"]))
            elif c == "ablation":
                if backend.name == "live":
                    print("ablation: skipped with --live (planner internals; run it with --simulate)")
                    continue
                print(drivers.ablation_table(drivers.ablation(grid, backend, out, args.force, configs_dir)))
            elif c == "table":
                from megatron.experiments.rows import read_rows
                rows = [r for r in read_rows(out / "best_throughput.jsonl") if r["grid"] == grid.name]
                print(drivers.speedup_table(rows))
    except (ExperimentConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
