"""The zero-bubble schedules here against PyTorch's own generators, replayed by the project's
simulator (seconds, one process, no ranks):

    python benchmarks/bench_zb_vs_torch.py                # the grid PP 2, 4, 8 x m = PP..4 PP
    python benchmarks/bench_zb_vs_torch.py --markdown     # the table of docs/zero_bubble.md

torch's action lists come from the real schedule classes of `torch.distributed.pipelining`
(`megatron/planner/schedule/torch_reference.py`): ScheduleInterleavedZeroBubble with one stage
per rank (ZB-H1), ScheduleZBVZeroBubble, ScheduleDualPipeV. One JSON line per (PP, m):

  unit        makespans on the paper's unit costs (F = I = W = 1, B = 2, a V's stages at half,
              no communication) of 1F1B, zb-h1 / zb-h2 / zb-v / dualpipev here and torch's
              ZB-H1 / ZBV / DualPipeV (null where torch refuses the point)
  peak        the most forward graphs any rank keeps at once (a V's graphs are half-size)
  a100_ms     (m in PP, 2 PP, 4 PP) the schedules timed with a real table: GPT 6.7B on A100
              (cost_models/gpt_6.7b_a100.json, TP 1, no recompute, micro-batch 1 x 2048
              tokens, 32 layers cut evenly, the output layer and loss on the last stage), W
              derived as fwd x 6h/(6h+s) (`zb_search.derive_wgrad`), no transfer time; ms.
              Here: `zb_orders(..., costs=table)` (the greedy clocked by the table);
              `<name>_unit_orders`: the orders chosen on unit costs; `<name>_runtime_orders`:
              the orders the runtime runs without a profiled table (the greedy clocked by
              `zb_costs.analytic_stage_costs` of GPT 6.7B; with `--dynapipe-cost-model` it is
              clocked by the table: `<name>`); torch: its lists
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.planner.cost.cost_model import CostModel  # noqa: E402
from megatron.planner.schedule.orders import one_f_one_b  # noqa: E402
from megatron.planner.schedule.simulator import PipelineCosts  # noqa: E402
from megatron.planner.schedule.torch_reference import replay_orders, torch_orders  # noqa: E402
from megatron.planner.schedule.zb_costs import analytic_stage_costs  # noqa: E402
from megatron.planner.schedule.zb_search import derive_wgrad  # noqa: E402
from megatron.planner.schedule.zero_bubble import zb_orders  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = ("zb-h1", "zb-h2", "zb-v", "dualpipev")
TORCH = ("zb-h1", "zb-v", "dualpipev")
LAYERS, SEQ, MBS = 32, 2048, 1


def a100_costs(num_stages: int, m: int) -> PipelineCosts:
    cm = CostModel.load(os.path.join(ROOT, "cost_models", "gpt_6.7b_a100.json"))
    layer = cm.layer("encoder", 1, "none", MBS, SEQ)
    post = cm.postprocess(1, "none", MBS, SEQ)
    per = LAYERS / num_stages
    fwd = np.full((num_stages, m), per * float(layer["forward_ms"]))
    bwd = np.full((num_stages, m), per * float(layer["backward_ms"]))
    fwd[-1] += float(post["forward_ms"])
    bwd[-1] += float(post["backward_ms"])
    stored = np.full((num_stages, m), per * float(layer["stored_mb"]))
    z = np.zeros((num_stages, m))
    return PipelineCosts(fwd, bwd, stored, z, z, wgrad=derive_wgrad(fwd, bwd, cm.model["hidden_size"], SEQ))


def _orders(name, m, p, torch_ref):
    try:
        return torch_orders(name, m, p) if torch_ref else zb_orders(name, m, p)
    except ValueError:
        return None


def row(p: int, m: int, a100: bool) -> dict:
    out = {"pp": p, "m": m, "unit": {}, "peak": {}}
    runs = {"1f1b": (one_f_one_b(p, range(m)), list(range(p)))}
    runs.update({k: _orders(k, m, p, False) for k in HERE})
    runs.update({f"torch_{k}": _orders(k, m, p, True) for k in TORCH})
    if a100:
        out["a100_ms"] = {}
    for name, got in runs.items():
        if got is None:
            out["unit"][name] = out["peak"][name] = None
            continue
        orders, s2r = got
        t, peaks = replay_orders(orders, s2r, m)
        out["unit"][name], out["peak"][name] = t, max(peaks)
        if a100:
            costs = a100_costs(len(s2r), m)
            out["a100_ms"][name] = round(replay_orders(orders, s2r, m, costs)[0], 1)
            if name in HERE:  # the unit-cost orders above, and the greedy run on the table itself
                out["a100_ms"][name + "_unit_orders"] = out["a100_ms"][name]
                out["a100_ms"][name] = round(replay_orders(*zb_orders(name, m, p, costs), m, costs)[0], 1)
                est = analytic_stage_costs([LAYERS // len(s2r)] * len(s2r), m, 4096, SEQ, 50304, 16384)
                out["a100_ms"][name + "_runtime_orders"] = round(
                    replay_orders(*zb_orders(name, m, p, est), m, costs)[0], 1)
    return out


def markdown(rows) -> str:
    def cell(r, key, peak=True):
        t = r["unit"][key]
        if t is None:
            return "refused"
        return f"{t:g} ({r['peak'][key]})" if peak else f"{t:g}"
    lines = ["| pp | m | 1F1B | zb-h1 here | torch ZB-H1 | zb-h2 here | zb-v here | torch ZBV | dualpipev here | "
             "torch DualPipeV |", "|" + " --- |" * 10]
    for r in rows:
        lines.append(f"| {r['pp']} | {r['m']} | {cell(r, '1f1b')} | {cell(r, 'zb-h1')} | {cell(r, 'torch_zb-h1')} | "
                     f"{cell(r, 'zb-h2')} | {cell(r, 'zb-v')} | {cell(r, 'torch_zb-v')} | {cell(r, 'dualpipev')} | "
                     f"{cell(r, 'torch_dualpipev')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--markdown", action="store_true", help="print the docs table instead of JSON lines")
    ap.add_argument("--every-m", action="store_true", help="every m in PP..4 PP (default: PP, 1.5, 2, 3 and 4 PP)")
    args = ap.parse_args(argv)
    rows = []
    for p in args.pp:
        ms = range(p, 4 * p + 1) if args.every_m else sorted({p, (3 * p) // 2, 2 * p, 3 * p, 4 * p})
        for m in ms:
            r = row(p, m, a100=m in (p, 2 * p, 4 * p))
            rows.append(r)
            if not args.markdown:
                print(json.dumps({"benchmark": "zb_vs_torch", **r}), flush=True)
    if args.markdown:
        print(markdown(rows))
        print()
        print("| pp | m | " + " | ".join(["1F1B"] + list(HERE) + [f"torch {k}" for k in TORCH]) + " |")
        print("|" + " --- |" * (2 + 1 + len(HERE) + len(TORCH)))
        for r in rows:
            if "a100_ms" in r:
                keys = ["1f1b"] + list(HERE) + [f"torch_{k}" for k in TORCH]
                vals = ["refused" if r["a100_ms"].get(k) is None else f"{r['a100_ms'][k]:g}" for k in keys]
                print(f"| {r['pp']} | {r['m']} | " + " | ".join(vals) + " |")
        print()
        print("| pp | m | " + " | ".join(f"{k} runtime (unit-cost orders)" for k in HERE)
              + " | " + " | ".join(f"torch {k}" for k in TORCH) + " |")
        print("|" + " --- |" * (2 + len(HERE) + len(TORCH)))
        for r in rows:
            if "a100_ms" in r:
                a = r["a100_ms"]
                vals = [f"{a[k + '_runtime_orders']:g} ({a[k + '_unit_orders']:g})" for k in HERE]
                vals += ["refused" if a.get(f"torch_{k}") is None else f"{a[f'torch_{k}']:g}" for k in TORCH]
                print(f"| {r['pp']} | {r['m']} | " + " | ".join(vals) + " |")


if __name__ == "__main__":
    main()
