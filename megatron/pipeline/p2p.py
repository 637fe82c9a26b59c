"""Point-to-point transfers between pipeline ranks, with shapes taken from the plan.

Nothing about shapes is exchanged at run time: the receiver allocates exactly what its plan
says and posts `irecv`; messages between a pair of ranks match by order. Waits are bounded by
the distributed timeout and a timeout becomes an error that names the instruction and the
peer, instead of a silent hang.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import List, Sequence

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PipelineCommError(RuntimeError):
    pass


class P2PHandle:
    __slots__ = ("works", "tensors", "what")

    def __init__(self, works, tensors, what: str):
        self.works, self.tensors, self.what = works, tensors, what

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class P2PCommunicator:
    def __init__(self, pp_global_ranks: Sequence[int], my_rank: int, group=None,
                 timeout: timedelta = timedelta(minutes=10), device: torch.device = torch.device("cpu")):
        self.peers = list(pp_global_ranks)
        self.my_rank = my_rank
        self.group = group
        self.timeout = timeout
        self.device = device

    def isend(self, tensors: List[torch.Tensor], peer: int, what: str) -> P2PHandle:
        dst = self.peers[peer]
        tensors = [t.contiguous() for t in tensors]
        works = [dist.isend(t, dst=dst, group=self.group) for t in tensors]
        return P2PHandle(works, tensors, what)

    def irecv(self, shapes, dtype: str, peer: int, what: str) -> P2PHandle:
        src = self.peers[peer]
        tensors = [torch.empty(tuple(s), dtype=DTYPES[dtype], device=self.device) for s in shapes]
        works = [dist.irecv(t, src=src, group=self.group) for t in tensors]
        return P2PHandle(works, tensors, what)

    def wait(self, handle: P2PHandle) -> List[torch.Tensor]:
        start = time.monotonic()
        for w in handle.works:
            try:
                ok = w.wait(self.timeout)
            except RuntimeError as e:
                raise PipelineCommError(
                    f"global rank {self.my_rank}: pipeline communication failed in {handle.what} "
                    f"after {time.monotonic() - start:.1f}s ({e.__class__.__name__}: {str(e).splitlines()[0]}). "
                    f"The peer rank probably died or is stuck; see its log.") from e
            if ok is False:
                raise PipelineCommError(
                    f"global rank {self.my_rank}: timed out after {self.timeout.total_seconds():.0f}s "
                    f"in {handle.what}; the peer never reached the matching operation "
                    f"(raise --distributed-timeout-minutes if it is just slow)")
        return handle.tensors
