"""A CPU stand-in for NCCL's device rule: fail where an NCCL run would get a host tensor.

NCCL carries CUDA tensors only; on a GPU run, a tensor made on the host (torch.tensor(...) with
no device, `.cpu()`, `.to("cpu")`) and passed to a collective fails at run time. On a CPU machine
every tensor is a CPU tensor, so the device cannot tell. This checker follows each tensor's
*would-be* device instead:

* under `megatron.core.comm_device.pretend_nccl()`, `comm_device(group)` answers PRETEND_DEVICE,
  and the trainer is given PRETEND_DEVICE as its device: what is made on it, or moved to it,
  would be on the GPU;
* a TorchFunctionMode tags what would be on the host: factories called without a device or with
  the string "cpu", `.cpu()`, `.to("cpu")`, and anything computed only from host tensors (a
  torch.device object is trusted: `device=x.device` is right on a GPU run, and a CPU run cannot
  tell it from torch.device("cpu"));
* torch.distributed's tensor collectives and point-to-point calls are wrapped: a host-tagged
  tensor passed to one is a violation, reported with the line that made it.

Parameters and gradients are made before the mode starts (or by autograd, which the mode does not
see) and so count as device tensors, as they are on a GPU run.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import List

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from megatron.core import comm_device as CD

FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
             torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.scalar_tensor}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
CHECKED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
           "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
           "isend", "irecv", "batch_isend_irecv")
_HERE = os.path.dirname(os.path.abspath(__file__))
_PKG = os.path.join(os.path.dirname(_HERE), "megatron")


def _host_device(d) -> bool:
    """Would a factory given device=d make a host tensor on a GPU run? No device, or the literal
    string "cpu": yes. A torch.device object is trusted: it is usually another tensor's
    `.device` (the model's device on a GPU run), which no CPU run can tell from a literal one."""
    if d is None:
        return True  # the default device: the host, on a GPU run too
    if isinstance(d, str):
        return d == "cpu" or d.startswith("cpu:")
    return False


def _tensors(obj, depth=0):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dist.P2POp):
        yield obj.tensor
    elif isinstance(obj, (list, tuple)) and depth < 2:
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif isinstance(obj, dict) and depth < 2:
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def _site() -> str:
    """The innermost megatron/ (or tests/) line on the stack: where the host tensor was made."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if (fn.startswith(_PKG) or fn.startswith(_HERE)) and not fn.endswith("comm_device_check.py"):
            return f"{os.path.relpath(fn, os.path.dirname(_PKG))}:{f.f_lineno}"
        f = f.f_back
    return "?"


class HostTensors(TorchFunctionMode):
    """Tags tensors that would live on the host on a GPU run (see the module doc)."""

    def __init__(self):
        super().__init__()
        self.host = WeakIdKeyDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            host = _host_device(kwargs.get("device"))
        elif func is torch.Tensor.cpu:
            host = True
        elif func in MOVES:
            dev = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, (torch.device, str)):
                    dev = a
            if func is torch.Tensor.cuda:
                host = False
            elif dev is None:  # a dtype-only .to(): where the input was
                host = bool(args) and args[0] in self.host
            else:
                host = _host_device(dev)
            if not host and torch.is_tensor(out):
                self.host.pop(out, None)  # a no-op .to() returns its input: it has moved now
        else:
            ins = [t for t in _tensors(list(args) + list(kwargs.values()))]
            host = bool(ins) and all(t in self.host for t in ins)
        if host:
            site = None
            for t in _tensors(out):
                if t not in self.host:
                    site = site or _site()
                    self.host[t] = site
        return out


@contextlib.contextmanager
def nccl_device_rule(violations: List[str]):
    """Pretend every group is NCCL; append one line per host tensor handed to torch.distributed."""
    mode = HostTensors()
    saved = {name: getattr(dist, name) for name in CHECKED if hasattr(dist, name) and hasattr(c10d, name)}

    def wrap(name, orig):
        def checked(*args, **kwargs):
            for t in _tensors(list(args) + list(kwargs.values())):
                if t in mode.host:
                    violations.append(f"dist.{name} got a host tensor {tuple(t.shape)} {t.dtype} made at "
                                      f"{mode.host[t]} (NCCL takes CUDA tensors only: make it on comm_device(group))")
            return orig(*args, **kwargs)
        return checked

    # both names: P2POp checks its op against distributed_c10d's own isend / irecv
    for name, orig in saved.items():
        w = wrap(name, orig)
        setattr(dist, name, w)
        setattr(c10d, name, w)
    try:
        with CD.pretend_nccl(), mode:
            yield CD.PRETEND_DEVICE
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)
            setattr(c10d, name, orig)
