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
* Token slices (TeraPipe): `LoadInput`, `ForwardPass`, `BackwardPass` and the communication
  instructions may carry `token_slice = (sequence, offset, length)`. The instruction's
  `microbatch` is then a *unit* id (one slice of one sequence micro-batch);
  `microbatch_shapes[unit]` is the slice's token shape ``((b, length),)``; the data is
  micro-batch `sequence` of the iteration, tokens ``[offset, offset + length)``. Units of one
  sequence tile its tokens; a stage forwards them in ascending offset (each attends to the
  cached keys/values of the earlier ones) and runs their backwards in descending offset.
  An empty `token_slice` (the default) means an unsliced micro-batch, as before.
* Batch splits (stages with different TP / DP sizes, Aceso): one plan per *global* rank, and
  `peer` is a global rank. A rank whose stage splits each micro-batch over DP ranks has
  `ExecutionPlan.batch_split = (index, parts)`: it holds rows
  ``[index * b / parts, (index + 1) * b / parts)`` of every micro-batch of b rows
  (`microbatch_shapes` stay the whole micro-batch; `LoadInput` carries the rank's rows, and
  activation shapes are [s, b / parts, h]). A communication instruction with
  `batch_slice = (first, count)` moves rows ``[first, first + count)`` of the micro-batch
  (global row numbers, the same on both ends; dimension 1 of each [s, b, h] tensor):
  `buffer_shapes` is still the rank's whole buffer, so a receive buffer is assembled from
  the pieces of several senders and a send buffer may go out in pieces to several receivers.
  Sequence parallelism on such stages also splits dimension 0 (tokens): the rank's
  `batch_split = (index, parts, seq_index, seq_parts)` says it holds tokens
  ``[seq_index * s / seq_parts, ...)`` of the sequence (its buffers are [s / seq_parts, ...]),
  and `batch_slice = (first row, rows, first token, tokens)` names a block of both (global
  token positions). A 2-entry `batch_slice` spans dimension 0 of both ends' buffers.
"""
from __future__ import annotations

import array
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Optional, Tuple

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
    token_slice: Tuple[int, ...] = ()


@dataclass(frozen=True)
class ForwardPass(BufferInstruction):
    output_buffer_ids: Tuple[int, ...] = ()
    output_shapes: Tuple[Shape, ...] = ()
    token_slice: Tuple[int, ...] = ()


@dataclass(frozen=True)
class BackwardPass(BufferInstruction):
    output_buffer_ids: Tuple[int, ...] = ()
    output_shapes: Tuple[Shape, ...] = ()
    token_slice: Tuple[int, ...] = ()


@dataclass(frozen=True)
class BackwardInput(BufferInstruction):
    """The input-gradient half of a split backward (zero-bubble schedules): the same slots as
    `BackwardPass`, but parameters gain no gradient; the graph is kept for the matching
    `BackwardWeight`, which must follow before the end of the plan (the optimizer step)."""
    output_buffer_ids: Tuple[int, ...] = ()
    output_shapes: Tuple[Shape, ...] = ()
    token_slice: Tuple[int, ...] = ()


@dataclass(frozen=True)
class BackwardWeight(BufferInstruction):
    """The weight-gradient half of a split backward: accumulates the parameter gradients of
    (microbatch, stage) from the graph its `BackwardInput` kept. Reads and writes no slots."""


@dataclass(frozen=True)
class FreeBuffer(BufferInstruction):
    pass


@dataclass(frozen=True)
class CommInstruction(BufferInstruction):
    peer: int = -1
    # > 0 on SendGrad*/RecvGrad* of a compressed gradient message (Optimus-CC): the
    # rank of its low-rank factors. Wire shapes follow from buffer_shapes and this rank.
    compress_rank: int = 0
    token_slice: Tuple[int, ...] = ()
    # (first row, row count) of the micro-batch this message carries; () = the whole buffer.
    batch_slice: Tuple[int, ...] = ()


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
    # (index, parts): this rank holds part `index` of `parts` equal row blocks of every
    # micro-batch; () = whole micro-batches (every planner but the heterogeneous-stage one);
    # (index, parts, seq_index, seq_parts) also a block of the sequence (see the top).
    batch_split: Tuple[int, ...] = ()

    def __post_init__(self):
        if self.recompute not in RECOMPUTE_LEVELS:
            raise ValueError(
                f"ExecutionPlan.recompute must be one of {RECOMPUTE_LEVELS}, got {self.recompute!r}"
            )

    # ------------------------------------------------------------------ serialization
    def serialize(self) -> bytes:
        """Encode this plan as a compact, versioned little-endian byte string.

        Plans are computed ahead (possibly in another process) and shipped to the ranks, so
        the format is independent of Python pickling. See `_serialization` below."""
        return _encode_plan(self)

    @classmethod
    def deserialize(cls, data: bytes) -> "ExecutionPlan":
        """Inverse of `serialize`; raises ValueError on a foreign, corrupt or truncated buffer."""
        return _decode_plan(data)


def describe(instr: Instruction) -> str:
    """One-line human-readable form of an instruction, used in error messages."""
    parts = [f"mb={instr.microbatch}", f"stage={instr.stage}"]
    if isinstance(instr, CommInstruction):
        parts.append(f"peer={instr.peer}")
        if instr.compress_rank:
            parts.append(f"compress_rank={instr.compress_rank}")
    if isinstance(instr, BufferInstruction):
        if instr.buffer_ids or not isinstance(instr, LoadInput):
            parts.append(f"buffers={tuple(instr.buffer_ids)}")
        parts.append(f"shapes={tuple(tuple(s) for s in instr.buffer_shapes)}")
    if isinstance(instr, (ForwardPass, BackwardPass, BackwardInput)):
        parts.append(f"out={tuple(instr.output_buffer_ids)}")
        parts.append(f"out_shapes={tuple(tuple(s) for s in instr.output_shapes)}")
    if getattr(instr, "token_slice", ()):
        parts.append(f"slice={tuple(instr.token_slice)}")
    if getattr(instr, "batch_slice", ()):
        first, count = instr.batch_slice[:2]
        parts.append(f"rows={first}..{first + count - 1}")
        if len(instr.batch_slice) == 4:
            a, n = instr.batch_slice[2:]
            parts.append(f"tokens={a}..{a + n - 1}")
    return f"{type(instr).__name__}({', '.join(parts)})"


# ---------------------------------------------------------------------- serialization
# Layout (all little-endian):
#   header  : magic b"MPLN" | u16 version | u16 reserved(0) | u32 payload bytes |
#             u32 crc32(dtype + payload) | u8 len(dtype) | dtype utf-8
#   payload : a flat stream of int32:
#     rank, num_ranks, num_stages, num_buffers, iteration, recompute index,
#     n_assigned, assigned..., n_mb, per mb: <shape list>, n_instructions,
#     per instruction: tag, microbatch, stage, <id list>, <shape list>,
#                      then for Forward/Backward: <id list>, <shape list>;
#                      for Comm: peer, compress_rank (version >= 2; version 1 has peer only)
#   <id list>    = n, ids...
#   <shape list> = n, per shape: ndim, dims...
#   Version 3 (written only when some instruction has a token slice, so unsliced plans stay
#   byte-identical to version 2) appends to every LoadInput/compute/comm record an <id list>
#   with its token_slice (n = 0 for none, else sequence, offset, length).
#   Version 4 (written only for plans with a batch split) is version 3 plus an <id list> with
#   the plan's batch_split after the micro-batch shapes and, on every comm record after its
#   token slice, an <id list> with its batch_slice.
#   Version 5 (written only for plans with a split backward, so all other plans keep their
#   bytes) is version 4 plus two tags: 13 BackwardInput (a compute record, like BackwardPass)
#   and 14 BackwardWeight (a plain record: no slots, shapes or slices).
# One int32 array keeps encoding/decoding to a single pass of Python-level list work, which
# is what makes plans with thousands of instructions take a few milliseconds.
_MAGIC = b"MPLN"
_VERSION = 2
_VERSION_SLICED = 3
_VERSION_SPLIT = 4
_VERSION_ZB = 5
_READABLE_VERSIONS = (1, _VERSION, _VERSION_SLICED, _VERSION_SPLIT, _VERSION_ZB)
_HEADER = struct.Struct("<4sHHIIB")

# Tags are part of the wire format: append new classes, never renumber.
_TAG_OF = {
    LoadInput: 1, ForwardPass: 2, BackwardPass: 3, FreeBuffer: 4,
    SendActivationStart: 5, SendActivationFinish: 6, RecvActivationStart: 7,
    RecvActivationFinish: 8, SendGradStart: 9, SendGradFinish: 10, RecvGradStart: 11,
    RecvGradFinish: 12, BackwardInput: 13, BackwardWeight: 14,
}
_CLASS_OF = {tag: cls for cls, tag in _TAG_OF.items()}
_ZB_TAGS = frozenset((13, 14))
_COMPUTE_TAGS = frozenset((2, 3, 13))
_COMM_TAGS = frozenset(range(5, 13))
_SLICE_TAGS = frozenset((1,)) | _COMPUTE_TAGS | _COMM_TAGS


def _put_shapes(out: list, shapes) -> None:
    out.append(len(shapes))
    for shape in shapes:
        out.append(len(shape))
        out.extend(shape)


def _encode_plan(plan: ExecutionPlan, version: Optional[int] = None) -> bytes:
    """The version is the oldest one that can carry the plan (2, or 3 with token slices);
    `version=1` (no compress_rank) exists so tests can prove old plans still decode."""
    v: list = [plan.rank, plan.num_ranks, plan.num_stages, plan.num_buffers, plan.iteration,
               RECOMPUTE_LEVELS.index(plan.recompute), len(plan.assigned_stages)]
    v.extend(plan.assigned_stages)
    v.append(len(plan.microbatch_shapes))
    for shapes in plan.microbatch_shapes:
        _put_shapes(v, shapes)
    sliced = any(getattr(instr, "token_slice", ()) for instr in plan.instructions)
    split = bool(plan.batch_split) or any(getattr(instr, "batch_slice", ()) for instr in plan.instructions)
    zb = any(type(instr) in (BackwardInput, BackwardWeight) for instr in plan.instructions)
    if version is None:
        version = _VERSION_ZB if zb else _VERSION_SPLIT if split else _VERSION_SLICED if sliced else _VERSION
    elif zb and version < _VERSION_ZB:
        raise ValueError(f"format version {version} cannot carry a split backward (BackwardInput/BackwardWeight)")
    elif sliced and version < _VERSION_SLICED:
        raise ValueError(f"format version {version} cannot carry token slices")
    elif split and version < _VERSION_SPLIT:
        raise ValueError(f"format version {version} cannot carry batch splits")
    if version >= _VERSION_SPLIT:
        v.append(len(plan.batch_split))
        v.extend(plan.batch_split)
    v.append(len(plan.instructions))
    append, extend = v.append, v.extend
    for instr in plan.instructions:
        tag = _TAG_OF.get(type(instr))
        if tag is None:
            raise ValueError(f"cannot serialize instruction type {type(instr).__name__}: "
                             f"it has no wire tag in megatron.pipeline.instructions._TAG_OF")
        append(tag)
        append(instr.microbatch)
        append(instr.stage)
        ids = instr.buffer_ids
        append(len(ids))
        extend(ids)
        _put_shapes(v, instr.buffer_shapes)
        if tag in _COMPUTE_TAGS:
            ids = instr.output_buffer_ids
            append(len(ids))
            extend(ids)
            _put_shapes(v, instr.output_shapes)
        elif tag in _COMM_TAGS:
            append(instr.peer)
            if version >= 2:
                append(instr.compress_rank)
            elif instr.compress_rank:
                raise ValueError("format version 1 cannot carry compressed gradient messages")
        if version >= _VERSION_SLICED and tag in _SLICE_TAGS:
            sl = instr.token_slice
            append(len(sl))
            extend(sl)
        if version >= _VERSION_SPLIT and tag in _COMM_TAGS:
            sl = instr.batch_slice
            append(len(sl))
            extend(sl)
    try:
        arr = array.array("i", v)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"cannot serialize plan of rank {plan.rank}: every id, shape "
                         f"dimension and counter must be an int32 ({exc})") from None
    if sys.byteorder != "little":
        arr.byteswap()
    payload = arr.tobytes()
    dtype = plan.dtype.encode("utf-8")
    if len(dtype) > 255:
        raise ValueError(f"dtype name too long to serialize: {plan.dtype!r}")
    header = _HEADER.pack(_MAGIC, version, 0, len(payload), zlib.crc32(dtype + payload),
                         len(dtype))
    return header + dtype + payload


def _truncated(total: int) -> ValueError:
    return ValueError(f"serialized ExecutionPlan is truncated or corrupt: its {total} int32 "
                      "values end in the middle of a record")


def _decode_values(v: list, version: int = _VERSION):
    """Decode the int32 stream. Inlined index arithmetic (no helper calls per value) because
    this loop dominates decoding time; any IndexError means the stream ended early."""
    shape_cache: dict = {}  # plans repeat a handful of shapes: share the tuples

    def shapes_at(i):
        n = v[i]
        i += 1
        out = []
        for _ in range(n):
            nd = v[i]
            key = tuple(v[i + 1:i + 1 + nd])
            if len(key) != nd:
                raise IndexError
            out.append(shape_cache.setdefault(key, key))
            i += 1 + nd
        return tuple(out), i

    def ids_at(i):  # <id list>; only the format's optional attributes use it
        n = v[i]
        ids = tuple(v[i + 1:i + 1 + n])
        if len(ids) != n:
            raise IndexError
        return ids, i + 1 + n

    i = 7
    header = v[:6]
    assigned = tuple(v[i:i + v[6]])
    i += v[6]
    n_mb = v[i]
    i += 1
    mb_shapes = []
    for _ in range(n_mb):
        shp, i = shapes_at(i)
        mb_shapes.append(shp)
    batch_split = ()
    if version >= _VERSION_SPLIT:
        batch_split, i = ids_at(i)
    n_instr = v[i]
    i += 1
    instructions = []
    append = instructions.append
    compute, comm, class_of, slice_tags = _COMPUTE_TAGS, _COMM_TAGS, _CLASS_OF, _SLICE_TAGS
    for _ in range(n_instr):
        tag, mb, stage, n = v[i], v[i + 1], v[i + 2], v[i + 3]
        cls = class_of.get(tag)
        if cls is None or (tag in _ZB_TAGS and version < _VERSION_ZB):
            raise ValueError(f"serialized ExecutionPlan is corrupt: unknown instruction tag {tag}")
        i += 4
        ids = tuple(v[i:i + n])
        shp, i = shapes_at(i + n)
        if tag in compute:
            n = v[i]
            out_ids = tuple(v[i + 1:i + 1 + n])
            out_shp, i = shapes_at(i + 1 + n)
            args = (mb, stage, ids, shp, out_ids, out_shp)
        elif tag in comm:
            if version >= 2:
                args = (mb, stage, ids, shp, v[i], v[i + 1])
                i += 2
            else:
                args = (mb, stage, ids, shp, v[i])
                i += 1
        else:
            args = (mb, stage, ids, shp)
        extra = {}
        if version >= _VERSION_SLICED and tag in slice_tags:
            sl, i = ids_at(i)
            if sl:
                extra["token_slice"] = sl
        if version >= _VERSION_SPLIT and tag in comm:
            sl, i = ids_at(i)
            if sl:
                extra["batch_slice"] = sl
        append(cls(*args, **extra) if extra else cls(*args))
    if i != len(v):
        # Also catches a short final slice: slicing never raises, so check the length here.
        raise IndexError if i > len(v) else ValueError(
            f"serialized ExecutionPlan is corrupt: {len(v) - i} unread values after the "
            "last instruction")
    return header, assigned, tuple(mb_shapes), instructions, batch_split


def _decode_plan(data: bytes) -> ExecutionPlan:
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise ValueError(f"serialized ExecutionPlan is truncated: {len(data)} bytes, the header "
                         f"alone is {_HEADER.size}")
    magic, version, reserved, nbytes, crc, dlen = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError(f"not a serialized ExecutionPlan: magic {magic!r}, expected {_MAGIC!r}")
    if reserved != 0:
        raise ValueError(f"serialized ExecutionPlan is corrupt: reserved header field is {reserved}, must be 0")
    if version not in _READABLE_VERSIONS:
        raise ValueError(f"serialized ExecutionPlan has format version {version}; this build "
                         f"reads versions {_READABLE_VERSIONS} (planner and trainer are out of sync)")
    start = _HEADER.size + dlen
    if len(data) != start + nbytes or nbytes % 4:
        raise ValueError(f"serialized ExecutionPlan is truncated or has trailing bytes: "
                         f"{len(data)} bytes, header says {start + nbytes}")
    payload = data[start:]
    if zlib.crc32(data[_HEADER.size:]) != crc:
        raise ValueError("serialized ExecutionPlan is corrupt (payload checksum mismatch)")
    arr = array.array("i")
    arr.frombytes(payload)
    if sys.byteorder != "little":
        arr.byteswap()
    values = arr.tolist()
    try:
        header, assigned, mb_shapes, instructions, batch_split = _decode_values(values, version)
    except IndexError:
        raise _truncated(len(values)) from None
    rank, num_ranks, num_stages, num_buffers, iteration, recompute = header
    if not 0 <= recompute < len(RECOMPUTE_LEVELS):
        raise ValueError(f"serialized ExecutionPlan is corrupt: recompute index {recompute}")
    return ExecutionPlan(rank=rank, num_ranks=num_ranks, num_stages=num_stages,
                         assigned_stages=assigned, instructions=instructions,
                         microbatch_shapes=mb_shapes, recompute=RECOMPUTE_LEVELS[recompute],
                         num_buffers=num_buffers, dtype=data[_HEADER.size:start].decode("utf-8"),
                         iteration=iteration, batch_split=batch_split)
