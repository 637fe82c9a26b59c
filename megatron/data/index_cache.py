"""Build-once, load-everywhere cache of dataset index arrays (.npy).

Megatron's scheme: rank 0 builds the arrays and saves them under --data-cache-path (or
next to the data), the other ranks wait at a barrier and then memory-map the files.
If after the barrier a rank still cannot see the files (no shared filesystem between
nodes, Megatron-LM issues #907/#356), it builds its own copy instead of failing: the
arrays are deterministic, so every rank gets the same result.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from typing import Callable, Optional

import numpy as np

from megatron.atomic import atomic_path, write_text


def _dist():
    try:
        import torch.distributed as dist
        return dist if dist.is_available() and dist.is_initialized() else None
    except ImportError:  # pragma: no cover - torch is a hard dependency of the trainer
        return None


def is_rank_zero() -> bool:
    d = _dist()
    return d is None or d.get_rank() == 0


def barrier() -> None:
    d = _dist()
    if d is not None:
        d.barrier()


def _save_atomic(path: str, arr: np.ndarray) -> None:
    with atomic_path(path, suffix=".tmp.npy") as tmp:  # np.save appends .npy to any other name
        np.save(tmp, arr, allow_pickle=False)


def cached_arrays(cache_dir: Optional[str], description: str, kind: str, names: list[str],
                  build: Callable[[], dict]) -> dict:
    """Return {name: array} for `names`, building with `build()` at most once per cache.

    `description` must capture every input of `build` (paths, split, seq length, seed,
    sample counts); its md5 names the files, and it is written next to them so a user
    can see what a cache entry is.  With cache_dir None nothing is written.
    """
    if cache_dir is None:
        return build()
    digest = hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()
    paths = {n: os.path.join(cache_dir, f"{digest}-{kind}-{n}.npy") for n in names}
    desc_path = os.path.join(cache_dir, f"{digest}-{kind}-description.txt")

    def complete() -> bool:
        return all(os.path.exists(p) for p in paths.values())

    built = None
    if is_rank_zero() and not complete():
        built = build()
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for n, p in paths.items():
                _save_atomic(p, np.asarray(built[n]))
            write_text(desc_path, description)
        except OSError as exc:  # read-only data folder: train anyway, just uncached
            warnings.warn(f"cannot write dataset index cache under {cache_dir} ({exc}); indices are rebuilt "
                          "on every run and by every rank; pass --data-cache-path to a writable folder")
    barrier()
    if built is not None and not complete():
        return built
    if not complete():  # not visible here (node-local disk): build locally, same result
        arrays = build()
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for n, p in paths.items():
                _save_atomic(p, np.asarray(arrays[n]))
        except OSError:
            pass
        return arrays
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}
