#!/usr/bin/env python
"""Step time and peak memory beside Megatron-LM core_v0.9.0's GPT, on CPU with gloo.

Megatron-LM is never a dependency: point `MEGATRON_LM_PYTHONPATH` (or `--megatron`) at a
checkout of NVIDIA/Megatron-LM at tag core_v0.9.0 (as tests/fixtures/megatron/README.md says):

    git clone https://github.com/NVIDIA/Megatron-LM /tmp/mlm && git -C /tmp/mlm checkout core_v0.9.0
    pip install --target /tmp/deps six   # Megatron's tokenizer module imports it
    MEGATRON_LM_PYTHONPATH=/tmp/mlm:/tmp/deps python benchmarks/bench_vs_megatron.py   # ~5 min, 2 busy cores

For each layout (TP 1, TP 2, PP 2, TP 2 x PP 2; pipelines run 1F1B on both sides) the same
GPT (hidden, layers, heads, FFN, sequence, vocabulary 1024 with no padding, dropout 0, fp32, learned
positions, tied embeddings, LayerNorm, GeLU) is trained for `--iters` steps of `--micro-batches`
micro-batches of `--mbs` samples, each side launched by torchrun with one thread per rank:

* Megatron: its own training step, `megatron.training.training.train_step` (Megatron's
  `get_forward_backward_func()`: forward_backward_no_pipelining or the 1F1B
  forward_backward_pipelining_without_interleaving, its p2p communication, its
  DistributedDataParallel grad buffers, `finalize_model_grads`, and `get_megatron_optimizer`:
  torch's Adam with decoupled weight decay, as without apex/TE), `pretrain_gpt.py`'s
  `model_provider` (Megatron-Core GPTModel, local layer spec) and `forward_step` (its
  `get_batch_on_this_tp_rank` broadcast and loss).
* this project: `pretrain_gpt.py --mock-data`'s main (parse_args, run_pretraining) as its
  users run it, with `Trainer.train_step` wrapped by the baton below; both sides are timed
  the same way, around one training step (`ours_rank`).

Same data: the parent process writes this project's `--mock-data` samples (MockGPTDataset,
sample i depends only on (seed, i)) to a file and Megatron's data iterator yields them in the
same order. Same weights: Megatron saves its freshly initialised model (`save_checkpoint`,
Megatron-Core `torch` format, untimed) and this project `--load`s that checkpoint at the same
layout, so the per-iteration losses of the two must agree (`max_loss_diff`), not only the model
shape. Gradient clipping is off on both sides (Megatron's clip needs CUDA tensors).

Interleaved step by step: both launches of a layout run side by side and pass a baton over a
TCPStore (`Baton`): Megatron's step k, then ours' step k, then Megatron's step k + 1, ... (A, B,
A, B), so load from other processes on the host falls on both alike. A step's wall time is the
slowest rank's, from the baton to the end of its step; the JSON gives the median of the steps
after `--warmup` for each side, their ratio ours / Megatron (below 1: ours is faster), and the
median of the ratios of adjacent step pairs. On a loaded host the wall clock mostly measures the
scheduler's share of the cores, so each step's CPU time (`time.process_time`, all threads, summed
over the ranks) is printed too (`cpu_ms_per_step`): the work each framework does per step,
whatever the load. Peak memory is the peak RSS (ru_maxrss) of the largest process of each launch:
every rank's, imports included. `--profile-dir DIR` writes one torch.profiler trace per rank
and side of step `--warmup` (that step then pays the profiler's cost, on both sides).

Stubs on Megatron's side (there is no GPU; `_stub_cuda` below), each only where core_v0.9.0
calls CUDA for placement or ordering, never for arithmetic:
  * `torch.cuda.current_device` -> cpu: p2p buffers, grad buffers, TP broadcast buffers are
    allocated there;
  * `torch.Tensor.cuda` / `torch.nn.Module.cuda` -> identity: get_model and the batch move there;
  * `torch.zeros / torch.tensor / torch.empty` called with `device="cuda"` -> cpu (schedules'
    token counter, the optimizer's found-inf / scale tensors): one dict look-up per call of
    these factories, a handful per step;
  * `torch.cuda.synchronize` -> no-op (p2p's batch_isend_irecv guard, Timers), `empty_cache`
    -> no-op;
  * CUDA RNG state get/set/seed and the tracker's fork -> no-ops (dropout is 0: no RNG is drawn);
  * `_shim_dcp_write_item` is not needed (the `torch` format has no DCP).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
VOCAB = 1024  # no padding column on either side (Megatron's NullTokenizer gets VOCAB - 1 and adds its EOD):
# this project keeps padding columns out of the softmax, Megatron does not, and with padding the
# losses would differ by log(padded / real) at the first step
SEED = 1234


def _log(msg):
    print(f"[bench_vs_megatron {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the baton: one system steps at a time

class Baton:
    """Step k of Megatron, then step k of ours, then step k + 1 of Megatron, ...: both launches
    run side by side and hand a baton over the parent's TCPStore, so a burst of load from other
    processes on the host falls on both systems' steps alike. Each rank times its own step from
    the baton to the end of its step; the parent takes the slowest rank of each step."""

    def __init__(self, me):
        from datetime import timedelta

        import torch.distributed as dist
        self.me, self.other = me, {"M": "O", "O": "M"}[me]
        self.world = int(os.environ["WORLD_SIZE"])
        self.store = dist.TCPStore("127.0.0.1", int(os.environ["BENCH_BATON_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=float(os.environ.get("BENCH_BATON_TIMEOUT", "600"))))
        self.k, self.t0, self.c0, self.times, self.cpu = 0, 0.0, 0.0, [], []

    def _done(self, k):
        if self.store.add(f"{self.me}_done_{k}", 1) == self.world:
            self.store.set(f"{self.me}_fin_{k}", "1")

    def before_step(self):
        if self.k == 0 and self.me == "O":
            self._done(-1)  # ours is built and loaded: Megatron may take its first step
        self.store.wait([f"{self.other}_fin_{self.k - 1 if self.me == 'M' else self.k}"])
        self.prof = None
        if os.environ.get("BENCH_PROFILE_DIR") and self.k == int(os.environ.get("BENCH_PROFILE_STEP", "2")):
            import torch.profiler  # both sides profiled the same way, one step each (--profile-dir)
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def after_step(self):
        self.times.append(1e3 * (time.perf_counter() - self.t0))
        self.cpu.append(1e3 * (time.process_time() - self.c0))  # all threads (gloo's too); host load aside
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            name = "megatron" if self.me == "M" else "ours"
            self.prof.export_chrome_trace(os.path.join(os.environ["BENCH_PROFILE_DIR"],
                                                       f"{name}_rank{os.environ['RANK']}.json"))
        self._done(self.k)
        self.k += 1

    def report(self, **extra):
        """Into the store, not stdout: ranks sharing one stdout may interleave their lines."""
        self.store.set(f"{self.me}_report_{os.environ['RANK']}", json.dumps({"ms": self.times, "cpu": self.cpu,
                                                                             **extra}))


def ours_rank(argv):
    """One torchrun rank of this project: pretrain_gpt.py's main, each train step under the baton."""
    from megatron.cli.arguments import parse_args
    from megatron.cli.startup_checks import check_inputs_or_exit
    from megatron.training import trainer
    from megatron.training.pretrain import run_pretraining
    baton, step = Baton("O"), trainer.Trainer.train_step

    def timed_step(self):
        baton.before_step()
        out = step(self)
        baton.after_step()
        return out
    trainer.Trainer.train_step = timed_step
    baton.store.wait(["M_saved"])  # started beside Megatron (imports overlap); load what it saved
    cfg = parse_args(argv, model_type="gpt")
    check_inputs_or_exit(cfg)
    rc = run_pretraining(cfg)
    baton.report()
    return rc


# ---------------------------------------------------------------- Megatron's side (a torchrun rank)

def _stub_cuda():
    import contextlib

    import torch

    def cpu_device(fn):
        def wrapped(*a, **k):
            d = k.get("device")
            if d is not None and str(d).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return wrapped
    for name in ("zeros", "tensor", "empty"):
        setattr(torch, name, cpu_device(getattr(torch, name)))
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    tp_random._set_cuda_rng_state = lambda *a, **k: None


def megatron_argv(o, tp, pp, save):
    return ["--num-layers", str(o.layers), "--hidden-size", str(o.hidden), "--num-attention-heads", str(o.heads),
            "--ffn-hidden-size", str(4 * o.hidden), "--seq-length", str(o.seq), "--max-position-embeddings",
            str(o.seq), "--micro-batch-size", str(o.mbs), "--global-batch-size", str(o.mbs * o.micro_batches),
            "--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style", "constant", "--weight-decay", "0.01",
            "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8", "--clip-grad", "0",
            "--train-iters", str(o.iters), "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--vocab-size", str(VOCAB - 1), "--tokenizer-type",
            "NullTokenizer", "--make-vocab-size-divisible-by", "128", "--save", save,
            "--save-interval", "1000000", "--ckpt-format", "torch",
            "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seed", str(SEED), "--transformer-impl", "local",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-persist-layer-norm", "--attention-softmax-in-fp32", "--no-async-tensor-model-parallel-allreduce"]


def megatron_rank(o):
    """One torchrun rank of Megatron-LM: build, save the initial weights, train, report."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    dist.init_process_group("gloo")
    _stub_cuda()
    from megatron.core import parallel_state as mpu
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.core.distributed import finalize_model_grads
    from megatron.training import arguments, global_vars
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.training import setup_model_and_optimizer, train_step
    tp, pp = LAYOUTS[o.layout]
    sys.argv = ["pretrain_gpt.py"] + megatron_argv(o, tp, pp, o.save)
    args = arguments.parse_args(ignore_unknown_args=False)
    arguments.validate_args(args, {})
    global_vars.set_global_variables(args, build_tokenizer=True)
    mpu.initialize_model_parallel(tp, pp)
    torch.manual_seed(args.seed)
    import pretrain_gpt
    model, optimizer, sched = setup_model_and_optimizer(pretrain_gpt.model_provider, ModelType.encoder_or_decoder)
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.timers = global_vars.get_timers()
    config.finalize_model_grads_func = finalize_model_grads
    args.iteration, args.consumed_train_samples = 0, 0
    save_checkpoint(0, model, optimizer, sched, 0)  # the initial weights, for this project's --load
    samples = torch.load(o.data, weights_only=True)["text"]
    s = o.seq
    mask = torch.triu(torch.ones(o.mbs, 1, s, s, dtype=torch.bool), diagonal=1)

    def batches():
        for i in range(0, samples.shape[0], o.mbs):
            text = samples[i:i + o.mbs]
            yield {"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous(),
                   "loss_mask": torch.ones(o.mbs, s), "attention_mask": mask,
                   "position_ids": torch.arange(s).unsqueeze(0).expand(o.mbs, s).contiguous()}
    data = batches()
    baton = Baton("M")
    dist.barrier()
    if dist.get_rank() == 0:
        baton.store.set("M_saved", "1")  # this project's ranks wait for it, then load the weights
    losses = []
    for _ in range(o.iters):
        baton.before_step()
        loss, skipped, _, _ = train_step(pretrain_gpt.forward_step, data, model, optimizer, sched, config)
        baton.after_step()
        if loss:
            losses.append(float(loss["lm loss"]))
        assert not skipped, "Megatron skipped an iteration"
    if mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0:
        baton.report(losses=losses)
    else:
        baton.report()
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the parent: launches, pairs, reports

_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
            "print('PEAK_RSS_KB ' + str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss), flush=True); "
            "sys.exit(rc)")


class Launch:
    """One torchrun launch under a wrapper that prints the peak RSS of its process tree (ru_maxrss
    of the largest rank, imports included), in a session of its own so a failure ends it all."""

    def __init__(self, name, argv, env, cwd):
        self.name, self.log = name, tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, *argv], env=env, cwd=cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def text(self):
        self.log.seek(0)
        return self.log.read()


def _torchrun(n):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]


def ours_argv(o, layout, load):
    tp, pp = LAYOUTS[layout]
    return [
        "--num-layers", str(o.layers), "--hidden-size", str(o.hidden),
        "--num-attention-heads", str(o.heads), "--ffn-hidden-size", str(4 * o.hidden), "--seq-length", str(o.seq),
        "--max-position-embeddings", str(o.seq), "--micro-batch-size", str(o.mbs), "--global-batch-size",
        str(o.mbs * o.micro_batches), "--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style", "constant",
        "--weight-decay", "0.01", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8",
        "--clip-grad", "0", "--train-iters", str(o.iters), "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp), "--mock-data", "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "128", "--seed", str(SEED), "--hidden-dropout", "0",
        "--attention-dropout", "0", "--activation-func", "gelu-erf", "--log-interval", "1", "--eval-iters", "0",
        "--split", "100,0,0", "--load", load, "--finetune", "--no-load-optim", "--no-load-rng"]


def _reports(store, who, world):
    return [json.loads(store.get(f"{who}_report_{r}")) for r in range(world) if store.check([f"{who}_report_{r}"])]


def _steps(reports, iters, key="ms", over=max):
    """Per step, the slowest rank's wall time (ms); with key "cpu" and over=sum, the CPU time of
    all ranks together."""
    per_rank = [r[key] for r in reports]
    if not per_rank or any(len(t) != iters for t in per_rank):
        return None
    return [over(t[k] for t in per_rank) for k in range(iters)]


def run_pair(o, layout, tmp, data, store, port):
    """Megatron and this project side by side at one layout, stepping in turn; returns a dict."""
    import torch.distributed as dist  # noqa: F401  (the store's module)
    from megatron.experiments.logparse import parse_log
    tp, pp = LAYOUTS[layout]
    save = str(tmp / f"mcore_{layout}")
    # CPU on both sides, also on a GPU box (`make gpu-check`): Megatron's side has no CUDA path here.
    base = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", BENCH_BATON_PORT=str(port),
                BENCH_BATON_TIMEOUT=str(o.timeout), CUDA_VISIBLE_DEVICES="")
    if o.profile_dir:
        os.makedirs(os.path.join(o.profile_dir, layout), exist_ok=True)
        base.update(BENCH_PROFILE_DIR=os.path.abspath(os.path.join(o.profile_dir, layout)),
                    BENCH_PROFILE_STEP=str(o.warmup))
    m_env = dict(base, PYTHONPATH=o.megatron)
    o_env = dict(base, MEGATRON_NO_FUSED_KERNELS="1",  # plain PyTorch ops, as Megatron's local spec without apex
                 PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    me, t0 = str(Path(__file__).resolve()), time.monotonic()
    # cwd of Megatron's ranks: not this project's root, whose `megatron` package has the same name
    meg = Launch("Megatron", _torchrun(tp * pp) + [me, "--megatron-rank", "--layout", layout, "--save", save,
                                                   "--data", data, *_model_flags(o)], m_env, tempfile.gettempdir())
    ours = Launch("ours", _torchrun(tp * pp) + [me, "--ours-rank", *ours_argv(o, layout, save)], o_env, str(ROOT))
    try:
        while any(x.proc.poll() is None for x in (meg, ours)):
            for x in (meg, ours):
                if x.proc.poll() not in (None, 0):
                    raise RuntimeError(f"{x.name} failed at {layout} (rc {x.proc.returncode}):\n{x.text()[-4000:]}")
            if time.monotonic() - t0 > o.timeout:
                raise RuntimeError(f"the pair at {layout} ran past --timeout {o.timeout:.0f} s")
            time.sleep(0.2)
        for x in (meg, ours):
            if x.proc.returncode != 0:
                raise RuntimeError(f"{x.name} failed at {layout} (rc {x.proc.returncode}):\n{x.text()[-4000:]}")
    finally:
        for x in (meg, ours):
            if x is not None:
                x.kill()
    m_text, o_text = meg.text(), ours.text()
    m_rep, o_rep = _reports(store, "M", tp * pp), _reports(store, "O", tp * pp)
    m_ms, o_ms = _steps(m_rep, o.iters), _steps(o_rep, o.iters)
    m_loss = [r["losses"] for r in m_rep if "losses" in r]
    o_loss = [r["loss"] for r in parse_log(o_text)]  # the trainer's own log line, printed by one rank
    if m_ms is None or o_ms is None or len(m_loss) != 1 or len(o_loss) != o.iters:
        raise RuntimeError(f"missing step times or losses at {layout}:\n{m_text[-3000:]}\n{o_text[-3000:]}")
    m_loss = m_loss[0]

    def peak(t):
        v = [int(x.split()[1]) for x in t.splitlines() if x.startswith("PEAK_RSS_KB ")]
        return round(v[-1] / 1024, 1) if v else None
    return {"megatron_ms": m_ms, "ours_ms": o_ms, "megatron_cpu_ms": _steps(m_rep, o.iters, "cpu", sum),
            "ours_cpu_ms": _steps(o_rep, o.iters, "cpu", sum), "megatron_losses": m_loss,
            "ours_losses": o_loss,
            "megatron_peak_rss_mb": peak(m_text), "ours_peak_rss_mb": peak(o_text),
            "seconds": round(time.monotonic() - t0, 1)}


def write_data(o, path):
    """This project's --mock-data samples, in the order its trainer consumes them (DP 1)."""
    import numpy as np
    import torch
    sys.path.insert(0, str(ROOT))
    from megatron.data.mock_dataset import MockGPTDataset
    n = o.iters * o.mbs * o.micro_batches
    ds = MockGPTDataset(n, o.seq, VOCAB, SEED)
    torch.save({"text": torch.from_numpy(np.stack([ds[i]["text"] for i in range(n)]))}, path)


def _model_flags(o):
    return ["--layers", str(o.layers), "--hidden", str(o.hidden), "--heads", str(o.heads), "--seq", str(o.seq),
            "--mbs", str(o.mbs), "--micro-batches", str(o.micro_batches), "--iters", str(o.iters)]


def bench(o, log=_log):
    import torch.distributed as dist
    if not o.megatron or not (Path(o.megatron.split(os.pathsep)[0]) / "megatron" / "core").is_dir():
        raise SystemExit("no Megatron-LM checkout: set MEGATRON_LM_PYTHONPATH (or --megatron) to a clone of "
                         "NVIDIA/Megatron-LM at tag core_v0.9.0 (see this file's docstring)")
    tmp = Path(tempfile.mkdtemp(prefix="bench_vs_megatron_"))
    data = str(tmp / "samples.pt")
    write_data(o, data)
    rows, t_start, load = [], time.monotonic(), [os.getloadavg()[0]]
    for lay in o.layouts.split(","):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        log(f"{lay}: Megatron and this project side by side, {o.iters} steps each, in turn ...")
        r = run_pair(o, lay, tmp, data, store, store.port)
        load.append(os.getloadavg()[0])
        m, u = statistics.median(r["megatron_ms"][o.warmup:]), statistics.median(r["ours_ms"][o.warmup:])
        diff = max(abs(a - b) for a, b in zip(r["megatron_losses"], r["ours_losses"]))
        # Step k of ours ran right after step k of Megatron: the pair saw the same load on the host.
        pairs = statistics.median(a / b for a, b in zip(r["ours_ms"][o.warmup:], r["megatron_ms"][o.warmup:]))
        row = {"layout": lay, "tp": LAYOUTS[lay][0], "pp": LAYOUTS[lay][1],
               "schedule": "1F1B" if LAYOUTS[lay][1] > 1 else "none (gradient accumulation)",
               "megatron_step_ms": round(m, 2), "ours_step_ms": round(u, 2),
               "ratio_ours_over_megatron": round(u / m, 3), "ratio_median_of_step_pairs": round(pairs, 3),
               "cpu_ms_per_step": {"ours": round(statistics.median(r["ours_cpu_ms"][o.warmup:]), 1),
                                   "megatron": round(statistics.median(r["megatron_cpu_ms"][o.warmup:]), 1)},
               "megatron_steps_ms": [round(x, 1) for x in r["megatron_ms"]],
               "ours_steps_ms": [round(x, 1) for x in r["ours_ms"]],
               "megatron_peak_rss_mb": r["megatron_peak_rss_mb"], "ours_peak_rss_mb": r["ours_peak_rss_mb"],
               "first_loss": {"megatron": r["megatron_losses"][0], "ours": r["ours_losses"][0]},
               "max_loss_diff": diff, "losses_agree": diff <= o.loss_tol, "pair_seconds": r["seconds"]}
        rows.append(row)
        log(f"{lay}: ours {u:.1f} ms / Megatron {m:.1f} ms = {u / m:.3f} (CPU ms per step "
            f"{row['cpu_ms_per_step']['ours']} / {row['cpu_ms_per_step']['megatron']}); peak RSS "
            f"{r['ours_peak_rss_mb']} / {r['megatron_peak_rss_mb']} MB; "
            f"losses {r['ours_losses'][0]:.6f} / {r['megatron_losses'][0]:.6f} "
            f"(max diff {diff:.1e}); {r['seconds']:.0f} s")
        del store
    shutil.rmtree(tmp, ignore_errors=True)
    return {"bench": "vs_megatron", "megatron": "core_v0.9.0", "model": {
        "layers": o.layers, "hidden": o.hidden, "heads": o.heads, "ffn": 4 * o.hidden, "seq": o.seq,
        "vocab": VOCAB, "dtype": "float32", "dropout": 0, "tied_embeddings": True}, "micro_batch_size": o.mbs,
        "micro_batches": o.micro_batches, "iters": o.iters, "warmup": o.warmup, "threads_per_rank": 1,
        "optimizer": "Adam, decoupled weight decay 0.01, lr 1e-3 constant, no clipping",
        "loadavg_1m": [round(x, 1) for x in load], "cpu_count": os.cpu_count(),
        "seconds": round(time.monotonic() - t_start, 1), "layouts": rows}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ours-rank"]:  # the rest is pretrain_gpt.py's command line
        return ours_rank(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron", default=os.environ.get("MEGATRON_LM_PYTHONPATH"),
                   help="PYTHONPATH of a Megatron-LM core_v0.9.0 checkout (default: $MEGATRON_LM_PYTHONPATH)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {list(LAYOUTS)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of the median")
    p.add_argument("--loss-tol", type=float, default=1e-4, help="largest |loss difference| called agreement")
    p.add_argument("--timeout", type=float, default=300, help="seconds per layout (both launches)")
    p.add_argument("--profile-dir", help="write a torch.profiler trace of step --warmup of every rank of both "
                   "sides here (<layout>/megatron_rank<R>.json, ours_rank<R>.json); that step's time then "
                   "includes the profiler's cost on both sides")
    p.add_argument("--megatron-rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    o = p.parse_args(argv)
    if o.megatron_rank:
        megatron_rank(o)
        return 0
    if o.warmup >= o.iters:
        p.error(f"--warmup {o.warmup} leaves no timed iteration of --iters {o.iters}")
    print(json.dumps(bench(o)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
