"""gpu_check's pipeline, context-parallel, MFU and DynaPipe parts (issue 50 item 5, issue 45 item 7).

Each is a `gpu_check.Part` (its own process, its own limit); the multi-run ones (MFU at several
TP sizes, DynaPipe) run as `python benchmarks/gpu_check_extra.py --child NAME OUT_JSONL`, which
spawns torchrun once per run with a limit of its own, so a hung run costs its share only.

  zb_clock       bench_zb_cpu.py: 1F1B, ZB-H1, ZB-V and DualPipeV at PP 2, iteration time by the
                 clock and each rank's idle fraction from the executor's per-instruction trace
                 (the events `--pipeline-timeline` writes). CUDA: NCCL, one GPU per rank (needs 2
                 GPUs); CPU form: gloo ranks
  cp_memory      CUDA (2 GPUs): torch.cuda.max_memory_allocated around the attention core's forward +
                 backward at CP 1 and CP 2 (both exchanges, bf16, S 8192); CPU form: the saved-for-
                 backward bytes of megatron/profiling/cp_memory.py on gloo ranks (S 512)
  mfu_tp         pretrain_gpt.py on mock data, GPT-1.3B (24 x 2048, seq 2048) in bf16, at TP 1, 2, 4
                 as far as the GPUs go (torchrun --nproc_per_node TP): the trainer's TFLOP/s/device
                 over the dense bf16 peak, beside Megatron-LM's published 41-47 % on H100. CPU form:
                 a 2-layer hidden-64 GPT at TP 2 on gloo (TFLOP/s only)
  dynapipe_pred  pretrain_gpt.py --dynapipe on the shipped multi-task data (built into a temporary
                 folder unless data/cache has it): the planner's simulated iteration ms against the
                 measured ms, per logged iteration. CPU form: PP 2 on gloo with the shipped
                 cost_models/cpu_tiny_gpt.json; CUDA: PP 2 (PP 1 on one GPU) with the table gpu_check's
                 profile part just wrote on this GPU, at its model's sizes

  moe_gemm       bench_moe_grouped_gemm.py: --moe-grouped-gemm (torch grouped_mm) against the per-expert
                 loop, forward and forward + backward ms (CUDA: bf16, Mixtral / fine-grained shapes;
                 CPU form: one small fp32 shape)
  moe_alltoall   bench_moe_alltoall.py: the alltoall dispatcher's uneven all_to_all_single at EP =
                 the visible GPUs (NCCL, bf16); skipped with one GPU; CPU form: EP 2 on gloo

With one GPU, zb_clock, cp_memory and moe_alltoall skip (two ranks sharing a GPU time-slice it, so the clock
would not show bubbles); the CPU form measures both on gloo ranks.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_LM_H100_MFU = "41-47 % (the MFU Megatron-LM reports on H100)"


def _json_lines(text):
    out = []
    for line in text.splitlines():
        if line.strip().startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _rows(out, ctx):
    return {"rows": _json_lines(out)}


# ---- argv of each part (ctx: gpu_check.Ctx; ctx.gpus is the visible device count)

# On CUDA with one GPU the PP 2 and CP 2 parts skip: two ranks sharing one GPU time-slice it, so
# the clock would not show bubbles, and the CPU form (CI) already measures them on gloo ranks.
def _one_gpu(ctx):
    return ctx.cuda and ctx.gpus < 2


def two_gpus_reason(ctx):
    return (f"needs >= 2 GPUs ({ctx.gpus} visible): ranks sharing one GPU would time-slice it; the CPU "
            "form (make gpu-check-cpu, CI) measures this part on gloo ranks")


def zb_argv(ctx):
    if _one_gpu(ctx):
        return None
    base = [ctx.py, "benchmarks/bench_zb_cpu.py", "--pp", "2", "--schedules", "1f1b", "zb-h1", "zb-v", "dualpipev"]
    if ctx.cuda:
        return base + ["--device", "cuda", "--microbatches", "8", "--hidden", "1024", "--layers", "8",
                       "--seq", "1024", "--warmup", "2", "--iters", "3"]
    return base + ["--microbatches", "4", "--hidden", "64", "--layers", "4", "--seq", "32", "--iters", "2"]


def zb_note(ctx):
    return "NCCL, one GPU per pipeline rank" if ctx.cuda else "PP 2 on gloo CPU ranks"


def cp_argv(ctx):
    if _one_gpu(ctx):
        return None
    if ctx.cuda:
        return [ctx.py, "benchmarks/gpu_check_extra.py", "--child", "cp_alloc"]
    return [ctx.py, "benchmarks/bench_cp_memory.py", "--seq", "512", "--heads", "4", "--head-size", "16",
            "--sizes", "1,2"]


def cp_note(ctx):
    return ("torch.cuda.max_memory_allocated over fwd + bwd, NCCL" if ctx.cuda else
            "saved-for-backward bytes by megatron/profiling/cp_memory.py, gloo CPU ranks")


def moe_gemm_argv(ctx):
    if ctx.cuda:
        return [ctx.py, "benchmarks/bench_moe_grouped_gemm.py", "--device", "cuda", "--reps", "5"]
    return [ctx.py, "benchmarks/bench_moe_grouped_gemm.py", "--device", "cpu", "--quick", "--reps", "3"]


def moe_alltoall_argv(ctx):
    if _one_gpu(ctx):
        return None
    if ctx.cuda:
        return [ctx.py, "benchmarks/bench_moe_alltoall.py", "--device", "cuda", "--ranks", str(ctx.gpus),
                "--hidden", "4096", "--tokens", "1024,4096,16384", "--iters", "10"]
    return [ctx.py, "benchmarks/bench_moe_alltoall.py", "--ranks", "2", "--hidden", "64", "--tokens", "256,1024"]


def moe_alltoall_reason(ctx):
    return (f"all-to-all at EP = visible GPUs needs >= 2 GPUs ({ctx.gpus} visible); the CPU form measures "
            "EP 2 on gloo")


def vs_megatron_argv(ctx):
    """Megatron-LM core_v0.9.0 beside this project (bench_vs_megatron.py), when a checkout is given
    (MEGATRON_LM_PYTHONPATH, as the fixture makers use). Gloo CPU ranks in both forms: the pairing
    runs Megatron through its CPU stubs, which have no CUDA path; a GPU box's many cores make it
    quick and quiet."""
    if not ctx.env.get("MEGATRON_LM_PYTHONPATH"):
        return None
    base = [ctx.py, "benchmarks/bench_vs_megatron.py", "--timeout", "150"]
    return base if ctx.cuda else base + ["--iters", "5", "--warmup", "1"]


def vs_megatron_reason(ctx):
    return ("MEGATRON_LM_PYTHONPATH is not set: point it at a Megatron-LM core_v0.9.0 checkout (and `six`), "
            "see tests/fixtures/megatron/README.md")


def vs_megatron_note(ctx):
    return "TP 1/2, PP 2, TP 2 x PP 2 (1F1B) on gloo CPU ranks, one thread each, steps in turn with Megatron"


def child_argv(name):
    def argv(ctx):
        return [ctx.py, "benchmarks/gpu_check_extra.py", "--child", name,
                "--cuda" if ctx.cuda else "--cpu", "--gpus", str(ctx.gpus), "--out-dir", str(ctx.out_dir)]
    return argv


# ---- children

def _torchrun(nproc, args, limit_s, env=None):
    """(rc or 'timeout', output) of one torchrun launch in its own session, ended on timeout."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "pretrain_gpt.py", *args]
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return "timeout", out


_ITER = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+).*?TFLOP/s/device: ([\d.]+)")
_SIM = re.compile(r"simulated / measured iteration ms: ([\d.]+) / ([\d.]+)")


def mfu_args(cuda: bool, tp: int) -> list:
    """pretrain_gpt.py's arguments for one MFU run: GPT-1.3B (Megatron-LM's 1.3B shape) in bf16."""
    if cuda:
        model = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                 "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size", "50257",
                 "--micro-batch-size", "4", "--global-batch-size", "32", "--bf16", "--train-iters", "8"]
    else:
        model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--max-position-embeddings", "64", "--vocab-size", "512", "--micro-batch-size", "2",
                 "--global-batch-size", "4", "--train-iters", "4"]
    return [*model, "--tensor-model-parallel-size", str(tp), "--mock-data", "--lr", "1e-4", "--log-interval", "1",
            "--eval-interval", "1000000"]


def mfu_tps(cuda: bool, gpus: int) -> list:
    # CPU form: TP 2 only (torchrun with nproc = TP, gloo); bench_gpu_gpt already times one process
    return [t for t in (1, 2, 4) if t <= gpus] if cuda else [2]


def mfu_child(cuda, gpus) -> int:
    """Non-zero when a run failed or its log had no iteration line this parser reads (so CI's
    CPU form notices a changed log format)."""
    sys.path.insert(0, str(ROOT))
    bad = 0
    from benchmarks.bench_gpu import peak_tflops
    name, peak, limit = "cpu", None, 120
    if cuda:
        name = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                              capture_output=True, text=True, timeout=60).stdout.strip()   # no context held here
        _, peak = peak_tflops(name)
        limit = 150
    for tp in mfu_tps(cuda, gpus):
        t0 = time.monotonic()
        rc, out = _torchrun(tp, mfu_args(cuda, tp), limit)
        its = [(int(a), float(b), float(c)) for a, b, c in _ITER.findall(out)]
        steady = its[2:] or its[-1:]    # the first iterations compile and warm the allocator
        tflops = statistics.median(x[2] for x in steady) if steady else None
        row = {"benchmark": "gpu_check_mfu", "model": "GPT-1.3B" if cuda else "GPT tiny (CPU form)", "tp": tp,
               "device": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "iterations_logged": len(its),
               "step_ms": statistics.median(x[1] for x in steady) if steady else None,
               "tflops_per_device": tflops, "peak_tflops": peak,
               "mfu": round(tflops / peak, 4) if tflops and peak else None, "reference": MEGATRON_LM_H100_MFU}
        if rc != 0 or not its:
            row["log_tail"] = out[-1500:]
            bad += 1
        print(json.dumps(row), flush=True)
    return 1 if bad else 0


def dynapipe_child(cuda, gpus, out_dir) -> int:
    """PP 2 (PP 1 with one GPU) with the table the profile part measured on this GPU; CPU: the
    shipped cost_models/cpu_tiny_gpt.json on 2 gloo ranks."""
    import shutil
    pp = min(2, gpus) if cuda else 2
    table = Path(out_dir) / "gpu_check_gpt_flash_cost_model.json"
    if cuda and not table.exists():
        print(json.dumps({"benchmark": "gpu_check_dynapipe", "skipped": f"no GPU cost table at {table}: the "
                          "profile part did not finish, and a CPU table would price GPU steps in CPU times"}))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_dynapipe_"))
    sp = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "data/tokenizers/kjv_sp4k.model"]
    prefix = ROOT / "data/cache/kjv_tasks_sp4k"
    if not Path(f"{prefix}_targets_document.idx").exists():
        prefix = tmp / "kjv_tasks_sp4k"
        subprocess.run([sys.executable, "tools/preprocess_data.py", "--workers", "1", "--no-progress", "--input",
                        "data/multitask/kjv_tasks.jsonl.gz", *sp, "--json-keys", "inputs", "targets", "--append-eod",
                        "--output-prefix", str(prefix)], cwd=ROOT, check=True, timeout=180, stdout=subprocess.DEVNULL)
    note = ""
    if cuda:  # the model the profile part measured, so the table prices this run
        m = json.loads(table.read_text())["model"]
        size = ["--hidden-size", str(m["hidden_size"]), "--num-attention-heads", str(m["num_attention_heads"]),
                "--ffn-hidden-size", str(m["ffn_hidden_size"]), "--bf16", "--hidden-dropout", "0",
                "--attention-dropout", "0", "--tokens-per-global-batch", "16384", "--dynapipe-memory-limit", "60000"]
        note = f"table profiled at vocabulary {m.get('vocab_size')}; this run's tokenizer has 4096"
    else:
        table = ROOT / "cost_models/cpu_tiny_gpt.json"
        size = ["--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
                "--tokens-per-global-batch", "4096", "--dynapipe-memory-limit", "200"]
    args = ["--pipeline-model-parallel-size", str(pp), "--num-layers", "4", *size, "--seq-length", "512",
            "--max-position-embeddings", "512", "--train-iters", "6", "--lr", "1e-3",
            "--data-path", f"{prefix}_inputs_document", "--targets-data-path", f"{prefix}_targets_document", *sp,
            "--log-interval", "1", "--eval-interval", "1000000", "--dynapipe", "--dynapipe-cost-model", str(table)]
    t0 = time.monotonic()
    try:
        rc, out = _torchrun(pp, args, 240)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    pairs = [(float(a), float(b)) for a, b in _SIM.findall(out)]
    steady = pairs[1:] or pairs     # the first iteration also waits for the planner's start
    name = str(table.relative_to(ROOT)) if table.is_relative_to(ROOT) else str(table)
    row = {"benchmark": "gpu_check_dynapipe", "cost_model": name, "device": "cuda" if cuda else "cpu", "pp": pp,
           "rc": rc, "seconds": round(time.monotonic() - t0, 1),
           "iterations": len(pairs), "simulated_ms": [p[0] for p in pairs], "measured_ms": [p[1] for p in pairs],
           "median_measured_over_simulated": round(statistics.median(m / s for s, m in steady), 3) if steady else None}
    if note:
        row["note"] = note
    if rc != 0 or not pairs:
        row["log_tail"] = out[-1500:]
    print(json.dumps(row), flush=True)
    return 0 if rc == 0 and pairs else 1


def _cp_alloc_rank(rank, world, comm, seq):
    import torch
    import torch.nn.functional as F

    from megatron.models.cp_attention import cp_core_attention
    from megatron.profiling.cp_memory import _spec
    dev = torch.device("cuda", rank)
    local, heads, hn = seq // world, 16, 128
    torch.cuda.synchronize(dev)
    q, k, v = [torch.randn(local, 1, heads, hn, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]
    spec = _spec(world, rank, comm, seq) if world > 1 else None
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    if spec is not None:
        out = cp_core_attention(q, k, v, spec, 0.0, 1, 0)
    else:
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    kept = torch.cuda.memory_allocated(dev) - base
    out.float().sum().backward()
    torch.cuda.synchronize(dev)
    return {"kept_after_forward": kept, "peak": torch.cuda.max_memory_allocated(dev) - base}


def cp_alloc_child(seq=8192):
    from megatron.core.launch import run_ranks
    base = None
    for cp, comm in ((1, "one_process"), (2, "all_gather"), (2, "p2p")):
        got = run_ranks(_cp_alloc_rank, cp, comm, seq, timeout_s=120, backend="nccl", start="spawn",
                        what=f"CP {cp} {comm}")
        row = {k: max(g[k] for g in got) for k in got[0]}
        base = base or row
        print(json.dumps({"benchmark": "gpu_check_cp_alloc", "cp": cp, "comm": comm, "seq": seq, "dtype": "bfloat16",
                          **row, **{f"{k}_ratio": round(row[k] / base[k], 3) for k in row if base[k]}}), flush=True)


# ---- the summary section

def _or_dash(v):
    return "-" if v is None else v


def markdown(parts) -> list:
    lines = []
    zb = [r for r in parts.get("zb_clock", {}).get("rows", []) if r.get("benchmark") == "zero_bubble_cpu"]
    if zb:
        lines += ["", f"**Pipeline schedules by the clock** (`bench_zb_cpu.py`, {parts['zb_clock'].get('note', '')})",
                  "", "| schedule | pp x micro-batches | measured ms | simulated ms | idle per rank (measured) |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['schedule']} | {r['pp']} x {r['microbatches']} | {r['measured_ms']} | {r['simulated_ms']} | "
                  f"{r['idle_fraction_measured']} |" for r in zb]
    cp = parts.get("cp_memory", {}).get("rows", [])
    if cp:
        lines += ["", f"**Context-parallel memory** ({parts['cp_memory'].get('note', '')})", "",
                  "| CP | exchange | bytes | / CP 1 |", "| --- | --- | --- | --- |"]
        for r in cp:
            b = r.get("peak", r.get("core_bytes"))
            lines.append(f"| {r.get('cp')} | {r.get('comm')} | {b} | {r.get('peak_ratio', r.get('core_ratio'))} |")
    mfu = parts.get("mfu_tp", {}).get("rows", [])
    if mfu:
        lines += ["", "**MFU** (`pretrain_gpt.py` on mock data; reference " + MEGATRON_LM_H100_MFU + ")", "",
                  "| model | TP | step ms | TFLOP/s/device | MFU | rc |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['model']} | {r['tp']} | {_or_dash(r['step_ms'])} | {_or_dash(r['tflops_per_device'])} | "
                  f"{_or_dash(r['mfu'])} | {r['rc']} |" for r in mfu]
    vs = [r for r in parts.get("vs_megatron", {}).get("rows", []) if r.get("bench") == "vs_megatron"]
    for r in vs:
        lines += ["", f"**Beside Megatron-LM {r['megatron']}** (`bench_vs_megatron.py`, CPU gloo, load "
                      f"{r['loadavg_1m']})", "", "| layout | ours / Megatron | ms ours | ms Megatron | "
                      "CPU ms per step ours / Megatron | peak RSS MB ours / Megatron | losses agree |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {x['layout']} | {x['ratio_ours_over_megatron']} | {x['ours_step_ms']} | "
                  f"{x['megatron_step_ms']} | {x['cpu_ms_per_step']['ours']} / {x['cpu_ms_per_step']['megatron']} | "
                  f"{x['ours_peak_rss_mb']} / {x['megatron_peak_rss_mb']} | {x['losses_agree']} |"
                  for x in r["layouts"]]
    dp = parts.get("dynapipe_pred", {}).get("rows", [])
    for r in dp:
        lines += ["", f"**DynaPipe predicted vs measured** (`{r['cost_model']}`): simulated ms {r['simulated_ms']}, "
                      f"measured ms {r['measured_ms']}, median measured / simulated "
                      f"{r['median_measured_over_simulated']} (rc {r['rc']})"]
    return lines


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", required=True, choices=["mfu", "dynapipe", "cp_alloc"])
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--out-dir", default=str(ROOT / "build/gpu_check"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if a.child == "mfu":
        return mfu_child(a.cuda, a.gpus)
    if a.child == "dynapipe":
        return dynapipe_child(a.cuda, a.gpus, a.out_dir)
    cp_alloc_child()
    return 0


if __name__ == "__main__":
    sys.exit(main())
