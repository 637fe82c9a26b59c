"""The weight pass of a split backward without walking the input-gradient path twice.

The input pass (`BackwardInput`) runs autograd from the stage's outputs restricted to its
inputs. Every autograd node it runs that also feeds parameters through nodes off the input path
(a linear's `AddmmBackward`, a norm's backward, a fused bias op) is a *boundary*: a pre-hook
keeps the gradient it receives. The weight pass (`BackwardWeight`) then starts autograd at each
boundary with that gradient, restricted to the parameters behind it, so the engine runs only
the weight side of those nodes (the weight GEMMs) and nothing of the input path again. Still
autograd, no hand-written backward; the parameters' gradients are the same kernels' results
as in one whole backward.

`WeightPlan.build` returns None where this does not hold and the executor then walks the kept
graph again: recompute (each autograd call would replay the checkpointed segments), a stage
without input gradient (stage 0: its weight pass is the whole backward anyway), a parameter or
weight-side node reached from two boundaries (its accumulation order would change), a leaf
the stage does not own (zb-v's last stage borrows the first stage's embedding weight).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, get_gradient_edge


def _nexts(node):
    return [n for n, _ in node.next_functions if n is not None]


class WeightPlan:
    """Boundary nodes, their captured gradients and the parameters behind each."""

    def __init__(self, boundaries, params_of, owner=None, eager=None):
        self.boundaries = boundaries          # [node]
        self.params_of = params_of            # node -> [param]
        # A custom autograd.Function computes every gradient it returns, needed or not (the fused
        # bias-GeLU and bias-dropout-add): the input pass already computes its parameters'
        # gradients. `eager`: node -> [(index in next_functions, leaf node, input_nr)] of such
        # boundaries whose weight side is the parameters' accumulators alone; a post hook keeps
        # those gradients and the weight pass hands them to the accumulators (same values, same
        # accumulation point), so the node itself, its saved tensors and its incoming gradient
        # are not kept for W.
        self.eager = eager or {}
        # Every node the weight pass runs: the other boundaries and the weight-side nodes behind
        # them (what `weight_store.SavedBoxes.release` keeps the saved tensors of).
        owner = owner or {}
        self.nodes = [n for n in boundaries if n not in self.eager] + [k for k, b in owner.items()
                                                                      if b not in self.eager]
        self.captured: dict = {}
        self._hooks = [n.register_hook(self._keep_eager(n)) if n in self.eager else
                       n.register_prehook(self._capture(n)) for n in boundaries]

    def _capture(self, node):
        def hook(grad_outputs):
            self.captured[node] = grad_outputs
        return hook

    def _keep_eager(self, node):
        def hook(grad_inputs, grad_outputs):
            self.captured[node] = tuple(grad_inputs[i] for i, _, _ in self.eager[node])
        return hook

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @classmethod
    def build(cls, outputs, inputs, params) -> Optional["WeightPlan"]:
        roots = [o.grad_fn for o in outputs if o.requires_grad and o.grad_fn is not None]
        ins = [t for t in inputs if t.requires_grad]
        if not roots or not ins:
            return None
        input_nodes = {get_gradient_edge(t).node for t in inputs if t.requires_grad}
        param_of = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
        seen, stack, order = set(), list(roots), []
        while stack:  # every node of the stage's graph
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            order.append(n)
            stack.extend(_nexts(n))
        if any(hasattr(n, "variable") and n not in param_of and n not in input_nodes for n in order):
            return None  # a leaf the stage does not own (zb-v's borrowed tied embedding): whole walk
        # Reachability of the inputs / the parameters, children before parents.
        reach_in, reach_p, done = {}, {}, set()

        def visit(n):
            stack = [(n, False)]
            while stack:
                x, expanded = stack.pop()
                if x in done:
                    continue
                if expanded:
                    kids = _nexts(x)
                    reach_in[x] = x in input_nodes or any(reach_in[k] for k in kids)
                    reach_p[x] = x in param_of or any(reach_p[k] for k in kids)
                    done.add(x)
                else:
                    stack.append((x, True))
                    stack.extend((k, False) for k in _nexts(x) if k not in done)
        for r in roots:
            visit(r)
        boundaries, params_of, owner, eager = [], {}, {}, {}
        for n in order:
            if not reach_in[n]:
                continue
            side = [k for k in _nexts(n) if not reach_in[k] and reach_p[k]]
            if not side:
                continue
            if isinstance(n, BackwardCFunction) and all(k in param_of for k in side):
                eager[n] = [(i, k, nr) for i, (k, nr) in enumerate(n.next_functions) if k in side]
            behind, stack = [], list(side)
            while stack:  # the weight-side subgraph behind this boundary
                k = stack.pop()
                if k in owner:
                    if owner[k] is not n:
                        return None  # shared with another boundary: keep the whole walk
                    continue
                owner[k] = n
                if k in param_of:
                    behind.append(param_of[k])
                stack.extend(x for x in _nexts(k) if reach_p[x])
            boundaries.append(n)
            params_of[n] = behind
        reachable = {id(param_of[n]) for n in order if n in param_of}
        covered = {id(p) for ps in params_of.values() for p in ps}
        if not boundaries or reachable != covered:
            return None  # a parameter the boundaries do not reach: keep the whole walk
        return cls(boundaries, params_of, owner, eager)

    def complete(self) -> bool:
        """Every boundary received its gradient in the input pass (`run` will not fall back)."""
        return all(n in self.captured for n in self.boundaries)

    def captured_tensors(self) -> list:
        return [g for grads in self.captured.values() for g in grads if g is not None]

    def _edges(self, n):
        grads = self.captured[n]
        if n in self.eager:  # the parameters' gradients, computed by the input pass
            return [(GradientEdge(k, nr), g) for (_, k, nr), g in zip(self.eager[n], grads) if g is not None]
        return [(GradientEdge(n, i), g) for i, g in enumerate(grads) if g is not None]

    def run(self) -> bool:
        """The weight pass; False if some boundary never received a gradient (then the caller
        walks the whole graph instead)."""
        if not self.complete():
            return False
        for n in self.boundaries:
            edges = self._edges(n)
            if edges and self.params_of[n]:
                torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], retain_graph=True,
                                        inputs=self.params_of[n])
        self.captured = {}
        return True
