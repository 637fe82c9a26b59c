"""pretrain(): data -> planner -> executor -> gradient reduction -> optimizer -> log/checkpoint.

Every step runs planner-written `ExecutionPlan`s through `PipelineExecutor`, also at PP=1, so
a new schedule (DynaPipe, TeraPipe, ...) is a new planner, not a new training loop.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron.atomic import write_json
from megatron.config.core import MegatronConfig
from megatron.config.schedules import V_SCHEDULES
from megatron.core.comm_device import comm_device
from megatron.core.optimizer import LRScheduler, MegatronOptimizer
from megatron.core.parallel_state import ParallelState
from megatron.data.samplers import MegatronPretrainingSampler
from megatron.training.grad_sync import GradientSync
from megatron.training.logging import MetricsLogger, print_rank_last
from megatron.pipeline.executor import PipelineExecutor
from megatron.pipeline.p2p import DTYPES, P2PCommunicator
from megatron.planner.schedule.fixed import FixedBatchPlanner


def timeline_dir(cfg) -> str:
    """Where --pipeline-timeline writes: RUN/timeline beside --tensorboard-dir (or --save), or
    --profile-dir/timeline."""
    lg, base = cfg.logging, "."
    for d in (lg.tensorboard_dir, cfg.checkpoint.save):
        if d:
            base = os.path.dirname(os.path.normpath(d)) or "."
            break
    return os.path.join(lg.profile_dir or base, "timeline")


@dataclasses.dataclass
class IterationWork:
    """What one rank runs in one iteration: its micro-batches (this DP rank's), the plan of
    its pipeline rank, how many samples the whole global batch consumed, and planner info
    for the log (micro-batch shapes, padding efficiency, planning / simulated time, ...)."""
    microbatches: List[dict]
    plan: object
    num_samples: int
    info: dict = dataclasses.field(default_factory=dict)


class RunInputError(RuntimeError):
    """What the user gave the run does not fit (data too short for the resumed position, ...):
    reported in one line by pretrain.py, without a traceback."""


class FixedBatchSource:
    """Megatron's fixed global batches (--global-batch-size of --micro-batch-size samples)
    with a static schedule from `FixedBatchPlanner`."""

    def __init__(self, cfg: MegatronConfig, ps: ParallelState, dataset, collate_fn: Callable,
                 planner: FixedBatchPlanner, shapes_fn: Callable):
        self.cfg, self.ps, self.dataset = cfg, ps, dataset
        self.collate_fn, self.planner, self.shapes_fn = collate_fn, planner, shapes_fn
        self.schedule = None  # a growing global batch (megatron.config.batch_schedule), set for training

    def next(self, iteration: int, consumed_samples: int) -> IterationWork:
        t = self.cfg.training
        n = len(self.dataset)
        # --rampup-batch-size / --step-batch-size-schedule: this iteration's global batch (training only)
        batch = self.schedule.at(consumed_samples) if self.schedule is not None else t.global_batch_size
        if consumed_samples + batch > n:
            resumed = " (the run resumed from a checkpoint that consumed them at another --global-batch-size?)" \
                if self.cfg.checkpoint.load else ""
            raise RunInputError(f"the dataset has {n} samples but iteration {iteration} needs sample "
                                f"{consumed_samples + batch - 1}{resumed}; build it for --train-iters "
                                f"x --global-batch-size samples, or raise --train-iters")
        # With per-stage DP sizes --micro-batch-size is the pipeline micro-batch: this rank takes
        # its stage's share of each one, and plans are made for the whole micro-batches.
        split = self.ps.dp_size if self.ps.stage_layouts else 1
        sampler = MegatronPretrainingSampler(n, consumed_samples, t.micro_batch_size // split, self.ps.dp_rank,
                                             self.ps.dp_size)
        idx = list(itertools.islice(sampler, self.cfg.num_microbatches * batch // t.global_batch_size))
        mbs = [self.collate_fn([self.dataset[i] for i in ids]) for ids in idx]
        shapes = [tuple((s[0] * split,) + tuple(s[1:]) for s in self.shapes_fn(mb)) for mb in mbs]
        plan = self.planner.plans(iteration, shapes)[self.ps.plan_rank]
        return IterationWork(mbs, plan, batch)


def gpt_microbatch_shapes(mb: dict) -> tuple:
    """LoadInput shapes of a GPT micro-batch: ((b, s),)."""
    return (tuple(mb["tokens"].shape),)


def real_tokens(mb: dict) -> int:
    """Non-padding input tokens of a micro-batch (collates of padded data record the count)."""
    if "num_real_tokens" in mb:
        return int(mb["num_real_tokens"])
    if "tokens" in mb:
        return int(mb["tokens"].numel())
    return int(mb["text_enc"].numel() + mb["text_dec"].numel())


def _all_reduce_sum(values, group, size: int, device: Optional[torch.device] = None) -> List[float]:
    """Sum of `values` (floats, or a float64 tensor already on the device) over `group`, read
    back with one host sync. The collective runs on `device`: NCCL has no CPU tensors."""
    if torch.is_tensor(values):
        t = values.to(device=device or values.device, dtype=torch.float64)
    else:
        t = torch.tensor(values, dtype=torch.float64, device=device)
    if group is not None and size > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


class PerDataParallelRank:
    """Checkpoint adapter for state that differs between data-parallel replicas (compression
    residuals): every DP rank's state is gathered into the one file its (TP, PP) rank writes,
    and each rank takes its own entry back on load. A different DP size starts it afresh."""

    def __init__(self, obj, ps: ParallelState):
        self.obj, self.ps = obj, ps

    def state_dict(self) -> dict:
        mine = self.obj.state_dict()
        if self.ps.dp_size == 1 or self.ps.dp_group is None:
            return {"dp_size": 1, "per_rank": [mine]}
        gathered = [None] * self.ps.dp_size
        dist.all_gather_object(gathered, mine, group=self.ps.dp_group)
        return {"dp_size": self.ps.dp_size, "per_rank": gathered}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("dp_size") != self.ps.dp_size:
            if self.ps.rank == 0:
                print(f"note: compression state was saved with data-parallel size {sd.get('dp_size')}, this run has "
                      f"{self.ps.dp_size}: residuals and warm starts begin afresh", flush=True)
            return
        self.obj.load_state_dict(sd["per_rank"][self.ps.dp_rank])


class Trainer:
    def __init__(self, cfg: MegatronConfig, ps: ParallelState, device: torch.device,
                 stages: Dict[int, nn.Module], *, train_ds=None, valid_ds=None, collate_fn: Optional[Callable] = None,
                 planner=None, tied_params: List[nn.Parameter], flops_per_sample: float = 0.0,
                 shapes_fn: Optional[Callable] = None, batch_source=None, valid_source=None,
                 extra_tied_groups: Sequence[tuple] = ()):
        self.cfg, self.ps, self.device = cfg, ps, device
        self.stages = stages
        for m in stages.values():
            m.to(device)
        self.modules = [stages[k] for k in sorted(stages)]
        self.tied_params = tied_params
        # (params, group) pairs whose gradients are summed like tied embeddings, e.g. T5's learned
        # position tables shared by the first encoder and first decoder stage.
        self.extra_tied_groups = list(extra_tied_groups)
        shapes_fn = shapes_fn or gpt_microbatch_shapes
        self.batch_source = batch_source or FixedBatchSource(cfg, ps, train_ds, collate_fn, planner, shapes_fn)
        from megatron.config.extras import extras_of
        self.batch_schedule = extras_of(cfg).batch_schedule
        if self.batch_schedule is not None:
            self.batch_source.schedule = self.batch_schedule
        if valid_source is None and valid_ds is not None and planner is not None:
            valid_source = FixedBatchSource(cfg, ps, valid_ds, collate_fn, planner, shapes_fn)
        self.valid_source = valid_source
        t = cfg.training
        self.lr_scheduler = LRScheduler(t)
        self._setup_compression(cfg, ps)
        # Every gradient sync after the pipeline (DP all-reduce or the distributed optimizer's
        # reduce-scatter, overlap, PowerSGD, tied and fused embeddings): one object, built once.
        self.grad_sync = GradientSync(cfg, ps, self.modules, tied_params, self.extra_tied_groups,
                                      dp_reducer=self.dp_reducer, emb_reducer=self.emb_reducer,
                                      fused_embedding_group=self.fused_embedding_group)
        self.sequence_parallel_params = self.grad_sync.sequence_parallel_params
        self.bucket_numel = self.grad_sync.bucket_numel
        ex = extras_of(cfg)
        decoupled = None if ex.decoupled_lr is None else (ex.decoupled_lr, ex.decoupled_min_lr)
        if t.use_distributed_optimizer:
            from megatron.core.distributed_optimizer import DistributedOptimizer
            # Gradients the tied-embedding / sequence-parallel syncs still change after the backward.
            late = self.grad_sync.late_params()
            overlap = t.overlap_grad_reduce or t.overlap_param_gather
            # --emb-comm-opt's fused sync sums the tied embeddings over DP itself.
            fused = list(tied_params) if cfg.compression.emb_comm_opt and ps.pp_size > 1 else []
            self.optimizer = DistributedOptimizer(self.modules, t, ps, self.lr_scheduler, device,
                                                  bucket_numel=self.bucket_numel if overlap else None, late_params=late,
                                                  reduced_params=fused, decoupled_lr=decoupled)
        else:
            self.optimizer = MegatronOptimizer(self.modules, t, ps, self.lr_scheduler, device, decoupled)
        comm = None
        if ps.pp_size > 1:
            comm = P2PCommunicator(ps.pp_global_ranks, ps.rank, ps.pp_group, ps.timeout, device)
        autocast = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else None
        self.comm_dtype_name = t.params_dtype_name
        self.grad_sync.attach(self.optimizer)
        self.executor = PipelineExecutor(stages, comm, rank_desc=ps.describe(), autocast_dtype=autocast,
                                         device=device, comm_dtype=DTYPES[self.comm_dtype_name],
                                         grad_compressor=self.grad_compressor)
        if dist.is_initialized() and ps.world_size > 1:
            from megatron.core import heartbeat
            from megatron.core.parallel_state import job_store
            heartbeat.start(job_store(), ps.rank, ps.world_size, 60.0 * cfg.parallel.distributed_timeout_minutes)
        self.iteration = 0
        self._trace_first: Optional[int] = None  # first iteration this run traces (--dynapipe-trace-dir)
        self.consumed_samples = 0
        self.consumed_tokens = 0  # real (non-padding) input tokens; saved in checkpoints
        self.skipped_iters = 0
        self.consecutive_skipped = 0
        self.logger = MetricsLogger(cfg, ps, flops_per_sample)
        from megatron.training.extras import RunExtras
        self.extras = RunExtras(extras_of(cfg), ps, self._collective_device())
        self.moe_hooks = None
        if cfg.model.moe is not None:  # aux-loss scale, expert-bias update, per-layer log lines
            from megatron.training.moe_hooks import MoEHooks
            self.moe_hooks = MoEHooks(cfg, ps, self.modules)

    def _setup_compression(self, cfg: MegatronConfig, ps: ParallelState) -> None:
        """Optimus-CC hooks (megatron/compression); all None when its flags are off."""
        c = cfg.compression
        self.grad_compressor = self.dp_reducer = self.fused_embedding_group = None
        self.extra_checkpoint_state = {}
        if c.inter_grad_comp:
            from megatron.compression.pipeline import PipelineGradCompressor
            self.grad_compressor = PipelineGradCompressor(c.use_error_feedback, seed=cfg.training.seed,
                                                          reset_each_iteration=not c.lep_carry_across_iterations)
            self.extra_checkpoint_state["pipeline_grad_compression"] = PerDataParallelRank(self.grad_compressor, ps)
        if c.grad_comp:
            from megatron.compression.data_parallel import PowerSGDReducer
            self.dp_reducer = PowerSGDReducer.from_config(cfg, ps)
            self.extra_checkpoint_state["data_parallel_grad_compression"] = PerDataParallelRank(self.dp_reducer, ps)
        if c.emb_comm_opt:
            from megatron.compression.embedding import build_fused_embedding_group
            self.fused_embedding_group = build_fused_embedding_group(ps)
        self.emb_reducer = self.compression_stats = None
        if c.emb_grad_comp:
            from megatron.compression.embedding import build_embedding_reducer
            self.emb_reducer = build_embedding_reducer(cfg, ps, self.fused_embedding_group)
            self.extra_checkpoint_state["embedding_grad_compression"] = PerDataParallelRank(self.emb_reducer, ps)
        if c.log_compression_stats:
            from megatron.compression.stats import CompressionStats
            self.compression_stats = CompressionStats()
            for holder in (self.grad_compressor, self.dp_reducer, self.emb_reducer):
                if holder is not None:
                    holder.stats = self.compression_stats
        from megatron.compression.tensor_parallel import install
        self.tp_compressors = install(cfg, ps, self.compression_stats)  # {} (exact all-reduces) unless asked

    def _expected_accumulations(self, plan) -> dict:
        """id(param) -> how many backward passes of this plan accumulate into it (a split
        backward accumulates in its BackwardWeight: a bucket is final at its last W)."""
        from megatron.pipeline.instructions import BackwardPass, BackwardWeight
        per_stage: dict = {}
        for ins in plan.instructions:
            if isinstance(ins, (BackwardPass, BackwardWeight)):
                per_stage[ins.stage] = per_stage.get(ins.stage, 0) + 1
        out: dict = {}
        for sid, n in per_stage.items():
            stage = self.stages[sid]
            # zb-v: the last stage borrows the first stage's (same-rank) tied embedding weight
            borrowed = [stage.output_weight()] if hasattr(stage, "_tied_embedding_stage") else []
            for p in list(stage.parameters()) + borrowed:
                out[id(p)] = out.get(id(p), 0) + n
        return out

    @property
    def overlap_reducer(self):
        return self.grad_sync.overlap_reducer

    def _reduce_gradients(self) -> dict:
        """Tied-embedding sync and data-parallel reduction; returns payload bytes per mechanism."""
        return self.grad_sync.reduce(self.optimizer, self.iteration + 1)

    # -- one step ------------------------------------------------------------------------
    def train_step(self) -> dict:
        ps = self.ps
        work = self.batch_source.next(self.iteration + 1, self.consumed_samples)
        mbs = work.microbatches
        # The loss multiplier needs the global batch's loss-token count before the first forward:
        # one host read per step (of host data, normally), never one per micro-batch.
        local = torch.stack([torch.stack([mb["loss_mask"].sum(dtype=torch.float64) for mb in mbs]).sum().cpu(),
                             torch.tensor(float(sum(real_tokens(mb) for mb in mbs)), dtype=torch.float64)])
        total_tokens, total_real = _all_reduce_sum(local, ps.grad_group, ps.grad_size, self._collective_device())
        if total_tokens <= 0:
            raise RuntimeError(f"iteration {self.iteration + 1}: the global batch has no loss tokens "
                               "(every loss_mask entry is 0); check the data and --split")
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            base_mb = torch.cuda.memory_allocated(self.device) / 1e6
        if self.grad_sync.overlap_reducer is not None:
            self.grad_sync.overlap_reducer.start_iteration(self._expected_accumulations(work.plan), self.iteration + 1)
        traced = self._tracing()
        if traced:
            self.executor.trace_events = []
        if self.moe_hooks is not None:
            self.moe_hooks.before_step(self.optimizer.loss_scale / total_tokens)
        stats = self.executor.run(work.plan, mbs, self.optimizer.loss_scale / total_tokens)
        if self.grad_compressor is not None:
            self.grad_compressor.end_iteration()
        if traced:
            self._write_measured_trace(self.iteration + 1, work)
        if on_cuda and work.info:
            # Activation peak above what was allocated before the pipeline ran (weights, grads,
            # optimizer state): comparable with the planner's predicted activation peak.
            work.info["measured_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 1e6 - base_mb
        reduced = self._reduce_gradients()
        if self.moe_hooks is not None:
            self.moe_hooks.after_backward()
        comm_bytes = None
        if self.cfg.compression.enabled or self.cfg.compression.log_compression_stats:
            # Whole-job payload bytes this iteration (summed over ranks), for the log.
            comm_bytes = dict(zip(
                ("pp_act", "pp_grad", "pp_grad_raw", "dp", "dp_raw", "emb"),
                _all_reduce_sum([stats.act_bytes, stats.grad_bytes, stats.grad_bytes_raw, reduced["dp"],
                                 reduced["dp_raw"], reduced["emb"]], dist.group.WORLD if ps.world_size > 1 else None,
                                ps.world_size, self._collective_device())))
        zeros = None
        if self.extras.cfg.log_num_zeros_in_grad:  # before clipping, as Megatron counts
            from megatron.training.extras import num_zeros_in_grad
            zeros = num_zeros_in_grad(self.optimizer.params, ps)
        applied, grad_norm = self.optimizer.step()
        if applied:
            # a growing batch advances the schedule by samples (in --global-batch-size units), as Megatron's
            gbs = self.cfg.training.global_batch_size
            self.lr_scheduler.step(1 if self.batch_schedule is None else work.num_samples / gbs)
            if self.consecutive_skipped and ps.rank == ps.world_size - 1:
                print(f" loss scale settled at {self.optimizer.loss_scale:.1f} after {self.consecutive_skipped} "
                      f"skipped iteration(s) (fp16 overflow)", flush=True)
            self.consecutive_skipped = 0
        else:
            self.skipped_iters += 1
            self.consecutive_skipped += 1
            self._check_consecutive_skips()
        self.optimizer.zero_grad()
        totals = stats.loss_totals if stats.loss_totals is not None else torch.zeros(2, dtype=torch.float64)
        loss_sum, loss_tokens = self._loss_totals(totals)
        self.iteration += 1
        self.consumed_samples += work.num_samples
        self.consumed_tokens += int(total_real)
        return {"consumed_tokens": self.consumed_tokens,
                "loss": loss_sum / loss_tokens if loss_tokens else float("nan"), "grad_norm": grad_norm,
                "applied": applied, "tokens": total_tokens, "real_tokens": total_real, "num_microbatches": len(mbs),
                "num_samples": work.num_samples, "planner": work.info, "comm_bytes": comm_bytes,
                "num_zeros": zeros}

    def _collective_device(self) -> torch.device:
        """Where small reductions run: the device under NCCL, the host otherwise."""
        return comm_device()

    def _tracing(self) -> bool:
        """--dynapipe-trace-dir: the first --dynapipe-trace-iters iterations of this run get a
        measured timeline beside the planner's simulated one (same decision on every rank)."""
        d = self.cfg.data
        if self.cfg.logging.pipeline_timeline == self.iteration + 1:  # --pipeline-timeline ITER
            return True
        if not d.dynapipe_trace_dir:
            return False
        if self._trace_first is None:
            self._trace_first = self.iteration + 1
        return self.iteration + 1 - self._trace_first < d.dynapipe_trace_iters

    def _write_measured_trace(self, iteration: int, work) -> None:
        """Gather every pipeline rank's instruction spans (TP rank 0 of each DP group) and write
        `iter_NNNNNNN.measured.json` on rank 0, one process per (DP group, pipeline rank) as in the
        simulated trace; times are from each rank's own start of the iteration's plan."""
        ps = self.ps
        events, self.executor.trace_events = self.executor.trace_events, None
        pid = ps.dp_rank * ps.pp_size + ps.pp_rank
        mine = [dict(ev, pid=pid) for ev in events] if ps.tp_rank == 0 else []
        if ps.world_size > 1:  # only rank 0 writes: gather there
            gathered = [None] * ps.world_size if ps.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        else:
            gathered = [mine]
        if ps.rank != 0:
            return
        from megatron.planner.service.worker import trace_path
        out = [ev for rank_events in gathered for ev in rank_events]
        for d in range(ps.dp_size):
            for p in range(ps.pp_size):
                out.append({"name": "process_name", "ph": "M", "pid": d * ps.pp_size + p,
                            "args": {"name": f"DP group {d} / pipeline rank {p} (measured)"}})
        meta = {"iteration": iteration, "device": self.device.type,
                "simulated_ms": work.info.get("simulated_ms") if work.info else None}
        from megatron.pipeline.timeline import add_flows, unit_replay
        trace_dir = self.cfg.data.dynapipe_trace_dir or timeline_dir(self.cfg)
        os.makedirs(trace_dir, exist_ok=True)
        write_json(trace_path(trace_dir, iteration, "measured"),
                   {"traceEvents": add_flows(out, ps.pp_size), "displayTimeUnit": "ms", "otherData": meta})
        if self.cfg.logging.pipeline_timeline == iteration:  # the schedule as planned, in unit costs
            meta = dict(meta, units="F 1, B 2, W 1 (1 unit = 1 ms in the viewer); messages take no time")
            names = [dict(e, args={"name": e["args"]["name"].replace("measured", "planned")})
                     for e in out if e.get("ph") == "M"]
            planned = unit_replay(out, ps.pp_size) + names
            write_json(trace_path(trace_dir, iteration, "unit"), {"traceEvents": add_flows(planned, ps.pp_size),
                                                                  "displayTimeUnit": "ms", "otherData": meta})
            print(f" pipeline timeline of iteration {iteration}: {trace_path(trace_dir, iteration, 'measured')} "
                  "(and .unit.json, the schedule as planned); open in https://ui.perfetto.dev", flush=True)

    def _check_consecutive_skips(self) -> None:
        t, n = self.cfg.training, self.consecutive_skipped
        limit = getattr(t, "max_consecutive_skipped_iters", 0)
        if limit and n >= limit:
            static = t.loss_scale is not None
            raise RuntimeError(
                f"iteration {self.iteration + 1}: {n} consecutive iterations skipped for inf/nan gradients "
                f"(--max-consecutive-skipped-iters {limit}); "
                + (f"the static --loss-scale {t.loss_scale} overflows every step: lower it or drop it for dynamic "
                   "scaling" if static else "the loss or gradients are not finite: check the data, lower --lr, "
                   "or use --bf16"))
        warn_at = 10 if t.loss_scale is not None else 40
        if n == warn_at and self.ps.rank == self.ps.world_size - 1:
            print(f"WARNING: {n} consecutive iterations skipped for inf/nan gradients (loss scale "
                  f"{self.optimizer.loss_scale:.1f}); training stops at --max-consecutive-skipped-iters "
                  f"{limit or 'unlimited'}", file=sys.stderr, flush=True)

    def evaluate(self, source, iters: int) -> Optional[float]:
        if source is None or iters <= 0:
            return None
        for m in self.modules:
            m.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        consumed = 0
        try:
            for _ in range(iters):
                work = source.next(self.iteration, consumed)
                consumed += work.num_samples
                stats = self.executor.run(work.plan, work.microbatches, 1.0, forward_only=True)
                if stats.loss_totals is not None:
                    totals += stats.loss_totals
        finally:
            for m in self.modules:
                m.train()
        loss_sum, loss_tokens = self._loss_totals(totals)
        return loss_sum / loss_tokens if loss_tokens else None

    def _loss_totals(self, totals) -> list:
        """[loss sum, loss tokens] over DP x CP, on the rank that reports (the last rank). zb-v runs the
        last stage on pipeline rank 0, so there the pipeline group sums them too."""
        ps = self.ps
        # over DP x CP: context-parallel ranks hold other tokens of the same samples
        out = _all_reduce_sum(totals, ps.grad_group, ps.grad_size, self._collective_device())
        if self.cfg.parallel.pipeline_schedule in V_SCHEDULES and ps.pp_size > 1:
            out = _all_reduce_sum(out, ps.pp_group, ps.pp_size, self._collective_device())
        return out

    # -- loop ----------------------------------------------------------------------------
    def train(self, save_fn: Optional[Callable] = None) -> List[dict]:
        try:
            return self._train(save_fn)
        finally:
            close = getattr(self.batch_source, "close", None)
            if close is not None:
                close()

    def _train(self, save_fn: Optional[Callable]) -> List[dict]:
        cfg = self.cfg
        history = []
        for m in self.modules:
            m.train()
        from megatron.profiling.step_trace import StepProfiler
        profiler = StepProfiler(cfg.logging, self.ps.rank, self.device)
        self.extras.begin()
        try:
            return self._train_loop(save_fn, history, profiler)
        finally:
            self.extras.finish()
            profiler.close()
            self._params_up_to_date()

    def _params_up_to_date(self) -> None:
        """--overlap-param-gather leaves the last step's all-gathers in flight: finish them
        before anything reads the parameters outside a forward (evaluation, checkpoints)."""
        finish = getattr(self.optimizer, "finish_param_gather", None)
        if finish is not None:
            finish()

    def _train_loop(self, save_fn: Optional[Callable], history: List[dict], profiler) -> List[dict]:
        cfg = self.cfg
        while self.iteration < cfg.training.train_iters:
            profiler.before_step(self.iteration + 1)
            t0 = time.perf_counter()
            out = self.train_step()
            out["time_s"] = time.perf_counter() - t0
            profiler.after_step(self.iteration)
            if self.extras.cfg.log_params_norm:  # every iteration, as Megatron (a model-parallel all-reduce)
                from megatron.training.extras import params_norm
                self._params_up_to_date()  # --overlap-param-gather: this step's parameters, not the last
                out["params_norm"] = params_norm(self.optimizer.params, self.ps)
            if self.iteration % cfg.logging.log_interval == 0:  # every rank: one MAX all-reduce
                from megatron.training.stage_memory import stage_peaks_mb
                out["stage_memory"] = stage_peaks_mb(self.ps.pp_rank, self.ps.pp_size, self.ps.world_size,
                                                     self.device, self._collective_device())
            history.append(out)
            self.logger.record(self.iteration, self.consumed_samples, out, self.lr_scheduler.lr(),
                               self.optimizer.loss_scale, self.skipped_iters)
            if self.moe_hooks is not None:
                self.moe_hooks.report(self.iteration, self.logger)
            if self.compression_stats is not None and self.iteration % cfg.logging.log_interval == 0:
                self.compression_stats.report(self.iteration, dist.group.WORLD if self.ps.world_size > 1 else None,
                                              self.logger.active, self.logger.writer)
            if self.valid_source is not None and self.iteration % cfg.training.eval_interval == 0:
                self._params_up_to_date()
                self.extras.around_eval()
                self.logger.log_validation(self.iteration, self.evaluate(self.valid_source, cfg.training.eval_iters))
                self.extras.around_eval()
            self.extras.after_step(self.iteration)
            if cfg.checkpoint.async_save:  # a save in flight whose files are all written is named now
                from megatron.checkpointing.async_save import maybe_finalize
                maybe_finalize(self)
            if save_fn and cfg.checkpoint.save_interval and self.iteration % cfg.checkpoint.save_interval == 0:
                self._params_up_to_date()
                save_fn(self)
            if cfg.training.exit_interval and self.iteration % cfg.training.exit_interval == 0:
                print_rank_last(self.ps, f"exiting at iteration {self.iteration} (--exit-interval)")
                break
            if self.iteration < cfg.training.train_iters and self.extras.out_of_time():
                print_rank_last(self.ps, f"exiting at iteration {self.iteration} after "
                                f"{self.extras.cfg.exit_duration_in_mins} minutes of training (--exit-duration-in-mins)"
                                + ("; the checkpoint is saved" if save_fn else ""))
                break
        return history
