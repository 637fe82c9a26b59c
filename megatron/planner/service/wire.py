"""The plan service's record for one iteration: a fixed schema, never a pickle.

The TCP store is a port anyone on the network can write to, so what a rank reads from it must
not be able to run code. A record is

    b"MPIR" | version u16 | kind u8 | reserved u8 | json_len u32 | n_blobs u32 | blob_len u32 * n_blobs
    | json (utf-8) | blobs

kind 0 ("value"): the JSON is the whole result (numbers, strings, lists, dicts: what tests and
simple planners return). kind 1 ("dynapipe"): the JSON carries a `DynaPipeIterationPlan`'s
scalar fields and per data-parallel group its micro-batch sample ids, shapes, schedule and
predicted peaks; each group's per-pipeline-rank `ExecutionPlan`s travel as blobs in the
validated binary plan format (`ExecutionPlan.serialize`). Every length is checked against the
bytes actually present before anything is sliced or parsed, and every field of the JSON is
type-checked, so a forged or truncated record is a ValueError naming what is wrong.
"""
from __future__ import annotations

import json
import math
import struct
import sys
from typing import Any

from megatron.pipeline.instructions import ExecutionPlan

MAGIC = b"MPIR"
VERSION = 1
_HEADER = struct.Struct("<4sHBBII")
KIND_VALUE, KIND_DYNAPIPE = 0, 1
MAX_RECORD_BYTES = 1 << 30  # far above any real iteration (a few MB); a bigger record is forged


def encode(result: Any) -> bytes:
    dynapipe = sys.modules.get("megatron.planner.dynapipe.planner")  # loaded wherever such a plan exists
    if dynapipe is not None and isinstance(result, dynapipe.DynaPipeIterationPlan):
        head, blobs = _dynapipe_to_json(result)
        kind = KIND_DYNAPIPE
    else:
        head, blobs, kind = result, [], KIND_VALUE
    body = json.dumps(head, separators=(",", ":"), allow_nan=False).encode()
    return (_HEADER.pack(MAGIC, VERSION, kind, 0, len(body), len(blobs))
            + struct.pack(f"<{len(blobs)}I", *map(len, blobs)) + body + b"".join(blobs))


def decode(data: bytes) -> Any:
    data = memoryview(data)
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(data)} bytes is over the {MAX_RECORD_BYTES}-byte limit")
    if len(data) < _HEADER.size:
        raise ValueError(f"record is truncated: {len(data)} bytes, the header alone is {_HEADER.size}")
    magic, version, kind, reserved, jlen, nblobs = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a plan record (starts with {bytes(data[:4])!r}, expected {MAGIC!r}); "
                         f"plans are never unpickled")
    if version != VERSION or reserved != 0 or kind not in (KIND_VALUE, KIND_DYNAPIPE):
        raise ValueError(f"plan record version {version} kind {kind} (reserved {reserved}); this build reads "
                         f"version {VERSION} kinds 0-1 (planner and trainer out of sync?)")
    # Sizes first, against the bytes present: a forged count cannot make us allocate.
    if nblobs > (len(data) - _HEADER.size) // 4:
        raise ValueError(f"record is truncated: it claims {nblobs} plan blobs and has {len(data)} bytes in all")
    lens = struct.unpack_from(f"<{nblobs}I", data, _HEADER.size)
    start = _HEADER.size + 4 * nblobs
    if start + jlen + sum(lens) != len(data):
        raise ValueError(f"record is truncated or has trailing bytes: {len(data)} bytes, its header says "
                         f"{start + jlen + sum(lens)}")
    try:
        head = json.loads(bytes(data[start:start + jlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (nesting deep enough to exhaust the stack)
        raise ValueError(f"record's JSON part is corrupt: {type(e).__name__}: {str(e)[:160]}") from None
    blobs, off = [], start + jlen
    for n in lens:
        blobs.append(bytes(data[off:off + n]))
        off += n
    if kind == KIND_VALUE:
        if blobs:
            raise ValueError("a value record carries no plan blobs")
        return head
    return _dynapipe_from_json(head, blobs)


_SCALARS = {"iteration": int, "recompute": str, "makespan_ms": float, "padding_efficiency": float,
            "planning_ms": float, "lowering_ms": float, "memory_fallback": bool}
_GROUP = {"microbatches": list, "shapes": list, "schedule": str, "makespan_ms": float, "peak_memory_mb": list,
          "num_plans": int}


def _dynapipe_to_json(plan):
    head = {k: getattr(plan, k) for k in _SCALARS}
    groups, blobs = [], []
    for g in plan.groups:
        groups.append({"microbatches": [[int(i) for i in mb] for mb in g.microbatches],
                       "shapes": [[[int(d) for d in s] for s in shp] for shp in g.shapes],
                       "schedule": g.schedule, "makespan_ms": float(g.makespan_ms),
                       "peak_memory_mb": [float(x) for x in g.peak_memory_mb], "num_plans": len(g.plans),
                       "token_slices": None if g.token_slices is None
                       else [[int(x) for x in u] for u in g.token_slices],
                       "rows": None if g.rows is None else [[[int(i) for i in r] for r in mb] for mb in g.rows],
                       "cp": None if g.cp is None else [[int(x) for x in u] for u in g.cp]})
        blobs.extend(p.serialize() for p in g.plans)
    head["groups"] = groups
    return head, blobs


def _typed(d, schema, where):
    if not isinstance(d, dict):
        raise ValueError(f"{where} is not an object")
    for k, t in schema.items():
        v = d.get(k)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) if t is float else \
            isinstance(v, int) and not isinstance(v, bool) if t is int else isinstance(v, t)
        if not ok:
            raise ValueError(f"{where}.{k} is {type(v).__name__}, expected {t.__name__}")


def _ints(x, depth, where):
    if depth == 0:
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise ValueError(f"{where} holds {x!r}, expected a non-negative integer")
        return x
    if not isinstance(x, list):
        raise ValueError(f"{where} is {type(x).__name__}, expected a list")
    return [_ints(v, depth - 1, where) for v in x]


def _cp_pairs(x, n: int, where: str) -> list:
    """Variable CP: [size >= 1, index < size] per micro-batch."""
    got = _ints(x, 2, where)
    if len(got) != n or any(len(u) != 2 or u[0] < 1 or u[1] >= u[0] for u in got):
        raise ValueError(f"{where} must hold [CP size, index in the sub-group] for each of the {n} micro-batches")
    return got


def _dynapipe_from_json(head, blobs):
    from megatron.planner.dynapipe.base import DynaPipeIterationPlan, GroupPlan
    _typed(head, _SCALARS, "plan")
    groups_json = head.get("groups")
    if not isinstance(groups_json, list):
        raise ValueError("plan.groups is not a list")
    groups, used = [], 0
    for gi, g in enumerate(groups_json):
        where = f"plan.groups[{gi}]"
        _typed(g, _GROUP, where)
        mbs = _ints(g["microbatches"], 2, f"{where}.microbatches")
        shapes = [tuple(tuple(s) for s in shp) for shp in _ints(g["shapes"], 3, f"{where}.shapes")]
        if len(shapes) != len(mbs):
            raise ValueError(f"{where}: {len(mbs)} micro-batches but {len(shapes)} shapes")
        n = g["num_plans"]
        if n < 0 or used + n > len(blobs):
            raise ValueError(f"{where} claims {n} pipeline plans; the record has {len(blobs) - used} left")
        plans = [ExecutionPlan.deserialize(b) for b in blobs[used:used + n]]
        used += n
        peaks = g["peak_memory_mb"]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in peaks):
            raise ValueError(f"{where}.peak_memory_mb holds a non-number")
        groups.append(GroupPlan(microbatches=mbs, shapes=shapes, schedule=g["schedule"],
                                makespan_ms=float(g["makespan_ms"]), peak_memory_mb=[float(x) for x in peaks],
                                plans=plans, token_slices=None if g.get("token_slices") is None
                                else [tuple(u) for u in _ints(g["token_slices"], 2, f"{where}.token_slices")],
                                rows=None if g.get("rows") is None else _ints(g["rows"], 3, f"{where}.rows"),
                                cp=None if g.get("cp") is None else _cp_pairs(g["cp"], len(mbs), f"{where}.cp")))
    if used != len(blobs):
        raise ValueError(f"record has {len(blobs) - used} plan blobs no group claims")
    kw = {k: head[k] for k in _SCALARS}
    return DynaPipeIterationPlan(groups=groups, **{k: (float(v) if _SCALARS[k] is float else v)
                                                   for k, v in kw.items()})
