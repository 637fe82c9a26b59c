"""A PNG of a pipeline timeline (megatron/pipeline/timeline.py's Chrome traces): one row per
pipeline rank, forward / backward / weight-gradient boxes labelled with their micro-batch,
messages as arrows from send to receive; the measured run above the planned (unit-cost) one."""
from __future__ import annotations

import json

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def _draw(ax, trace: dict, title: str, unit: str) -> None:
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    pids = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    row = {pid: len(pids) - 1 - i for i, pid in enumerate(pids)}
    scale = 1e-3  # trace microseconds -> ms
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "compute" or e["pid"] not in row:
            continue
        kind = e["name"].rstrip("0123456789")
        kind = "B" if kind in ("B", "BackwardInput") else kind
        x, w = e["ts"] * scale, max(e["dur"] * scale, 1e-9)
        ax.broken_barh([(x, w)], (row[e["pid"]] - 0.4, 0.8), facecolors=COLOURS.get(kind, "#8c8c8c"),
                       edgecolors="white", linewidth=0.5)
        ax.text(x + w / 2, row[e["pid"]], e["name"], ha="center", va="center", fontsize=6, color="white")
    starts = {}
    for e in events:
        if e.get("ph") == "s":
            starts[e["id"]] = e
        elif e.get("ph") == "f" and e["id"] in starts and e["pid"] in row:
            s = starts[e["id"]]
            ax.annotate("", xy=(e["ts"] * scale, row[e["pid"]]), xytext=(s["ts"] * scale, row[s["pid"]]),
                        arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 0.4, "alpha": 0.6})
    ax.set_yticks(list(row.values()), [names.get(p, f"rank {p}") for p in row], fontsize=7)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)


def timeline_png(measured_path: str, unit_path: str, out_png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(measured_path) as f:
        measured = json.load(f)
    traces = [(measured, f"measured, iteration {measured.get('otherData', {}).get('iteration')}", "ms")]
    if unit_path:
        with open(unit_path) as f:
            traces.append((json.load(f), "as planned (unit costs: F 1, B 2, W 1)", "time units"))
    ranks = len({e["pid"] for e in measured["traceEvents"] if e.get("ph") == "X"})
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 0.5 + 0.45 * ranks * len(traces) + 0.6 * len(traces)),
                             dpi=110, squeeze=False)
    for ax, (trace, title, unit) in zip(axes[:, 0], traces):
        _draw(ax, trace, title, unit)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
