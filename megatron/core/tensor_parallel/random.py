"""RNG for tensor parallelism and layout-independent initialisation.

* `RNGStatesTracker` keeps a named RNG stream for tensor-parallel regions: dropout on sharded
  activations (attention probabilities) must differ across TP ranks, while dropout on
  replicated activations must not. `fork()` swaps the device generator's state in and out.
* `checkpoint()` recomputes a function in backward with the RNG streams (default and tracked)
  replayed exactly, so recomputed dropout masks equal the original ones.
* `init_generator()` derives a per-parameter generator from (seed, parameter key), so every
  parameter starts identical whatever the TP/PP layout: parity tests rely on it.
"""
from __future__ import annotations

import contextlib
import zlib

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.states: dict[str, torch.Tensor] = {}
        self.active: set = set()  # streams forked right now (the global RNG *is* that stream)

    def reset(self):
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device_type)
        _set_state(saved, self.device_type)

    def get_states(self) -> dict:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added; call model_parallel_seed() first")
        active = self.active
        if name in active:
            # Already drawing from this stream (sequence parallelism forks around a whole block
            # and attention forks again): re-entering would restart from the stale saved state.
            yield
            return
        active.add(name)
        saved = _get_state(self.device_type)
        _set_state(self.states[name], self.device_type)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(saved, self.device_type)
            active.discard(name)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int, device_type: str = "cpu") -> None:
    """Megatron's seeding: default stream seed + 100*pp_rank; TP stream + 2718 + tp_rank."""
    base = seed + 100 * pp_rank
    torch.manual_seed(base)
    if device_type == "cuda":
        torch.cuda.manual_seed(base)
    _TRACKER.device_type = device_type
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, base + 2718 + tp_rank)


def init_generator(seed: int, key: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 63))
    return g


def checkpoint(fn, *args):
    """Activation checkpointing that also replays the tracked TP RNG streams."""
    tracker = _TRACKER
    snapshot = tracker.get_states()
    # A stream forked around this call (sequence parallelism forks around whole blocks) lives
    # in the global RNG, which torch's checkpoint restores for the recompute: mark it forked
    # again then, so nested forks draw from it exactly as the first forward did.
    active = set(tracker.active)
    calls = [0]

    def run(*a):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        current, current_active = tracker.get_states(), tracker.active
        tracker.set_states(snapshot)
        tracker.active = set(active)
        try:
            return fn(*a)
        finally:
            tracker.set_states(current)
            tracker.active = current_active

    return _torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
