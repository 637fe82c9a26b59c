"""Reading checkpoint files without running code from them.

A `.pt` file is a pickle, and a pickle can call any function (`os.system`, ...) while it is
read. Checksums and the manifest guard against corruption, not against the person who wrote
the file, so every reader of this project loads with `torch.load(weights_only=True)`: the
file may hold tensors, numbers, strings, None and containers, nothing else.

What this project writes is exactly that (config as a plain dict, RNG states as tensors and
plain lists, optimizer state as torch's state dict, grad scaler and scheduler as numbers).
Checkpoints written by earlier versions held one more thing: numpy's RNG state as a
`numpy.ndarray` of uint32. Those files load through a scoped allowlist of numpy's array
reconstruction (`_reconstruct`, `ndarray`, `dtype`) instead of a `--load-unsafe-pickle` flag:
that is enough for every file this project ever wrote, the allowlisted callables only build
arrays (their contents still go through the same restricted unpickler), and after loading we
check that the only array sits where the RNG state belongs and is uint32 — a file with an
array anywhere else is refused. Anything else (a class, a function) is refused with the file
name and the type it names.
"""
from __future__ import annotations

import argparse
import pickle
import re
import types
from typing import Any

import numpy as np
import torch


class UnsafeCheckpointError(ValueError):
    """The file references something other than tensors, numbers, strings and containers."""


def _legacy_numpy_globals() -> list:
    mod = getattr(np, "_core", None) or np.core  # numpy 2 moved multiarray to numpy._core
    rec = mod.multiarray._reconstruct
    out = [rec, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    # A file written under numpy 1 names the function by its old module path.
    out.append((rec, "numpy.core.multiarray._reconstruct"))
    return out


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)|got <class '([\w.]+)'>")


def _offending(e: Exception) -> str:
    text = str(e)
    m = _GLOBAL_RE.search(text)
    if m:
        return m.group(1) or m.group(2)
    for line in text.splitlines():  # torch's own description of what it refused
        if "Unsupported" in line or "Can only build" in line:
            return line.replace("WeightsUnpickler error:", "").strip()[:160]
    return type(e).__name__


def _arrays(obj, path=()):
    """(path, array) for every numpy array inside every container a load may return: dicts,
    lists, tuples, argparse.Namespace and types.SimpleNamespace (Megatron's `args`). Walked with
    an explicit stack, not recursion: a file nesting 100,000 lists is walked, not a RecursionError."""
    stack = [(obj, tuple(path))]
    while stack:
        o, where = stack.pop()
        if isinstance(o, np.ndarray):
            yield where, o
        elif isinstance(o, dict):
            stack.extend((v, where + (k,)) for k, v in o.items())
        elif isinstance(o, (list, tuple)):
            stack.extend((v, where + (i,)) for i, v in enumerate(o))
        elif isinstance(o, (argparse.Namespace, types.SimpleNamespace)):
            stack.append((vars(o), where + ("args",)))


def numpy_rng_to_plain(st) -> dict:
    """np.random.get_state() as plain values (what a weights_only load accepts)."""
    kind, keys, pos, has_gauss, cached = st
    return {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached)}


def numpy_rng_from_plain(st) -> tuple:
    if isinstance(st, dict):
        return (st["kind"], np.asarray(st["keys"], dtype=np.uint32), st["pos"], st["has_gauss"],
                st["cached_gaussian"])
    return tuple(st)  # an older checkpoint's tuple with its uint32 array


def safe_load(path: str) -> Any:
    """`torch.load(path, weights_only=True)` on CPU. Raises UnsafeCheckpointError naming `path`
    and the offending type for a file that references code; other read errors pass through."""
    try:
        with torch.serialization.safe_globals(_legacy_numpy_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: refused to load: the file references `{_offending(e)}`, which is not a tensor, number, "
            f"string or container (a checkpoint must not carry code; was it written by another program or "
            f"tampered with?)") from None
    for where, arr in _arrays(state):
        legacy_rng = where[-3:-1] == ("rng_state", "numpy") and where[-1] == 1 and arr.dtype == np.uint32
        if not legacy_rng:
            raise UnsafeCheckpointError(
                f"{path}: refused to load: a numpy array ({arr.dtype}) at {'/'.join(map(str, where))}; "
                f"only an older checkpoint's numpy RNG state may be an array")
    return state
