"""Side by side: our DynaPipe planner and the published one (awslabs/optimizing-multitask-
training-through-dynamic-pipelines, package `dynapipe`) on the same global batches.

The published package is never a dependency of this project. When it (with its compiled
`dp_helper` extension) is not importable, this script prints how to install it and exits 0
without rows. When it is, it needs the published cost model (the profile directory or the
`ProfileBasedCostModelWithRC.save` pickle the artifact ships, `--published-cost-model`),
since our converted JSON tables cannot be fed back to its interpolator.

Per batch it prints one JSON row: planning ms of each planner (ours: partition + schedules;
published: `DataAssignmentOptimizer.generate_microbatches` + `ExecutionPlanner.
generate_execution_plan` for every DP group), the simulated iteration time under each
simulator (ours for our plan; the published simulator's for its plan; and ours for the
published micro-batches, scheduled by our search), padding efficiency, micro-batch count and
recompute level of each. Layouts and batches are `bench_planner.py`'s (`--mixture`).
"simulated_ms_ours" schedules the published micro-batches with our search under our memory
budget (null when they do not fit it); "simulated_ms_ours_no_memory_limit" without one: the
gap between the two is what the memory models' difference costs (cost_models/README.md).

Install the published planner in a separate environment (this script only needs numpy next to
it; the project's planner does not import torch). Tried with awslabs/...@d8666ad:
    python -m venv /tmp/pubvenv && /tmp/pubvenv/bin/pip install "numpy<2" scipy scikit-learn \
        prtpy sortedcontainers redis tqdm pybind11 scikit-build
    # its TSP dependency is a fork: github.com/chenyu-jiang/elkai, branch blkh (GCC >= 10: -fcommon)
    CFLAGS=-fcommon /tmp/pubvenv/bin/pip install --no-build-isolation ./elkai
    /tmp/pubvenv/bin/pip install --no-build-isolation --no-deps -e \
        ./optimizing-multitask-training-through-dynamic-pipelines   # builds dp_helper
    /tmp/pubvenv/bin/python benchmarks/compare_published_dynapipe.py --published-cost-model \
        gpt=gpt_6.7b_cm.pkl t5=t5_11b_cm.pkl
The cost-model pickles are in github.com/chenyu-jiang/Megatron-LM, branch dynapipe,
cost_models/. numpy >= 2 breaks the published interpolator (`float()` of an array).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

INSTALL = """the published DynaPipe planner (package `dynapipe` with its compiled dp_helper) is not importable.
To compare side by side, install it into this environment (it is not a dependency of this project):
    git clone https://github.com/awslabs/optimizing-multitask-training-through-dynamic-pipelines
    cd optimizing-multitask-training-through-dynamic-pipelines
    pip install pybind11 && pip install -e .
then rerun with --published-cost-model PATH (the artifact's profile directory or saved cost-model pickle).
Its TSP dependency (elkai, branch blkh of github.com/chenyu-jiang/elkai) and numpy < 2 are needed too:
see this script's header for the recipe that worked."""


@contextlib.contextmanager
def _stdout_to_stderr():
    """The published package logs to stdout and runs `make` (on fd 1) when first imported:
    keep stdout for the JSON rows."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def published_available():
    try:
        with _stdout_to_stderr():
            import dynapipe  # noqa: F401
            from dynapipe.data_opt import dp_helper  # noqa: F401
            from dynapipe.data_opt.optimizer import DataAssignmentOptimizer  # noqa: F401
            from dynapipe.schedule_opt.execution_planner import ExecutionPlanner  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed"
        return False, repr(e)
    return True, None


class Published:
    """Thin driver of the published planner's public classes (its code, not ours)."""

    def __init__(self, cfg, cost_model_path):
        from dynapipe.data_opt.cost_models import ProfileBasedCostModelWithRC
        from dynapipe.data_opt.optimizer import DataAssignmentOptimizer
        from dynapipe.model import DynaPipeCluster, TransformerModelSpec
        from dynapipe.schedule_opt.execution_planner import ExecutionPlanner
        p = Path(cost_model_path)
        cm = ProfileBasedCostModelWithRC.load(str(p)) if p.is_file() else ProfileBasedCostModelWithRC(str(p))
        P, gpt = cfg.pipeline_parallel, cfg.model_kind == "gpt"
        if gpt:
            spec = TransformerModelSpec(cfg.num_layers, 0, cfg.hidden_size, 32, 4 * cfg.hidden_size)
            n_layers = cfg.num_layers
        else:  # T5-11B: 128 heads of 128 channels, FFN 65536
            spec = TransformerModelSpec(cfg.encoder_layers, cfg.decoder_layers, cfg.hidden_size, 128, 65536,
                                        kv_channels=128)
            n_layers = cfg.encoder_layers + cfg.decoder_layers
        per = n_layers // P
        assignment = [i // per for i in range(n_layers)]
        cluster = DynaPipeCluster({d: 0 for d in range(P)}, [int(cfg.memory_limit_mb)] * P,
                                  cfg.bandwidth_gbps, cfg.bandwidth_gbps, cfg.link_latency_ms * 1e3,
                                  cfg.link_latency_ms * 1e3)
        self.gpt, self.pad = gpt, cfg.pad_multiple
        self.extra = 0 if gpt else cfg.decoder_extra_tokens
        self.dataopt = DataAssignmentOptimizer(cm, spec, P, per, dp_size=cfg.data_parallel,
                                               tp_size=cfg.tensor_parallel, zero_stage=1,
                                               device_memory_limit=cfg.memory_limit_mb,
                                               round_seqlen_multiple=cfg.pad_multiple,
                                               len_decoder_additional_tokens=self.extra)
        self.planner = ExecutionPlanner(cluster, spec, assignment, cfg.memory_limit_mb, cm,
                                        dp_size=cfg.data_parallel, tp_size=cfg.tensor_parallel, zero_stage=1)

    def _r(self, x):
        return -(-int(x) // self.pad) * self.pad

    def plan(self, batch):
        enc = [b if self.gpt else b[0] for b in batch]
        dec = None if self.gpt else [b[1] for b in batch]
        t0 = time.perf_counter()
        _, groups, _, rc, _ = self.dataopt.generate_microbatches(enc, decoder_sample_sequence_lengths=dec)
        if groups is None:
            return None
        out = {"groups": [], "rc": rc}
        makespan = 0.0
        for mbs in groups:
            # A published micro-batch is a list of (packed) sequences, each a list of sample
            # indices ([mb][sequence][sample id]); with packing off (its default) one sample each.
            # Shapes as its data loader's _collate_samples builds them.
            shapes = [(len(mb), self._r(max(enc[i] for seq in mb for i in seq)),
                       0 if self.gpt else self._r(max(dec[i] for seq in mb for i in seq) + self.extra))
                      for mb in mbs]
            _, cost, _, best_rc, best_sch = self.planner.generate_execution_plan(shapes)
            makespan = max(makespan, cost)
            out["groups"].append(shapes)
            out["rc"], out["schedule"] = best_rc, best_sch
        out["planning_ms"] = (time.perf_counter() - t0) * 1e3
        out["makespan_ms"] = makespan
        return out


def ours_on(planner, shapes_per_group, rc, memory_limit=True):
    """Our simulator (and schedule search) on given micro-batch shapes, under our per-stage
    activation budget (`memory_limit`) or none; None if they do not fit."""
    from megatron.planner.schedule.schedules import search
    from megatron.planner.schedule.simulator import PipelineCosts
    worst = 0.0
    for shapes in shapes_per_group:
        a = np.array(shapes, float)
        sc = planner.stage_costs(rc, a[:, 0], a[:, 1], None if planner.cfg.model_kind == "gpt" else a[:, 2])
        costs = PipelineCosts(sc["fwd"], sc["bwd"], sc["stored"], sc["transient"], np.array(sc["comm"]))
        ch = search(costs, list(planner.available) if memory_limit else [np.inf] * planner.S)
        if ch is None:
            return None
        worst = max(worst, ch.result.makespan)
    return worst


def main(argv=None):
    import bench_planner as bp
    from megatron.planner.dynapipe.planner import DynaPipePlanner
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,t5")
    ap.add_argument("--gpt-max-lens", default="512,2048,8192")
    ap.add_argument("--t5-max-lens", default="512,2048")
    ap.add_argument("--mixture", default="flan", choices=sorted(bp.MIXTURES))
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--published-cost-model", nargs="*", default=[],
                    help="MODEL=PATH of the published cost model, e.g. gpt=profiles/gpt t5=cm_t5.pkl")
    args = ap.parse_args(argv)
    ok, why = published_available()
    if not ok:
        print(INSTALL)
        print(f"(import error: {why})")
        return 0
    paths = dict(x.split("=", 1) for x in args.published_cost_model)
    for kind in args.models.split(","):
        if kind not in paths:
            print(f"skipping {kind}: give --published-cost-model {kind}=PATH (the published planner needs its own "
                  "profiled cost model)")
            continue
        for L in map(int, getattr(args, f"{kind}_max_lens").split(",")):
            cfg = bp.config(kind, ROOT / "cost_models")
            cfg.emit_plans = False
            ours = DynaPipePlanner(cfg)
            theirs = Published(cfg, paths[kind])
            for i, batch in enumerate(bp.make_batches(kind, L, args.tokens, args.batches, 4242 + L, args.mixture)):
                t0 = time.perf_counter()
                mine = ours.plan(batch, i)
                ours_ms = (time.perf_counter() - t0) * 1e3
                pub = theirs.plan(batch)
                row = {"model": kind, "max_len": L, "mixture": args.mixture, "batch": i,
                       "ours": {"planning_ms": round(ours_ms, 1), "simulated_ms": round(mine.makespan_ms, 2),
                                "padding_efficiency": round(mine.padding_efficiency, 4), "recompute": mine.recompute,
                                "microbatches": sum(len(g.microbatches) for g in mine.groups)}}
                if pub is None:
                    row["published"] = None
                else:
                    real = sum(b if kind == "gpt" else b[0] + b[1] for b in batch)
                    computed = sum(m * (e + d) for g in pub["groups"] for m, e, d in g)
                    row["published"] = {
                        "planning_ms": round(pub["planning_ms"], 1), "simulated_ms_own": round(pub["makespan_ms"], 2),
                        "simulated_ms_ours": ours_on(ours, pub["groups"], pub["rc"]),
                        "simulated_ms_ours_no_memory_limit": ours_on(ours, pub["groups"], pub["rc"], False),
                        "padding_efficiency": round(real / computed, 4), "recompute": pub["rc"],
                        "microbatches": sum(len(g) for g in pub["groups"])}
                    row["ours_over_published"] = round(mine.makespan_ms / pub["makespan_ms"], 4)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
