"""Pipeline schedules on CPU: measured iteration time and activation memory of 1F1B vs GPipe
(and interleaved 1F1B where valid) at PP=2 and PP=4, next to the analytic bubble model.

How to run (from the repository root; about 2-3 minutes on 2 cores with the defaults):

    python benchmarks/bench_pipeline.py                      # PP=2 and PP=4, all schedules
    python benchmarks/bench_pipeline.py --pp 2 --schedules 1f1b gpipe --iters 3

Every pipeline rank is its own process (forked, gloo on 127.0.0.1, one intra-op thread), TP=DP=1,
mock GPT data. The parent process never computes, so forking is safe. Each configuration runs
`--warmup` untimed iterations (the last of them with saved-tensor hooks, for memory), then
`--iters` timed ones without hooks, so the memory instrumentation never slows the timing.

Output: one JSON object per configuration (`"benchmark": "pipeline_schedule"`), then one per PP
(`"benchmark": "pipeline_schedule_summary"`). Fields of a configuration line:

  schedule, pp, vpp_chunks   schedule name as `megatron.planner.schedule.static` spells it; model chunks per rank
  cores                      CPU cores this process may use (os.sched_getaffinity)
  ranks_per_core, oversubscribed
                             pp / cores; true when ranks share cores (PP=4 on 2 cores): then the
                             ranks time-slice, the steady state runs at about cores/pp of a core
                             per rank and measured/analytic is not a pure schedule effect
  hidden, heads, layers, seq, vocab, micro_batch_size, microbatches, warmup, iters   the workload
  iter_ms_median             median over timed iterations of the slowest rank's whole train_step
                             (pipeline + embedding-grad all-reduce + optimizer step)
  pipeline_ms_median         same for the executor's run of the plan alone (what the analytic model covers)
  t_f_ms, t_b_ms             forward / backward time of one micro-batch on the slowest rank (all of
                             its model chunks), median over the timed iterations' micro-batches, timed
                             inside the same pipeline run around the executor's ForwardPass /
                             BackwardPass handlers (so they include core sharing when oversubscribed)
  t_f_ms_per_rank, t_b_ms_per_rank   the same per pipeline rank (first stage has the embedding,
                             last the output layer and loss, so they differ)
  analytic_ms                `analytic_bubble(schedule, pp, m, t_f, t_b, v)`: (m + (pp-1)/v)(t_f+t_b)
  measured_over_analytic     pipeline_ms_median / analytic_ms (1.0 = schedule behaves as modelled;
                             above 1 = communication, imbalance and scheduling overhead)
  ideal_ms                   m (t_f + t_b): no bubble at all
  analytic_bubble_fraction   (pp-1) / (v m)
  measured_bubble_fraction   pipeline_ms_median / ideal_ms - 1
  compute_ms_per_rank        per rank, median over timed iterations of the time in ForwardPass +
                             BackwardPass handlers (per iteration, summed)
  comm_wait_ms_per_rank      the same for the *Finish handlers: time blocked on a peer (bubbles and
                             transfers show up here)
  other_instr_ms_per_rank    the same for the remaining instructions (LoadInput, FreeBuffer, *Start)
  peak_live_records_per_rank forwards whose backward has not run yet, at their peak
                             (`ExecutionStats.peak_live_records`): micro-batches in flight
  expected_inflight_per_rank the peak the schedule's compute order implies (counted from
                             `static_orders`, virtual micro-batches for interleaved)
  inflight_ok                every rank's peak equals the expected one
  one_f_one_b_bound_ok       (1f1b lines) every rank r holds at most PP - r micro-batches
  gpipe_holds_all_ok         (gpipe lines) every rank holds all m micro-batches at its peak
  peak_saved_activation_bytes_per_rank
                             peak bytes of tensors autograd saved for backward (unique storages,
                             parameters excluded), from torch.autograd.graph.saved_tensors_hooks
                             installed around the executor's run of one warm-up iteration
  saved_bytes_per_inflight_microbatch_per_rank   peak bytes / peak live records

Summary line per PP: speedup_1f1b_over_gpipe (GPipe pipeline time / 1F1B pipeline time),
saved_bytes_ratio_gpipe_over_1f1b_per_rank (memory 1F1B saves, about m / (PP - r)),
one_f_one_b_bound_ok, gpipe_holds_all_ok.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from datetime import timedelta

if __name__ == "__main__":  # before torch is imported: one thread per rank (not when imported by tests)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.launch import run_ranks  # noqa: E402
from megatron.planner.schedule.static import analytic_bubble, static_orders  # noqa: E402

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved")


# -- measurement helpers (rank side) -----------------------------------------------------------
class SavedActivationMeter:
    """Live and peak bytes of tensors autograd saves for backward, counted once per storage.

    The pack hook keeps the tensor in a holder (exactly what autograd would keep anyway); when
    autograd frees the saved variable (after the backward that used it) the holder dies and a
    finalizer drops its storage's reference, so `live` follows what is really held."""

    def __init__(self, exclude_storages=()):
        self.exclude = set(exclude_storages)
        self.refs: dict = {}  # storage data_ptr -> [nbytes, number of live holders]
        self.live = 0
        self.peak = 0

    class _Holder:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, t):
            self.tensor = t

    def _release(self, key):
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[key]

    def pack(self, t):
        holder = self._Holder(t)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return holder
        entry = self.refs.get(key)
        if entry is None:
            self.refs[key] = entry = [storage.nbytes(), 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def unpack(holder):
        return holder.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _instrument(trainer, state):
    """Wrap the executor (this benchmark's trainer only) to time run / forward / backward and to
    install the saved-tensor hooks when `state["meter"]` is set. Handlers are looked up as
    `self._HANDLERS[type(ins)]`, so an instance-level copy of the table overrides them."""
    from megatron.pipeline import instructions as I
    ex = trainer.executor
    handlers = dict(type(ex)._HANDLERS)

    def timed(fn, kind):
        def wrapper(self, ins):
            t0 = time.perf_counter()
            fn(self, ins)
            state["compute"].append((kind, ins.microbatch, ins.stage, time.perf_counter() - t0))
        return wrapper

    for ins_type, fn in list(handlers.items()):
        kind = ("F" if ins_type is I.ForwardPass else "B" if ins_type is I.BackwardPass
                else "wait" if ins_type.__name__.endswith("Finish") else "other")
        handlers[ins_type] = timed(fn, kind)
    ex._HANDLERS = handlers
    run = ex.run

    def run_wrapper(*args, **kwargs):
        meter = state.get("meter")
        t0 = time.perf_counter()
        if meter is not None:
            with meter.hooks():
                stats = run(*args, **kwargs)
        else:
            stats = run(*args, **kwargs)
        state["run_s"] = time.perf_counter() - t0
        state["stats"] = stats
        return stats

    ex.run = run_wrapper


def _per_microbatch_times(records, kind):
    """Median over micro-batches of the per-micro-batch sum over this rank's chunks."""
    per_mb: dict = {}
    for k, it_mb, _stage, dt in records:
        if k == kind:
            per_mb[it_mb] = per_mb.get(it_mb, 0.0) + dt
    return statistics.median(per_mb.values())


def _rank_main(rank, world, cfg, warmup, iters, timeout_s):
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.pretrain import build_gpt_trainer
    ps = initialize_model_parallel(1, world, timedelta(seconds=timeout_s))
    device = torch.device("cpu")
    set_seeds(cfg.training.seed, ps, device)
    trainer = build_gpt_trainer(cfg, ps, device)
    for m in trainer.modules:
        m.train()
    params = {p.untyped_storage().data_ptr() for m in trainer.modules for p in m.parameters()}
    state = {"compute": []}
    _instrument(trainer, state)
    peak_records, meter = 0, None
    iter_s, run_s, compute = [], [], []
    for it in range(warmup + iters):
        if it == warmup - 1:
            meter = state["meter"] = SavedActivationMeter(params)
        state["compute"] = []
        dist.barrier()  # all ranks start the iteration together
        t0 = time.perf_counter()
        trainer.train_step()
        dt = time.perf_counter() - t0
        state.pop("meter", None)
        peak_records = max(peak_records, state["stats"].peak_live_records)
        if it >= warmup:
            iter_s.append(dt)
            run_s.append(state["run_s"])
            compute += [(k, (it, mb), s, t) for k, mb, s, t in state["compute"]]

    def per_iter_total(kinds):  # median over timed iterations of the summed handler time
        totals = [sum(t for k, (i, _), _s, t in compute if k in kinds and i == it)
                  for it in range(warmup, warmup + iters)]
        return statistics.median(totals)

    return {"rank": rank, "iter_s": iter_s, "run_s": run_s,
            "compute_s": per_iter_total(("F", "B")), "wait_s": per_iter_total(("wait",)),
            "other_s": per_iter_total(("other",)),
            "t_f": _per_microbatch_times(compute, "F"), "t_b": _per_microbatch_times(compute, "B"),
            "peak_live_records": peak_records,
            "peak_saved_bytes": meter.peak if meter is not None else 0}


# -- parent side -------------------------------------------------------------------------------
def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def expected_inflight(schedule: str, pp: int, m: int, v: int) -> list:
    """Peak number of forwards without their backward, per rank, from the compute order."""
    orders, _ = static_orders(schedule, m, pp, v)
    peaks = []
    for order in orders:
        live = peak = 0
        for op in order:
            live += 1 if op.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def interleaved_chunks(layers: int, pp: int, m: int):
    """(v, layers per virtual stage) for a 2-chunk interleaved run, or None with the reason."""
    per_rank = layers // pp
    if layers % pp or per_rank % 2:
        return None, f"--layers {layers} does not give each of {pp} ranks an even number of layers"
    if m % pp:
        return None, f"{m} micro-batches are not a multiple of PP={pp}"
    return 2, per_rank // 2


def gpt_config(pp, schedule, vpp_layers, *, hidden, heads, layers, seq, vocab, micro_batch_size,
               num_microbatches, train_iters):
    from megatron.config.core import (DataConfig, LoggingConfig, MegatronConfig, ModelConfig, ParallelConfig,
                                 TrainingConfig)
    return MegatronConfig(
        model=ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                          vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(world_size=pp, pipeline_model_parallel_size=pp,
                                num_layers_per_virtual_pipeline_stage=vpp_layers,
                                pipeline_schedule="1f1b" if schedule == "interleaved" else schedule),
        training=TrainingConfig(micro_batch_size=micro_batch_size,
                                global_batch_size=micro_batch_size * num_microbatches,
                                train_iters=train_iters, lr=1e-4, lr_warmup_iters=0, seed=1234,
                                eval_interval=10 ** 9),
        data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=10 ** 9))


def run_benchmark(schedule: str, pp: int, *, hidden=256, heads=8, layers=8, seq=128, vocab=1024,
                  micro_batch_size=2, num_microbatches=8, warmup=2, iters=5, timeout_s=600.0) -> dict:
    """Measure one (schedule, PP) configuration; returns the JSON-ready result line."""
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule must be one of {SCHEDULE_NAMES}, got {schedule!r}")
    if warmup < 1 or iters < 1:
        raise ValueError(f"need --warmup >= 1 (memory is measured there) and --iters >= 1, got {warmup}, {iters}")
    v, vpp_layers = 1, None
    if schedule == "interleaved":
        v, detail = interleaved_chunks(layers, pp, num_microbatches)
        if v is None:
            raise ValueError(f"interleaved schedule not valid here: {detail}")
        vpp_layers = detail
    m = num_microbatches
    cfg = gpt_config(pp, schedule, vpp_layers, hidden=hidden, heads=heads, layers=layers, seq=seq, vocab=vocab,
                     micro_batch_size=micro_batch_size, num_microbatches=m, train_iters=warmup + iters)
    ranks = run_ranks(_rank_main, pp, cfg, warmup, iters, timeout_s, timeout_s=timeout_s,
                      what="pipeline benchmark")

    # An iteration ends when its slowest rank does: per-iteration max over ranks, then median.
    iter_ms = statistics.median(max(r["iter_s"][i] for r in ranks) for i in range(iters)) * 1e3
    pipe_ms = statistics.median(max(r["run_s"][i] for r in ranks) for i in range(iters)) * 1e3
    t_f = [r["t_f"] * 1e3 for r in ranks]
    t_b = [r["t_b"] * 1e3 for r in ranks]
    slow = max(range(pp), key=lambda i: t_f[i] + t_b[i])  # the bottleneck rank sets the pace
    analytic = analytic_bubble(schedule, pp, m, t_f[slow], t_b[slow], v)  # ms in, ms out
    ideal = m * (t_f[slow] + t_b[slow])
    peaks = [r["peak_live_records"] for r in ranks]
    expected = expected_inflight(schedule, pp, m, v)
    saved = [r["peak_saved_bytes"] for r in ranks]
    cores = available_cores()
    line = {
        "benchmark": "pipeline_schedule", "device": "cpu", "schedule": schedule, "pp": pp, "vpp_chunks": v,
        "cores": cores, "ranks_per_core": round(pp / cores, 2), "oversubscribed": pp > cores,
        "hidden": hidden, "heads": heads, "layers": layers, "seq": seq, "vocab": vocab,
        "micro_batch_size": micro_batch_size, "microbatches": m, "warmup": warmup, "iters": iters,
        "iter_ms_median": round(iter_ms, 2), "pipeline_ms_median": round(pipe_ms, 2),
        "t_f_ms": round(t_f[slow], 3), "t_b_ms": round(t_b[slow], 3),
        "t_f_ms_per_rank": [round(x, 3) for x in t_f], "t_b_ms_per_rank": [round(x, 3) for x in t_b],
        "analytic_ms": round(analytic, 2), "measured_over_analytic": round(pipe_ms / analytic, 4),
        "ideal_ms": round(ideal, 2), "analytic_bubble_fraction": round((pp - 1) / (v * m), 4),
        "measured_bubble_fraction": round(pipe_ms / ideal - 1, 4),
        "compute_ms_per_rank": [round(r["compute_s"] * 1e3, 1) for r in ranks],
        "comm_wait_ms_per_rank": [round(r["wait_s"] * 1e3, 1) for r in ranks],
        "other_instr_ms_per_rank": [round(r["other_s"] * 1e3, 1) for r in ranks],
        "peak_live_records_per_rank": peaks, "expected_inflight_per_rank": expected,
        "inflight_ok": peaks == expected,
        "peak_saved_activation_bytes_per_rank": saved,
        "saved_bytes_per_inflight_microbatch_per_rank": [s // p if p else 0 for s, p in zip(saved, peaks)],
    }
    if schedule == "1f1b":
        line["one_f_one_b_bound_ok"] = all(peaks[r] <= pp - r for r in range(pp))
    elif schedule == "gpipe":
        line["gpipe_holds_all_ok"] = all(p == m for p in peaks)
    return line


def summarize(lines: list) -> list:
    """One summary per PP comparing its 1F1B and GPipe lines."""
    out = []
    for pp in sorted({ln["pp"] for ln in lines}):
        by = {ln["schedule"]: ln for ln in lines if ln["pp"] == pp}
        if "1f1b" not in by or "gpipe" not in by:
            continue
        a, g = by["1f1b"], by["gpipe"]
        out.append({
            "benchmark": "pipeline_schedule_summary", "pp": pp, "cores": a["cores"],
            "oversubscribed": a["oversubscribed"],
            "speedup_1f1b_over_gpipe": round(g["pipeline_ms_median"] / a["pipeline_ms_median"], 4),
            "speedup_interleaved_over_1f1b": (round(a["pipeline_ms_median"] / by["interleaved"]["pipeline_ms_median"], 4)
                                              if "interleaved" in by else None),
            "saved_bytes_ratio_gpipe_over_1f1b_per_rank": [
                round(x / y, 3) if y else None for x, y in zip(g["peak_saved_activation_bytes_per_rank"],
                                                               a["peak_saved_activation_bytes_per_rank"])],
            "one_f_one_b_bound_ok": a["one_f_one_b_bound_ok"], "gpipe_holds_all_ok": g["gpipe_holds_all_ok"],
        })
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULE_NAMES), choices=SCHEDULE_NAMES)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    a = p.parse_args(argv)
    lines = []
    for pp in a.pp:
        for schedule in a.schedules:
            if schedule == "interleaved":
                v, why = interleaved_chunks(a.layers, pp, a.microbatches)
                if v is None:
                    print(f"skipping interleaved at PP={pp}: {why}", file=sys.stderr, flush=True)
                    continue
            line = run_benchmark(schedule, pp, hidden=a.hidden, heads=a.heads, layers=a.layers, seq=a.seq,
                                 vocab=a.vocab, micro_batch_size=a.micro_batch_size,
                                 num_microbatches=a.microbatches, warmup=a.warmup, iters=a.iters,
                                 timeout_s=a.timeout)
            print(json.dumps(line), flush=True)
            lines.append(line)
    for s in summarize(lines):
        print(json.dumps(s), flush=True)
    ok = all(ln.get("one_f_one_b_bound_ok", True) and ln.get("gpipe_holds_all_ok", True) and ln["inflight_ok"]
             for ln in lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
