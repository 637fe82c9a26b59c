"""python -m megatron.report RUN_DIR [--out DIR]: PNG plots and summary.md of a run.

RUN_DIR is a run folder (`make demo` writes runs/demo-<date-time>/ with checkpoints/ and
tensorboard/) or a --tensorboard-dir itself. Writes into RUN_DIR/report/ unless --out.
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys

# series the trainer writes (megatron/training/logging.py) -> (file, title, y label)
PLOTS = (
    ("loss.png", "loss", "lm loss", ("lm loss", "lm loss validation")),
    ("tokens_per_s.png", "throughput", "tokens/s", ("throughput/tokens-per-second",)),
    ("step_time.png", "step time: measured vs the planner's prediction", "seconds",
     ("iteration-time", "planner/simulated_ms")),
)


def read_scalars(run_dir: str) -> dict:
    """{tag: [(step, value)]} from every TensorBoard event file under `run_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    files = sorted(glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"), recursive=True))
    out: dict = {}
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    for tag in out:
        out[tag] = sorted(dict(out[tag]).items())  # a resumed run rewrites steps: the last value wins
    return out


def _series(scalars, tag):
    pts = scalars.get(tag, [])
    if tag == "planner/simulated_ms":  # plotted beside iteration-time, in seconds
        pts = [(s, v / 1000.0) for s, v in pts]
    return pts


def _memory_label(tag: str) -> str:
    """memory/stage1_peak_rss_mb -> "stage 1 (peak RSS)" (megatron/training/stage_memory.py)."""
    if not tag.startswith("memory/stage"):
        return tag
    stage, _, what = tag[len("memory/stage"):].partition("_")
    kind = {"peak_rss_mb": "peak RSS", "peak_allocated_mb": "peak allocated"}.get(what, what)
    return f"stage {stage} ({kind})"


def plot(scalars: dict, out: str) -> list:
    """The PNGs that have data; returns their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = {"lm loss": "training loss", "lm loss validation": "validation loss",
             "throughput/tokens-per-second": "tokens/s", "iteration-time": "measured step time",
             "planner/simulated_ms": "planner's predicted step time"}
    written = []
    memory = tuple(sorted(t for t in scalars if t.startswith("memory/")))
    plots = PLOTS + ((("memory.png", "memory per pipeline stage", "MiB", memory),) if memory else ())
    for fname, title, ylabel, tags in plots:
        lines = [(names.get(t, _memory_label(t)), _series(scalars, t)) for t in tags if scalars.get(t)]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        for label, pts in lines:
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o" if len(pts) < 30 else None,
                    markersize=3, label=label)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname))
        plt.close(fig)
        written.append(fname)
    return written


def summary(run_dir: str, scalars: dict, pngs: list) -> str:
    def last(tag):
        return scalars[tag][-1] if scalars.get(tag) else None
    lines = [f"# Run report: {run_dir}", ""]
    loss = scalars.get("lm loss", [])
    if loss:
        lines.append(f"- iterations logged: {loss[0][0]}-{loss[-1][0]}; training loss {loss[0][1]:.4f} -> "
                     f"{loss[-1][1]:.4f}")
    val = scalars.get("lm loss validation", [])
    if val:
        best = min(val, key=lambda p: p[1])
        lines.append(f"- validation loss: last {val[-1][1]:.4f} (iteration {val[-1][0]}), best {best[1]:.4f} "
                     f"(iteration {best[0]})")
    tps = [v for _, v in scalars.get("throughput/tokens-per-second", [])[1:]]  # the first window pays set-up
    if tps:
        lines.append(f"- tokens/s: median {statistics.median(tps):.1f} over {len(tps)} log intervals "
                     "(the first left out: it pays one-time set-up)")
    step = {s: v for s, v in scalars.get("iteration-time", [])}
    sim = {s: v / 1000.0 for s, v in scalars.get("planner/simulated_ms", [])}
    if step:
        lines.append(f"- step time: median {statistics.median(step.values()):.3f} s")
    both = [step[s] / sim[s] for s in sim if s in step and sim[s] > 0 and s > 1]
    if both:
        lines.append(f"- measured / predicted step time: median {statistics.median(both):.2f} "
                     f"({len(both)} iterations; far from 1: calibrate the cost model on this machine)")
    tracker = glob.glob(os.path.join(run_dir, "**", "latest_checkpointed_iteration.txt"), recursive=True)
    for t in tracker:
        lines.append(f"- checkpoint: {os.path.dirname(t)} (iteration {open(t).read().strip()})")
    timelines = sorted(glob.glob(os.path.join(run_dir, "**", "iter_*.measured.json"), recursive=True))
    if timelines:
        lines.append(f"- pipeline timelines (open in https://ui.perfetto.dev or chrome://tracing): "
                     f"{', '.join(timelines[:4])}")
    mem = sorted((t for t in scalars if t.startswith("memory/stage")),
                 key=lambda t: int(t[len("memory/stage"):].partition("_")[0] or 0))
    if mem:
        lines.append("- memory per stage at the last log: " + ", ".join(
            f"{_memory_label(t)} {scalars[t][-1][1]:.0f} MiB" for t in mem)
            + (" (CPU: the process's peak resident set, interpreter and torch included)"
               if "rss" in mem[0] else " (the last step's peak of torch's CUDA allocator)"))
    else:
        lines.append("- memory per stage: not recorded by this run (trained before the trainer logged it?)")
    if not scalars:
        lines.append("- no TensorBoard scalars found: train with --tensorboard-dir RUN_DIR/tensorboard")
    lines.append("")
    lines += [f"![{p[:-4]}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run folder (with tensorboard/ and checkpoints/) or a --tensorboard-dir")
    p.add_argument("--out", default=None, help="where the PNGs and summary.md go (default RUN_DIR/report)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.run_dir):
        print(f"megatron.report: error: {args.run_dir} is not a folder (give a run folder, e.g. runs/demo-...)",
              file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.run_dir, "report")
    os.makedirs(out, exist_ok=True)
    scalars = read_scalars(args.run_dir)
    pngs = plot(scalars, out)
    from megatron.report.timeline_png import timeline_png
    for measured in sorted(glob.glob(os.path.join(args.run_dir, "**", "iter_*.measured.json"), recursive=True))[:4]:
        unit = measured.replace(".measured.json", ".unit.json")
        name = "timeline_" + os.path.basename(measured).split(".")[0] + ".png"
        timeline_png(measured, unit if os.path.exists(unit) else None, os.path.join(out, name))
        pngs.append(name)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary(args.run_dir, scalars, pngs))
    print(f"wrote {os.path.join(out, 'summary.md')}" + (f" and {', '.join(pngs)}" if pngs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
