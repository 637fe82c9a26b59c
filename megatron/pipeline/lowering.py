"""Lowering: the one place that turns a pipeline schedule into per-rank instruction streams.

Every planner (static GPipe/1F1B/interleaved, DynaPipe, TeraPipe) decides only *which
compute op runs where and in which order*: a list of `ComputeOp("F"|"B", mb, stage)` per
pipeline rank. `lower_to_plans` adds everything else (loads, sends, receives, buffer slots,
frees) the same way for all of them, so the executor and `p2p.py` see one dialect.

Emission rules (per rank, walking its compute order):

* `LoadInput(mb, stage, shapes=microbatch_shapes[mb])` before the first op of `mb` on this
  rank (no slots: the executor keeps the batch by micro-batch id).
* Forward of stage s reads its input slots: the slots written by the forward of s-1 when that
  stage is on this rank, else slots filled by a receive. It writes output slots unless s is
  the last stage (which produces the loss); when stage s+1 is on another rank the output is
  sent right away (`SendActivationStart`). Backward is the mirror image: it reads the
  gradient w.r.t. its output (received, or written by the backward of s+1 on this rank) and
  writes the gradient w.r.t. its input unless s == 0, sent right away (`SendGradStart`)
  when stage s-1 is on another rank.
* Receives: all messages between an ordered rank pair travel on one ordered channel (NCCL
  pairs point-to-point ops by issue order), in the order the sender starts them. Before the
  consumer of message k of channel (peer -> me), `Recv*Start` is posted for every message of
  that channel up to k not yet posted, then `Recv*Finish` of message k comes right before the
  consumer. Starts never block, so posting early cannot deadlock; it only keeps a slot live.
* Sends complete lazily (DynaPipe's instruction optimizer): `SendActivationFinish` just
  before the backward of that (mb, stage), `SendGradFinish` at the end of the iteration -
  unless the rank already *knows* the send is complete earlier: once it has finished
  receiving a message the peer started after posting the matching receive, the Finish
  cannot block, so it and the slot's FreeBuffer are moved right there. This keeps gradient
  slots from piling up over a whole iteration without adding any wait.
* `FreeBuffer` right after a slot's last use. Slots are allocated lowest-free-id first after
  emission, so `num_buffers` is the peak number of live slots.

Blocking only happens at `Recv*Finish` (waits for a send that follows a compute op the
receiver needs anyway) and `Send*Finish` (placed where the receive is already posted or
implied), so the plans are deadlock-free exactly when the compute orders are, and they pass
`megatron.pipeline.validator.validate_plans`.

Split backward (zero-bubble schedules): an order may replace `B(mb, s)` by `I(mb, s)` (the
input gradient: lowered to `BackwardInput`, which reads and writes the same slots and sends
like a backward) followed later on the same rank by `W(mb, s)` (the weight gradient:
`BackwardWeight`, no slots, no messages).
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, NamedTuple, Sequence

from megatron.pipeline.instructions import (
    BackwardInput, BackwardPass, BackwardWeight, ExecutionPlan, ForwardPass, FreeBuffer, LoadInput,
    RecvActivationFinish, RecvActivationStart, RecvGradFinish, RecvGradStart, SendActivationFinish,
    SendActivationStart, SendGradFinish, SendGradStart,
)

ACT, GRAD = "activation", "grad"
_SEND_START = {ACT: SendActivationStart, GRAD: SendGradStart}
_SEND_FINISH = {ACT: SendActivationFinish, GRAD: SendGradFinish}
_RECV_START = {ACT: RecvActivationStart, GRAD: RecvGradStart}
_RECV_FINISH = {ACT: RecvActivationFinish, GRAD: RecvGradFinish}


COMPUTE_KINDS = ("F", "B", "I", "W")


class ComputeOp(NamedTuple):
    """One compute op of a schedule: the op type of every planner, simulator and lowering (a
    tuple: the schedule searches build and replay millions of them; kinds are checked where
    orders are lowered)."""
    kind: str          # "F" (forward), "B" (backward), or a split backward's "I" (input) / "W" (weight)
    microbatch: int
    stage: int

    def __str__(self):
        return f"{self.kind}(mb={self.microbatch}, stage={self.stage})"


def lower_to_plans(compute_orders: list[list[ComputeOp]], stage_to_rank: list[int],
                   microbatch_shapes: Sequence, activation_shapes: Callable,
                   recompute: str = "none", dtype: str = "float32", iteration: int = 0,
                   validate: bool = True) -> list[ExecutionPlan]:
    """Lower per-rank compute orders to one `ExecutionPlan` per pipeline rank.

    `activation_shapes(mb, stage)` gives the shapes of the output of `stage` (= the input of
    stage+1, and the shapes of the gradient sent back to `stage`). With `validate` (the
    default) the result is checked by `validate_plans`, so an impossible order (e.g. a rank
    waiting on itself) is reported as a `PlanValidationError` instead of a hang later.
    """
    num_ranks, num_stages = len(compute_orders), len(stage_to_rank)
    mb_shapes = tuple(tuple(tuple(int(d) for d in s) for s in shp) for shp in microbatch_shapes)
    _check_orders(compute_orders, stage_to_rank, len(mb_shapes))
    shapes = _ShapeCache(activation_shapes, num_stages)
    channels = _channels(compute_orders, stage_to_rank, num_stages)
    emitted = [_RankEmitter(r, compute_orders[r], stage_to_rank, mb_shapes, shapes,
                            channels).run() for r in range(num_ranks)]
    # Ordinal of every Start among its rank's Starts, per (src, dst, k, is_send): this is
    # what the send-completion hoisting reasons about, and it is unaffected by moving Finishes.
    ordinal = {}
    for r, records in enumerate(emitted):
        n = 0
        for rec in records:
            if rec[0] == "start":
                ordinal[rec[1]] = n
                n += 1
    plans = []
    for r in range(num_ranks):
        records = _place_send_finishes(r, emitted[r], ordinal)
        instructions, num_buffers = _assign_slots(records)
        plans.append(ExecutionPlan(
            rank=r, num_ranks=num_ranks, num_stages=num_stages,
            assigned_stages=tuple(s for s in range(num_stages) if stage_to_rank[s] == r),
            instructions=instructions, microbatch_shapes=mb_shapes, recompute=recompute,
            num_buffers=num_buffers, dtype=dtype, iteration=iteration))
    if validate:
        from megatron.pipeline.validator import validate_plans
        validate_plans(plans)
    return plans


def _check_orders(orders, stage_to_rank, num_mb) -> None:
    num_ranks, num_stages = len(orders), len(stage_to_rank)
    for s, r in enumerate(stage_to_rank):
        if not 0 <= r < num_ranks:
            raise ValueError(f"stage_to_rank[{s}] = {r} is not a rank in [0, {num_ranks})")
    seen = set()
    for r, order in enumerate(orders):
        for op in order:
            if op.kind not in COMPUTE_KINDS:
                raise ValueError(f"compute_orders[{r}] has {op}: kind must be 'F', 'B', 'I' or 'W'")
            if not (0 <= op.microbatch < num_mb and 0 <= op.stage < num_stages):
                raise ValueError(f"compute_orders[{r}] has {op}: micro-batch must be in "
                                 f"[0, {num_mb}) and stage in [0, {num_stages})")
            if stage_to_rank[op.stage] != r:
                raise ValueError(f"compute_orders[{r}] has {op}, but stage {op.stage} runs on "
                                 f"rank {stage_to_rank[op.stage]}")
            if op in seen:
                raise ValueError(f"compute_orders[{r}] has {op} twice")
            seen.add(op)
    for mb in range(num_mb):
        for s in range(num_stages):
            split = ComputeOp("I", mb, s) in seen or ComputeOp("W", mb, s) in seen
            for kind in ("FIW" if split else "FB"):
                if ComputeOp(kind, mb, s) not in seen:
                    raise ValueError(f"no rank runs {ComputeOp(kind, mb, s)} "
                                     f"(expected on rank {stage_to_rank[s]})")
            if split and ComputeOp("B", mb, s) in seen:
                raise ValueError(f"{ComputeOp('B', mb, s)} and a split backward (I/W) of it are both ordered")


class _ShapeCache:
    def __init__(self, fn, num_stages):
        self.fn, self.num_stages, self.cache = fn, num_stages, {}

    def __call__(self, mb, stage):
        key = (mb, stage)
        if key not in self.cache:
            shapes = tuple(tuple(int(d) for d in s) for s in self.fn(mb, stage))
            if not shapes:
                raise ValueError(f"activation_shapes({mb}, {stage}) is empty: the output of a "
                                 f"non-last stage must have at least one tensor")
            self.cache[key] = shapes
        return self.cache[key]


def _channels(orders, stage_to_rank, num_stages) -> dict:
    """(src, dst) -> ({message: k}, [messages]), in the order src starts them (= its compute
    order, since each send starts right after its producing op)."""
    channels: dict = {}
    for src, order in enumerate(orders):
        for op in order:
            if op.kind == "F" and op.stage + 1 < num_stages:
                msg, dst = (ACT, op.microbatch, op.stage), stage_to_rank[op.stage + 1]
            elif op.kind in ("B", "I") and op.stage > 0:
                msg, dst = (GRAD, op.microbatch, op.stage), stage_to_rank[op.stage - 1]
            else:
                continue
            if dst != src:
                index, messages = channels.setdefault((src, dst), ({}, []))
                index[msg] = len(messages)
                messages.append(msg)
    return channels


# Records are plain tuples until slots are assigned:
#   ("op", cls, mb, stage, in_ids, in_shapes, out_ids, out_shapes, peer)  (logical buffer ids)
#   ("start", key, cls, mb, stage, ids, shapes, peer)   key = (src, dst, k, is_send)
#   ("recv_finish", key, cls, mb, stage, ids, shapes, peer)
#   ("send_finish", key)  default (latest) completion point of the send with that key
class _RankEmitter:
    def __init__(self, rank, order, stage_to_rank, mb_shapes, shapes, channels):
        self.rank, self.order, self.where = rank, order, stage_to_rank
        self.mb_shapes, self.shapes, self.channels = mb_shapes, shapes, channels
        self.last = len(stage_to_rank) - 1
        self.records: list = []
        self.next_buffer = 0
        self.local: dict = {}     # message on this rank -> logical ids (producer -> consumer)
        self.received: dict = {}  # message -> (key, logical ids, shapes)
        self.posted: dict = {}    # src -> number of messages of channel (src, me) posted
        self.sends: dict = {}     # (ACT, mb, s) -> key of the send, finished before B(mb, s)
        self.grad_sends: list = []

    def new_buffers(self, n):
        self.next_buffer += n
        return tuple(range(self.next_buffer - n, self.next_buffer))

    def run(self) -> list:
        loaded = set()
        for op in self.order:
            if op.microbatch not in loaded:
                loaded.add(op.microbatch)
                self.records.append(("op", LoadInput, op.microbatch, op.stage, (),
                                     self.mb_shapes[op.microbatch], (), (), None))
            if op.kind == "F":
                self.forward(op.microbatch, op.stage)
            elif op.kind == "W":
                self.records.append(("op", BackwardWeight, op.microbatch, op.stage, (), (), (), (), None))
            else:
                self.backward(op.microbatch, op.stage, BackwardInput if op.kind == "I" else BackwardPass)
        for key in self.grad_sends:
            self.records.append(("send_finish", key))
        if self.local:
            raise ValueError(f"rank {self.rank}: outputs never consumed on this rank: "
                             f"{sorted(self.local)}")
        return self.records

    def forward(self, mb, s):
        ids, in_shapes = self.input(mb, s, (ACT, mb, s - 1), s > 0, s - 1, "F")
        out_shapes = self.shapes(mb, s) if s < self.last else ()
        self.compute(ForwardPass, mb, s, ids, in_shapes, out_shapes, (ACT, mb, s), s + 1)

    def backward(self, mb, s, cls=BackwardPass):
        if (ACT, mb, s) in self.sends:
            self.records.append(("send_finish", self.sends.pop((ACT, mb, s))))
        ids, in_shapes = self.input(mb, s, (GRAD, mb, s + 1), s < self.last, s + 1, "B")
        out_shapes = self.shapes(mb, s - 1) if s > 0 else ()
        self.compute(cls, mb, s, ids, in_shapes, out_shapes, (GRAD, mb, s), s - 1)

    def input(self, mb, s, msg, needed, src_stage, kind):
        if not needed:
            return (), ()
        src = self.where[src_stage]
        if src == self.rank:
            if msg not in self.local:
                raise ValueError(f"rank {self.rank}: {ComputeOp(kind, mb, s)} is ordered before "
                                 f"{ComputeOp(kind, mb, src_stage)} that produces its input")
            return self.local.pop(msg)
        index, messages = self.channels[(src, self.rank)]
        k = index[msg]
        posted = self.posted.get(src, 0)
        if k >= posted:
            for j in range(posted, k + 1):
                kind_j, mb_j, s_j = m = messages[j]
                shapes = self.shapes(mb_j, s_j if kind_j == ACT else s_j - 1)
                ids = self.new_buffers(len(shapes))
                key = (src, self.rank, j, False)
                self.received[m] = (key, ids, shapes)
                self.records.append(("start", key, _RECV_START[kind_j], mb_j, s_j, ids, shapes,
                                     src))
            self.posted[src] = k + 1
        key, ids, shapes = self.received.pop(msg)
        self.records.append(("recv_finish", key, _RECV_FINISH[msg[0]], msg[1], msg[2], ids,
                             shapes, src))
        return ids, shapes

    def compute(self, cls, mb, s, in_ids, in_shapes, out_shapes, out_msg, dst_stage):
        out_ids = self.new_buffers(len(out_shapes))
        self.records.append(("op", cls, mb, s, in_ids, in_shapes, out_ids, out_shapes, None))
        if in_ids:
            self.records.append(("op", FreeBuffer, mb, s, in_ids, in_shapes, (), (), None))
        if not out_ids:
            return
        dst = self.where[dst_stage]
        if dst == self.rank:
            self.local[out_msg] = (out_ids, out_shapes)
            return
        key = (self.rank, dst, self.channels[(self.rank, dst)][0][out_msg], True)
        self.records.append(("start", key, _SEND_START[out_msg[0]], mb, s, out_ids, out_shapes,
                             dst))
        if out_msg[0] == ACT:
            self.sends[out_msg] = key
        else:
            self.grad_sends.append(key)


def _place_send_finishes(rank, records, ordinal) -> list:
    """Emit each Send*Finish (+ FreeBuffer of its slots) at the earlier of its default point
    and the first point where this rank has finished a receive that the peer started after
    posting the matching receive (then the send is known complete: the Finish is free)."""
    out: list = []
    starts: dict = {}         # send key -> its start record
    pending: dict = {}        # peer -> deque of send keys, in channel order
    done: set = set()
    known: dict = {}          # peer -> highest Start ordinal of the peer known to be executed

    def finish(key):
        done.add(key)
        _, _, cls, mb, s, ids, shapes, peer = starts[key]
        kind = ACT if cls is SendActivationStart else GRAD
        out.append(("op", _SEND_FINISH[kind], mb, s, ids, shapes, (), (), peer))
        out.append(("op", FreeBuffer, mb, s, ids, shapes, (), (), None))

    for rec in records:
        tag = rec[0]
        if tag == "send_finish":
            if rec[1] not in done:
                finish(rec[1])
            continue
        out.append(rec)
        if tag == "start" and rec[1][3]:
            starts[rec[1]] = rec
            pending.setdefault(rec[7], deque()).append(rec[1])
        elif tag == "recv_finish":
            src, _, k, _ = rec[1]
            known[src] = max(known.get(src, -1), ordinal[(src, rank, k, True)])
            queue = pending.get(src, ())
            # Receives of one channel are posted in channel order, so the deque is sorted by
            # the ordinal of the peer's matching RecvStart.
            while queue and (queue[0] in done or
                             ordinal[queue[0][:3] + (False,)] < known[src]):
                head = queue.popleft()
                if head not in done:
                    finish(head)
    return out


def _assign_slots(records) -> tuple[list, int]:
    """Map logical buffers to physical slot ids, lowest free id first; returns the
    instructions and the peak number of live slots."""
    free: list = []
    slot_of: dict = {}
    peak = 0
    instructions = []

    def alloc(ids):
        nonlocal peak
        out = []
        for b in ids:
            slot = heapq.heappop(free) if free else peak
            peak = max(peak, slot + 1)
            slot_of[b] = slot
            out.append(slot)
        return tuple(out)

    for rec in records:
        if rec[0] == "op":
            _, cls, mb, s, ids, shapes, out_ids, out_shapes, peer = rec
            if cls is ForwardPass or cls is BackwardPass or cls is BackwardInput:
                instructions.append(cls(mb, s, tuple(slot_of[b] for b in ids), shapes,
                                        alloc(out_ids), out_shapes))
            elif cls is BackwardWeight:
                instructions.append(cls(mb, s))
            elif cls is FreeBuffer:
                slots = tuple(slot_of.pop(b) for b in ids)
                instructions.append(cls(mb, s, slots, shapes))
                for slot in slots:
                    heapq.heappush(free, slot)
            elif cls is LoadInput:
                instructions.append(cls(mb, s, (), shapes))
            else:  # Send*Finish
                instructions.append(cls(mb, s, tuple(slot_of[b] for b in ids), shapes, peer))
        else:
            _, key, cls, mb, s, ids, shapes, peer = rec
            if rec[0] == "start" and not key[3]:
                slots = alloc(ids)
            else:
                slots = tuple(slot_of[b] for b in ids)
            instructions.append(cls(mb, s, slots, shapes, peer))
    return instructions, peak
