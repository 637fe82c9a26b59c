"""Multi-task (inputs, targets) training: token-budget global batches and three ways to cut them.

* `--dynapipe`: per-batch DynaPipe plans (variable micro-batches, recompute level and schedule
  chosen for that batch under `--dynapipe-memory-limit`), computed ahead by planner worker
  processes on rank 0 and shipped to every rank over the job's TCP store (`PlanService`).
* `--pack-dataset`: the packing baseline: samples packed next-fit into rows of --seq-length
  (T5: --encoder-seq-length / --decoder-seq-length) with per-document attention,
  --micro-batch-size rows per micro-batch, static 1F1B.
* neither: the fixed micro-batch baseline: --micro-batch-size samples per micro-batch in data
  order, padded to the longest sample of the micro-batch, static 1F1B.

All three consume the same global batches (`TokenBudgetSampler` over --tokens-per-global-batch)
and normalise the loss by the target tokens of the whole global batch, so they train the same
model on the same data and differ only in speed and memory.
"""
from __future__ import annotations

import functools
import math
import time
from typing import List

import numpy as np
import torch

from megatron.training.batching import pad_rows, rows_of
from megatron.config.core import MegatronConfig
from megatron.config.schedules import SPLIT_SCHEDULES
from megatron.data.packing import (collate_supervised_gpt, collate_supervised_t5, concat_pair, next_fit_rows,
                                   pack_samples, pack_t5_rows)
from megatron.data.samplers import TokenBudgetSampler
from megatron.planner.schedule.fixed import FixedBatchPlanner
from megatron.training.trainer import IterationWork
from megatron.planner.passes import plan_passes

PAD_MULTIPLE = 8


def pad_multiple(cfg: MegatronConfig) -> int:
    """What micro-batch lengths are padded to: a multiple of 8 and, with --sequence-parallel, of
    every stage's TP size (each TP rank holds an equal piece of the sequence)."""
    p = cfg.parallel
    tps = [t for t, _ in p.stage_parallel] if p.stage_parallel else [p.tensor_model_parallel_size]
    q = math.lcm(PAD_MULTIPLE, *tps) if cfg.model.sequence_parallel else PAD_MULTIPLE
    if p.context_parallel_size > 1:  # each CP rank holds 2 equal chunks of every row (cut again by SP)
        from megatron.config.context_parallel import cp_granule
        q = math.lcm(q, cp_granule(cfg))
    return q


def _round_up(n, q: int = PAD_MULTIPLE) -> int:
    return int(-(-int(n) // q) * q)


def _tensors(d: dict) -> dict:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in d.items()}


def planning_lengths(cfg: MegatronConfig, dataset) -> np.ndarray:
    """Tokens each sample occupies after truncation: GPT len(input + target) - 1 (<= seq);
    T5 pairs (encoder, decoder) with the decoder's bos."""
    m = cfg.model
    if m.model_type == "gpt":
        return np.minimum(dataset.input_lengths + dataset.target_lengths - 1, m.seq_length).clip(min=1)
    enc = np.minimum(dataset.input_lengths, m.encoder_seq_length).clip(min=1)
    dec = np.minimum(dataset.target_lengths + 1, m.decoder_seq_length)
    return np.stack([enc, dec], axis=1)


def global_batch_bounds(cfg: MegatronConfig, lengths: np.ndarray, consumed_samples: int, iterations: int) -> np.ndarray:
    """Start/end sample index of each upcoming global batch (contiguous in data order)."""
    budget_len = lengths if lengths.ndim == 1 else lengths.sum(axis=1)
    max_len = cfg.model.seq_length if lengths.ndim == 1 else cfg.model.encoder_seq_length + cfg.model.decoder_seq_length
    sampler = TokenBudgetSampler(budget_len, cfg.data.tokens_per_global_batch, max_len, consumed_samples)
    bounds = [consumed_samples]
    for batch in sampler:
        bounds.append(batch[-1] + 1)
        if len(bounds) > iterations:
            break
    if len(bounds) <= iterations:
        raise RuntimeError(f"the multi-task dataset has {len(lengths)} samples: enough for {len(bounds) - 1} global "
                           f"batches of --tokens-per-global-batch {cfg.data.tokens_per_global_batch}, but "
                           f"{iterations} iterations remain (--train-iters)")
    return np.asarray(bounds, dtype=np.int64)


class _SupervisedSource:
    """Global batches are laid out when the first iteration is requested: only then (after a
    checkpoint load) are the resumed iteration and consumed-sample count known."""

    def __init__(self, cfg: MegatronConfig, ps, dataset, tokenizer_ids: dict):
        self.cfg, self.ps, self.dataset = cfg, ps, dataset
        self.ids = tokenizer_ids
        self.lengths = planning_lengths(cfg, dataset)
        self.bounds = None

    def _start(self, iteration: int, consumed_samples: int) -> None:
        self.first_iteration = iteration
        remaining = self.cfg.training.train_iters - iteration + 1
        self.bounds = global_batch_bounds(self.cfg, self.lengths, consumed_samples, remaining)

    def _batch(self, iteration: int, consumed_samples: int):
        if self.bounds is None:
            self._start(iteration, consumed_samples)
        k = iteration - self.first_iteration
        if not 0 <= k < len(self.bounds) - 1:
            raise RuntimeError(f"iteration {iteration} is outside the planned range of global batches")
        lo, hi = int(self.bounds[k]), int(self.bounds[k + 1])
        if lo != consumed_samples:
            raise RuntimeError(f"iteration {iteration}: the planned global batch starts at sample {lo} but "
                               f"{consumed_samples} samples were consumed")
        return lo, hi

    def collate_rows(self, rows: List[List[int]], shape=None) -> dict:
        """Packed rows, row r holding samples rows[r] (global ids, each row fitting as
        `next_fit_rows` packs it). GPT: rows of --seq-length tokens (`pack_samples`; a sample
        takes its length + 1); T5: (--encoder-seq-length, --decoder-seq-length) rows with
        per-pair segments (`pack_t5_rows`), as long as a plan's `shape` says where given."""
        m = self.cfg.model
        if m.model_type == "t5":
            pairs = {i: self.dataset[i] for r in rows for i in r}
            se, sd = (m.encoder_seq_length, m.decoder_seq_length) if shape is None else (shape[0][1], shape[1][1])
            d = pack_t5_rows(pairs, rows, se, sd, self.ids["bos"], self.ids["eos"], self.ids["pad"])
            d["loss_mask"] = d["loss_mask"].astype(np.float32)
            mb = _tensors(d)
            mb["num_real_tokens"] = int(np.einsum("bii->", d["enc_mask"]) + d["loss_mask"].sum())
            return mb
        seq = m.seq_length
        ids = [i for r in rows for i in r]
        at = {i: k for k, i in enumerate(ids)}
        seqs, starts = [], []
        for i in ids:
            p = self.dataset[i]
            x, n_in = concat_pair(p["inputs"], p["targets"], seq)  # the fixed collate's truncation
            seqs.append(x)
            starts.append(n_in)
        # Rows hold seq + 1 tokens so that a full-length sample keeps all of its labels.
        out = pack_samples(seqs, seq + 1, pad_id=self.ids["pad"], loss_starts=starts,
                           rows=[[at[i] for i in r] for r in rows])
        mb = _tensors({k: v[:, :seq] for k, v in out.items()})
        # Count what the padded collate counts for the same samples (`collate_supervised_gpt`:
        # a sample of L tokens is L - 1 inputs, each with its next token as label): a position
        # is real when the next one in its row belongs to the same sample. Counting every
        # segment position added one per sample, and the modes' "consumed tokens" disagreed.
        seg = out["segment_ids"]
        mb["num_real_tokens"] = int(((seg[:, :seq] > 0) & (seg[:, 1:seq + 1] == seg[:, :seq])).sum())
        return mb

    def microbatches(self, lo: int, group) -> List[dict]:
        """A DynaPipe group's micro-batches: padded samples, or packed rows where the plan has them."""
        if group.rows is not None:
            mbs = [self.collate_rows([[lo + i for i in r] for r in rows], shape)
                   for rows, shape in zip(group.rows, group.shapes)]
        else:
            mbs = [self.collate([lo + i for i in ids], shape) for ids, shape in zip(group.microbatches, group.shapes)]
        if self.ps.stage_layouts:  # one pipeline; the plan's shapes count the filler rows
            return self.stage_rows([self.padded(mb) for mb in mbs])
        if group.cp is not None:  # variable CP: ContextParallelSource cuts each for its sub-group
            for mb, (size, index) in zip(mbs, group.cp):
                mb["cp_split"] = (int(size), int(index))
        return mbs

    def my_group(self, plan, iteration: int):
        """This rank's group of a DynaPipe plan: its DP rank's, the one pipeline's with per-stage
        layouts, or with variable CP (`--dynapipe-cp-sizes`) its own lane of DP x CP."""
        ps = self.ps
        lanes = bool(plan.groups) and plan.groups[0].cp is not None
        groups = 1 if ps.stage_layouts else ps.grad_size if lanes else ps.dp_size
        if len(plan.groups) != groups:
            raise RuntimeError(f"iteration {iteration}: plan has {len(plan.groups)} data-parallel groups, "
                               f"the job has {groups}")
        return plan.groups[0 if ps.stage_layouts else ps.grad_rank if lanes else ps.dp_rank]

    def padded(self, mb: dict) -> dict:
        """With per-stage DP sizes a micro-batch's rows must divide by every stage's DP: a short
        one gets loss-free filler rows (`pad_rows`)."""
        return pad_rows(mb, math.lcm(*(dp for _, dp in self.ps.stage_layouts)))

    def stage_rows(self, whole: List[dict]) -> List[dict]:
        """This rank's share of each whole (padded) micro-batch: its stage's DP part of the rows."""
        return [rows_of(mb, self.ps.dp_rank, self.ps.dp_size) for mb in whole]

    def collate(self, sample_ids: List[int], shape) -> dict:
        pairs = [self.dataset[i] for i in sample_ids]
        if self.cfg.model.model_type == "gpt":
            d = collate_supervised_gpt(pairs, shape[0][1], pad_id=self.ids["pad"])
            # Right padding under a causal mask cannot influence real tokens, and padding carries
            # no loss, so the plain causal kernel is exact here (no explicit mask needed).
            real = int((d.pop("segment_ids") > 0).sum())
        else:
            d = collate_supervised_t5(pairs, shape[0][1], shape[1][1], self.ids["bos"], self.ids["eos"],
                                      self.ids["pad"])
            d["loss_mask"] = d["loss_mask"].astype(np.float32)
            real = int(np.einsum("bii->", d["enc_mask"]) + d["loss_mask"].sum())
        out = _tensors(d)
        out["num_real_tokens"] = real
        return out


class DynaPipeSource(_SupervisedSource):
    """Per-iteration DynaPipe plans; DP rank d runs group d, pipeline rank p its plan p."""

    def __init__(self, cfg, ps, dataset, tokenizer_ids, planner_config, num_workers: int, lookahead: int):
        super().__init__(cfg, ps, dataset, tokenizer_ids)
        self.planner_config, self.num_workers, self.lookahead = planner_config, num_workers, lookahead
        self.service = None

    def _start(self, iteration: int, consumed_samples: int) -> None:
        # After a checkpoint load this lays out the global batches from the consumed-samples
        # position and (re)starts the plan service at the resumed iteration.
        super()._start(iteration, consumed_samples)
        from megatron.planner.service.worker import batch_digest, plan_iteration
        d = self.cfg.data
        # Only one process writes traces: rank 0 (its workers, or itself without the service).
        trace_dir = d.dynapipe_trace_dir if self.ps.rank == 0 else None
        self.plan_fn = functools.partial(plan_iteration, self.planner_config, self.lengths, self.bounds,
                                         self.first_iteration, self.cfg.parallel.validate_plans_iters,
                                         trace_dir=trace_dir, trace_iters=d.dynapipe_trace_iters)
        if self.num_workers > 0 and self.ps.world_size > 1:
            from megatron.planner.service.service import PlanService
            self.service = PlanService(self.plan_fn if self.ps.rank == 0 else None, self.ps.rank,
                                       self.ps.world_size, lookahead=self.lookahead, num_workers=self.num_workers,
                                       start_iteration=self.first_iteration, num_iterations=len(self.bounds) - 1,
                                       prefix=f"dynapipe-plans-{self.first_iteration}",
                                       batch_digest=functools.partial(batch_digest, self.lengths, self.bounds,
                                                                      self.first_iteration))

    def next(self, iteration: int, consumed_samples: int) -> IterationWork:
        lo, hi = self._batch(iteration, consumed_samples)
        t0 = time.perf_counter()
        plan = self.service.get(iteration) if self.service is not None else self.plan_fn(iteration)
        wait_ms = (time.perf_counter() - t0) * 1e3
        counts = [len(g.microbatches) for g in plan.groups]
        if self.ps.ep_size > 1 and len(set(counts)) > 1:  # the EP exchange would wait forever (lockstep.py)
            raise RuntimeError(f"iteration {iteration}: the DynaPipe plan gives the DP groups {counts} micro-batches, "
                               "but expert parallelism runs them in lockstep (plan with lockstep_groups)")
        from megatron.planner.service.worker import check_covers
        check_covers(plan, iteration, hi - lo)
        group = self.my_group(plan, iteration)
        mbs = self.microbatches(lo, group)
        info = {"planner": "dynapipe", "recompute": plan.recompute, "schedule": group.schedule,
                "packed_rows": group.rows is not None,
                "microbatch_shapes": [s[0] if len(s) == 1 else s for s in group.shapes],
                "num_microbatches": [len(g.microbatches) for g in plan.groups],
                "padding_efficiency": plan.padding_efficiency, "planning_ms": plan.planning_ms,
                "plan_wait_ms": wait_ms, "simulated_ms": plan.makespan_ms,
                "predicted_peak_mb": group.peak_memory_mb,
                "token_slices": None if group.token_slices is None else len(group.token_slices),
                "cp_sizes": None if group.cp is None else [c for c, _ in group.cp]}
        if group.cp is not None:  # variable CP: the whole plan's micro-batches per size (each once)
            counts = {}
            for g in plan.groups:
                for c, j in g.cp:
                    counts[c] = counts.get(c, 0) + (j == 0)
            info["cp_size_counts"] = {c: counts[c] for c in sorted(counts)}
        plans = group.plans
        # DynaPipe's plans come lowered onto the stage layout; the marks remain. Every rank has
        # its group's plans for all pipeline ranks, so each marks the same messages alone.
        plan_pass = plan_passes(self.cfg, self.ps.stage_layouts, presplit=True)
        if plan_pass is not None:
            plans = plan_pass(plans)
        return IterationWork(mbs, plans[self.ps.plan_rank], hi - lo, info)

    def close(self):
        if self.service is not None:
            self.service.close()


class DynaPipeEvalSource(_SupervisedSource):
    """Validation batches on a `--dynapipe` run: the first --eval-iters token-budget global
    batches of the validation split, each planned like a training batch (same planner, cost
    model and memory limit; in-process on every rank, deterministic, cached across
    evaluations). `Trainer.evaluate` runs the plans forward-only and reports the loss summed
    over the real target tokens divided by their count (padding carries no loss)."""

    def __init__(self, cfg, ps, dataset, tokenizer_ids, planner_config):
        super().__init__(cfg, ps, dataset, tokenizer_ids)
        self.planner_config = planner_config
        self.bounds = None
        self._plans = {}

    def _eval_bounds(self) -> np.ndarray:
        if self.bounds is None:
            iters = self.cfg.training.eval_iters
            try:
                self.bounds = global_batch_bounds(self.cfg, self.lengths, 0, iters)
            except RuntimeError:
                raise RuntimeError(
                    f"the validation split has {len(self.lengths)} pairs: not enough for --eval-iters {iters} "
                    f"global batches of --tokens-per-global-batch {self.cfg.data.tokens_per_global_batch}; lower "
                    "--eval-iters or give validation more of --split") from None
        return self.bounds

    def next(self, iteration: int, consumed_samples: int) -> IterationWork:
        bounds = self._eval_bounds()
        k = int(np.searchsorted(bounds, consumed_samples))
        if k >= len(bounds) - 1 or bounds[k] != consumed_samples:
            raise RuntimeError(f"evaluation asked for a batch at validation sample {consumed_samples}, which does "
                               f"not start one of the {len(bounds) - 1} laid-out batches")
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        plan = self._plans.get(k)
        if plan is None:
            from megatron.planner.service.worker import planner_for, strip
            plan = strip(planner_for(self.planner_config).plan(self.lengths[lo:hi].tolist(), iteration=iteration,
                                                               validate=k == 0))
            self._plans[k] = plan
        group = self.my_group(plan, iteration)
        mbs = self.microbatches(lo, group)
        info = {"planner": "dynapipe", "num_microbatches": [len(g.microbatches) for g in plan.groups],
                "padding_efficiency": plan.padding_efficiency}
        return IterationWork(mbs, group.plans[self.ps.plan_rank], hi - lo, info)


def supervised_valid_source(cfg: MegatronConfig, ps, dataset, ids: dict):
    """Validation source for multi-task data: DynaPipe-planned batches on --dynapipe runs;
    None otherwise (the baselines do not evaluate on multi-task data), without a validation
    split, or with --eval-iters 0."""
    if not cfg.data.dynapipe or dataset is None or cfg.training.eval_iters <= 0:
        return None
    return DynaPipeEvalSource(cfg, ps, dataset, ids, dynapipe_planner_config(cfg, ps))


class BaselineSource(_SupervisedSource):
    """Fixed micro-batches (--micro-batch-size samples) or packed rows (--pack-dataset) of the same
    token-budget global batches, with a static schedule."""

    def __init__(self, cfg, ps, dataset, tokenizer_ids, planner: FixedBatchPlanner, shapes_fn, pack: bool):
        super().__init__(cfg, ps, dataset, tokenizer_ids)
        self.planner, self.shapes_fn, self.pack = planner, shapes_fn, pack

    def _packed_microbatches(self, lo: int, hi: int) -> List[dict]:
        m, mbs = self.cfg.model, self.cfg.training.micro_batch_size
        if m.model_type == "t5":  # a pair takes its planned (input, target + bos) lengths
            rows = next_fit_rows(self.lengths[lo:hi], (m.encoder_seq_length, m.decoder_seq_length))
        else:  # a sample takes its planned length + 1 tokens (concat_pair's sequence) of a row of seq + 1
            rows = next_fit_rows(self.lengths[lo:hi] + 1, m.seq_length + 1)
        rows = [[lo + i for i in r] for r in rows]
        chunks = [rows[s:s + mbs] for s in range(0, len(rows), mbs)]
        return [self.collate_rows(c) for c in self._mine(chunks)]

    def _mine(self, chunks: list) -> list:
        """This DP rank's micro-batches; with per-stage DP sizes every rank takes every (whole,
        pipeline) micro-batch and `_split` cuts its rows after collating."""
        return chunks if self.ps.stage_layouts else chunks[self.ps.dp_rank::self.ps.dp_size]

    def _split(self, mbs: List[dict]):
        """(this rank's micro-batches, the plans' whole-micro-batch shapes)."""
        if not self.ps.stage_layouts:
            return mbs, [self.shapes_fn(mb) for mb in mbs]
        whole = [self.padded(mb) for mb in mbs]
        return self.stage_rows(whole), [self.shapes_fn(mb) for mb in whole]

    def next(self, iteration: int, consumed_samples: int) -> IterationWork:
        lo, hi = self._batch(iteration, consumed_samples)
        if self.pack:
            mbs = self._packed_microbatches(lo, hi)
        else:
            size = self.cfg.training.micro_batch_size
            chunks = [list(range(s, min(s + size, hi))) for s in range(lo, hi, size)]
            mbs = []
            for c in self._mine(chunks):
                longest = self.lengths[c].max(axis=0)
                b = len(c)
                q = pad_multiple(self.cfg)
                shape = ((b, _round_up(longest, q)),) if self.lengths.ndim == 1 else \
                    ((b, _round_up(longest[0], q)), (b, _round_up(longest[1], q)))
                mbs.append(self.collate(c, shape))
        if not mbs:
            raise RuntimeError(f"iteration {iteration}: data-parallel rank {self.ps.dp_rank} got no micro-batch; "
                               "raise --tokens-per-global-batch or lower --micro-batch-size")
        info = {"planner": "packing" if self.pack else "fixed", "num_microbatches": [len(mbs)],
                "microbatch_shapes": [tuple(mb["tokens" if "tokens" in mb else "text_enc"].shape) for mb in mbs],
                "padding_efficiency": padding_efficiency(mbs)}
        mbs, shapes = self._split(mbs)
        plan = self.planner.plans(iteration, shapes)[self.ps.plan_rank]
        # --terapipe: its planner's line (token slices, planning and predicted time) goes along
        info = {**getattr(self.planner, "info", {}), **info}
        return IterationWork(mbs, plan, hi - lo, info)


def padding_efficiency(mbs: List[dict]) -> float:
    """Real tokens / computed tokens of this rank's micro-batches (encoder + decoder for T5)."""
    computed = sum(int(mb["tokens"].numel()) if "tokens" in mb else
                   int(mb["text_enc"].numel() + mb["text_dec"].numel()) for mb in mbs)
    return sum(mb["num_real_tokens"] for mb in mbs) / max(computed, 1)


def tokenizer_ids(tokenizer) -> dict:
    pad = tokenizer.pad if tokenizer.pad is not None else (tokenizer.eod if tokenizer.eod is not None else 0)
    bos = tokenizer.bos if tokenizer.bos is not None else pad
    eos = tokenizer.eos if tokenizer.eos is not None else (tokenizer.eod if tokenizer.eod is not None else pad)
    return {"pad": int(pad), "bos": int(bos), "eos": int(eos)}


def _bias_dropout_fused(m) -> bool:
    """Whether this run's layers add the row-parallel biases in the fused kernel (the flag, and
    the kernels built for this device): what a deferred W keeps depends on it under SP."""
    if not m.bias_dropout_fusion:
        return False
    from megatron.fused_kernels.ops import use_fused
    return use_fused(torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu"))


def dynapipe_planner_config(cfg: MegatronConfig, ps):
    from megatron.planner.dynapipe.planner import DynaPipeConfig
    m, d = cfg.model, cfg.data
    ep = m.moe.expert_model_parallel_size if m.moe is not None else 1
    hetero = bool(ps.stage_layouts)  # one pipeline whose stages have their own TP/DP sizes
    common = dict(cost_model_path=d.dynapipe_cost_model, hidden_size=m.hidden_size,
                  pipeline_parallel=ps.pp_size, data_parallel=1 if hetero else ps.dp_size,
                  tensor_parallel=cfg.parallel.tensor_model_parallel_size if hetero else ps.tp_size,
                  stage_parallel=tuple(tuple(x) for x in ps.stage_layouts) if hetero else None,
                  # explicit stage layer counts (--pipeline-stage-layers, an Aceso layout): priced per stage
                  stage_layer_counts=tuple(cfg.parallel.pipeline_stage_layers
                                           or [m.num_layers // ps.pp_size] * ps.pp_size)
                  if hetero or cfg.parallel.pipeline_stage_layers else None,
                  memory_limit_mb=d.dynapipe_memory_limit, pad_multiple=pad_multiple(cfg),
                  dtype=cfg.training.params_dtype_name,
                  # What this trainer holds: fp32 weights and gradients (autocast computes in 16 bits),
                  # Adam's two fp32 moments, and with --use-distributed-optimizer an fp32 copy of the
                  # rank's shard; only the optimizer state is sharded over DP, and only with the flag.
                  weight_grad_bytes_per_param=8.0,
                  optimizer_bytes_per_param=12.0 if cfg.training.use_distributed_optimizer else 8.0,
                  zero_shards=ps.dp_size * ps.cp_size if cfg.training.use_distributed_optimizer else 1,
                  # The simulator then times compressed gradient messages at their real size.
                  grad_compress_rank=cfg.compression.inter_grad_comp_rank if cfg.compression.inter_grad_comp else 0,
                  grad_compress_epilogue_only=cfg.compression.inter_grad_comp_epilogue_only,
                  sequence_parallel=m.sequence_parallel, num_attention_heads=m.num_attention_heads,
                  bias_dropout_fused=_bias_dropout_fused(m),
                  packed_rows=d.dynapipe_packed_rows,
                  # a static CP group per DP rank: each rank sends S/CP tokens across stage
                  # boundaries (priced as CP x the bandwidth, as cp_cost.cp_planner_config does)
                  context_parallel=ps.cp_size, cp_comm_type=cfg.parallel.cp_comm_type,
                  cp_sizes=tuple(d.dynapipe_cp_sizes),
                  bandwidth_gbps=DynaPipeConfig.bandwidth_gbps * ps.cp_size,
                  # --recompute-granularity with --dynapipe: plan only that level, never drop it
                  **({"recompute_levels": (cfg.training.recompute_granularity,)}
                     if cfg.training.recompute_granularity else {}),
                  # --terapipe: cut micro-batches into token slices (-1: the planner decides)
                  token_slices=(-1 if cfg.terapipe.slices.strip() == "auto" else int(cfg.terapipe.slices))
                  if cfg.terapipe.enabled else 0,
                  # --pipeline-schedule zb-h1/zb-h2: DynaPipe may split backwards and place the
                  # weight-gradient passes into its bubbles (megatron/planner/schedule/zb_search.py)
                  schedules=("1f1b",) if ep > 1 else ("1f1b", "adaptive")
                  + (("zb",) if cfg.parallel.pipeline_schedule in SPLIT_SCHEDULES else ()),
                  # expert parallelism: the EP ranks (DP groups) run equal counts of 1F1B passes in lockstep
                  lockstep_groups=ep > 1,
                  # --num-experts: the table's layers priced as MoE layers (planner/cost/moe_cost.py)
                  moe=moe_pricing(m, cfg.training))
    if d.dynapipe_packed_rows:  # rows as long as the fixed batches' sequences (T5: both sides)
        common.update(packed_max_len=m.seq_length if m.model_type == "gpt" else m.encoder_seq_length,
                      packed_dec_len=None if m.model_type == "gpt" else m.decoder_seq_length)
    if m.model_type == "gpt":
        nv = cfg.parallel.num_layers_per_virtual_pipeline_stage  # interleaved: v chunks per rank
        return DynaPipeConfig(model_kind="gpt", num_layers=m.num_layers,
                              virtual_stages=m.num_layers // (ps.pp_size * nv) if nv else 1, **common)
    return DynaPipeConfig(model_kind="t5", num_layers=m.num_layers, encoder_layers=m.encoder_num_layers,
                          decoder_layers=m.decoder_num_layers, decoder_extra_tokens=0, **common)


def moe_pricing(m, t):
    """The MoE layers' pricing for the planner (None for a dense model); load-blind (skew 1)."""
    if m.moe is None:
        return None
    from megatron.planner.cost.moe_cost import MoEPricing
    return MoEPricing.from_config(m.moe, m.num_layers, gated=m.gated_mlp,
                                  activation_bytes=2 if t.fp16 or t.bf16 else 4)
