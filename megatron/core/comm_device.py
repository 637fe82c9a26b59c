"""The one rule for where a tensor that goes on the wire lives: the device its group's backend takes.

NCCL carries CUDA tensors only; a CPU scalar (a flag, a loss sum, a token count, a digest buffer)
passed to an NCCL collective fails at run time, on the first GPU run. gloo takes CPU tensors.
Every tensor that the project *creates* for a collective or point-to-point call is made on
`comm_device(group)` (or moved there with `to_comm`), so the device follows the backend in
this one place. Tensors computed from the model (gradients, activations) are already on the
model's device and need nothing.

`pretend_nccl()` is for tests on CPU machines: comm_device then answers PRETEND_DEVICE, a
device object distinct from torch.device("cpu") whose tensors are ordinary CPU tensors, so a
checker (tests/comm_device_check.py) can tell "made for the wire" from "made on the host" and
fail where an NCCL run would.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

PRETEND_DEVICE = torch.device("cpu", 0)  # compares unequal to torch.device("cpu")
_pretend = False


def backend_of(group=None) -> str:
    if not dist.is_available() or not dist.is_initialized():
        return "none"
    return str(dist.get_backend(group)).lower()


def needs_cuda(group=None) -> bool:
    """True when `group`'s backend carries CUDA tensors only (NCCL), or a test pretends so."""
    return _pretend or "nccl" in backend_of(group)


def comm_device(group=None) -> torch.device:
    """The device for tensors passed to a collective / p2p call on `group` (None: the world)."""
    if _pretend:
        return PRETEND_DEVICE
    if "nccl" in backend_of(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_comm(t: torch.Tensor, group=None) -> torch.Tensor:
    """`t` on its group's device (no copy when it is there already)."""
    return t.to(comm_device(group))


def comm_tensor(data, group=None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torch.tensor(data) made directly on the group's device."""
    return torch.tensor(data, dtype=dtype, device=comm_device(group))


@contextlib.contextmanager
def pretend_nccl():
    """Every group treated as NCCL (for the CPU device checker; see the module doc)."""
    global _pretend
    old, _pretend = _pretend, True
    try:
        yield PRETEND_DEVICE
    finally:
        _pretend = old
