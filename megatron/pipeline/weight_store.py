"""What a deferred weight pass keeps: only the tensors its nodes read, not the whole graph.

The input pass (`BackwardInput`) must keep the autograd graph for the weight pass, and a kept
graph keeps every tensor its nodes saved: all of the micro-batch's activations. The weight pass
(`split_backward.WeightPlan.run`) runs only the boundary nodes (a linear's `AddmmBackward`, a
norm's backward: their weight side) and the weight-side nodes behind them, with the gradient
each boundary captured. So W reads: the weight GEMMs' inputs (and a norm's input and
statistics), the output gradients the boundaries captured, and parameters.

`SavedBoxes` is a `saved_tensors_hooks` pair installed around the stage's forward: each saved
tensor goes into a small box the graph holds instead of the tensor. After the input pass,
`release` asks the boundary and weight-side nodes for their saved tensors (reading a node's
`_saved_*` attributes unpacks through the hook, which marks the box) and empties every other
box. The graph's structure stays (the weight pass starts at its nodes); everything W does not
read is freed at the end of the input pass, as in Megatron-Core's and torchtitan's W-stores of
(input, grad_output), with autograd's own kernels still computing the gradients, so the
weight pass is exactly the whole backward's. A box emptied and then read (a fallback to the
whole walk after release, which `release`'s callers never do) fails loudly.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch


class _Box:
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


_NAMES: dict = {}


def _saved_names(node_type) -> tuple:
    """The `_saved_*` attributes of an autograd node type (dir() is slow: once per type)."""
    names = _NAMES.get(node_type)
    if names is None:
        names = _NAMES[node_type] = tuple(n for n in dir(node_type) if n.startswith("_saved_"))
    return names


class SavedBoxes:
    """Saved tensors of one micro-batch's forward on one stage, in boxes that can be emptied."""

    def __init__(self, where: str = "this stage"):
        self.where = where
        self.boxes: List[_Box] = []
        self._marking: Optional[set] = None
        self.released = False

    def _pack(self, t):
        # A detached alias, as autograd itself saves an output: the pack hook is handed the
        # output tensor object itself, which the executor empties after sending it
        # (`_free_data`); the alias keeps the storage the node saved.
        box = _Box(t.detach())
        self.boxes.append(box)
        return box

    def _unpack(self, box):
        if self._marking is not None:
            self._marking.add(id(box))
        if box.tensor is None:
            raise RuntimeError(f"{self.where}: a tensor the weight pass released was read again; the split "
                               "backward walked a node outside its weight plan (set "
                               "PipelineExecutor.split_weight_pass = False to keep whole graphs)")
        return box.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def read_by(self, nodes: Iterable) -> set:
        """ids of the boxes the autograd `nodes` saved (by reading each saved attribute)."""
        self._marking = marked = set()
        try:
            for node in nodes:
                for name in _saved_names(type(node)):
                    getattr(node, name)
                if hasattr(node, "saved_tensors"):  # a custom autograd.Function's node
                    node.saved_tensors
        finally:
            self._marking = None
        return marked

    def release(self, nodes: Iterable) -> None:
        """Empty every box the `nodes` (those the weight pass runs) did not save."""
        keep = self.read_by(nodes)
        for box in self.boxes:
            if id(box) not in keep:
                box.tensor = None
        self.boxes = [b for b in self.boxes if b.tensor is not None]
        self.released = True

    def tensors(self) -> list:
        return [b.tensor for b in self.boxes if b.tensor is not None]


def unique_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind `tensors` (a view keeps its whole storage), those
    of `exclude` (parameters: not activation memory) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in skip or key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total
