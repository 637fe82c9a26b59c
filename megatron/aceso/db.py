"""Reader for Aceso-format profiled databases: per-operator tables, collective tables, p2p bandwidth.

One directory holds, for one or more models (see data/README.md for the published set):

- ``<model>_<size>_mbs<M>_tp<T>_algo<A>.csv``: one row per operator (times in µs, sizes in MB,
  all per device);
- ``prim_<model>_<size>_<collective>_<n>gpus.csv``: collective time (ms) by message size (MB);
- ``p2p_intra_node.csv`` / ``p2p_inter_node.csv``: bandwidth (GB/s) by message size (MB).

Lookups interpolate where Aceso looks up exact sizes: collectives linearly between profiled
sizes and by the last bandwidth beyond them; p2p bandwidth linearly in log2(size).
"""
from __future__ import annotations

import bisect
import csv
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

OP_HEADER = [
    "op_name", "forward-compute", "backward-compute", "input_size", "output_size",
    "weights", "activations", "fwd_reserved", "bwd_reserved",
]
COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
_OP_FILE = re.compile(r"^(?P<model>[a-z0-9]+)_(?P<size>.+)_mbs(?P<mbs>\d+)_tp(?P<tp>\d+)_algo(?P<algo>\d+)\.csv$")
_PRIM_FILE = re.compile(r"^prim_(?P<model>[a-z0-9]+)_(?P<size>.+)_(?P<coll>" + "|".join(COLLECTIVES)
                        + r")_(?P<n>\d+)gpus\.csv$")

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@dataclass(frozen=True)
class OpRow:
    """One profiled operator at one (micro-batch size, TP size, algo); per-device values."""
    name: str
    fwd_us: float
    bwd_us: float
    input_mb: float
    output_mb: float
    weight_mb: float
    act_mb: float
    fwd_reserved_mb: float
    bwd_reserved_mb: float

    def as_csv_row(self) -> List[str]:
        # 3 decimals as in the published tables; 6 for the sub-kB sizes of tiny CPU models
        return [self.name] + [f"{v:.3f}" if abs(v) >= 1 or v == 0 else f"{v:.6f}" for v in (
            self.fwd_us, self.bwd_us, self.input_mb, self.output_mb, self.weight_mb,
            self.act_mb, self.fwd_reserved_mb, self.bwd_reserved_mb)]


def read_op_csv(path: str) -> List[OpRow]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or [h.strip() for h in rows[0]] != OP_HEADER:
        raise ValueError(f"{path}: expected header {','.join(OP_HEADER)}")
    out = []
    for r in rows[1:]:
        if not r:
            continue
        if len(r) != len(OP_HEADER):
            raise ValueError(f"{path}: row {r!r} has {len(r)} fields, expected {len(OP_HEADER)}")
        out.append(OpRow(r[0].strip(), *_numbers(r[1:], path, r)))
    return out


def _pairs(rows, path) -> List[Tuple[float, float]]:
    out = []
    for r in rows:
        if not r or not r[0]:
            continue
        if len(r) != 2:
            raise ValueError(f"{path}: row {r!r} has {len(r)} fields, expected 2 (size, time)")
        out.append(tuple(_numbers(r, path, r)))
    return out


def _numbers(fields, path, row) -> List[float]:
    """Finite, non-negative numbers (times, sizes): a forged 'nan' or '-1e9' would steer the search."""
    try:
        vals = [float(x) for x in fields]
    except ValueError:
        raise ValueError(f"{path}: row {row!r} holds a field that is not a number") from None
    if not all(math.isfinite(v) and v >= 0 for v in vals):
        raise ValueError(f"{path}: row {row!r} holds a negative, infinite or NaN value")
    return vals


def profile_meta_path(root: str, model: str, size: str) -> str:
    return os.path.join(root, f"{model}_{size}_profile.json")


def read_profile_meta(root: str, model: str, size: str) -> dict:
    """What wrote a model's tables (absent for the published ones): ``{"reserved_columns":
    "working_set"}`` says ``fwd_reserved`` / ``bwd_reserved`` are measured working sets."""
    path = profile_meta_path(root, model, size)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            meta = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e}); delete it or re-profile") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return meta


def write_op_csv(path: str, rows: List[OpRow]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(OP_HEADER)
        for r in rows:
            w.writerow(r.as_csv_row())


class _Curve:
    """Piecewise-linear time(size) with bandwidth extrapolation beyond the last point."""

    def __init__(self, points: List[Tuple[float, float]]):
        pts: Dict[float, float] = {}
        for s, t in points:
            if t >= 1e8:  # the published tables mark failed measurements with 1e9
                continue
            pts[s] = t
        if not pts:
            raise ValueError("collective table has no valid rows")
        self.sizes = sorted(pts)
        self.times = [pts[s] for s in self.sizes]

    def __call__(self, size: float) -> float:
        if size <= 0:
            return 0.0
        xs, ys = self.sizes, self.times
        if size <= xs[0]:
            return ys[0] * size / xs[0] if xs[0] > 0 else ys[0]
        if size >= xs[-1]:
            return ys[-1] * size / xs[-1]
        i = bisect.bisect_left(xs, size)
        if xs[i] == size:
            return ys[i]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)


class OpDatabase:
    """All tables of one model (e.g. ``gpt``/``1_3B``) in one directory."""

    def __init__(self, root: str, model: str, size: str):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"--db {root}: not a directory")
        self.root, self.model, self.size = root, model, size
        self.tables: Dict[Tuple[int, int, int], List[OpRow]] = {}
        self._collectives: Dict[Tuple[str, int], _Curve] = {}
        for fn in sorted(os.listdir(root)):
            m = _OP_FILE.match(fn)
            if m and m["model"] == model and m["size"] == size:
                key = (int(m["mbs"]), int(m["tp"]), int(m["algo"]))
                self.tables[key] = read_op_csv(os.path.join(root, fn))
                continue
            m = _PRIM_FILE.match(fn)
            if m and m["model"] == model and m["size"] == size:
                with open(os.path.join(root, fn), newline="") as f:
                    rows = [r for r in csv.reader(f)][1:]
                self._collectives[(m["coll"], int(m["n"]))] = _Curve(
                    _pairs(rows, os.path.join(root, fn)))
        # Collective time depends on the message and the devices, not on the model: a model
        # without an all_reduce table (the published T5 sets) borrows the first other model's
        # tables from the same directory; ``borrowed_collectives`` names it.
        self.borrowed_collectives: Optional[str] = None
        if not any(k[0] == "all_reduce" for k in self._collectives):
            donors: Dict[str, Dict[Tuple[str, int], _Curve]] = {}
            for fn in sorted(os.listdir(root)):
                m = _PRIM_FILE.match(fn)
                if m and (m["model"], m["size"]) != (model, size):
                    with open(os.path.join(root, fn), newline="") as f:
                        rows = [r for r in csv.reader(f)][1:]
                    donors.setdefault(f"{m['model']}_{m['size']}", {})[(m["coll"], int(m["n"]))] = \
                        _Curve(_pairs(rows, os.path.join(root, fn)))
            for name, curves in sorted(donors.items()):
                if any(k[0] == "all_reduce" for k in curves):
                    self.borrowed_collectives = name
                    for k, c in curves.items():
                        self._collectives.setdefault(k, c)
                    break
        if not self.tables:
            raise FileNotFoundError(
                f"--db {root}: no {model}_{size}_mbs*_tp*_algo*.csv files; "
                f"check --model (available: {', '.join(available_models(root)) or 'none'})")
        names = None
        for key, rows in sorted(self.tables.items()):
            n = [r.name for r in rows]
            if names is None:
                names = n
            elif n != names:
                raise ValueError(f"{root}: operator list of {key} differs from the others")
        self.op_names: List[str] = names
        self.mbs_values = sorted({k[0] for k in self.tables})
        self.tp_values = sorted({k[1] for k in self.tables})
        self.algos = sorted({k[2] for k in self.tables})
        self.p2p_intra = _read_p2p(os.path.join(root, "p2p_intra_node.csv"))
        self.p2p_inter = _read_p2p(os.path.join(root, "p2p_inter_node.csv"))
        # True when the reserve columns hold per-op working sets measured by our profiler
        # (megatron/aceso/profiler.py), not allocator reserves as in the published tables
        self.working_set = read_profile_meta(root, model, size).get("reserved_columns") == "working_set"

    # ---- operators
    def has(self, mbs: int, tp: int, algo: int = 0) -> bool:
        return (mbs, tp, algo) in self.tables

    def ops(self, mbs: int, tp: int, algo: int = 0) -> List[OpRow]:
        try:
            return self.tables[(mbs, tp, algo)]
        except KeyError:
            raise KeyError(
                f"{self.model}_{self.size}: no profile for micro-batch {mbs} per data-parallel "
                f"rank, tp {tp}, algo {algo} (have mbs {self.mbs_values}, tp {self.tp_values}, "
                f"algo {self.algos})") from None

    # ---- collectives
    def collective_ms(self, kind: str, n: int, size_mb: float, gpus_per_node: int = 8) -> float:
        """Time of one collective over ``n`` devices on a message of ``size_mb``.

        Missing tables (after borrowing, see ``__init__``): all_reduce = reduce_scatter +
        all_gather if those exist, else 2 x all_gather. Groups larger than
        the largest table scale the ring factor (n-1)/n and, when they span nodes, the
        intra/inter-node p2p bandwidth ratio.
        """
        if n <= 1 or size_mb <= 0:
            return 0.0
        avail = sorted({k[1] for k in self._collectives if k[0] == kind})
        if not avail:
            if kind == "all_reduce":
                if any(k[0] == "reduce_scatter" for k in self._collectives):
                    return (self.collective_ms("reduce_scatter", n, size_mb, gpus_per_node)
                            + self.collective_ms("all_gather", n, size_mb, gpus_per_node))
                return 2.0 * self.collective_ms("all_gather", n, size_mb, gpus_per_node)
            raise KeyError(f"{self.model}_{self.size}: no {kind} table in {self.root}")
        if n in avail:
            return self._collectives[(kind, n)](size_mb)
        m = max(a for a in avail if a <= n) if any(a <= n for a in avail) else min(avail)
        t = self._collectives[(kind, m)](size_mb) * ((n - 1) / n) / ((m - 1) / m)
        if n > gpus_per_node >= m and self.p2p_inter is not None:
            t *= self.p2p_intra.bandwidth(size_mb) / self.p2p_inter.bandwidth(size_mb)
        return t

    # ---- point to point
    def p2p_ms(self, size_mb: float, inter_node: bool) -> float:
        if size_mb <= 0:
            return 0.0
        table = self.p2p_inter if (inter_node and self.p2p_inter is not None) else self.p2p_intra
        if table is None:
            raise FileNotFoundError(f"{self.root}: no p2p_intra_node.csv")
        return table.time_ms(size_mb)


class _P2P:
    def __init__(self, sizes: List[float], bw: List[float]):
        if len(sizes) != len(bw) or not sizes:
            raise ValueError("p2p table: sizes and bandwidths differ in length")
        self.log_sizes = [math.log2(s) for s in sizes]
        self.bw = bw
        self._t: dict = {}  # size -> ms: a search asks for the same few boundary sizes often

    def bandwidth(self, size_mb: float) -> float:
        x = math.log2(max(size_mb, 1e-9))
        xs, ys = self.log_sizes, self.bw
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_left(xs, x)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def time_ms(self, size_mb: float) -> float:
        # GB/s taken as MB/ms (1 GB = 1000 MB, as a bandwidth figure).
        t = self._t.get(size_mb)
        if t is None:
            t = self._t[size_mb] = size_mb / self.bandwidth(size_mb)
        return t


def _read_p2p(path: str) -> Optional[_P2P]:
    if not os.path.exists(path):
        return None
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    if len(rows) < 2:
        raise ValueError(f"{path}: expected two rows (sizes, bandwidths), found {len(rows)}")
    return _P2P(_numbers(rows[0], path, rows[0]), _numbers(rows[1], path, rows[1]))


def available_models(root: str) -> List[str]:
    out = set()
    for fn in os.listdir(root):
        m = _OP_FILE.match(fn)
        if m:
            out.add(f"{m['model']}_{m['size']}")
    return sorted(out)
