"""Compressed backpropagation (CB) between pipeline stages, with lazy error propagation (LEP).

Only the activation *gradient* sent to the previous stage is compressed (activations stay
exact: an error there changes the loss, not just one gradient estimate). Which messages are
compressed, and at which rank, is part of the instruction stream: the planner pass
`megatron.planner.passes.compression.grad_compression_pass` sets `compress_rank` on matching
`SendGrad*`/`RecvGrad*` instructions of all ranks' plans, the validator checks both sides agree,
and the wire shapes follow from the plan's shapes alone (`wire_shapes`), so nothing about
compression is negotiated at run time. This module (the compressor and the wire layout) sits
below the pipeline executor that uses it, so it knows nothing of instructions.

Epilogue-only: only the gradients a rank sends after its last forward (the last steady-state
backward and the cool-down) are compressed; that drain is on the critical path of 1F1B,
the steady-state sends overlap with compute.

LEP: the residual M - P Q^T of one micro-batch is kept by the sender and added to the next
gradient it sends from the same stage with the same shape, instead of being resent. Weight
gradients accumulate over micro-batches, so the residual still reaches the weights, one
micro-batch later. How residuals are keyed when micro-batch shapes vary (DynaPipe) or a
micro-batch is cut into token slices (TeraPipe) is `error_key`'s docstring.
"""
from __future__ import annotations

import contextlib
from typing import List, Sequence, Tuple

import torch

from megatron.compression import lowrank
from megatron.compression.stats import Timer

Shape = Tuple[int, ...]


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def _raw_per_factor(dtype: str) -> float:
    """A raw value's bytes over a factor value's (`wire_dtypes`: float32 factors, float64 in a
    float64 run)."""
    size = _ITEMSIZE.get(str(dtype).replace("torch.", ""), 4)
    return size / (8 if size == 8 else 4)


def tensor_wire_shapes(shape: Sequence[int], rank: int, dtype: str = "float32") -> List[Shape]:
    """What one gradient tensor of `shape` and plan dtype `dtype` becomes on the wire at
    compression rank `rank`: [P (tokens, r), Q (hidden, r)], or [shape] itself when compressing
    would not save bytes (fp16/bf16 messages against float32 factors: half as many values)."""
    shape = tuple(shape)
    if rank <= 0 or len(shape) < 2:
        return [shape]
    cols = shape[-1]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    if not lowrank.worth_compressing(rows, cols, rank, _raw_per_factor(dtype)):
        return [shape]
    r = lowrank.effective_rank(rows, cols, rank)
    return [(rows, r), (cols, r)]


def wire_shapes(shapes: Sequence[Sequence[int]], rank: int, dtype: str = "float32") -> List[Shape]:
    out: List[Shape] = []
    for s in shapes:
        out.extend(tensor_wire_shapes(s, rank, dtype))
    return out


def wire_numel(shapes: Sequence[Sequence[int]], rank: int, dtype: str = "float32") -> int:
    total = 0
    for s in wire_shapes(shapes, rank, dtype):
        n = 1
        for d in s:
            n *= d
        total += n
    return total


def error_key(stage: int, index: int, shape: Sequence[int], token_offset: int = 0) -> tuple:
    """The LEP state key of one gradient message: (sending stage, tensor index, first token
    position, full tensor shape [s, b, h]).

    A residual is a correction to the gradient at particular token positions. It is folded
    into the next message with the same key, i.e. into the gradient of the same positions of
    another micro-batch of the same shape:
      * DynaPipe (micro-batch shapes vary within an iteration): a residual waits for the next
        micro-batch with the same (s, b), and is dropped at the iteration's end if none comes
        (as every residual is, by default). The former key, the stage with a check of the
        token-matrix shape (s*b, h), lost a residual whenever another shape was sent in
        between (a reordered schedule) and folded a [64, 1] residual into a [32, 2] gradient
        (64 tokens both), adding token (i, j)'s error to an unrelated position. DynaPipe
        sorts micro-batches by length, so equal shapes are usually adjacent and both keys
        fold equally often there (26 compressed messages of a PP=2 test run: 9 folds with either key).
        Weight gradients are sums over
        micro-batches, so a residual that reaches the weights through another same-shape
        micro-batch is still delivered: per key, sum of sent + kept = sum of true gradients.
      * TeraPipe (token slices): the offset keys a slice's residual to the same token
        positions [offset, offset + length) of the next sequence micro-batch, which is where
        the unsliced run would have put it; keying by slice shape only would move the error
        of the last tokens onto the first ones of the same sequence (uniform slices share a
        shape), whose gradients have another scale (causal attention: early tokens feed every
        later one).
    The warm-start Q (hidden x r) is keyed by (stage, index, rank) only: it approximates the
    gradients' leading directions in the hidden dimension, which do not depend on the tokens."""
    return (stage, index, token_offset) + tuple(shape)


class PipelineGradCompressor:
    """Sender and receiver side of compressed gradient messages on one rank."""

    def __init__(self, lazy_error_propagation: bool, seed: int = 0, reset_each_iteration: bool = True):
        self.lep = lazy_error_propagation
        # Drop the residual at the end of each iteration instead of adding it to the first
        # compressed gradient of the next one: that gradient was computed under the weights
        # of the next step, and carried over, the residual chain never ends (it grew to
        # 1.1-1.6x the gradient's norm and cost 0.3-0.35 in loss; README, Optimus-CC).
        self.reset_each_iteration = reset_each_iteration
        self.state = lowrank.LowRankState(seed)
        self.stats = None  # a CompressionStats with --log-compression-stats
        self._touched: set = set()  # error keys written this iteration

    def encode(self, stage: int, tensors: List[torch.Tensor], rank: int, token_offset: int = 0,
               piece: tuple = ()) -> List[torch.Tensor]:
        """Wire tensors of one gradient message. `token_offset`: the first token position of a
        TeraPipe slice (0 for a whole micro-batch), part of the LEP key (`error_key`). `piece`:
        the message's batch_slice (rows of the micro-batch) when a stage's gradient goes out in
        row pieces (stages with their own TP/DP sizes): warm starts and residuals are then kept
        per piece, so a piece's residual rides on the same rows of the next micro-batch."""
        out: List[torch.Tensor] = []
        for idx, t in enumerate(tensors):
            layout = tensor_wire_shapes(t.shape, rank, str(t.dtype))
            if len(layout) == 1:
                out.append(t)
                continue
            timer = Timer(t.device) if self.stats is not None else contextlib.nullcontext()
            with timer:
                r = layout[0][1]
                key = error_key(stage, idx, t.shape, token_offset) + tuple(piece)
                m = lowrank.as_matrix(t).to(torch.promote_types(t.dtype, torch.float32))
                if self.lep:
                    e = self.state.take_error(key, m.shape)
                    if e is not None:
                        m = m + e.to(m.device)
                q_key = (stage, idx) + tuple(piece) + (r,)
                q = self.state.q_for(q_key, m.shape[1], r, m.device)
                p, q = lowrank.compress(m, q)
                self.state.q[q_key] = q.detach().cpu()
                residual = None
                if self.lep:
                    residual = m - lowrank.decompress(p, q)
                    self.state.error[key] = residual.detach().cpu()
                    self._touched.add(key)
            out.extend([p.contiguous(), q.contiguous()])
            if self.stats is not None:
                self.stats.record(stage, "pp_grad", raw_bytes=t.numel() * t.element_size(),
                                  sent_bytes=p.element_size() * (p.numel() + q.numel()), seconds=timer.seconds,
                                  true=lowrank.as_matrix(t).to(p.dtype), decoded=lowrank.decompress(p, q),
                                  residual=residual, p=p)
        return out

    def end_iteration(self) -> None:
        if self.reset_each_iteration:
            self.state.error.clear()
        else:
            # Carried residuals live one step: a shape not sent this iteration (DynaPipe) keeps
            # none, so the store stays as small as one iteration's distinct shapes.
            for key in [k for k in self.state.error if k not in self._touched]:
                del self.state.error[key]
        self._touched = set()

    @staticmethod
    def decode(shapes: Sequence[Sequence[int]], rank: int, wire: List[torch.Tensor],
               dtype: torch.dtype) -> List[torch.Tensor]:
        out: List[torch.Tensor] = []
        i = 0
        for s in shapes:
            layout = tensor_wire_shapes(s, rank, str(dtype))
            if len(layout) == 1:
                out.append(wire[i])
                i += 1
            else:
                out.append(lowrank.decompress(wire[i], wire[i + 1]).reshape(tuple(s)).to(dtype))
                i += 2
        return out

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.state.load_state_dict(sd)


def wire_dtypes(shapes: Sequence[Sequence[int]], rank: int, plan_dtype: str) -> List[str]:
    """Factors travel in float32 (a rank-r factor in bf16 loses most of what it carries), or in
    float64 in a float64 run."""
    factor = "float64" if plan_dtype == "float64" else "float32"
    out: List[str] = []
    for s in shapes:
        layout = tensor_wire_shapes(s, rank, plan_dtype)
        out.extend([plan_dtype] if len(layout) == 1 else [factor, factor])
    return out
