"""Megatron-style progress lines, model-FLOPs accounting and TensorBoard scalars."""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import Optional

import torch.distributed as dist

from megatron.config.core import MegatronConfig, ModelConfig
from megatron.core.parallel_state import ParallelState


def is_rank_last(ps: ParallelState) -> bool:
    return ps.rank == ps.world_size - 1


def print_rank_last(ps: ParallelState, msg: str) -> None:
    if is_rank_last(ps):
        print(msg, flush=True)


def print_rank_0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def gpt_flops_per_sample(m: ModelConfig, padded_vocab: int, seq_len: Optional[int] = None) -> float:
    """Model FLOPs (forward + backward, no recomputation) of one sample: Megatron's formula.

    Per token and layer the forward does 2*(3 h p) QKV, 2*2 s p attention, 2 p h projection and
    2*2 h f MLP multiply-adds; backward is twice the forward. With p = h and f = 4h this is
    72 B s L h^2 (1 + s/6h + V/12Lh) per batch."""
    s = seq_len or m.seq_length
    h, p, f = m.hidden_size, m.projection_size, m.ffn_hidden_size
    mlp_gemms = 3 if getattr(m, "gated_mlp", False) else 2  # a gated MLP (SwiGLU, GLU) adds the gate projection
    kv = 2 * getattr(m, "query_groups", m.num_attention_heads) * m.kv_channels  # GQA shrinks K and V
    per_token_layer = 3 * (2 * h * (p + kv) + 4 * s * p + 2 * p * h + 2 * mlp_gemms * h * f)
    return s * (m.num_layers * per_token_layer + 3 * 2 * h * padded_vocab)


def comm_bytes_line(b: dict) -> str:
    """Payload bytes of the last iteration, summed over all ranks, with what they would have
    been uncompressed (Optimus-CC's mechanisms)."""
    mb = 1e6

    def ratio(raw, sent):
        return f"{raw / sent:.1f}x" if sent else "-"

    return (f" communication (all ranks, this iteration) | pipeline activations: {b['pp_act'] / mb:.3f} MB | "
            f"pipeline gradients: {b['pp_grad'] / mb:.3f} MB (uncompressed {b['pp_grad_raw'] / mb:.3f} MB, "
            f"{ratio(b['pp_grad_raw'], b['pp_grad'])}) | data-parallel: {b['dp'] / mb:.3f} MB (uncompressed "
            f"{b['dp_raw'] / mb:.3f} MB, {ratio(b['dp_raw'], b['dp'])}) | embedding sync: {b['emb'] / mb:.3f} MB |")


def planner_line(info: dict, measured_s: float) -> str:
    """Per-iteration planner report (last iteration of the window): micro-batches, padding,
    planning time, simulated vs measured time, predicted peak activation memory."""
    shapes = info.get("microbatch_shapes", [])
    shown = ", ".join("x".join(str(d) for d in (s if isinstance(s[0], int) else (s[0][0], s[0][1], s[1][1])))
                      for s in shapes[:8]) + (" ..." if len(shapes) > 8 else "")
    parts = [f" planner: {info.get('planner')}", f"micro-batches per DP group: {info.get('num_microbatches')}",
             f"shapes (b x s): {shown}"]
    if "slices" in info:
        parts.append(f"token slices: {info['slices']}")
    if info.get("cp_size_counts"):  # --dynapipe-cp-sizes: micro-batches run at each CP size
        parts.append("micro-batches per CP size: " + ", ".join(f"{c}:{n}" for c, n in info["cp_size_counts"].items()))
    if "padding_efficiency" in info:
        parts.append(f"padding efficiency: {info['padding_efficiency']:.3f}")
    if "recompute" in info:
        parts.append(f"recompute: {info['recompute']} | schedule: {info.get('schedule')}")
    if "planning_ms" in info:
        parts.append(f"planning ms: {info['planning_ms']:.1f} (waited {info.get('plan_wait_ms', 0.0):.1f})")
    if "simulated_ms" in info:
        parts.append(f"simulated / measured iteration ms: {info['simulated_ms']:.1f} / {measured_s * 1e3:.1f}")
    if "predicted_peak_mb" in info:
        peaks = ", ".join(f"{x:.1f}" for x in info["predicted_peak_mb"])
        parts.append(f"predicted peak activation MB per stage: [{peaks}]")
        measured = info.get("measured_peak_mb")
        parts.append("measured peak activation MB (this stage): "
                     + (f"{measured:.1f}" if measured is not None else "n/a on CPU"))
    return " | ".join(parts) + " |"


def _busy_host() -> str:
    """A note when the 1-minute load average exceeds the cores (other jobs slow every step)."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return ""
    return (f"but the host is busy (load average {load:.1f} on {cores} cores), so the measured time is not only "
            "this job's: judge the cost model on an idle host") if load > cores else ""


class MetricsLogger:
    def __init__(self, cfg: MegatronConfig, ps: ParallelState, flops_per_sample: float):
        self.cfg, self.ps = cfg, ps
        self.flops_per_sample = flops_per_sample
        self.active = is_rank_last(ps)
        self.writer = None
        self.consumed_tokens = 0
        self._skipped_before_window = 0
        self._printed_any = False
        self._drift_warned = False
        self._drift = []  # measured / simulated iteration time, one per planned iteration after the first
        if self.active and cfg.logging.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("warning: --tensorboard-dir given but tensorboard is not installed "
                      "(pip install tensorboard); scalars are not written", file=sys.stderr)
            else:
                self.writer = SummaryWriter(log_dir=cfg.logging.tensorboard_dir, max_queue=100)
        from megatron.config.extras import extras_of
        from megatron.training.extras import WandbWriter
        self.extras = extras_of(cfg)
        self.wandb = WandbWriter(self.extras, cfg.to_dict()) if self.active else None
        self._reset()

    def _reset(self):
        self.n = 0
        self.loss_sum = 0.0
        self.time_s = 0.0
        self.tokens = 0.0
        self.nan_iters = 0
        self.window_start = time.perf_counter()

    def record(self, iteration: int, consumed: int, out: dict, lr: float, loss_scale: float,
               skipped_total: int) -> None:
        self.consumed_tokens = int(out.get("consumed_tokens",
                                           self.consumed_tokens + out.get("real_tokens", out["tokens"])))
        if not self.active:
            return
        loss = out["loss"]
        if math.isfinite(loss):
            self.loss_sum += loss
            self.n += 1
        else:
            self.nan_iters += 1
        self.time_s += out["time_s"]
        self.tokens += out.get("real_tokens", out["tokens"])
        sim = (out.get("planner") or {}).get("simulated_ms")
        if sim and iteration > 1:  # the first iteration pays one-time set-up the model does not price
            self._drift.append(out["time_s"] * 1e3 / sim)
        scalars = {"lm loss": loss, "learning-rate": lr, "grad-norm": out["grad_norm"], "loss-scale": loss_scale,
                   "params-norm": out.get("params_norm"), "num-zeros": out.get("num_zeros")}
        if iteration % self.extras.tensorboard_log_interval == 0:
            if self.writer is not None:
                for key, value in scalars.items():
                    if value is not None:
                        self.writer.add_scalar(key, value, iteration)
            if self.wandb is not None:
                self.wandb.log(scalars, iteration)
        first = not self._printed_any  # the first iteration of a run always prints, so a run shows life early
        if iteration % self.cfg.logging.log_interval != 0 and not first:
            return
        self._printed_any = True
        iters = max(self.n + self.nan_iters, 1)
        ms = 1000.0 * self.time_s / iters
        tokens_per_s = self.tokens / max(self.time_s, 1e-9)
        gbs = out.get("num_samples") or self.cfg.training.global_batch_size
        tflops = self.flops_per_sample * gbs / max(self.time_s / iters, 1e-9) / self.ps.world_size / 1e12
        gn = out["grad_norm"]
        # Megatron prints skipped iterations per log interval, not since the start.
        skipped = skipped_total - self._skipped_before_window
        self._skipped_before_window = skipped_total
        avg = self.loss_sum / self.n if self.n else float("nan")
        line = (f" iteration {iteration:8d}/{self.cfg.training.train_iters:8d} | consumed samples: {consumed:12d} | "
                f"consumed tokens: {int(self.consumed_tokens):14d} | "
                f"elapsed time per iteration (ms): {ms:.1f} | tokens/s: {tokens_per_s:.1f} | "
                f"TFLOP/s/device: {tflops:.3f} | learning rate: {lr:.6E} | global batch size: {gbs:5d} | "
                f"lm loss: {avg:.6E} | "
                f"loss scale: {loss_scale:.1f} | grad norm: {'skipped' if gn is None else f'{gn:.3f}'} | "
                + (f"num zeros: {out['num_zeros']} | " if out.get("num_zeros") is not None else "")
                + (f"params norm: {out['params_norm']:.3f} | " if out.get("params_norm") is not None else "") +
                f"number of skipped iterations: {skipped:3d} | number of nan iterations: {self.nan_iters:3d} |")
        print(line, flush=True)
        if out.get("comm_bytes"):
            print(comm_bytes_line(out["comm_bytes"]), flush=True)
        info = out.get("planner") or {}
        if info:
            print(planner_line(info, out["time_s"]), flush=True)
            # Judged on the median of the iterations so far (3 at least): one iteration slowed by
            # another process on the host is not the cost model's fault.
            if not self._drift_warned and len(self._drift) >= 3:
                ratio = statistics.median(self._drift)
                if ratio > 3.0 or ratio < 1 / 3.0:
                    self._drift_warned = True
                    # TeraPipe plans from its own latency model, DynaPipe from the per-layer cost model.
                    # A table that describes the layers but not the host (ranks sharing cores, per-op
                    # overheads) is fixed by calibrating it (planner/calibration.py).
                    tool = ("python -m megatron.planner.terapipe.latency --output FILE, then python -m "
                            "megatron.profiling.calibrate --terapipe-cost-model FILE -- <model flags>, then "
                            "--terapipe-cost-model FILE" if info.get("planner") == "terapipe"
                            else "experiment_scripts/gen_cost_model.sh, which also calibrates it on CPU")
                    busy = _busy_host()
                    print(f"WARNING: measured iteration time is {ratio:.1f}x the planner's simulated time (median of "
                          f"{len(self._drift)} iterations); the cost "
                          "model does not describe this model or device, so plans (and memory) are unreliable: "
                          f"profile it here ({tool})" + (f"; {busy}" if busy else ""), file=sys.stderr, flush=True)
        if self.writer is not None:
            for key in ("padding_efficiency", "planning_ms", "simulated_ms"):
                if key in info:
                    self.writer.add_scalar(f"planner/{key}", info[key], iteration)
            self.writer.add_scalar("iteration-time", ms / 1000.0, iteration)
            self.writer.add_scalar("throughput/tokens-per-second", tokens_per_s, iteration)
            self.writer.add_scalar("throughput/tflops-per-device", tflops, iteration)
            what, peaks = out.get("stage_memory") or ("", [])
            for k, mb in enumerate(peaks):  # megatron/training/stage_memory.py
                self.writer.add_scalar(f"memory/stage{k}_{what}", mb, iteration)
            self.writer.flush()
        self._reset()

    def state_dict(self) -> dict:
        return {"consumed_tokens": self.consumed_tokens, "skipped_before_window": self._skipped_before_window}

    def load_state_dict(self, sd: dict) -> None:
        self.consumed_tokens = int(sd.get("consumed_tokens", 0))
        self._skipped_before_window = int(sd.get("skipped_before_window", 0))

    def log_validation(self, iteration: int, loss: Optional[float]) -> None:
        if not self.active or loss is None:
            return
        ppl = math.exp(min(20.0, loss))
        print(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |",
              flush=True)
        if self.writer is not None:
            self.writer.add_scalar("lm loss validation", loss, iteration)
            self.writer.flush()
