"""Offline checks of a set of per-rank `ExecutionPlan`s before any of them runs.

A wrong plan on a real cluster shows up as a hang or as a silently mis-shaped receive, so
every rule the executor and `p2p.py` rely on is checked here, once, in time linear in the
plan size, and a violation raises `PlanValidationError` naming the rank (pair), the
instruction index and the instruction.

Rules (see the module docstring of `megatron.pipeline.instructions` for the semantics):

* header: all plans agree on num_ranks, num_stages, dtype, microbatch_shapes and iteration;
  there is exactly one plan per rank; every stage is owned by exactly one rank.
* per rank: every instruction names a micro-batch and a stage this rank may touch and, for
  communication, the rank that owns the neighbouring stage; `*Finish` follows its `*Start`
  (same buffers) and every `*Start` is finished; each message is sent/received once.
* buffers: a slot is written (LoadInput/ForwardPass/BackwardPass outputs, Recv*Start) only
  when free, read only after it is written (and its receive finished), freed only when no
  send from it is in flight, and every slot is freed by the end of the plan. Each slot is
  tagged with what it holds, so a ForwardPass of stage s must read exactly the output of
  stage s-1 of the same micro-batch and a BackwardPass of stage s exactly the gradient
  w.r.t. the input of stage s+1.
* compute: per (micro-batch, owned stage) exactly one forward and one backward, the
  backward after the forward; LoadInput of the micro-batch before its first forward; the
  last stage has no outputs; backward gradients have the forward's input shapes.
* matching: per ordered rank pair (a -> b), the k-th send of a to b (activations and
  gradients share one ordered channel, as NCCL matches point-to-point ops by issue order
  only) is the k-th receive of b from a: same kind, micro-batch, stage and shapes.
* token slices (TeraPipe): either no instruction has a `token_slice` or every LoadInput,
  compute and communication instruction has one; all instructions of a unit (micro-batch id)
  on all ranks carry the same (sequence, offset, length); `microbatch_shapes[unit]` is
  ((b, length),); the units of a sequence tile its tokens [0, S) without gap or overlap with
  one b; on each stage the forwards of a sequence run in ascending offset, all before its
  first backward, and the backwards in descending offset (the key/value cache and its
  gradients flow that way).
* batch splits (stages with different TP / DP sizes): either no plan has a `batch_split` or
  every plan has one; a stage may then be owned by several ranks (one stage each) whose
  (index, parts) cover every part; every communication instruction carries a
  `batch_slice` inside this rank's rows of the micro-batch, both ends of a message carry the
  same rows, and the pieces a receive buffer is assembled from are disjoint and cover the
  rank's rows before the buffer is read. Batch splits do not combine with token slices or
  compressed messages.
* deadlock: all ranks are simulated together with "Start never blocks; RecvFinish waits
  until the peer executed the matching SendStart; SendFinish waits until the peer executed
  the matching RecvStart; compute never blocks". If every unfinished rank is waiting, the
  error lists where each one is stuck.
"""
from __future__ import annotations

from collections import deque

from megatron.pipeline.instructions import (
    BackwardPass, ExecutionPlan, ForwardPass, FreeBuffer, LoadInput, RecvActivationFinish,
    RecvActivationStart, RecvGradFinish, RecvGradStart, SendActivationFinish,
    SendActivationStart, SendGradFinish, SendGradStart, describe,
)


class PlanValidationError(ValueError):
    """A set of execution plans that would hang, mis-match or corrupt data if run."""


# Communication kinds: class -> (message kind, is_send, is_start)
_COMM = {
    SendActivationStart: ("activation", True, True),
    SendActivationFinish: ("activation", True, False),
    RecvActivationStart: ("activation", False, True),
    RecvActivationFinish: ("activation", False, False),
    SendGradStart: ("grad", True, True),
    SendGradFinish: ("grad", True, False),
    RecvGradStart: ("grad", False, True),
    RecvGradFinish: ("grad", False, False),
}


def validate_plans(plans: list[ExecutionPlan]) -> None:
    """Raise `PlanValidationError` unless `plans` (one per pipeline rank) can run together."""
    plans = _check_headers(plans)
    stage_to_rank = _check_stage_assignment(plans)
    if plans[0].batch_split and any(getattr(i, "token_slice", ()) for p in plans for i in p.instructions):
        raise PlanValidationError("batch splits (stages with different TP/DP) and token slices (TeraPipe) "
                                  "cannot be combined in one plan")
    # Pairing first: a missing or mis-ordered message is best reported as a rank-pair error,
    # before it surfaces on the receiver as "input not received".
    _check_matching(plans, [_comm_sequences(plan) for plan in plans])
    _check_slices(plans)
    ranks = [_RankChecker(plan, stage_to_rank).run() for plan in plans]
    _check_deadlock(plans, ranks)


def _check_headers(plans) -> list[ExecutionPlan]:
    if not plans:
        raise PlanValidationError("no execution plans to validate")
    first = plans[0]
    for plan in plans[1:]:
        for name in ("num_ranks", "num_stages", "dtype", "microbatch_shapes", "iteration"):
            a, b = getattr(first, name), getattr(plan, name)
            if tuple(a) != tuple(b) if isinstance(a, (tuple, list)) else a != b:
                raise PlanValidationError(
                    f"plans of rank {first.rank} and rank {plan.rank} disagree on {name}: "
                    f"{a!r} vs {b!r}")
    if len(plans) != first.num_ranks:
        raise PlanValidationError(
            f"got {len(plans)} plans for num_ranks={first.num_ranks}: need one plan per rank")
    by_rank = sorted(plans, key=lambda p: p.rank)
    for expected, plan in enumerate(by_rank):
        if plan.rank != expected:
            raise PlanValidationError(
                f"plan ranks are {sorted(p.rank for p in plans)}: expected each of "
                f"0..{first.num_ranks - 1} exactly once")
    return by_rank


def _check_stage_assignment(plans) -> list:
    """Stage -> sorted list of owner ranks: exactly one owner, or with batch splits the ranks
    that share the stage's rows (TP ranks hold the same rows, DP ranks disjoint parts)."""
    num_stages = plans[0].num_stages
    split = bool(plans[0].batch_split)
    owner: list = [[] for _ in range(num_stages)]
    for plan in plans:
        if bool(plan.batch_split) != split:
            raise PlanValidationError(f"rank {plan.rank} {'lacks' if split else 'has'} a batch_split but rank "
                                      f"{plans[0].rank} {'has' if split else 'does not'}: all plans or none split "
                                      "micro-batches")
        if split:
            if len(plan.batch_split) != 2 or not 0 <= plan.batch_split[0] < plan.batch_split[1]:
                raise PlanValidationError(f"rank {plan.rank}: batch_split must be (index, parts) with "
                                          f"0 <= index < parts, got {tuple(plan.batch_split)}")
            if len(plan.assigned_stages) != 1:
                raise PlanValidationError(f"rank {plan.rank}: a plan with a batch split runs exactly one stage, "
                                          f"not {list(plan.assigned_stages)}")
        for stage in plan.assigned_stages:
            if not 0 <= stage < num_stages:
                raise PlanValidationError(
                    f"rank {plan.rank} is assigned stage {stage}, outside [0, {num_stages})")
            if owner[stage] and not split:
                raise PlanValidationError(
                    f"stage {stage} is assigned to two ranks: rank {owner[stage][0]} and "
                    f"rank {plan.rank}")
            owner[stage].append(plan.rank)
    missing = [s for s, r in enumerate(owner) if not r]
    if missing:
        raise PlanValidationError(f"stages {missing} are assigned to no rank")
    if split:
        by_rank = {p.rank: p for p in plans}
        for stage, ranks in enumerate(owner):
            parts = {by_rank[r].batch_split[1] for r in ranks}
            seen = {by_rank[r].batch_split[0] for r in ranks}
            if len(parts) != 1 or seen != set(range(next(iter(parts)))):
                raise PlanValidationError(
                    f"stage {stage}: its ranks {ranks} hold row parts "
                    f"{sorted(tuple(by_rank[r].batch_split) for r in ranks)}; they must cover every part of "
                    "one split of the micro-batch")
    return owner


def _rows(plan, mb: int):
    """(first, count) of micro-batch `mb`'s rows that `plan`'s rank holds, or None if its
    micro-batch does not divide into the plan's parts."""
    b = plan.microbatch_shapes[mb][0][0]
    if not plan.batch_split:
        return 0, b
    index, parts = plan.batch_split
    if b % parts:
        return None
    return index * (b // parts), b // parts


def _wire_shapes(instr) -> tuple:
    """Shapes of what travels: the buffer's shapes, with dimension 1 cut to the message's rows."""
    shapes = tuple(map(tuple, instr.buffer_shapes))
    sl = getattr(instr, "batch_slice", ())
    if not sl:
        return shapes
    return tuple(s[:1] + (sl[1],) + s[2:] if len(s) >= 2 else s for s in shapes)


class _RankChecker:
    """Single pass over one rank's plan: structure, buffers, compute order.

    Produces, for the cross-rank checks, the ordered sends/receives per peer and, per
    instruction, which counter it bumps and which counter it waits on (deadlock search).
    """

    def __init__(self, plan: ExecutionPlan, stage_to_rank: list[int]):
        self.plan = plan
        self.rank = plan.rank
        self.stage_to_rank = stage_to_rank
        self.owned = frozenset(plan.assigned_stages)
        self.num_mb = len(plan.microbatch_shapes)
        self.last = plan.num_stages - 1
        self.slots: dict = {}          # slot -> [tag, shape, ready, sends in flight]
        self.assembly: dict = {}       # slot -> [row pieces, open receives] (batch splits)
        self.loaded: set = set()
        self.forwarded: dict = {}      # (mb, stage) -> (input shapes, output shapes)
        self.backwarded: set = set()
        self.open: dict = {}           # (kind, is_send, mb, stage) -> (index, Start, position)
        self.done_comm: set = set()
        self.sends: dict = {}          # peer -> [(msg, index, instr)]
        self.recvs: dict = {}          # peer -> [(msg, index, instr)]
        # Deadlock search inputs, one entry per instruction (None when not applicable).
        # Counter keys: ("sent", a, b) = SendStarts executed by a towards b,
        #               ("posted", a, b) = RecvStarts executed by b for messages from a.
        self.bumps: list = []
        self.waits: list = []

    def fail(self, index, instr, msg):
        raise PlanValidationError(
            f"rank {self.rank}, instruction #{index} {describe(instr)}: {msg}")

    def run(self):
        for index, instr in enumerate(self.plan.instructions):
            self.bumps.append(None)
            self.waits.append(None)
            self._check_common(index, instr)
            kind = type(instr)
            if kind is ForwardPass:
                self._forward(index, instr)
            elif kind is BackwardPass:
                self._backward(index, instr)
            elif kind is LoadInput:
                self._load(index, instr)
            elif kind is FreeBuffer:
                for slot, shape in zip(instr.buffer_ids, instr.buffer_shapes):
                    self._free(index, instr, slot, shape)
            elif kind in _COMM:
                self._comm(index, instr, *_COMM[kind])
            else:
                self.fail(index, instr, f"unknown instruction type {kind.__name__}")
        self._check_end()
        return self

    # -- per-instruction rules ------------------------------------------------------------
    def _check_common(self, index, instr):
        if not 0 <= instr.microbatch < self.num_mb:
            self.fail(index, instr, f"micro-batch {instr.microbatch} outside "
                      f"[0, {self.num_mb}) (the plan's microbatch_shapes)")
        if not 0 <= instr.stage <= self.last:
            self.fail(index, instr, f"stage outside [0, {self.plan.num_stages})")
        if len(instr.buffer_ids) != len(instr.buffer_shapes) and not (
                type(instr) is LoadInput and not instr.buffer_ids):
            self.fail(index, instr, "buffer_ids and buffer_shapes differ in length")
        outs = getattr(instr, "output_buffer_ids", ())
        if len(outs) != len(getattr(instr, "output_shapes", ())):
            self.fail(index, instr, "output_buffer_ids and output_shapes differ in length")
        for slot in tuple(instr.buffer_ids) + tuple(outs):
            if not 0 <= slot < self.plan.num_buffers:
                self.fail(index, instr, f"slot {slot} outside [0, num_buffers="
                          f"{self.plan.num_buffers})")

    def _own(self, index, instr, stage, what):
        if stage not in self.owned:
            self.fail(index, instr, f"{what} stage {stage} is not assigned to this rank "
                      f"(assigned: {sorted(self.owned)}; owner: rank "
                      f"{'/'.join(map(str, self.stage_to_rank[stage]))})")

    def _load(self, index, instr):
        mb = instr.microbatch
        self._own(index, instr, instr.stage, "LoadInput")
        if mb in self.loaded:
            self.fail(index, instr, f"micro-batch {mb} is loaded twice")
        want = tuple(map(tuple, self.plan.microbatch_shapes[mb]))
        rows = _rows(self.plan, mb)
        if rows is None:
            self.fail(index, instr, f"micro-batch {mb} has {want[0][0]} rows, which batch_split "
                      f"{tuple(self.plan.batch_split)} cannot divide")
        if self.plan.batch_split:  # this rank loads its rows only
            want = tuple((rows[1],) + s[1:] for s in want)
        if tuple(map(tuple, instr.buffer_shapes)) != want:
            self.fail(index, instr, f"shapes differ from microbatch_shapes[{mb}] = {want}"
                      + (" (this rank's rows)" if self.plan.batch_split else ""))
        self.loaded.add(mb)
        n = len(instr.buffer_ids)
        for j, (slot, shape) in enumerate(zip(instr.buffer_ids, instr.buffer_shapes)):
            self._write(index, instr, slot, ("input", mb, 0, j, n), shape, ready=True)

    def _forward(self, index, instr):
        mb, s = instr.microbatch, instr.stage
        self._own(index, instr, s, "forward")
        if (mb, s) in self.forwarded:
            self.fail(index, instr, f"second forward of micro-batch {mb}, stage {s}")
        if mb not in self.loaded:
            self.fail(index, instr, f"forward before LoadInput of micro-batch {mb}")
        if s == 0:
            if instr.buffer_ids:
                self.fail(index, instr, "stage 0 starts from tokens and reads no slots")
        else:
            self._read_tagged(index, instr, "activation", mb, s - 1,
                              f"its input (the output of stage {s - 1}) was not received "
                              "or produced on this rank")
        if s == self.last:
            if instr.output_buffer_ids:
                self.fail(index, instr, "the last stage produces the loss: no output slots")
        elif not instr.output_buffer_ids:
            self.fail(index, instr, f"stage {s} is not last: its output must go to slots")
        n = len(instr.output_buffer_ids)
        for j, (slot, shape) in enumerate(zip(instr.output_buffer_ids, instr.output_shapes)):
            self._write(index, instr, slot, ("activation", mb, s, j, n), shape, ready=True)
        self.forwarded[(mb, s)] = (tuple(map(tuple, instr.buffer_shapes)),
                                   tuple(map(tuple, instr.output_shapes)))

    def _backward(self, index, instr):
        mb, s = instr.microbatch, instr.stage
        self._own(index, instr, s, "backward")
        if (mb, s) not in self.forwarded:
            self.fail(index, instr, f"backward of micro-batch {mb}, stage {s} before its forward")
        if (mb, s) in self.backwarded:
            self.fail(index, instr, f"second backward of micro-batch {mb}, stage {s}")
        in_shapes, out_shapes = self.forwarded[(mb, s)]
        if s == self.last:
            if instr.buffer_ids:
                self.fail(index, instr, "the last stage starts from the loss: no gradient slots")
        else:
            self._read_tagged(index, instr, "grad", mb, s + 1,
                              f"the gradient w.r.t. its output (from stage {s + 1}) was not "
                              "received or produced on this rank")
            if tuple(map(tuple, instr.buffer_shapes)) != out_shapes:
                self.fail(index, instr, f"gradient shapes differ from the forward's output "
                          f"shapes {out_shapes}")
        if s == 0:
            if instr.output_buffer_ids:
                self.fail(index, instr, "stage 0 has no input gradient: no output slots")
        elif tuple(map(tuple, instr.output_shapes)) != in_shapes:
            self.fail(index, instr, f"input-gradient shapes differ from the forward's input "
                      f"shapes {in_shapes}")
        n = len(instr.output_buffer_ids)
        for j, (slot, shape) in enumerate(zip(instr.output_buffer_ids, instr.output_shapes)):
            self._write(index, instr, slot, ("grad", mb, s, j, n), shape, ready=True)
        self.backwarded.add((mb, s))

    def _comm(self, index, instr, kind, is_send, is_start):
        mb, s, peer = instr.microbatch, instr.stage, instr.peer
        act = kind == "activation"
        # The instruction names the sender's stage; the receiver owns s+1 (act) or s-1 (grad).
        dst_stage = s + 1 if act else s - 1
        if not 0 <= dst_stage <= self.last:
            self.fail(index, instr, f"stage {s} has no {'next' if act else 'previous'} stage")
        mine, theirs = (s, dst_stage) if is_send else (dst_stage, s)
        self._own(index, instr, mine, "communicating")
        owners = self.stage_to_rank[theirs]
        if peer not in owners or peer == self.rank:
            self.fail(index, instr, f"peer must be rank {'/'.join(map(str, owners))}, the "
                      f"owner of stage {theirs}, and not this rank")
        rank = getattr(instr, "compress_rank", 0)
        if rank < 0 or (act and rank):
            self.fail(index, instr, f"compress_rank {rank} is invalid: only gradient messages are "
                      "compressed, at a rank >= 1 (0 = uncompressed)")
        piece = tuple(getattr(instr, "batch_slice", ()))
        if self.plan.batch_split or piece:
            self._check_piece(index, instr, piece, rank)
        key = (kind, is_send, mb, s, peer, piece) if piece else (kind, is_send, mb, s)
        channel = (self.sends if is_send else self.recvs).setdefault(peer, [])
        if is_start:
            if key in self.open or key in self.done_comm:
                self.fail(index, instr, "this message is started twice")
            if not instr.buffer_ids:
                self.fail(index, instr, "a message needs at least one slot")
            self.open[key] = (index, instr, len(channel))
            self.done_comm.add(key)
            channel.append(((kind, mb, s, tuple(map(tuple, instr.buffer_shapes)), rank), index, instr))
            if is_send:
                self._read_tagged(index, instr, kind, mb, s, "the data to send is not in "
                                  "these slots")
                for slot in instr.buffer_ids:
                    self.slots[slot][3] += 1
                self.bumps[index] = ("sent", self.rank, peer)
            else:
                n = len(instr.buffer_ids)
                for j, (slot, shape) in enumerate(zip(instr.buffer_ids, instr.buffer_shapes)):
                    tag = (kind, mb, s, j, n)
                    if piece and slot in self.assembly and self.slots[slot][0] == tag:
                        self._add_piece(index, instr, slot, piece)
                        continue
                    self._write(index, instr, slot, tag, shape, ready=False)
                    if piece:
                        self.assembly[slot] = [[piece], 1]
                self.bumps[index] = ("posted", peer, self.rank)
            return
        if key not in self.open:
            self.fail(index, instr, "Finish without a matching Start before it")
        start_index, start, position = self.open.pop(key)
        if tuple(instr.buffer_ids) != tuple(start.buffer_ids):
            self.fail(index, instr, f"slots differ from its Start (#{start_index} "
                      f"{describe(start)})")
        if tuple(map(tuple, instr.buffer_shapes)) != tuple(map(tuple, start.buffer_shapes)):
            self.fail(index, instr, f"shapes {[tuple(x) for x in instr.buffer_shapes]} differ from its Start's "
                      f"{[tuple(x) for x in start.buffer_shapes]} (#{start_index} {describe(start)})")
        if peer != start.peer:
            self.fail(index, instr, f"peer {peer} differs from its Start's peer {start.peer} (#{start_index})")
        if rank != start.compress_rank:
            self.fail(index, instr, f"compress_rank {rank} differs from its Start's {start.compress_rank} "
                      f"(#{start_index})")
        # Blocking rule of the deadlock search: a send completes once the peer posted the
        # matching receive; a receive completes once the peer started the matching send.
        if is_send:
            self.waits[index] = ("posted", self.rank, peer, position + 1, start_index)
            for slot in instr.buffer_ids:
                self.slots[slot][3] -= 1
        else:
            self.waits[index] = ("sent", peer, self.rank, position + 1, start_index)
            for slot in instr.buffer_ids:
                if slot in self.assembly:  # ready once every piece arrived and they cover the rows
                    pieces = self.assembly[slot]
                    pieces[1] -= 1
                    if pieces[1] or sum(n for _, n in pieces[0]) != _rows(self.plan, mb)[1]:
                        continue
                    del self.assembly[slot]
                self.slots[slot][2] = True

    def _check_piece(self, index, instr, piece, rank):
        """Rules of a batch-split message (see the module docstring)."""
        if not self.plan.batch_split:
            self.fail(index, instr, "batch_slice on a plan without a batch_split")
        if len(piece) != 2 or piece[1] < 1:
            self.fail(index, instr, "a plan with a batch split needs batch_slice = (first row, count >= 1) on "
                      "every message")
        if rank:
            self.fail(index, instr, "compressed gradient messages cannot be split by rows")
        rows = _rows(self.plan, instr.microbatch)
        if rows is None or not (rows[0] <= piece[0] and piece[0] + piece[1] <= rows[0] + rows[1]):
            self.fail(index, instr, f"rows {piece[0]}..{piece[0] + piece[1] - 1} are not inside this rank's rows "
                      f"{rows} of micro-batch {instr.microbatch}")
        for shape in instr.buffer_shapes:
            if len(shape) < 2 or shape[1] != rows[1]:
                self.fail(index, instr, f"buffer shape {tuple(shape)} must hold this rank's {rows[1]} rows in "
                          "dimension 1 ([s, b, h])")

    def _add_piece(self, index, instr, slot, piece):
        pieces = self.assembly[slot]
        for first, count in pieces[0]:
            if piece[0] < first + count and first < piece[0] + piece[1]:
                self.fail(index, instr, f"rows {piece[0]}..{piece[0] + piece[1] - 1} overlap rows "
                          f"{first}..{first + count - 1} already received into slot {slot}")
        pieces[0].append(piece)
        pieces[1] += 1

    # -- slot state ------------------------------------------------------------------------
    def _write(self, index, instr, slot, tag, shape, ready):
        if slot in self.slots:
            self.fail(index, instr, f"slot {slot} is written while it still holds "
                      f"{_tag_text(self.slots[slot][0])} (missing FreeBuffer)")
        self.slots[slot] = [tag, tuple(shape), ready, 0]

    def _read(self, index, instr, slot, shape):
        state = self.slots.get(slot)
        if state is None:
            self.fail(index, instr, f"slot {slot} is read before it is written or after "
                      "it was freed")
        if not state[2]:
            self.fail(index, instr, f"slot {slot} is read before its receive is finished "
                      "(missing Recv*Finish)")
        if shape is not None and tuple(shape) != state[1]:
            self.fail(index, instr, f"slot {slot} holds shape {state[1]}, not {tuple(shape)}")
        return state

    def _read_tagged(self, index, instr, kind, mb, stage, why):
        ids, shapes = instr.buffer_ids, instr.buffer_shapes
        if not ids:
            self.fail(index, instr, why)
        for j, (slot, shape) in enumerate(zip(ids, shapes)):
            if slot not in self.slots:
                self.fail(index, instr, f"{why}: slot {slot} is read before it is written or "
                          "after it was freed")
            state = self._read(index, instr, slot, shape)
            if state[0] != (kind, mb, stage, j, len(ids)):
                self.fail(index, instr, f"{why}: slot {slot} (position {j}) holds "
                          f"{_tag_text(state[0])}")

    def _free(self, index, instr, slot, shape):
        state = self._read(index, instr, slot, shape) if slot in self.slots else None
        if state is None:
            self.fail(index, instr, f"slot {slot} is freed but holds nothing (double free?)")
        if state[3]:
            self.fail(index, instr, f"slot {slot} is freed while a send from it is in "
                      "flight (Send*Finish must come first)")
        del self.slots[slot]

    def _check_end(self):
        n = len(self.plan.instructions)
        end = f"rank {self.rank}, end of plan ({n} instructions)"
        for index, instr, _ in self.open.values():
            raise PlanValidationError(f"rank {self.rank}, instruction #{index} "
                                      f"{describe(instr)}: Start is never finished")
        if self.slots:
            slot, state = next(iter(self.slots.items()))
            raise PlanValidationError(f"{end}: slot {slot} still holds "
                                      f"{_tag_text(state[0])} (missing FreeBuffer)")
        for s in sorted(self.owned):
            for mb in range(self.num_mb):
                if (mb, s) not in self.forwarded:
                    raise PlanValidationError(f"{end}: no forward of micro-batch {mb}, stage {s}")
                if (mb, s) not in self.backwarded:
                    raise PlanValidationError(f"{end}: no backward of micro-batch {mb}, stage {s}")


def _tag_text(tag) -> str:
    kind, mb, stage, j, n = tag
    what = {"activation": f"the output of stage {stage}",
            "grad": f"the gradient w.r.t. the input of stage {stage}",
            "input": "the input tokens"}[kind]
    return f"{what} of micro-batch {mb} (tensor {j} of {n})"


def _comm_sequences(plan):
    """peer -> [(message, index, instruction)] for the sends and the receives of one plan, in
    the order of their Starts (the order the channel pairs them in)."""
    sends: dict = {}
    recvs: dict = {}
    for index, instr in enumerate(plan.instructions):
        spec = _COMM.get(type(instr))
        if spec is not None and spec[2]:
            msg = (spec[0], instr.microbatch, instr.stage, _wire_shapes(instr), instr.compress_rank,
                   tuple(instr.batch_slice))
            (sends if spec[1] else recvs).setdefault(instr.peer, []).append((msg, index, instr))
    return sends, recvs


def _check_matching(plans, sequences) -> None:
    for a, (sends_of_a, _) in enumerate(sequences):
        for b in range(len(sequences)):
            sends, recvs = sends_of_a.get(b, []), sequences[b][1].get(a, [])
            for k in range(max(len(sends), len(recvs))):
                pair = f"rank {a} -> rank {b}, message #{k}"
                if k >= len(recvs):
                    _, i, instr = sends[k]
                    raise PlanValidationError(
                        f"{pair}: rank {a} instruction #{i} {describe(instr)} has no matching "
                        f"receive (rank {b} posts only {len(recvs)} receives from rank {a})")
                if k >= len(sends):
                    _, i, instr = recvs[k]
                    raise PlanValidationError(
                        f"{pair}: rank {b} instruction #{i} {describe(instr)} has no matching "
                        f"send (rank {a} sends only {len(sends)} messages to rank {b})")
                (sent, i, si), (got, j, ri) = sends[k], recvs[k]
                if sent != got:
                    raise PlanValidationError(
                        f"{pair}: rank {a} instruction #{i} {describe(si)} does not match rank "
                        f"{b} instruction #{j} {describe(ri)} (kind, micro-batch, stage, "
                        "shapes, compress_rank and rows must be equal; sends and receives pair up in order)")


def _check_deadlock(plans, ranks) -> None:
    counters: dict = {}
    waiting: dict = {}  # counter key -> rank blocked on it (each counter has one reader)
    pc = [0] * len(ranks)
    queue = deque(range(len(ranks)))
    while queue:
        r = queue.popleft()
        waits, bumps, n = ranks[r].waits, ranks[r].bumps, len(ranks[r].waits)
        i = pc[r]
        while i < n:
            w = waits[i]
            if w is not None and counters.get(w[:3], 0) < w[3]:
                waiting[w[:3]] = r
                break
            b = bumps[i]
            if b is not None:
                counters[b] = counters.get(b, 0) + 1
                if b in waiting:
                    queue.append(waiting.pop(b))
            i += 1
        pc[r] = i
    stuck = [r for r in range(len(ranks)) if pc[r] < len(ranks[r].waits)]
    if not stuck:
        return
    lines = []
    for r in stuck:
        i = pc[r]
        what, a, b, need, start = ranks[r].waits[i]
        peer = b if what == "posted" else a
        verb = "post its receive" if what == "posted" else "start its send"
        lines.append(f"rank {r} is stuck at instruction #{i} "
                     f"{describe(plans[r].instructions[i])}, waiting for rank {peer} to {verb} "
                     f"(message #{need - 1} of rank {a} -> rank {b})")
    raise PlanValidationError("deadlock: no rank can progress:\n  " + "\n  ".join(lines))


def _check_slices(plans) -> None:
    """The token-slice rules of the module docstring (a no-op for unsliced plans)."""
    units: dict = {}   # unit -> (token_slice, rank, index, instr) of its first instruction
    any_sliced = any(getattr(i, "token_slice", ()) for p in plans for i in p.instructions)
    if not any_sliced:
        return
    mb_shapes = plans[0].microbatch_shapes
    for plan in plans:
        per_stage: dict = {}  # (sequence, stage) -> [last forward offset, last backward offset]
        for index, instr in enumerate(plan.instructions):
            if not hasattr(instr, "token_slice"):
                continue
            where = f"rank {plan.rank}, instruction #{index} {describe(instr)}"
            sl = tuple(instr.token_slice)
            if not sl:
                raise PlanValidationError(f"{where}: the plan slices tokens, but this instruction has no "
                                          f"token_slice")
            if len(sl) != 3 or sl[0] < 0 or sl[1] < 0 or sl[2] < 1:
                raise PlanValidationError(f"{where}: token_slice must be (sequence >= 0, offset >= 0, "
                                          f"length >= 1), got {sl}")
            first = units.setdefault(instr.microbatch, (sl, plan.rank, index))
            if first[0] != sl:
                raise PlanValidationError(f"{where}: unit {instr.microbatch} has token_slice {sl} here but "
                                          f"{first[0]} at rank {first[1]}, instruction #{first[2]}")
            seq, off, _ = sl
            if type(instr) is ForwardPass:
                state = per_stage.setdefault((seq, instr.stage), [-1, None])
                if state[1] is not None:
                    raise PlanValidationError(f"{where}: forward of a slice of sequence {seq} after a backward "
                                              f"of that sequence on stage {instr.stage}")
                if off <= state[0]:
                    raise PlanValidationError(f"{where}: slices of sequence {seq} must be forwarded in "
                                              f"ascending offset on stage {instr.stage} (after offset {state[0]})")
                state[0] = off
            elif type(instr) is BackwardPass:
                state = per_stage.setdefault((seq, instr.stage), [-1, None])
                if state[1] is not None and off >= state[1]:
                    raise PlanValidationError(f"{where}: slices of sequence {seq} must run backward in "
                                              f"descending offset on stage {instr.stage} (after offset {state[1]})")
                if state[1] is None and off != state[0]:
                    raise PlanValidationError(f"{where}: the first backward of sequence {seq} on stage "
                                              f"{instr.stage} must be its last forwarded slice (offset {state[0]})")
                state[1] = off
    tiles: dict = {}
    for unit, (sl, rank, index) in units.items():
        seq, off, ln = sl
        shape = tuple(map(tuple, mb_shapes[unit])) if 0 <= unit < len(mb_shapes) else None
        if not shape or len(shape[0]) != 2 or shape[0][1] != ln:
            raise PlanValidationError(f"unit {unit} (rank {rank}, instruction #{index}) has token_slice {sl} but "
                                      f"microbatch_shapes[{unit}] = {shape}: expected ((b, {ln}),)")
        tiles.setdefault(seq, []).append((off, ln, shape[0][0], unit))
    for seq, parts in tiles.items():
        parts.sort()
        end, b0 = 0, parts[0][2]
        for off, ln, b, unit in parts:
            if off != end:
                raise PlanValidationError(f"sequence {seq}: unit {unit} starts at token {off}, but the slices "
                                          f"before it end at {end} ({'overlap' if off < end else 'gap'})")
            if b != b0:
                raise PlanValidationError(f"sequence {seq}: unit {unit} has {b} rows, the others {b0}")
            end = off + ln
