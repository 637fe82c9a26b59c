"""One-device training step: our trainer (planner + executor) against plain PyTorch, and packed
against unpacked rows. One JSON line per row.

    python benchmarks/bench_gpu.py [--models gpt,llama] [--steps 10] [--micro-batch-size 8]

On CUDA the models are GPT-1.3B (24 layers, hidden 2048, 16 heads, sequence 2048, vocab 50257)
and the same size Llama-like (RoPE, RMSNorm, SwiGLU with ffn 5632, GQA with 4 key/value heads,
no biases), in bf16 (fp32 parameters, autocast; the plain model does the same). Without CUDA
a scaled-down model runs instead and every row says so (`scaled_down: true`); CI runs that form.

Rows:
* `step` (per model): ours vs the plain PyTorch model of benchmarks/plain_gpt.py (SDPA, fused
  AdamW on CUDA, no planner / executor) on the same micro-batches, steps alternating. Model
  TFLOP/s use `gpt_flops_per_sample`, the formula the trainer logs; MFU divides by the device's
  dense bf16 peak from PEAK_TFLOPS (the peak used is printed; unknown devices give null unless
  --peak-tflops is given). On CUDA the micro-batch size is the largest of --micro-batch-size,
  /2, /4, ... whose first steps fit in memory on both sides.
* `precision` (per model, plain model only): fp32 parameters with autocast (this project's
  --bf16) against Megatron's bf16 parameters with fp32 main gradients and parameters: step
  time and bytes of parameters, gradients and optimizer state (the decision in the README).
* `packed` (per model): our step on rows packed from the shipped multi-task lengths
  (block-diagonal attention over `segment_ids`) against full rows of one sequence each, in
  real (non-padding) tokens per second.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.plain_gpt import PlainGPT  # noqa: E402
from megatron.training.batching import gpt_microbatch  # noqa: E402
from megatron.config.core import (DataConfig, LoggingConfig, MegatronConfig, ModelConfig, ParallelConfig,  # noqa: E402
                             TrainingConfig)
from megatron.core.parallel_state import ParallelState  # noqa: E402
from megatron.training.initialize import set_seeds  # noqa: E402
from megatron.training.pretrain import build_gpt_trainer  # noqa: E402
from megatron.training.trainer import IterationWork  # noqa: E402

# Dense bf16 tensor-core peak, TFLOP/s, matched in order against torch.cuda.get_device_name().
PEAK_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0)]

FULL = dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=50257, mbs=8, gbs_mult=4)
SCALED = dict(layers=2, hidden=128, heads=4, seq=128, vocab=1024, mbs=2, gbs_mult=2)


def peak_tflops(device_name: str):
    for key, peak in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return key, peak
    return None, None


def model_config(model: str, size: dict) -> ModelConfig:
    kw = dict(num_layers=size["layers"], hidden_size=size["hidden"], num_attention_heads=size["heads"],
              seq_length=size["seq"], max_position_embeddings=size["seq"], vocab_size=size["vocab"],
              hidden_dropout=0.0, attention_dropout=0.0)
    if model == "llama":
        ffn = -(-int(8 * size["hidden"] / 3) // 64) * 64 if size["hidden"] < 1024 else \
            -(-int(8 * size["hidden"] / 3) // 256) * 256
        kw.update(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  num_query_groups=max(1, size["heads"] // 4), ffn_hidden_size=ffn)
    return ModelConfig(**kw)


def build_ours(model: str, size: dict, mbs: int, gbs: int, bf16: bool, steps: int, device):
    cfg = MegatronConfig(model=model_config(model, size), parallel=ParallelConfig(),
                         training=TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs, train_iters=steps,
                                                 lr=1e-4, bf16=bf16),
                         data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=10 ** 9))
    ps = ParallelState()
    set_seeds(cfg.training.seed, ps, device)
    return cfg, build_gpt_trainer(cfg, ps, device)


def build_plain(cfg: MegatronConfig, device):
    m = cfg.model
    plain = PlainGPT(m.padded_vocab_size(1), m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.num_layers,
                     m.seq_length, kv_heads=m.num_query_groups, llama=m.swiglu).to(device)
    kw = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.01, **kw)
    return plain, opt


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def state_bytes(params, optimizer) -> int:
    """Parameters, their gradients (one per parameter, in the parameter's dtype) and optimizer state."""
    n = sum(2 * p.numel() * p.element_size() for p in params)
    for st in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return n


class Clock:
    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.device = device

    def run(self, fn):
        """(seconds, peak allocated bytes or None) of fn()."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        return dt, (torch.cuda.max_memory_allocated(self.device) if self.cuda else None)


def step_row(model: str, size: dict, mbs: int, args, device, scaled: bool) -> dict:
    gbs = mbs * size["gbs_mult"]
    total = args.warmup + args.steps
    cfg, ours = build_ours(model, size, mbs, gbs, args.bf16, total, device)
    plain, opt = build_plain(cfg, device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else None
    ds = ours.batch_source.dataset
    n_micro = gbs // mbs

    def plain_step(step):
        base = step * gbs
        mbs_ = [gpt_microbatch([ds[base + k * mbs + j] for j in range(mbs)]) for k in range(n_micro)]
        denom = float(sum(mb["loss_mask"].sum() for mb in mbs_))  # host data: no device sync
        for mb in mbs_:
            t, l, lm = (to_device(mb[k], device) for k in ("tokens", "labels", "loss_mask"))
            if amp is not None:
                with amp:
                    loss = plain(t, l, lm, denom)
            else:
                loss = plain(t, l, lm, denom)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    clock = Clock(device)
    t_ours, t_plain, m_ours, m_plain = [], [], [], []
    for step in range(total):
        a = clock.run(ours.train_step)
        b = clock.run(lambda: plain_step(step))
        if step >= args.warmup:
            t_ours.append(a[0]); m_ours.append(a[1])
            t_plain.append(b[0]); m_plain.append(b[1])
    mo, mp = statistics.median(t_ours), statistics.median(t_plain)
    flops = ours.logger.flops_per_sample * gbs  # what the trainer's TFLOP/s/device uses
    tflops, plain_tflops = flops / mo / 1e12, flops / mp / 1e12
    peak_key, peak = (None, None)
    if device.type == "cuda":
        peak_key, peak = peak_tflops(torch.cuda.get_device_name(device))
        if args.peak_tflops:
            peak_key, peak = "--peak-tflops", args.peak_tflops
    row = {
        "benchmark": "gpu_step", "row": "step", "model": model, "scaled_down": scaled,
        **_device_fields(device), "dtype": "bf16" if args.bf16 else "fp32",
        "layers": size["layers"], "hidden": size["hidden"], "heads": size["heads"], "seq": size["seq"],
        "vocab": size["vocab"], "micro_batch_size": mbs, "global_batch_size": gbs,
        "params": sum(p.numel() for p in ours.optimizer.params),
        "params_plain": sum(p.numel() for p in plain.parameters()),
        "ours_step_s": round(mo, 5), "plain_step_s": round(mp, 5), "ratio": round(mo / mp, 4),
        "tokens_per_s": round(gbs * size["seq"] / mo, 1), "plain_tokens_per_s": round(gbs * size["seq"] / mp, 1),
        "model_tflops": round(tflops, 3), "plain_model_tflops": round(plain_tflops, 3),
        "peak_tflops_used": peak, "peak_tflops_device_key": peak_key,
        "mfu": round(tflops / peak, 4) if peak else None, "plain_mfu": round(plain_tflops / peak, 4) if peak else None,
        "peak_mem_bytes": max(m_ours) if m_ours[0] is not None else None,
        "plain_peak_mem_bytes": max(m_plain) if m_plain[0] is not None else None,
        "state_bytes": state_bytes(ours.optimizer.params, ours.optimizer.optimizer),
        "plain_state_bytes": state_bytes(list(plain.parameters()), opt),
        "steps": args.steps,
    }
    del ours, plain, opt
    return row


class RowsSource:
    """Hands the trainer pre-built micro-batches with plans from its own static planner."""

    def __init__(self, planner, batches):
        self.planner, self.batches = planner, batches

    def next(self, iteration, consumed):
        mbs = self.batches[(iteration - 1) % len(self.batches)]
        plan = self.planner.plans(iteration, [(tuple(mb["tokens"].shape),) for mb in mbs])[0]
        return IterationWork(mbs, plan, sum(int(mb["num_samples"]) for mb in mbs))


def packed_batches(seq: int, vocab: int, rows: int, mbs: int, packed: bool, n: int, seed: int):
    """`n` global batches of micro-batches: packed rows of multi-task samples holding about
    `rows` full rows' tokens, or `rows` full rows of one sequence each."""
    from megatron.data.packing import pack_samples
    from megatron.experiments.lengths import load_lengths
    lengths = load_lengths().sum(axis=1)
    lengths = np.maximum(2, np.round(lengths * seq / lengths.max())).astype(np.int64)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if packed:
            samples, budget = [], rows * seq
            while True:  # sample until the packed rows would exceed `rows`
                L = int(rng.choice(lengths))
                samples.append(rng.integers(1, vocab, size=L))
                if sum(s.size for s in samples) >= budget * 0.97:
                    break
            p = pack_samples(samples, seq)
            while p["tokens"].shape[0] > rows:
                samples.pop()
                p = pack_samples(samples, seq)
            num_samples = len(samples)
        else:
            toks = rng.integers(1, vocab, size=(rows, seq + 1))
            p = {"tokens": toks[:, :-1], "labels": toks[:, 1:], "loss_mask": np.ones((rows, seq), np.float32)}
            num_samples = rows
        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in p.items()}
        batch = []
        for i in range(0, t["tokens"].shape[0], mbs):
            mb = {k: v[i:i + mbs] for k, v in t.items()}
            real = int((mb["segment_ids"] > 0).sum()) if packed else mb["tokens"].numel()
            mb["num_real_tokens"] = real
            mb["num_samples"] = int(mb["segment_ids"].max(dim=1).values.sum()) if packed else mb["tokens"].shape[0]
            batch.append(mb)
        batch[0]["num_samples"] += num_samples - sum(mb["num_samples"] for mb in batch)
        out.append(batch)
    return out


def packed_row(model: str, size: dict, mbs: int, args, device, scaled: bool) -> dict:
    rows = mbs * size["gbs_mult"]
    total = args.warmup + args.steps
    clock = Clock(device)
    res = {}
    for kind in ("unpacked", "packed"):
        cfg, ours = build_ours(model, size, mbs, rows, args.bf16, total, device)
        batches = packed_batches(size["seq"], size["vocab"], rows, mbs, kind == "packed", 3, seed=1)
        ours.batch_source = RowsSource(ours.batch_source.planner, batches)
        times, real, peaks = [], [], []
        for step in range(total):
            dt, peak = clock.run(lambda: real.append(ours.train_step()["real_tokens"]))
            if step >= args.warmup:
                times.append(dt)
                peaks.append(peak)
        med = statistics.median(times)
        res[kind] = {"step_s": round(med, 5), "real_tokens_per_s": round(statistics.median(real) / med, 1),
                     "real_tokens": int(statistics.median(real)), "peak_mem_bytes": peaks[-1]}
        del ours
    return {"benchmark": "gpu_step", "row": "packed", "model": model, "scaled_down": scaled,
            **_device_fields(device), "dtype": "bf16" if args.bf16 else "fp32", "seq": size["seq"],
            "micro_batch_size": mbs, "rows_per_step": rows, "packed": res["packed"], "unpacked": res["unpacked"],
            "ours_step_s": res["packed"]["step_s"], "plain_step_s": None,
            "tokens_per_s": res["packed"]["real_tokens_per_s"], "mfu": None,
            "peak_mem_bytes": res["packed"]["peak_mem_bytes"],
            "packed_over_unpacked": round(res["packed"]["real_tokens_per_s"] / res["unpacked"]["real_tokens_per_s"], 4),
            "target": 0.9, "steps": args.steps}


def precision_row(model: str, size: dict, mbs: int, args, device, scaled: bool) -> dict:
    """The two mixed-precision designs on the plain model, bf16 compute in both: today's (fp32
    parameters and gradients, autocast casts weights per micro-batch) and Megatron's (bf16
    parameters, fp32 main gradients accumulated per micro-batch, fp32 main parameters in the
    optimizer, copied back to bf16 after the step). Step time and parameter + gradient +
    optimizer-state bytes of each."""
    gbs = mbs * size["gbs_mult"]
    cfg = MegatronConfig(model=model_config(model, size), parallel=ParallelConfig(),
                         training=TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs, bf16=True),
                         data=DataConfig(mock_data=True))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, size["vocab"], (mbs, size["seq"] + 1), generator=g) for _ in range(gbs // mbs)]
    batches = [(to_device(b[:, :-1].contiguous(), device), to_device(b[:, 1:].contiguous(), device)) for b in batches]
    ones = torch.ones(mbs, size["seq"], device=device)
    denom = float(gbs * size["seq"])
    kw = {"fused": True} if device.type == "cuda" else {}
    clock, res = Clock(device), {}
    for policy in ("fp32_params_autocast", "bf16_params_fp32_main"):
        torch.manual_seed(0)
        plain, _ = build_plain(cfg, device)
        if policy == "fp32_params_autocast":
            params = list(plain.parameters())
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kw)

            def step():
                for t, l in batches:
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        loss = plain(t, l, ones, denom)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            grads = lambda: 4 * sum(p.numel() for p in params)
        else:
            plain.to(torch.bfloat16)
            params = list(plain.parameters())
            main = [p.detach().float().requires_grad_(True) for p in params]
            opt = torch.optim.AdamW(main, lr=1e-4, weight_decay=0.01, **kw)

            def step():
                for m in main:
                    m.grad = torch.zeros_like(m)
                for t, l in batches:
                    plain(t, l, ones, denom).backward()
                    for p, m in zip(params, main):  # fp32 accumulation of the micro-batch gradients
                        m.grad.add_(p.grad)
                        p.grad = None
                torch.nn.utils.clip_grad_norm_(main, 1.0)
                opt.step()
                with torch.no_grad():
                    for p, m in zip(params, main):
                        p.copy_(m)
            grads = lambda: sum(4 * m.numel() + 2 * m.numel() for m in main)  # fp32 main + one bf16 micro-batch
        times, peaks = [], []
        for i in range(args.warmup + args.steps):
            dt, peak = clock.run(step)
            if i >= args.warmup:
                times.append(dt)
                peaks.append(peak)
        state = sum(p.numel() * p.element_size() for p in params) + grads()
        state += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() > 0)
        if policy != "fp32_params_autocast":
            state += sum(m.numel() * 4 for m in main)
        res[policy] = {"step_s": round(statistics.median(times), 5), "state_bytes": state,
                       "state_bytes_per_param": round(state / sum(p.numel() for p in params), 2),
                       "peak_mem_bytes": peaks[-1]}
        del plain, opt
    a, b = res["fp32_params_autocast"], res["bf16_params_fp32_main"]
    return {"benchmark": "gpu_step", "row": "precision", "model": model, "scaled_down": scaled,
            **_device_fields(device), "dtype": "bf16", "micro_batch_size": mbs, "global_batch_size": gbs,
            **res, "megatron_over_autocast_step": round(b["step_s"] / a["step_s"], 4),
            "ours_step_s": None, "plain_step_s": None, "tokens_per_s": None, "mfu": None,
            "peak_mem_bytes": a["peak_mem_bytes"], "steps": args.steps}


def _device_fields(device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": device.type, "device_name": name, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def _fit(fn, mbs: int, device):
    """fn(mbs) with the largest micro-batch size mbs, mbs/2, ... that does not run out of memory."""
    while True:
        try:
            return fn(mbs)
        except torch.OutOfMemoryError:
            if mbs == 1 or device.type != "cuda":
                raise
            gc.collect()
            torch.cuda.empty_cache()
            mbs //= 2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    p.add_argument("--rows", default="step,packed,precision", help="comma-separated: step, packed, precision")
    p.add_argument("--steps", type=int, default=None, help="timed steps per side (default 10 on CUDA, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 on CUDA, 1 on CPU)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="largest micro-batch size to try (CUDA halves it until it fits)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of this device for the MFU")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 autocast (the CPU default)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scaled = device.type != "cuda"
    size = dict(SCALED if scaled else FULL)
    args.steps = args.steps or (3 if scaled else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if scaled else 3)
    args.bf16 = not args.fp32 and not scaled
    mbs = args.micro_batch_size or size["mbs"]
    rows = []
    for model in args.models.split(","):
        for kind in args.rows.split(","):
            fn = {"step": step_row, "packed": packed_row, "precision": precision_row}[kind]
            row = _fit(lambda m: fn(model, size, m, args, device, scaled), mbs, device)
            print(json.dumps(row), flush=True)
            rows.append(row)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
