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
  and ``fwd_ms`` / ``bwd_ms``, one forward and whole backward, for the ratio (B + W) / whole
  and the derived rule W = fwd x 6h/(6h+s) (planner/schedule/zb_search.py) beside the measured W.
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
    """(forward s, whole backward s)."""
    _sync(device)
    t0 = time.perf_counter()
    inputs, outs = _forward(module, make_args, None)
    _sync(device)
    t1 = time.perf_counter()
    grads = [torch.randn_like(o) for o in outs]
    _sync(device)
    t2 = time.perf_counter()
    torch.autograd.backward(outs, grads)
    _sync(device)
    return t1 - t0, time.perf_counter() - t2


def measure_split(module: torch.nn.Module, make_args: Callable[[], tuple], device: torch.device,
                  iters: int = 3, warmup: int = 1) -> dict:
    """`make_args()` -> (batch, [input activations]) for `module(batch, inputs)` -> [outputs].
    Times are the minimum over `iters` runs after `warmup`; bytes are the same every run."""
    params: List[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    bs, ws, whole, fwd = [], [], [], []
    graph = before = kept = 0
    for i in range(warmup + iters):
        module.zero_grad(set_to_none=False)
        graph, before, kept, b, w = _split_once(module, make_args, params, device)
        f, t = _whole_once(module, make_args, device)
        if i >= warmup:
            bs.append(b)
            ws.append(w)
            whole.append(t)
            fwd.append(f)
    return dict(graph_bytes=graph, kept_graph_bytes=before, wstore_bytes=kept,
                wstore_share=round(kept / graph, 4), wstore_vs_kept_graph=round(kept / before, 4),
                b_ms=round(min(bs) * 1e3, 4), w_ms=round(min(ws) * 1e3, 4), bwd_ms=round(min(whole) * 1e3, 4),
                fwd_ms=round(min(fwd) * 1e3, 4))


def time_split(w, device: torch.device, warmup: int, iters: int, statistic: str = "median",
               agree: Callable[[bool], bool] = lambda x: x) -> tuple:
    """(input pass ms, weight pass ms) of a profiler `Workload` (`measure.Workload`: its
    `run(*make_inputs())` returns one tensor), split as the executor splits a zero-bubble
    backward; a statistic over `iters` timed iterations after `warmup`."""
    from megatron.profiling import noise
    params = [p for p in w.module.parameters() if p.requires_grad]

    def sample(i):
        inputs = w.make_inputs()
        diff = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        out = w.run(*inputs)
        plan = WeightPlan.build([out], diff, params)
        if plan is None:
            raise ValueError("the workload has no split weight pass (see split_backward.WeightPlan.build)")
        grads = [torch.ones_like(out)]
        _sync(device)
        t0 = noise.clock()
        try:
            _input_grads([out], grads, diff)
        finally:
            plan.remove_hooks()
        _sync(device)
        t1 = noise.clock()
        plan.run()
        _sync(device)
        t2 = noise.clock()
        del out, inputs, plan
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    return noise.repeat(sample, warmup, iters, statistic=statistic, agree=agree).values

