"""Convert a DynaPipe-artifact cost table (plain-JSON export) into our cost-model format v1.

Usage: python cost_models/convert_dynapipe.py SRC.json DST.json --kind gpt|t5 --hidden H
       --heads A --ffn F --source TEXT

The export lists, per (tp, recompute), `[[mbs, value], ...]` per sequence length. T5
encoder/postprocess rows repeat a micro-batch size once per decoder (resp. encoder) length
that was swept with it; the pairing was lost in the export, so we keep the median of the
repeats for times and their maximum for memory (see cost_models/README.md, "Memory
accounting"); the shipped tables predate the maximum and hold medians throughout.
Unmeasured shapes become null.
Only run by people converting a table; nothing reads the source file at run time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron.planner.cost.cost_model import COMPONENT_AXES, CostModel, Grid, Profile  # noqa: E402

# export key -> (our component, our quantity)
TIME_KEYS = {"forward": "forward_ms", "backward": "backward_ms"}


def _collect(table: dict, quantity: str, into: dict):
    """table[seqkey] = [[mbs, v], ...] -> into[(mbs, *seq)][quantity] = [values]."""
    for seqkey, rows in table.items():
        seq = tuple(int(x) for x in seqkey.split("x"))
        for mbs, v in rows:
            into.setdefault((int(mbs),) + seq, {}).setdefault(quantity, []).append(float(v))


def _grid(points: dict, ndim: int) -> Grid:
    axes = [sorted({k[a] for k in points}) for a in range(ndim)]
    pos = [{x: i for i, x in enumerate(ax)} for ax in axes]
    quantities = sorted({q for d in points.values() for q in d})
    vals = {q: np.full([len(a) for a in axes], np.nan) for q in quantities}
    for key, d in points.items():
        idx = tuple(pos[a][key[a]] for a in range(ndim))
        for q, vs in d.items():
            # Repeats of one shape: times are noise around one value (median); memory must
            # not be under-estimated, or a plan that "fits" runs out of memory (max).
            vals[q][idx] = float(np.max(vs) if q.endswith("_mb") else np.median(vs))
    return Grid(axes, vals)


def convert(doc: dict, model: dict, source: str) -> CostModel:
    profiles = []
    for e in doc["entries"]:
        per_comp: dict = {}
        for key, table in e["time_ms"].items():
            comp, phase = key.split(".")
            _collect(table, TIME_KEYS[phase], per_comp.setdefault(comp, {}))
        for q, src in (("stored_mb", "stored_activation_mb"), ("peak_mb", "peak_activation_mb")):
            for comp, table in e.get(src, {}).items():
                _collect(table, q, per_comp.setdefault(comp, {}))
        comps = {c: _grid(pts, len(COMPONENT_AXES[c])) for c, pts in per_comp.items()}
        profiles.append(Profile(int(e["tp"]), e["recompute"], dict(e["model_state_mb"]), comps))
    meta = {
        "device": "NVIDIA A100-SXM4-40GB (AWS p4d.24xlarge), Megatron-LM, 16-bit",
        "units": {"time": "ms", "memory": "MB"},
        "source": source,
    }
    return CostModel(doc["name"], model, profiles, meta)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--kind", choices=["gpt", "t5"], required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--ffn", type=int, required=True)
    ap.add_argument("--source", required=True)
    a = ap.parse_args(argv)
    doc = json.loads(Path(a.src).read_text())
    model = {"kind": a.kind, "hidden_size": a.hidden, "num_attention_heads": a.heads, "ffn_hidden_size": a.ffn}
    cm = convert(doc, model, a.source)
    cm.save(a.dst)
    CostModel.load(a.dst)  # round-trip check
    print(f"wrote {a.dst}: {len(doc['entries'])} profiles")


if __name__ == "__main__":
    main()
