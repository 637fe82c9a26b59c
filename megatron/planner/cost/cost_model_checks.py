"""Checks a cost-model document passes before any of it is used (issue 23).

A cost model decides what the planners run; a file someone else wrote (or a profiler bug) must
not turn into a plan through a traceback, a hang on a huge array, a NaN that compares false
everywhere, or a negative time that makes a plan look free. Each function returns the first
problem as one line (the caller adds the file name), or None.

What is refused:
* not JSON, or JSON with NaN / Infinity literals (an unmeasured shape is ``null``);
* wrong types anywhere (a string where a number belongs, a list where an object does, booleans
  as numbers), wrong nesting or shapes, unknown components, non-increasing axes;
* more than `MAX_PROFILES` profiles, `MAX_AXIS` values on an axis or `MAX_CELLS` cells in a grid;
* negative or infinite times, memory or parameter sizes;
* a fitted model (TeraPipe's context term) that predicts a negative time or one that falls as
  the slice, the context or the micro-batch grows anywhere on its grid.

Measured tables are not refused for a time that falls between two neighbouring grid points:
that is measurement noise, and the published A100 tables have up to 40 % of it (the DynaPipe
GPT-6.7B table's forward time falls in 124 places along the sequence axis).
"""
from __future__ import annotations

import itertools
import json
import math
from typing import Optional

import numpy as np

MAX_FILE_BYTES = 64 * 2 ** 20
MAX_PROFILES = 256
MAX_AXIS = 4096
MAX_CELLS = 2_000_000


def _reject_constant(name):
    raise ValueError(f"{name} is not allowed in a cost model (an unmeasured shape is null)")


def parse(text: str):
    """json.loads that refuses NaN/Infinity literals and oversized documents."""
    if len(text) > MAX_FILE_BYTES:
        raise ValueError(f"{len(text)} bytes is over the {MAX_FILE_BYTES // 2 ** 20} MiB a cost model may have")
    return json.loads(text, parse_constant=_reject_constant)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number(x, where: str, *, positive=False) -> Optional[str]:
    if not _is_num(x):
        return f"{where}: expected a number, got {type(x).__name__} {str(x)[:40]!r}"
    if not math.isfinite(x):
        return f"{where}: {x} is not finite"
    if x < 0 or (positive and x == 0):
        return f"{where}: {x} is {'negative' if x < 0 else 'zero'}"
    return None


def _axis(vals, where: str) -> Optional[str]:
    if not isinstance(vals, list) or not vals:
        return f"{where}: expected a non-empty list of numbers"
    if len(vals) > MAX_AXIS:
        return f"{where}: {len(vals)} values, at most {MAX_AXIS} allowed"
    for i, v in enumerate(vals):
        err = _number(v, f"{where}[{i}]", positive=True)
        if err:
            return err
    if any(b <= a for a, b in zip(vals, vals[1:])):
        return f"{where}: values must be strictly increasing"
    return None


def _table(vals, shape, where: str) -> Optional[str]:
    """A nested list of `shape` holding numbers >= 0 or null (level by level, then vectorised:
    the T5 table has 300k cells and is read at every planner start)."""
    level = [vals]
    for depth, n in enumerate(shape):
        if not all(type(v) is list and len(v) == n for v in level):
            i = next(i for i, v in enumerate(level) if not (type(v) is list and len(v) == n))
            got = f"{len(level[i])} entries" if isinstance(level[i], list) else type(level[i]).__name__
            idx = "".join(f"[{k}]" for k in np.unravel_index(i, shape[:depth])) if depth else ""
            return f"{where}{idx}: expected a list of {n} (the axis length), got {got}"
        level = list(itertools.chain.from_iterable(level))
    kinds = set(map(type, level))
    if not kinds <= {int, float, type(None)}:
        i = next(i for i, v in enumerate(level) if type(v) not in (int, float, type(None)))
        idx = "".join(f"[{k}]" for k in np.unravel_index(i, shape))
        return f"{where}{idx}: expected a number or null, got {type(level[i]).__name__} {str(level[i])[:40]!r}"
    arr = np.array([np.nan if v is None else v for v in level], dtype=np.float64)
    bad = np.isinf(arr) | (arr < 0)
    if bad.any():
        i = int(np.argmax(bad))
        idx = "".join(f"[{k}]" for k in np.unravel_index(i, shape))
        return f"{where}{idx}: {level[i]} is {'negative' if arr[i] < 0 else 'not finite'}"
    return None


def document_problem(doc, component_axes: dict, levels, quantities, fmt: str, version: int) -> Optional[str]:
    """First problem of a planner cost-model document (format `fmt`), or None."""
    if not isinstance(doc, dict):
        return f"not a cost model file (the top level is a {type(doc).__name__}, not an object)"
    if doc.get("format") != fmt:
        return f"not a cost model file (format field is {repr(doc.get('format'))[:60]})"
    versions = tuple(version) if isinstance(version, (tuple, list)) else (version,)
    if doc.get("version") not in versions:
        return (f"unsupported cost model version {repr(doc.get('version'))[:20]}; this code reads "
                f"{', '.join(map(str, versions))}")
    for key, typ in (("model", dict), ("name", str), ("profiles", list)):
        if key in doc and not isinstance(doc[key], typ):
            return (f"{key!r} must be a{'n object' if typ is dict else ' ' + typ.__name__}, "
                    f"got {type(doc[key]).__name__}")
    profiles = doc.get("profiles", [])
    if len(profiles) > MAX_PROFILES:
        return f"{len(profiles)} profiles, at most {MAX_PROFILES} allowed"
    for i, p in enumerate(profiles):
        if not isinstance(p, dict):
            return f"profile {i}: expected an object, got {type(p).__name__}"
        tp = p.get("tp")
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= 65536:
            return f"profile {i}: tp must be a positive integer, got {str(tp)[:20]!r}"
        if p.get("recompute") not in levels:
            return f"profile {i}: recompute must be one of {tuple(levels)}, got {str(p.get('recompute'))[:30]!r}"
        where = f"profile {i} (tp={tp}, {p['recompute']})"
        state = p.get("model_state_mb")
        if not isinstance(state, dict):
            return f"{where}: model_state_mb must be an object of MB per component"
        for k, v in state.items():
            err = _number(v, f"{where} model_state_mb[{k!r}]")
            if err:
                return err
        comps = p.get("components")
        if not isinstance(comps, dict):
            return f"{where}: components must be an object"
        for comp, g in comps.items():
            if comp not in component_axes:
                return f"{where}: unknown component {str(comp)[:30]!r}; known: {sorted(component_axes)}"
            w = f"{where} {comp}"
            if not isinstance(g, dict):
                return f"{w}: expected an object"
            names = component_axes[comp]
            if g.get("axes") != list(names):
                return f"{w}: axes must be {list(names)}, got {str(g.get('axes'))[:60]}"
            shape = []
            for a in names:
                err = _axis(g.get(a), f"{w} {a}")
                if err:
                    return err
                shape.append(len(g[a]))
            if math.prod(shape) > MAX_CELLS:
                return f"{w}: {math.prod(shape)} grid cells, at most {MAX_CELLS} allowed"
            if "forward_ms" not in g or "backward_ms" not in g:
                return f"{w}: forward_ms and backward_ms are required"
            for q in quantities:
                if q in g:
                    err = _table(g[q], shape, f"{w} {q}")
                    if err:
                        return err
    return None


def latency_problem(mbs, seq, t0_ms, coef, p2p=(0.0, 0.0)) -> Optional[str]:
    """First structural problem of a TeraPipe latency file (axes, table shape, numbers), or None.
    Whether the times it predicts are sound is `SliceLatencyModel.problems()`, which also checks
    models built in code."""
    for name, ax in (("mbs", mbs), ("seq", seq)):
        err = _axis(ax, name)
        if err:
            return err
    err = _table(t0_ms, [len(mbs), len(seq)], "t0_ms")
    if err:
        return err
    if not isinstance(coef, list) or len(coef) != 3 or not all(_is_num(c) and math.isfinite(c) for c in coef):
        return f"context_coef must be a list of 3 finite numbers, got {str(coef)[:60]}"
    for name, v in zip(("p2p_ms_per_mb", "p2p_latency_ms"), p2p):
        err = _number(v, name)
        if err:
            return err
    return None
