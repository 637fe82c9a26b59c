"""Add the split backward's timed halves (`input_grad_ms` B, `weight_grad_ms` W) to an existing
GPT cost-model table, in place, without re-profiling the rest:

    python -m megatron.profiling.split_columns --add-to my_table.json

The profiler (`profile_model`) writes the same columns when it makes a table.
"""
from __future__ import annotations

import torch

from megatron.profiling.weight_pass import time_split


def add_split_columns(cm, *, layers: int = 2, warmup: int = 1, iters: int = 5, statistic: str = "min",
                      device: str = "cpu", seed: int = 1234, log=print):
    """Time B and W on every cell of a GPT table's TP-1 grids (layers at recompute "none", the
    head at every level: it is never recomputed) and add them as `input_grad_ms` /
    `weight_grad_ms`. The planner uses their ratio on the table's own backward times
    (planner/cost/wpass_time.py), so a host busier than when the table was made shifts both
    halves alike."""
    import itertools

    import numpy as np

    from megatron.core.parallel_state import ParallelState
    from megatron.planner.cost.cost_model import Grid
    from megatron.profiling import components as C
    from megatron.profiling.memory_rows import model_config
    from megatron.profiling.profiler import _seeded
    if cm.kind != "gpt" or 1 not in cm.tps():
        raise ValueError(f"cost model {cm.name!r}: the split is timed for GPT tables with a TP-1 profile")
    dev = torch.device(device)
    dtype = torch.float32 if cm.meta.get("dtype", "float32") == "float32" else torch.bfloat16
    cfg, ps = model_config(cm, layers), ParallelState()
    with _seeded(seed, 0, dev.type):
        block = C.build_layers(cfg, ps, "encoder", layers, seed).to(dev, dtype)
        head = C.build_postprocess(cfg, ps, seed).to(dev, dtype)
        made = {}
        for comp, levels in (("encoder", ["none"]), ("postprocess", cm.levels(1))):
            grid = cm.profile(1, levels[0]).components[comp]
            b = np.full(grid.values["forward_ms"].shape, np.nan)
            w = b.copy()
            for idx in itertools.product(*[range(len(a)) for a in grid.axes]):
                if not np.isfinite(grid.values["forward_ms"][idx]):
                    continue
                mbs, seq = (int(a[i]) for a, i in zip(grid.axes, idx))
                wl = (C.layer_workload(block, cfg, "none", mbs, seq, dev, dtype) if comp == "encoder"
                      else C.postprocess_workload(head, cfg, mbs, seq, dev, dtype))
                bi, wi = time_split(wl, dev, warmup, iters, statistic)
                n = layers if comp == "encoder" else 1
                b[idx], w[idx] = bi / n, wi / n
                log(f"{comp} mbs {mbs} seq {seq}: B {b[idx]:.3f} ms W {w[idx]:.3f} ms "
                    f"(table backward {float(grid.values['backward_ms'][idx]):.3f} ms)")
            made[comp] = (levels, b, w)
    for comp, (levels, b, w) in made.items():
        for rc in levels:
            prof = cm.profile(1, rc)
            g = prof.components[comp]
            prof.components[comp] = Grid(g.axes, dict(g.values, input_grad_ms=b, weight_grad_ms=w))
    cm.meta["split_backward"] = {"source": "megatron.profiling.split_columns --add-to", "device": device,
                                 "layers_per_measurement": layers, "warmup": warmup, "iters": iters,
                                 "statistic": statistic}
    return cm


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="Add the split backward's timed halves (input_grad_ms, "
                                            "weight_grad_ms) to a GPT cost-model table, in place.")
    p.add_argument("--add-to", required=True, help="cost-model JSON (rewritten)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    from megatron.planner.cost.cost_model import CostModel
    cm = add_split_columns(CostModel.load(a.add_to), iters=a.iters, device=a.device)
    cm.save(a.add_to)
    print(f"wrote {a.add_to}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
