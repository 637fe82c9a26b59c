"""One job = one system at one parallel layout on one setting; a back-end turns it into a result row.

* `SimulateBackend`: the DynaPipe planner (`megatron.planner.dynapipe.planner`, also searching micro-batches
  of packed rows) and the packing / packing_varlen / packing_balanced / fixed baselines
  (`megatron.planner.dynapipe.baselines`) on the grid's cost model, over batches drawn from the
  multi-task lengths (`lengths.draw_batches`); iteration times are the simulator's makespans.
* `LiveBackend` (`live.py`): torchrun pretrain_gpt.py / pretrain_t5.py, log lines parsed.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from megatron.experiments.config import ROOT, Grid, ModelSpec, Setting
from megatron.experiments.rows import make_row


@dataclass(frozen=True)
class Job:
    experiment: str
    setting: Setting
    system: str  # dynapipe | packing | packing_varlen | packing_balanced | fixed
    pp: int
    tp: int
    dp: int
    micro_batch_size: Optional[int] = None
    recompute: Optional[str] = None
    variant: str = ""
    batches: int = 4

    def row(self, grid: Grid, backend: str, **kw) -> dict:
        spec = grid.models[self.setting.model]
        return make_row(experiment=self.experiment, backend=backend, grid=grid.name, setting=self.setting.key,
                        model=self.setting.model, kind=spec.kind, max_len=self.setting.max_len,
                        gpus=self.setting.gpus, tokens_per_batch=self.setting.tokens, system=self.system,
                        variant=self.variant, pp=self.pp, tp=self.tp, dp=self.dp,
                        micro_batch_size=self.micro_batch_size,
                        recompute=kw.pop("recompute", self.recompute), **kw)


# Ablation variants: name -> (DynaPipeConfig overrides, partition). partition "dp" is DynaPipe's
# optimal partition; "token" / "fixed" cut the same ordered samples into micro-batches of at most
# a token budget / a fixed sample count (best budget or count, as the baselines get).
VARIANTS = {
    "dynapipe": ({}, "dp"),
    "partition=token": ({}, "token"),
    "partition=fixed": ({}, "fixed"),
    "schedule=1f1b": ({"schedules": ("1f1b",)}, "dp"),
    "order=as-partitioned": ({"max_orders": 1}, "dp"),
    "recompute=none": ({"recompute_levels": ("none",)}, "dp"),
    "recompute=full": ({"recompute_levels": ("full",)}, "dp"),
}


class Backend:
    name = "?"

    def run(self, grid: Grid, job: Job) -> dict:
        raise NotImplementedError


class SimulateBackend(Backend):
    name = "simulate"

    def __init__(self, lengths_file: Optional[str] = None):
        self.lengths_file = lengths_file
        self._pairs = None
        self._planners = {}
        self._batches = {}

    # ---- inputs ------------------------------------------------------------------------
    def batches(self, grid: Grid, spec: ModelSpec, s: Setting, n: int):
        from megatron.experiments.lengths import draw_batches, load_lengths
        key = (spec.kind, s.max_len, s.tokens, n, grid.seed)
        if key not in self._batches:
            if self._pairs is None:
                self._pairs = load_lengths(self.lengths_file or grid.lengths_file)
            self._batches[key] = draw_batches(self._pairs, spec.kind, s.max_len, s.tokens, n,
                                              seed=grid.seed * 100003 + s.max_len)
        return self._batches[key]

    def planner(self, grid: Grid, spec: ModelSpec, job: Job, overrides: dict):
        from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
        key = (spec.name, job.setting.max_len, job.pp, job.tp, job.dp, tuple(sorted(overrides.items())))
        if key not in self._planners:
            cm = str(ROOT / spec.cost_model) if (ROOT / spec.cost_model).is_file() else spec.cost_model
            shape = (dict(num_layers=spec.num_layers) if spec.kind == "gpt" else
                     dict(encoder_layers=spec.encoder_layers, decoder_layers=spec.decoder_layers))
            cfg = DynaPipeConfig(cost_model_path=cm, model_kind=spec.kind, hidden_size=spec.hidden_size,
                                 pipeline_parallel=job.pp, data_parallel=job.dp, tensor_parallel=job.tp,
                                 memory_limit_mb=grid.memory_limit_mb, emit_plans=False,
                                 packed_rows=True, packed_max_len=job.setting.max_len, **shape)
            cfg = replace(cfg, **overrides)
            try:
                self._planners[key] = DynaPipePlanner(cfg)
            except Exception as e:  # noqa: BLE001 - model states do not fit, TP not profiled, ...
                self._planners[key] = e
        return self._planners[key]

    # ---- run ---------------------------------------------------------------------------
    def run(self, grid: Grid, job: Job) -> dict:
        spec = grid.models[job.setting.model]
        overrides, partition = VARIANTS[job.variant or "dynapipe"] if job.system == "dynapipe" else ({}, "dp")
        planner = self.planner(grid, spec, job, overrides)
        if isinstance(planner, Exception):
            return job.row(grid, self.name, status="infeasible", iterations=0, error=str(planner))
        if not planner.cm.has(job.tp, job.recompute or "none") and job.system != "dynapipe":
            return job.row(grid, self.name, status="infeasible", iterations=0,
                           error=f"the cost model has no TP={job.tp} / recompute={job.recompute} profile")
        batches = self.batches(grid, spec, job.setting, job.batches)
        if job.system == "dynapipe" and partition == "dp":
            return self._dynapipe(grid, job, planner, batches)
        if job.system in ("packing_varlen", "packing_balanced"):
            return self._packed(grid, job, planner, spec.kind, batches)
        return self._fixed_shapes(grid, job, planner, spec.kind, batches, partition)

    def _dynapipe(self, grid, job, planner, batches):
        from megatron.planner.dynapipe.planner import PlanningError
        times, eff, plan_ms, peaks, rcs, scheds, real = [], [], [], [], Counter(), Counter(), 0
        for i, b in enumerate(batches):
            try:
                if i == 0:
                    planner.plan(b, 0)  # warm the per-length cost caches; not timed
                p = planner.plan(b, i)
            except PlanningError as e:
                return job.row(grid, self.name, status="infeasible", iterations=0, error=str(e))
            times.append(p.makespan_ms)
            eff.append(p.padding_efficiency)
            plan_ms.append(round(p.planning_ms, 3))
            peaks.append(round(max(max(g.peak_memory_mb) for g in p.groups), 2))
            rcs[p.recompute] += 1
            scheds.update(g.schedule for g in p.groups)
            real += int(np.asarray(b).sum())
        return job.row(grid, self.name, status="ok", iterations=len(times), iteration_ms=float(np.mean(times)),
                       tokens_per_s=real / (sum(times) / 1e3), padding_efficiency=float(np.mean(eff)),
                       planning_ms=plan_ms, predicted_ms=[round(t, 3) for t in times], predicted_peak_mb=peaks,
                       recompute=rcs.most_common(1)[0][0], schedules=dict(scheds))

    def _fixed_shapes(self, grid, job, planner, kind, batches, partition):
        from megatron.planner.dynapipe import baselines as bl
        times, eff, real, rcs = [], [], 0, Counter()
        for b in batches:
            best = (np.inf, None, None)
            for shapes, rc in self._candidates(planner, kind, job, b, partition):
                groups = bl.split_groups(shapes, job.dp)
                if groups is None:
                    continue
                if job.system == "dynapipe":  # ablation: the planner's schedules on a simple partition
                    t = bl.iteration_time(planner, kind, groups, rc, planner.cfg.schedules, planner.cfg.max_orders)
                else:
                    t = bl.iteration_time(planner, kind, groups, rc)
                if t < best[0]:
                    best = (t, shapes, rc)
            if not np.isfinite(best[0]):
                return job.row(grid, self.name, status="infeasible", iterations=0,
                               error=f"no micro-batch of {job.system}"
                                     f"{'/' + partition if job.system == 'dynapipe' else ''} fits "
                                     f"{grid.memory_limit_mb:.0f} MB at this layout")
            times.append(best[0])
            eff.append(bl.padding_efficiency(kind, b, best[1]))
            rcs[best[2]] += 1
            real += int(np.asarray(b).sum())
        return job.row(grid, self.name, status="ok", iterations=len(times), iteration_ms=float(np.mean(times)),
                       tokens_per_s=real / (sum(times) / 1e3), padding_efficiency=float(np.mean(eff)),
                       predicted_ms=[round(t, 3) for t in times], recompute=rcs.most_common(1)[0][0])

    def _packed(self, grid, job, planner, kind, batches):
        """Rows of documents with per-document attention (`megatron.planner.dynapipe.baselines`); the
        balanced packing defers long documents across the job's batches (`BalancedStream`)."""
        from megatron.planner.dynapipe import baselines as bl
        from megatron.planner.dynapipe import packed
        stream = bl.BalancedStream(kind, job.setting.max_len)
        times, eff, real = [], [], 0
        for k, b in enumerate(batches):
            if job.system == "packing_balanced":
                b = stream.next(b, last=k == len(batches) - 1)
                # cost estimated at the first recompute level, as the baselines and DynaPipe's search do
                mbs = packed.balanced(planner, kind, b, job.setting.max_len, job.micro_batch_size)
            else:
                rows = packed.next_fit(kind, b, job.setting.max_len)
                mbs = [rows[i:i + job.micro_batch_size] for i in range(0, len(rows), job.micro_batch_size)]
            groups = packed.contiguous_groups(len(mbs), job.dp)
            sh = packed.shapes_of(planner, kind, b, job.setting.max_len, mbs)
            t = np.inf if groups is None else packed.one_f_one_b_time(planner, job.recompute, sh, groups)
            if not np.isfinite(t):
                return job.row(grid, self.name, status="infeasible", iterations=0,
                               error=f"no {job.system} micro-batch of {job.micro_batch_size} rows fits "
                                     f"{grid.memory_limit_mb:.0f} MB at this layout")
            times.append(t)
            eff.append(sh.real_tokens / sh.computed_tokens)
            real += sh.real_tokens
        return job.row(grid, self.name, status="ok", iterations=len(times), iteration_ms=float(np.mean(times)),
                       tokens_per_s=real / (sum(times) / 1e3), padding_efficiency=float(np.mean(eff)),
                       predicted_ms=[round(t, 3) for t in times], recompute=job.recompute)

    @staticmethod
    def _candidates(planner, kind, job, batch, partition):
        """(micro-batch shapes, recompute level) candidates for one batch."""
        from megatron.planner.dynapipe import baselines as bl
        from megatron.planner.dynapipe import partitioner as part
        if job.system != "dynapipe":
            yield bl.microbatch_shapes(planner, kind, job.system, batch, job.setting.max_len,
                                       job.micro_batch_size), job.recompute
            return
        arr = np.asarray(batch, dtype=np.int64)
        order = part.order_by_length(arr) if kind == "gpt" else part.order_clustered(arr.reshape(-1, 2))
        ordered = [batch[i] for i in order]
        cuts = []
        if partition == "fixed":
            for size in bl.SIZES:
                cuts.append([ordered[k:k + size] for k in range(0, len(ordered), size)])
        else:  # token budget per micro-batch (padded tokens: size x longest)
            for budget in (1, 2, 4, 8, 16):
                budget *= job.setting.max_len
                mbs, cur = [], []
                for s in ordered:
                    trial = cur + [s]
                    longest = max(trial) if kind == "gpt" else max(x[0] + x[1] for x in trial)
                    if cur and len(trial) * longest > budget:
                        mbs.append(cur)
                        trial = [s]
                    cur = trial
                mbs.append(cur)
                cuts.append(mbs)
        q, extra = planner.cfg.pad_multiple, planner.cfg.decoder_extra_tokens
        pad = lambda x: -(-int(x) // q) * q  # noqa: E731
        for mbs in cuts:
            if kind == "gpt":
                shapes = [(len(m), pad(max(m)), 0) for m in mbs]
            else:
                shapes = [(len(m), pad(max(x[0] for x in m)), pad(max(x[1] for x in m) + extra)) for m in mbs]
            # Spread micro-batches over DP groups round-robin (sorted order: balanced groups).
            shapes = [shapes[g::job.dp][k] for g in range(job.dp) for k in range(len(shapes[g::job.dp]))] \
                if job.dp > 1 else shapes
            for rc in planner.cfg.recompute_levels:
                if planner.cm.has(job.tp, rc):
                    yield shapes, rc
