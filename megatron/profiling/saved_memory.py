"""What a forward pass keeps for its backward pass, measured on any device (CPU included).

``measure_saved(fn, make_inputs)`` runs ``fn(*make_inputs())`` and reports, with each storage
counted once (views and in-place results share their base's storage):

- ``saved_bytes``: storages autograd saves for backward, seen by
  ``torch.autograd.graph.saved_tensors_hooks`` (parameters excluded). Tensors saved inside a
  non-reentrant checkpoint segment are not seen (they are dropped); the segment's inputs are
  (torch saves them for the recompute).
- ``kept_bytes``: storages allocated during the forward pass (or handed to it as inputs) that
  are still alive after it, once the caller's references are dropped, the output's excluded:
  the memory the forward pass leaves behind for backward, whoever holds it.
- ``peak_bytes``: the largest total of live storages allocated in the measured region (inputs,
  activations, output, gradients flowing backward; parameter gradients excluded), sampled at
  every dispatched operator over forward and, with ``backward=True``, backward.

``measure_working_set(fn, make_inputs)`` reports, for one operator, what it needs while it runs
beyond what is live around it: ``forward_bytes``, the peak of new storages during its forward
(output, saved tensors, temporaries), and ``backward_bytes``, the peak during its backward
above what the forward left (incoming gradient, gradient of the input, temporaries, and the
temporaries of accumulating into existing parameter gradients).

Liveness is tracked with weak references to storages, so no allocator support is needed.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class SavedMemory:
    saved_bytes: int
    kept_bytes: int
    peak_bytes: int


class _Tracker(TorchDispatchMode):
    """Records every storage an operator returns; keeps (birth, death, bytes) per storage."""

    def __init__(self, skip=frozenset()):
        super().__init__()
        self.skip = skip    # storages of parameters (views of weights are not allocations)
        self.clock = 0
        self.refs = {}      # cdata -> [StorageWeakRef, nbytes, birth, death or None]
        self.alive: List[int] = []

    def track(self, tensors: Iterable) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            st = t.untyped_storage()
            ref = StorageWeakRef(st)
            if ref.cdata in self.refs or ref.cdata in self.skip:
                continue  # the weak reference keeps the storage object, so cdata is never reused
            self.refs[ref.cdata] = [ref, st.nbytes(), self.clock, None]
            self.alive.append(ref.cdata)

    def sweep(self) -> None:
        self.clock += 1
        still = []
        for k in self.alive:
            rec = self.refs[k]
            if rec[0].expired():
                rec[3] = self.clock
            else:
                still.append(k)
        self.alive = still

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sweep()
        self.track(tree_flatten(out)[0])
        return out

    def live_bytes(self, exclude=frozenset()) -> int:
        return sum(self.refs[k][1] for k in self.alive if k not in exclude)

    def peak(self, exclude=frozenset(), since: int = 0, until: Optional[int] = None) -> int:
        """Largest live total in ticks (``since``, ``until``], above what was live at ``since``."""
        events = []
        for k, (_, nb, birth, death) in self.refs.items():
            if k in exclude:
                continue
            events.append((birth, nb))
            if death is not None:
                events.append((death, -nb))
        events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations at the same tick
        cur = best = base = 0
        for t, d in events:
            cur += d
            if t <= since:
                base = best = cur
            elif until is None or t <= until:
                best = max(best, cur)
        return best - base


def _cdatas(tensors) -> set:
    out = set()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            ref = StorageWeakRef(t.untyped_storage())
            out.add(ref.cdata)
    return out


def measure_saved(fn: Callable, make_inputs: Callable[[], Sequence], *, params: Iterable = (),
                  backward: bool = True, grad_output: Callable = torch.ones_like) -> SavedMemory:
    """Measure ``fn(*make_inputs())``. ``params``: tensors never counted (weights); their
    gradients are left out of the peak. ``make_inputs`` should return fresh tensors nobody else
    holds, so the inputs count as kept only if the forward pass keeps them; make them non-leaf
    (``randn(...).requires_grad_() * 1``) as a layer's input is: a leaf requiring grad is held by
    its gradient accumulator whatever the forward pass saves."""
    params = list(params)
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen, saved = set(), [0]

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key[0] not in param_ptrs and key not in seen:
            seen.add(key)
            saved[0] += key[1]
        return t

    gc.collect()
    tracker = _Tracker(skip=_cdatas(params))
    inputs = list(make_inputs())
    tracker.track(tree_flatten(inputs)[0])
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*inputs)
        inputs.clear()
        gc.collect()
        tracker.sweep()
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        kept = tracker.live_bytes(exclude=_cdatas(outs))
        if backward:
            diff = [t for t in outs if t.requires_grad]
            torch.autograd.backward(diff, [grad_output(t) for t in diff])
        del out, outs
        gc.collect()
        tracker.sweep()
    grads = _cdatas([p.grad for p in params if p.grad is not None])
    return SavedMemory(saved[0], kept, tracker.peak(exclude=grads))


@dataclass
class WorkingSet:
    forward_bytes: int
    backward_bytes: int


def measure_working_set(fn: Callable, make_inputs: Callable[[], Sequence], *, params: Iterable = (),
                        grad_output: Callable = torch.ones_like) -> WorkingSet:
    """Working memory of one operator ``fn(*make_inputs())`` (see the module docstring).

    Parameter gradients are made to exist first (zeros), as they do from the second
    micro-batch of a step on: the temporaries of accumulating into them are counted, the
    gradient buffers themselves are not (the weights' share of a stage's memory holds them)."""
    params = list(params)
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    gc.collect()
    tracker = _Tracker(skip=_cdatas(params) | _cdatas([p.grad for p in params if p.grad is not None]))
    inputs = list(make_inputs())
    tracker.track(tree_flatten(inputs)[0])
    with tracker:
        tracker.sweep()
        start = tracker.clock
        out = fn(*inputs)
        tracker.sweep()
        mid = tracker.clock
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:  # an op of constants (nothing requires grad) has no backward
            torch.autograd.backward(outs, [grad_output(t) for t in outs])
        del out, outs
        tracker.sweep()
    return WorkingSet(tracker.peak(since=start, until=mid), tracker.peak(since=mid))
