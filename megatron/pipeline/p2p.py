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

from megatron.core import heartbeat

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PipelineCommError(RuntimeError):
    pass


class P2PHandle:
    __slots__ = ("works", "tensors", "what", "peer")

    def __init__(self, works, tensors, what: str, peer: int):
        self.works, self.tensors, self.what, self.peer = works, tensors, what, peer

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
        try:
            works = [dist.isend(t, dst=dst, group=self.group) for t in tensors]
        except RuntimeError as e:
            raise self._error(what, peer, e, 0.0) from e
        return P2PHandle(works, tensors, what, peer)

    def irecv(self, shapes, dtype, peer: int, what: str) -> P2PHandle:
        """`dtype`: one dtype name for every tensor, or a list with one name per shape."""
        src = self.peers[peer]
        dtypes = [dtype] * len(shapes) if isinstance(dtype, str) else list(dtype)
        tensors = [torch.empty(tuple(s), dtype=DTYPES[d], device=self.device) for s, d in zip(shapes, dtypes)]
        try:
            works = [dist.irecv(t, src=src, group=self.group) for t in tensors]
        except RuntimeError as e:
            raise self._error(what, peer, e, 0.0) from e
        return P2PHandle(works, tensors, what, peer)

    def _error(self, what: str, peer: int, cause, elapsed: float) -> PipelineCommError:
        text = str(cause).splitlines()[0] if cause is not None else ""
        where = f"global rank {self.my_rank}, in {what} (pipeline rank {peer} = global rank {self.peers[peer]})"
        beat = heartbeat.active()
        # A closed connection is not proof that the peer died: a peer that timed out waiting on a
        # third rank drops its connections too. The heartbeat says who really stopped.
        blame = f"; diagnosis: {beat.diagnose()}" if beat is not None else ""
        if cause is None or "timed out" in text.lower():
            return PipelineCommError(
                f"{where}: timed out after {elapsed:.1f}s (limit {self.timeout.total_seconds():.0f}s): the peer never "
                f"reached the matching operation; it is stuck or slow (raise --distributed-timeout-minutes if slow)"
                f"{blame}")
        return PipelineCommError(f"{where}: communication failed after {elapsed:.1f}s: the peer probably died "
                                 f"or gave up waiting itself; see its log ({text}){blame}")

    def wait(self, handle: P2PHandle) -> List[torch.Tensor]:
        start = time.monotonic()
        peer = handle.peer
        for w in handle.works:
            try:
                ok = w.wait(self.timeout)
            except RuntimeError as e:
                raise self._error(handle.what, peer, e, time.monotonic() - start) from e
            if ok is False:
                raise self._error(handle.what, peer, None, time.monotonic() - start)
        return handle.tensors
