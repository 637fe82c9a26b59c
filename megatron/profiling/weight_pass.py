"""The split backward of one stage, measured: bytes a deferred weight pass keeps, and the
times of the input-gradient half (B, what the previous stage waits for) and the weight half (W).

`measure_split(module, make_args)` runs the module's forward with the executor's saved-tensor
boxes (`megatron.pipeline.weight_store`), then exactly what `PipelineExecutor` runs for a
`BackwardInput` / `BackwardWeight` pair (`_input_grads`, `WeightPlan`, `SavedBoxes.release`),
and reports, counting each storage once and leaving parameters out:

* ``graph_bytes``: what a kept whole graph holds for W: every saved storage plus the output
  gradient (the executor kept both until W before the weight store);
* ``kept_graph_bytes``: what the executor held before the weight store: the whole graph
  plus the gradients the boundaries captured for W;
* ``wstore_bytes``: what the weight store holds: the saved storages of the nodes W runs (the
  weight GEMMs' inputs, a norm's input and statistics) plus the gradients the boundaries
  captured (the GEMMs' output gradients);
* ``b_ms`` / ``w_ms``: wall time of the input pass and of the weight pass (CUDA synchronised),
  and ``bwd_ms``, one whole backward of the same forward, for the ratio (B + W) / whole.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch

from megatron.pipeline.executor import _input_grads
from megatron.pipeline.split_backward import WeightPlan
from megatron.pipeline.weight_store import SavedBoxes, unique_bytes


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward(module, make_args, boxes: Optional[SavedBoxes]):
    batch, inputs = make_args()
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    if boxes is None:
        outs = module(batch, inputs)
    else:
        with boxes.hooks():
            outs = module(batch, inputs)
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    return inputs, outs


def _split_once(module, make_args, params, device):
    """One forward + input pass + weight pass; (graph, graph + captured, W-store bytes, b_s, w_s)."""
    boxes = SavedBoxes("profiling")
    inputs, outs = _forward(module, make_args, boxes)
    grads = [torch.randn_like(o) for o in outs]
    graph = unique_bytes(boxes.tensors() + grads, exclude=params)
    plan = WeightPlan.build(outs, inputs, params)
    if plan is None:
        raise ValueError("the module has no split weight pass (no input gradient, shared weight-side nodes or a "
                         "parameter it does not own): its W is the whole backward")
    _sync(device)
    t0 = time.perf_counter()
    try:
        _input_grads(outs, grads, inputs)
    finally:
        plan.remove_hooks()
    _sync(device)
    b = time.perf_counter() - t0
    if not plan.complete():
        raise ValueError("a boundary of the weight plan received no gradient in the input pass")
    before = unique_bytes(boxes.tensors() + grads + plan.captured_tensors(), exclude=params)
    boxes.release(plan.nodes)
    del grads
    kept = unique_bytes(boxes.tensors() + plan.captured_tensors(), exclude=params)
    _sync(device)
    t0 = time.perf_counter()
    plan.run()
    _sync(device)
    return graph, before, kept, b, time.perf_counter() - t0


def _whole_once(module, make_args, device):
    inputs, outs = _forward(module, make_args, None)
    grads = [torch.randn_like(o) for o in outs]
    _sync(device)
    t0 = time.perf_counter()
    torch.autograd.backward(outs, grads)
    _sync(device)
    return time.perf_counter() - t0


def measure_split(module: torch.nn.Module, make_args: Callable[[], tuple], device: torch.device,
                  iters: int = 3, warmup: int = 1) -> dict:
    """`make_args()` -> (batch, [input activations]) for `module(batch, inputs)` -> [outputs].
    Times are the minimum over `iters` runs after `warmup`; bytes are the same every run."""
    params: List[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    bs, ws, whole = [], [], []
    graph = before = kept = 0
    for i in range(warmup + iters):
        module.zero_grad(set_to_none=False)
        graph, before, kept, b, w = _split_once(module, make_args, params, device)
        t = _whole_once(module, make_args, device)
        if i >= warmup:
            bs.append(b)
            ws.append(w)
            whole.append(t)
    return dict(graph_bytes=graph, kept_graph_bytes=before, wstore_bytes=kept,
                wstore_share=round(kept / graph, 4), wstore_vs_kept_graph=round(kept / before, 4),
                b_ms=round(min(bs) * 1e3, 4), w_ms=round(min(ws) * 1e3, 4), bwd_ms=round(min(whole) * 1e3, 4))
