"""One command for a GPU: the GPU-only tests, the one-device training step, the attention kernels,
a cost-table profile, pipeline schedules by the clock, CP memory, MFU at TP 1/2/4 and DynaPipe's
predicted vs measured step, written to one JSON file and a Markdown summary (printed at the end).

    python benchmarks/gpu_check.py            # CUDA when visible (at most 9.5 minutes), else the CPU form
    python benchmarks/gpu_check.py --cpu      # the CPU form (CI): small sizes, 356 s on a 2-core host
                                              # at load 14 (2.5 minutes of CPU time; CI allows 900 s)
    make gpu-check / make gpu-check-cpu

Parts, each its own subprocess with its own time limit, so one that fails or hangs costs only
itself; the JSON file is rewritten after every part, so a run cut short keeps what finished:

  build_ext      the C++ data helpers (setup.py build_ext --inplace)
  fused_kernels  the fused CPU (and, with nvcc, CUDA) kernels; if this fails the later parts run
                 with MEGATRON_NO_FUSED_KERNELS=1 and say so
  cuda_build     CUDA only: a fresh verbose build of the CUDA kernels for sm_80 + sm_90 with torch's
                 extension flags, its time and nvcc's warnings (CPU machines: `make cuda-build`)
  gpu_tests      the tests marked `cuda` (pytest -m cuda): on CUDA they run, without it they skip
  bench_gpu_gpt, bench_gpu_llama
                 benchmarks/bench_gpu.py --rows step per model: our step vs plain PyTorch, tokens/s,
                 MFU (CUDA: GPT-1.3B and the Llama-like model at sequence 2048 in bf16; CPU: the
                 scaled-down models it runs without CUDA)
  kernels        benchmarks/bench_kernels.py: on CUDA its GPU rows (--gpu-only: dense-masked SDPA,
                 torch's varlen flash kernel, FlexAttention, the project's CUDA kernel,
                 bias-dropout-add); on CPU its quick CPU rows
  profile        megatron.profiling.profile_model on a small GPT (hidden 1024, 2 layers, sequence
                 up to 2048) with SDPA restricted to the flash backend (any attention that cannot
                 take it fails the part instead of silently timing another kernel); CPU: a tiny
                 GPT on the default backend. Its table carries the split backward's timed halves
                 (input_grad_ms / weight_grad_ms) at recompute none
  zb_wpass       benchmarks/bench_zb_wpass.py: bytes a deferred zero-bubble W keeps (weight store)
                 against the whole graph, the memory model's error, B / W times
  zb_clock, cp_memory, mfu_tp, dynapipe_pred
                 benchmarks/gpu_check_extra.py: 1F1B / ZB-H1 / ZB-V / DualPipeV at PP 2 by the clock
                 with idle fractions from the executor's trace, CP 1 / 2 memory (allocator with >= 2
                 GPUs), MFU of GPT-1.3B bf16 at TP 1/2/4 (torchrun, as far as the GPUs go) beside
                 Megatron-LM's 41-47 %, DynaPipe's simulated vs measured iteration ms

Outputs (``--out-dir``; default ``docs`` on CUDA, ``build/gpu_check`` for the CPU form):
``gpu_check.json`` (device, torch, per part: status, seconds, command, parsed rows, the log's
tail) and ``gpu_check.md`` (the summary the README quotes), plus the profiled cost table.
The CPU form writes ``gpu_check_cpu.*`` so it never overwrites a GPU result.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

if __package__ in (None, ""):   # run as a script: benchmarks/ is then not importable as a package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gpu_check_extra as extra  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# CUDA: 9.5 minutes for everything, so the whole check fits one 10-minute call on a lent GPU
# (`--budget` gives more); the parts' own limits below add up to more, so a part also never
# takes time the parts after it need (their `floor`). The CPU form took 356 s (2.5 CPU-minutes)
# on a 2-core machine at load 14; its limits leave room for a shared CI host (CI gives it 900 s).
CUDA_BUDGET_S = 570
CPU_BUDGET_S = 840


@dataclass
class Part:
    name: str
    what: str
    argv: Callable[["Ctx"], Optional[List[str]]]   # None: not run here (skip_reason says why)
    limit_s: Callable[["Ctx"], float]
    floor_s: float = 30.0                           # kept free for this part by the ones before it
    parse: Callable[[str, "Ctx"], dict] = lambda out, ctx: {}
    skip_reason: Callable[["Ctx"], str] = lambda ctx: ""
    cpu_note: str = ""                              # what the CPU form runs instead of the CUDA part
    note: Optional[Callable[["Ctx"], str]] = None   # what this run measures, in both forms


@dataclass
class Ctx:
    cuda: bool
    py: str
    out_dir: Path
    tmp: Path
    env: Dict[str, str] = field(default_factory=dict)
    gpus: int = 0                                   # visible CUDA devices (0 in the CPU form)

    def pick(self, cuda_value, cpu_value):
        return cuda_value if self.cuda else cpu_value


def _json_lines(text: str) -> List[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


# ---- the parts

def _cuda_test_files() -> List[str]:
    """Test files that hold a `cuda`-marked test (a text scan: collecting the whole suite to
    find them would cost more than running them)."""
    out = []
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        if "mark.cuda" in p.read_text(errors="replace"):
            out.append(str(p.relative_to(ROOT)))
    return out


def _tests_argv(ctx: Ctx):
    files = _cuda_test_files()
    if not files:
        return None
    return [ctx.py, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
            "--junitxml", str(ctx.tmp / "gpu_tests.xml"), *files]


def _parse_tests(out: str, ctx: Ctx) -> dict:
    path = ctx.tmp / "gpu_tests.xml"
    if not path.exists():
        return {}
    res = {"passed": 0, "failed": [], "skipped": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        fail = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if fail is not None:
            res["failed"].append({"test": name, "message": (fail.get("message") or "")[:300]})
        elif skip is not None:
            res["skipped"].append({"test": name, "reason": (skip.get("message") or "")[:200]})
        else:
            res["passed"] += 1
    return res


def _bench_gpu_argv(model: str):
    def argv(ctx: Ctx):
        base = [ctx.py, "benchmarks/bench_gpu.py", "--models", model, "--rows", "step"]
        if ctx.cuda:
            return base + ["--steps", "6", "--warmup", "2"]
        return base + ["--device", "cpu", "--steps", "2", "--warmup", "1"]
    return argv


def _parse_rows(out: str, ctx: Ctx) -> dict:
    return {"rows": _json_lines(out)}


def _kernels_argv(ctx: Ctx):
    if ctx.cuda:
        return [ctx.py, "benchmarks/bench_kernels.py", "--gpu-only", "--reps", "10"]
    return [ctx.py, "benchmarks/bench_kernels.py", "--quick", "--threads", "1", "--no-step", "--reps", "3"]


def _profile_argv(ctx: Ctx):
    out = ctx.out_dir / ctx.pick("gpu_check_gpt_flash_cost_model.json", "gpu_check_cpu_cost_model.json")
    if ctx.cuda:
        grid = ["--hidden-size", "1024", "--num-attention-heads", "16", "--vocab-size", "50257",
                "--micro-batch-sizes", "1,2,4", "--seq-lengths", "512,1024,2048",
                "--recompute", "none,selective,full", "--warmup", "2", "--iters", "5"]
    else:
        grid = ["--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "512",
                "--micro-batch-sizes", "1,2", "--seq-lengths", "32,64", "--recompute", "none,full",
                "--warmup", "1", "--iters", "2", "--statistic", "min"]
    # dropout 0: torch's flash kernels take no dropout on the varlen path, and the profile is of
    # the attention kernel, not of the dropout mask
    return [ctx.py, "benchmarks/gpu_check.py", "--profile-child", "--", "--model-type", "gpt", "--num-layers-profiled", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0", *grid, "--output", str(out)]


def _parse_profile(out: str, ctx: Ctx) -> dict:
    path = ctx.out_dir / ctx.pick("gpu_check_gpt_flash_cost_model.json", "gpu_check_cpu_cost_model.json")
    if not path.exists():
        return {}
    d = json.loads(path.read_text())
    res = {"cost_model": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
           "device": d.get("device"), "dtype": d.get("dtype"), "profile_seconds": d.get("profile_seconds"),
           "sdpa_backend": "flash only" if ctx.cuda else "default", "encoder": []}
    for prof in d.get("profiles", []):
        enc = prof.get("components", {}).get("encoder")
        if not enc:
            continue
        cells = [v for row in enc.get("forward_ms", []) for v in row]
        measured = [v for v in cells if v is not None]
        i, j = len(enc["mbs"]) - 1, len(enc["seq"]) - 1
        f, b = enc["forward_ms"][i][j], enc["backward_ms"][i][j]
        largest = {"mbs": enc["mbs"][i], "seq": enc["seq"][j], "forward_ms": f, "backward_ms": b}
        for q in ("input_grad_ms", "weight_grad_ms"):  # the zero-bubble halves, timed (recompute none)
            if q in enc:
                largest[q] = enc[q][i][j]
        res["encoder"].append({"tp": prof.get("tp"), "recompute": prof.get("recompute"),
                               "cells_measured": len(measured), "cells": len(cells), "largest": largest})
    return res


def _zb_wpass_argv(ctx: Ctx):
    if ctx.cuda:
        return [ctx.py, "benchmarks/bench_zb_wpass.py", "--device", "cuda", "--dtype", "bfloat16",
                "--sizes", "1024:2048:1,2048:2048:1", "--vocab", "50257", "--iters", "5"]
    return [ctx.py, "benchmarks/bench_zb_wpass.py", "--sizes", "64:64:1", "--iters", "2"]


def _fused_argv(ctx: Ctx):
    return [ctx.py, "-m", "megatron.fused_kernels"]


CUDA_ARCHS = "8.0;9.0"  # A100, H100: what CI's `make cuda-build` compiles on a CPU machine too


def _cuda_build_argv(ctx: Ctx):
    """A fresh, verbose CUDA build of the fused kernels for sm_80 and sm_90 with torch's own
    extension flags (nvcc's warnings in the log), timed; the CPU form leaves this to
    `make cuda-build` (tools/cuda_build_check.sh), its own CI step with its own environment."""
    if not ctx.cuda:
        return None
    return ["env", f"TORCH_CUDA_ARCH_LIST={CUDA_ARCHS}", f"MEGATRON_FUSED_KERNELS_DIR={ctx.tmp / 'cuda_build'}",
            "MEGATRON_FUSED_KERNELS_CUDA=1", "MAX_JOBS=4", ctx.py, "-m", "megatron.fused_kernels", "-v"]


def _parse_cuda_build(out: str, ctx: Ctx) -> dict:
    warnings = [line.strip() for line in out.splitlines() if "warning" in line.lower()]
    return {"arch_list": CUDA_ARCHS, "nvcc_warnings": len(warnings), "first_warnings": warnings[:5]}


PARTS = [
    Part("build_ext", "C++ data helpers", lambda ctx: [ctx.py, "setup.py", "build_ext", "--inplace", "-q"],
         lambda ctx: 120, floor_s=20),
    Part("fused_kernels", "fused kernels build", _fused_argv, lambda ctx: ctx.pick(180, 240), floor_s=20),
    Part("cuda_build", "CUDA kernels, fresh build for sm_80 + sm_90", _cuda_build_argv, lambda ctx: 300, floor_s=20,
         parse=_parse_cuda_build,
         skip_reason=lambda ctx: "the CPU form leaves the CUDA compile to `make cuda-build`"),
    Part("gpu_tests", "tests marked cuda", _tests_argv, lambda ctx: ctx.pick(120, 180), floor_s=20,
         parse=_parse_tests, skip_reason=lambda ctx: "no test file holds a `cuda`-marked test"),
    Part("bench_gpu_gpt", "bench_gpu.py step, GPT", _bench_gpu_argv("gpt"), lambda ctx: ctx.pick(150, 180),
         floor_s=60, parse=_parse_rows, cpu_note="GPT-1.3B in bf16 needs CUDA: the scaled-down fp32 model"),
    Part("bench_gpu_llama", "bench_gpu.py step, Llama-like", _bench_gpu_argv("llama"),
         lambda ctx: ctx.pick(150, 180), floor_s=60, parse=_parse_rows,
         cpu_note="the 1.3B Llama-like model in bf16 needs CUDA: the scaled-down fp32 model"),
    Part("kernels", "bench_kernels.py attention rows", _kernels_argv, lambda ctx: ctx.pick(150, 180),
         floor_s=45, parse=_parse_rows,
         cpu_note="the CUDA rows (dense SDPA, varlen flash, FlexAttention, our CUDA kernel) need CUDA: "
                  "the quick CPU rows"),
    Part("profile", "GPT cost table (profile_model)", _profile_argv, lambda ctx: ctx.pick(150, 180),
         floor_s=45, parse=_parse_profile,
         cpu_note="flash attention needs CUDA: a tiny GPT on the default SDPA backend"),
    Part("zb_wpass", "zero-bubble weight store bytes and B / W times", _zb_wpass_argv, lambda ctx: ctx.pick(90, 120),
         floor_s=20, parse=_parse_rows, cpu_note="a hidden-64 layer in fp32"),
    Part("zb_clock", "1F1B / ZB-H1 / ZB-V / DualPipeV at PP 2 by the clock", extra.zb_argv,
         lambda ctx: ctx.pick(120, 150), floor_s=40, parse=_parse_rows, note=extra.zb_note,
         skip_reason=extra.two_gpus_reason),
    Part("cp_memory", "CP 1 / 2 attention memory", extra.cp_argv, lambda ctx: ctx.pick(90, 120), floor_s=30,
         parse=_parse_rows, note=extra.cp_note, skip_reason=extra.two_gpus_reason),
    Part("mfu_tp", "MFU of GPT-1.3B bf16 at TP 1/2/4 (torchrun)", extra.child_argv("mfu"),
         lambda ctx: ctx.pick(60 + 120 * len(extra.mfu_tps(True, ctx.gpus)), 200), floor_s=60, parse=_parse_rows,
         cpu_note="a 2-layer hidden-64 GPT at TP 2 on gloo: TFLOP/s only"),
    Part("dynapipe_pred", "DynaPipe simulated vs measured step", extra.child_argv("dynapipe"),
         lambda ctx: ctx.pick(180, 240), floor_s=60, parse=_parse_rows),
    Part("moe_gemm", "MoE grouped GEMM vs per-expert loop", extra.moe_gemm_argv, lambda ctx: ctx.pick(90, 120),
         floor_s=20, parse=_parse_rows, cpu_note="one small fp32 shape"),
    Part("moe_alltoall", "MoE all-to-all (uneven splits) at EP = GPUs", extra.moe_alltoall_argv,
         lambda ctx: ctx.pick(60, 90), floor_s=20, parse=_parse_rows, skip_reason=extra.moe_alltoall_reason,
         cpu_note="EP 2 on gloo CPU ranks"),
    Part("vs_megatron", "step time and peak RSS beside Megatron-LM core_v0.9.0", extra.vs_megatron_argv,
         lambda ctx: ctx.pick(150, 240), floor_s=30, parse=_parse_rows, note=extra.vs_megatron_note,
         skip_reason=extra.vs_megatron_reason),
]


# ---- running

_ACTIVE: List[int] = []   # process groups of running parts


def _end_parts_on_signal(signum, frame):
    """A part runs in a session of its own (so a timeout ends what it started); if this process
    is stopped, end the running part's group too instead of leaving it on the device."""
    for pid in list(_ACTIVE):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)

def run_part(argv: List[str], limit_s: float, env: Dict[str, str], log_path: Path):
    """(status, seconds, output): status ok / failed (rc N) / timeout. The child gets its own
    process group, so a timeout also ends whatever it started (compilers, ranks)."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _ACTIVE.append(proc.pid)
        try:
            rc = proc.wait(timeout=max(1.0, limit_s))
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            status = f"timeout ({limit_s:.0f} s)"
        finally:
            _ACTIVE.remove(proc.pid)
    return status, round(time.monotonic() - t0, 1), log_path.read_text(errors="replace")


_PROBE = """
import json, torch
d = {"torch": torch.__version__, "cuda_visible": torch.cuda.is_available(), "gpus": torch.cuda.device_count()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    d.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
             device_memory_gib=round(p.total_memory / 2 ** 30, 1), capability=f"{p.major}.{p.minor}")
print(json.dumps(d))
"""


def device_fields(cuda: bool, py: str, env: Dict[str, str]) -> dict:
    """Device and torch of the Python the parts run with, asked in a child: this process never
    opens a CUDA context, which would hold device memory through every part."""
    d = {"python": platform.python_version(), "host": platform.node(),
         "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
         "form": "cuda" if cuda else "cpu", "device": "cpu", "torch": "?"}
    try:
        r = subprocess.run([py, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
        d.update(json.loads(r.stdout.strip().splitlines()[-1]))
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        d["probe_error"] = f"{type(e).__name__}: {e}"
    if not cuda:
        d["device"] = "cpu"
    return d


def check(cuda: bool, out_dir: Path, budget_s: float, parts: List[Part] = PARTS,
          py: str = sys.executable, log: Callable[[str], None] = print) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "gpu_check" if cuda else "gpu_check_cpu"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not cuda:
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""   # the CPU form on a GPU machine: same code paths as CI
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = Ctx(cuda=cuda, py=py, out_dir=out_dir, tmp=tmp, env=env)
    report = {"check": "gpu_check", "started_utc": datetime.datetime.now(datetime.timezone.utc)
              .strftime("%Y-%m-%dT%H:%M:%SZ"), "budget_s": budget_s, **device_fields(cuda, py, env), "parts": {}}
    ctx.gpus = int(report.get("gpus") or 0) if cuda else 0
    t_start = time.monotonic()

    def save():
        report["elapsed_s"] = round(time.monotonic() - t_start, 1)
        tmp_json = json_path.with_suffix(".json.tmp")
        tmp_json.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp_json, json_path)
        md_path.write_text(markdown(report))

    for i, part in enumerate(parts):
        argv = part.argv(ctx)
        if argv is None:
            report["parts"][part.name] = {"what": part.what, "status": "skipped", "reason": part.skip_reason(ctx)}
            log(f"[gpu_check] {part.name}: skipped ({part.skip_reason(ctx)})")
            save()
            continue
        left = budget_s - (time.monotonic() - t_start)
        reserve = sum(p.floor_s for p in parts[i + 1:])
        limit = min(part.limit_s(ctx), left - reserve)
        if limit < 1.0:
            report["parts"][part.name] = {"what": part.what, "status": "skipped",
                                          "reason": f"budget spent ({left:.0f} s left of {budget_s:.0f})"}
            log(f"[gpu_check] {part.name}: skipped, budget spent")
            save()
            continue
        log(f"[gpu_check] {part.name} ({part.what}): up to {limit:.0f} s, {left:.0f} s of the budget left ...")
        status, secs, out = run_part(argv, limit, ctx.env, tmp / f"{part.name}.log")
        entry = {"what": part.what, "status": status, "seconds": secs,
                 "command": " ".join(argv).replace(str(ROOT) + os.sep, ""),
                 "log_tail": out[-3000:]}
        if not ctx.cuda and part.cpu_note:
            entry["note"] = part.cpu_note
        if part.note:
            entry["note"] = part.note(ctx)
        try:
            entry.update(part.parse(out, ctx))
        except Exception as e:  # a half-written result must not lose the other parts
            entry["parse_error"] = f"{type(e).__name__}: {e}"
        if part.name == "gpu_tests" and entry.get("failed"):
            entry["status"] = f"failed ({len(entry['failed'])} tests)" if status == "ok" else status
        if part.name == "fused_kernels" and (status != "ok" or "NOT built" in out):
            ctx.env["MEGATRON_NO_FUSED_KERNELS"] = "1"
            entry["note"] = "later parts ran with MEGATRON_NO_FUSED_KERNELS=1 (PyTorch fallbacks)"
        report["parts"][part.name] = entry
        log(f"[gpu_check] {part.name}: {status} in {secs} s")
        save()
    save()
    shutil.rmtree(tmp, ignore_errors=True)   # the logs' tails are in the JSON
    report["json"], report["markdown"] = str(json_path), str(md_path)
    return report


# ---- the summary

def _fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def markdown(r: dict) -> str:
    form = "CUDA" if r["form"] == "cuda" else "CPU form (CUDA-only parts skipped; sizes scaled down)"
    lines = [f"# GPU check: {r.get('device')}", "",
             f"{form}. torch {r['torch']}" + (f", CUDA {r.get('cuda')}, {r.get('device_memory_gib')} GiB, "
                                             f"capability {r.get('capability')}" if r["form"] == "cuda" else "")
             + f"; {r['cpu_count']} CPUs; started {r['started_utc']}, {r.get('elapsed_s', 0):.0f} s of a "
               f"{r['budget_s']:.0f} s budget. Written by `benchmarks/gpu_check.py`; the numbers are in "
               f"`{'gpu_check' if r['form'] == 'cuda' else 'gpu_check_cpu'}.json` beside this file.", "",
             "| part | status | seconds |", "| --- | --- | --- |"]
    for name, p in r["parts"].items():
        st = p["status"] + (f": {p['reason']}" if p.get("reason") else "") + (f" ({p['note']})" if p.get("note") else "")
        lines.append(f"| {name} | {st} | {_fmt(p.get('seconds'), 1)} |")
    t = r["parts"].get("gpu_tests", {})
    if "passed" in t:
        lines += ["", f"**Tests marked cuda**: {t['passed']} passed, {len(t['failed'])} failed, "
                      f"{len(t['skipped'])} skipped."]
        lines += [f"- failed `{f['test']}`: {f['message'][:150]}" for f in t["failed"]]
        reasons = sorted({s["reason"] for s in t["skipped"]})
        lines += [f"- skipped: {x}" for x in reasons]
    steps = [row for k in ("bench_gpu_gpt", "bench_gpu_llama") for row in r["parts"].get(k, {}).get("rows", [])
             if row.get("row") == "step"]
    if steps:
        lines += ["", "**Training step** (`bench_gpu.py --rows step`: ours vs plain PyTorch, same micro-batches)", "",
                  "| model | layers x hidden, seq | dtype | mbs x micro-batches | ours s/step | plain s/step | "
                  "ours / plain | tokens/s | model TFLOP/s | MFU (peak used) | peak memory GiB |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in steps:
            mem = s.get("peak_mem_bytes")
            peak = f" ({s['peak_tflops_used']})" if s.get("peak_tflops_used") else ""
            lines.append(
                f"| {s['model']}{' (scaled down)' if s.get('scaled_down') else ''} | {s['layers']} x {s['hidden']}, "
                f"{s['seq']} | {s['dtype']} | {s['micro_batch_size']} x {s['global_batch_size'] // s['micro_batch_size']}"
                f" | {_fmt(s['ours_step_s'], 4)} | {_fmt(s['plain_step_s'], 4)} | {_fmt(s['ratio'], 3)} | "
                f"{_fmt(s['tokens_per_s'], 0)} | {_fmt(s['model_tflops'], 1)} | "
                f"{_fmt(s['mfu'], 3)}{peak} | "
                f"{_fmt(mem / 2 ** 30, 2) if mem else '-'} |")
    kern = r["parts"].get("kernels", {}).get("rows", [])
    if kern:
        lines += ["", "**Kernels** (`bench_kernels.py`; ms, median)", "",
                  "| kernel | implementation | forward ms | forward+backward ms | note |", "| --- | --- | --- | --- | --- |"]
        for row in kern:
            impls = {k: v for k, v in row.items() if isinstance(v, dict) and ("fwd_ms" in v or "error" in v
                                                                              or "fwd_bwd_ms" in v)}
            if not impls:
                if "error" in row or "skipped" in row:
                    lines.append(f"| {row.get('kernel', '?')} | - | - | - | {row.get('error') or row.get('skipped')} |")
                continue
            for label, v in impls.items():
                note = v.get("error") or ", ".join(f"{k} {x}" for k, x in v.items() if k.startswith("speedup"))
                lines.append(f"| {row.get('kernel')} | {label} | {_fmt(v.get('fwd_ms'))} | "
                             f"{_fmt(v.get('fwd_bwd_ms'))} | {note} |")
    prof = r["parts"].get("profile", {})
    if prof.get("encoder"):
        lines += ["", f"**Cost table** (`megatron.profiling.profile_model`, attention: {prof['sdpa_backend']}; "
                      f"{prof['dtype']}, {prof['profile_seconds']} s; file `{prof['cost_model']}`)", "",
                  "| tp | recompute | cells measured | largest shape | layer fwd ms | layer bwd ms | "
                  "B ms (split) | W ms (split) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for e in prof["encoder"]:
            lg = e["largest"]
            lines.append(f"| {e['tp']} | {e['recompute']} | {e['cells_measured']} / {e['cells']} | "
                         f"{lg['mbs']} x {lg['seq']} | {_fmt(lg['forward_ms'])} | {_fmt(lg['backward_ms'])} | "
                         f"{_fmt(lg.get('input_grad_ms'))} | {_fmt(lg.get('weight_grad_ms'))} |")
    zb = r["parts"].get("zb_wpass", {}).get("rows", [])
    if zb:
        lines += ["", "**Zero-bubble weight pass** (`bench_zb_wpass.py`: bytes a deferred W keeps, B / W ms)", "",
                  "| stage | hidden x seq x mbs | dtype | whole graph MB | kept before MB | weight store MB | "
                  "model error | B ms | W ms | whole bwd ms |", "|" + " --- |" * 10]
        for z in zb:
            lines.append(f"| {z['role']} | {z['hidden']} x {z['seq']} x {z['mbs']} | {z['dtype']} | "
                         f"{_fmt(z['graph_bytes'] / 1e6, 2)} | {_fmt(z['kept_graph_bytes'] / 1e6, 2)} | "
                         f"{_fmt(z['wstore_bytes'] / 1e6, 2)} | {_fmt(z['model_error'], 4)} | {_fmt(z['b_ms'])} | "
                         f"{_fmt(z['w_ms'])} | {_fmt(z['bwd_ms'])} |")
    lines += extra.markdown(r["parts"])
    bad = [n for n, p in r["parts"].items() if p["status"] not in ("ok",) and not p["status"].startswith("skipped")]
    if bad:
        lines += ["", "Parts that did not finish (their log tails are in the JSON): " + ", ".join(bad) + "."]
    return "\n".join(lines) + "\n"


def profile_child(argv: List[str]) -> int:
    """profile_model with SDPA held to the flash backend on CUDA (in this process, which the
    profiler uses at TP 1): an attention call flash cannot take fails loudly."""
    import torch

    from megatron.profiling.profile_model import main as profile_main
    if torch.cuda.is_available():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return profile_main(argv)
    return profile_main(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--profile-child"]:
        rest = argv[1:]
        return profile_child(rest[1:] if rest[:1] == ["--"] else rest)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="the CPU form even where CUDA is visible")
    p.add_argument("--out-dir", default=None, help="default: docs (CUDA) or build/gpu_check (CPU form)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all parts together (default {CUDA_BUDGET_S} on CUDA, {CPU_BUDGET_S} on CPU)")
    p.add_argument("--parts", default=None, help=f"comma-separated subset of: {', '.join(x.name for x in PARTS)}")
    a = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print(f"gpu_check: {sys.executable} has no torch; run it with the Python that has "
              f"(make gpu-check GPU_PYTHON=/path/to/python)", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not a.cpu   # no CUDA context: is_available asks the driver only
    if not cuda and not a.cpu:
        print("[gpu_check] no CUDA device visible: running the CPU form (CUDA-only parts are skipped or "
              "scaled down, and the files say so)", flush=True)
    parts = PARTS
    if a.parts:
        names = [x.strip() for x in a.parts.split(",") if x.strip()]
        unknown = [n for n in names if n not in {x.name for x in PARTS}]
        if unknown:
            print(f"gpu_check: --parts {','.join(unknown)}: unknown; choose from "
                  f"{', '.join(x.name for x in PARTS)}", file=sys.stderr)
            return 2
        parts = [x for x in PARTS if x.name in names]
    out_dir = Path(a.out_dir) if a.out_dir else ROOT / ("docs" if cuda else "build/gpu_check")
    budget = a.budget or (CUDA_BUDGET_S if cuda else CPU_BUDGET_S)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _end_parts_on_signal)
    rep = check(cuda, out_dir, budget, parts)
    print(Path(rep["markdown"]).read_text(), flush=True)   # the table, then where the commit-ready JSON is
    print(f"[gpu_check] wrote {rep['json']} and {rep['markdown']} in {rep['elapsed_s']:.0f} s", flush=True)
    failed = [n for n, x in rep["parts"].items() if not (x["status"] == "ok" or x["status"].startswith("skipped"))]
    if failed:
        print(f"[gpu_check] not ok: {', '.join(failed)} (see the log tails in {rep['json']})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
