"""The planners' memory (and time) models against the real model: one JSON line per row.

DynaPipe rows (`megatron.profiling.memory_rows`): the project's own `GPTStage` / `T5Stage`,
as the trainer builds them, run forward and backward at several shapes and every recompute
level; measured: bytes of the storages autograd saves (`saved_tensors_hooks`, one count per
storage, parameters excluded), the peak over forward + backward and the backward working set
(highest live memory during backward above what the forward left), with `torch.profiler`
memory events on CPU (the CPU allocator has no counters) or `max_memory_allocated` on CUDA;
predicted: `DynaPipePlanner.stage_costs` for the same stage. Stage roles: GPT first (embedding
+ layers), middle (layers), last (layers + head + loss), whole model on one stage; T5 encoder
stage, decoder stage (head + loss), whole. `time_ratio` = measured / predicted forward +
backward ms (the cost model's times on this machine; a shared CPU adds noise).

Shapes off the profiled grid (sequence 96, 192, 384 on a 16..512 grid) test the interpolation;
`--hidden` other than the table's profiles a small table for that width first (in-process,
about a minute each). Aceso rows come from `megatron.aceso.memory_check.aceso_rows` when that
module exists: kept bytes (`error`) and the stage peak over forward + backward (`peak_error`) of
one GPT layer per recompute set the search can emit (`--models ""` prints only them).
Zero-bubble rows (`kind: zb-weight-store`, `memory_rows.zb_rows`): the bytes a deferred weight
pass keeps in the executor's weight store for a GPT middle and last stage, against
`stage_costs(...)["wstored"]` (planner/cost/wpass_memory.py), beside the whole graph.

    python benchmarks/bench_memory_model.py                       # shipped CPU tables, GPT + T5
    python benchmarks/bench_memory_model.py --hidden 64,128 --quick
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron.planner.cost.cost_model import CostModel  # noqa: E402
from megatron.profiling.memory_rows import dynapipe_rows, model_config, zb_rows  # noqa: E402

GPT_SHAPES = [(1, 96), (2, 128), (4, 192), (1, 384), (2, 512), (8, 64), (1, 768)]  # 768: past the grid
T5_SHAPES = [(1, 96, 48), (2, 64, 32), (4, 128, 64), (2, 48, 24)]
QUICK_GPT, QUICK_T5 = [(1, 96), (2, 192)], [(2, 48, 24)]


def _profiled_for_hidden(base: CostModel, hidden: int, shapes, log) -> CostModel:
    """A small table of `base`'s model at another hidden size, profiled here and now."""
    from megatron.profiling.profiler import ProfileSpec, run_profile
    cfg = dataclasses.replace(model_config(base, 2), hidden_size=hidden, ffn_hidden_size=4 * hidden,
                              kv_channels=hidden // base.model["num_attention_heads"])
    longest = max(max(s[1:]) for s in shapes)
    seqs = sorted({x for x in (16, 32, 64, 128, 256, 512, 1024) if x < longest} | {longest})
    mbs = sorted({1, 2, 4, 8} | {s[0] for s in shapes})
    spec = ProfileSpec(model=cfg, tps=[1], micro_batch_sizes=mbs, seq_lengths=seqs,
                       decoder_seq_lengths=seqs if base.kind == "t5" else [], layers=2, warmup=1, iters=1,
                       statistic="min", name=f"bench_h{hidden}")
    log(f"profiling {base.kind} hidden {hidden} (mbs {mbs} x seq {seqs}) ...")
    return run_profile(spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt,t5", help="comma-separated: gpt,t5")
    p.add_argument("--gpt-cost-model", default=str(ROOT / "cost_models" / "cpu_tiny_gpt.json"))
    p.add_argument("--t5-cost-model", default=str(ROOT / "cost_models" / "cpu_tiny_t5.json"))
    p.add_argument("--hidden", default=None,
                   help="comma-separated hidden sizes (default: the table's); others are profiled first")
    p.add_argument("--settings", default="none,selective,full", help="recompute levels")
    p.add_argument("--layers", type=int, default=2, help="layers per stage")
    p.add_argument("--time-iters", type=int, default=3, help="timed iterations per stage (0: no timing)")
    p.add_argument("--quick", action="store_true", help="two shapes per model")
    p.add_argument("--no-zb", action="store_true", help="skip the zero-bubble weight-store rows")
    p.add_argument("--no-aceso", action="store_true", help="skip Aceso rows even if the module exists")
    a = p.parse_args(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    import torch
    torch.set_num_threads(1)
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    for kind in [m.strip() for m in a.models.split(",") if m.strip()]:
        if kind not in ("gpt", "t5"):
            print(f"bench_memory_model: --models takes gpt and t5, got {kind!r}", file=sys.stderr)
            return 2
        base = CostModel.load(a.gpt_cost_model if kind == "gpt" else a.t5_cost_model)
        shapes = (QUICK_GPT if a.quick else GPT_SHAPES) if kind == "gpt" else (QUICK_T5 if a.quick else T5_SHAPES)
        hiddens = [int(h) for h in a.hidden.split(",")] if a.hidden else [base.model["hidden_size"]]
        for h in hiddens:
            cm = base if h == base.model["hidden_size"] else _profiled_for_hidden(base, h, shapes, log)
            t0 = time.perf_counter()
            for row in dynapipe_rows(cm, settings, shapes, a.layers, time_iters=a.time_iters):
                row["cost_model"] = cm.name
                print(json.dumps(row), flush=True)
            if kind == "gpt" and "none" in settings and not a.no_zb:
                for row in zb_rows(cm, shapes, a.layers, time_iters=max(a.time_iters, 1)):
                    row["cost_model"] = cm.name
                    print(json.dumps(row), flush=True)
            log(f"{kind} hidden {h}: {time.perf_counter() - t0:.0f} s")
    if not a.no_aceso:
        try:
            from megatron.aceso.memory_check import aceso_rows
        except ImportError:
            log("megatron.aceso.memory_check is not in this tree: no Aceso rows")
        else:
            for row in aceso_rows():
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
