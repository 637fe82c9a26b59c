"""The pipeline instruction set and the per-rank, per-iteration `ExecutionPlan`.

A planner (static 1F1B, DynaPipe, TeraPipe, ...) writes one `ExecutionPlan` per pipeline
rank per iteration; `megatron.pipeline.executor.PipelineExecutor` runs it. Shapes travel in
the plan and are never exchanged at run time.

Conventions every planner and the executor share:

* `stage` is a global (virtual) pipeline stage id in ``[0, num_stages)``; a rank owns the
  stages listed in `ExecutionPlan.assigned_stages`.
* Buffers are numbered slots (`buffer_ids`) that hold tensors between instructions.
  `buffer_shapes[i]` is the exact shape of slot `buffer_ids[i]`.
* `LoadInput(mb, stage)` fetches micro-batch `mb` from the data iterator on this rank
  (every rank that runs any stage of `mb` loads it: masks and labels are needed everywhere).
  Its shapes are the input token shapes, e.g. ``((b, s),)`` for GPT or
  ``((b, s_enc), (b, s_dec))`` for T5.
* `ForwardPass(mb, stage)`: `buffer_ids` are the slots holding the stage's input activations
  (empty for a stage that starts from tokens); `output_buffer_ids` are the slots to write its
  output activations into (empty on the last stage, which produces the loss, and when the
  output is not consumed through a slot).
* `BackwardPass(mb, stage)`: `buffer_ids` are the slots holding the gradient w.r.t. the
  stage's outputs (empty on the last stage, which starts from the loss);
  `output_buffer_ids` are the slots to write the gradient w.r.t. its inputs into (empty on
  stage 0).
* Communication instructions carry `peer` (a pipeline rank) and name the *sender's* stage:
  `SendActivation*(mb, s)` / `RecvActivation*(mb, s)` move the output of stage `s` to the
  rank of stage `s + 1`; `SendGrad*(mb, s)` / `RecvGrad*(mb, s)` move the gradient w.r.t. the
  input of stage `s` to the rank of stage `s - 1`. A `*Start` posts a non-blocking
  operation; the matching `*Finish` waits for it. Sends and receives between a pair of ranks
  are matched by order, so both sides must list them in the same order.
* `FreeBuffer` releases slots so they can be reused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

Shape = Tuple[int, ...]

RECOMPUTE_LEVELS = ("none", "selective", "full")


@dataclass(frozen=True)
class Instruction:
    microbatch: int
    stage: int


@dataclass(frozen=True)
class BufferInstruction(Instruction):
    buffer_ids: Tuple[int, ...] = ()
    buffer_shapes: Tuple[Shape, ...] = ()


@dataclass(frozen=True)
class LoadInput(BufferInstruction):
    pass


@dataclass(frozen=True)
class ForwardPass(BufferInstruction):
    output_buffer_ids: Tuple[int, ...] = ()
    output_shapes: Tuple[Shape, ...] = ()


@dataclass(frozen=True)
class BackwardPass(BufferInstruction):
    output_buffer_ids: Tuple[int, ...] = ()
    output_shapes: Tuple[Shape, ...] = ()


@dataclass(frozen=True)
class FreeBuffer(BufferInstruction):
    pass


@dataclass(frozen=True)
class CommInstruction(BufferInstruction):
    peer: int = -1


@dataclass(frozen=True)
class SendActivationStart(CommInstruction):
    pass


@dataclass(frozen=True)
class SendActivationFinish(CommInstruction):
    pass


@dataclass(frozen=True)
class RecvActivationStart(CommInstruction):
    pass


@dataclass(frozen=True)
class RecvActivationFinish(CommInstruction):
    pass


@dataclass(frozen=True)
class SendGradStart(CommInstruction):
    pass


@dataclass(frozen=True)
class SendGradFinish(CommInstruction):
    pass


@dataclass(frozen=True)
class RecvGradStart(CommInstruction):
    pass


@dataclass(frozen=True)
class RecvGradFinish(CommInstruction):
    pass


@dataclass
class ExecutionPlan:
    """Everything one pipeline rank runs in one iteration.

    `microbatch_shapes[mb]` is the input token shape tuple of micro-batch `mb` (the same
    tuples `LoadInput` carries); `recompute` is the activation recomputation level used for
    this iteration; `num_buffers` is the number of buffer slots the plan uses; `dtype` is the
    dtype of every activation/gradient that crosses ranks.
    """

    rank: int
    num_ranks: int
    num_stages: int
    assigned_stages: Tuple[int, ...]
    instructions: list = field(default_factory=list)
    microbatch_shapes: Tuple[Tuple[Shape, ...], ...] = ()
    recompute: str = "none"
    num_buffers: int = 0
    dtype: str = "float32"
    iteration: int = 0

    def __post_init__(self):
        if self.recompute not in RECOMPUTE_LEVELS:
            raise ValueError(
                f"ExecutionPlan.recompute must be one of {RECOMPUTE_LEVELS}, got {self.recompute!r}"
            )
