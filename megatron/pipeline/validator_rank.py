"""The per-rank rules of the plan validator (`megatron.pipeline.validator` states them all):
one pass over one rank's instruction stream, and the error every rule raises."""
from __future__ import annotations

from megatron.pipeline.instructions import (
    BackwardInput, BackwardPass, BackwardWeight, ExecutionPlan, ForwardPass, FreeBuffer, LoadInput,
    RecvActivationFinish, RecvActivationStart, RecvGradFinish, RecvGradStart, SendActivationFinish,
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


def _rows(plan, mb: int):
    """(first, count) of micro-batch `mb`'s rows that `plan`'s rank holds, or None if its
    micro-batch does not divide into the plan's parts."""
    b = plan.microbatch_shapes[mb][0][0]
    if not plan.batch_split:
        return 0, b
    index, parts = plan.batch_split[:2]
    if b % parts:
        return None
    return index * (b // parts), b // parts


def _block(plan, piece, shape) -> tuple:
    """A batch_slice as (first row, rows, first token, tokens); a 2-entry one spans the tokens
    of this rank's buffer of `shape` (its block of the sequence, see `_token_range`)."""
    if len(piece) == 4:
        return tuple(piece)
    return tuple(piece) + _token_range(plan, shape)


def _token_range(plan, shape) -> tuple:
    """(first token, tokens) this rank's [s, b, h] buffer of `shape` holds."""
    split = plan.batch_split
    if len(split) == 4:
        return split[2] * shape[0], shape[0]
    return 0, shape[0]


def _wire_shapes(instr) -> tuple:
    """Shapes of what travels: the buffer's shapes, with dimension 1 cut to the message's rows."""
    shapes = tuple(map(tuple, instr.buffer_shapes))
    sl = getattr(instr, "batch_slice", ())
    if not sl:
        return shapes
    return tuple(((sl[3] if len(sl) == 4 else s[0]), sl[1]) + s[2:] if len(s) >= 2 else s for s in shapes)


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
        self.weight_pending: set = set()  # (mb, stage) whose BackwardInput ran, BackwardWeight not yet
        # Most forwards whose graph this rank keeps at once (activations until the backward, or
        # until the weight pass of a split backward): the deferred W state's memory, in records.
        self.peak_kept = 0
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
            elif kind is BackwardPass or kind is BackwardInput:
                self._backward(index, instr)
            elif kind is BackwardWeight:
                self._weight(index, instr)
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
        self.peak_kept = max(self.peak_kept, len(self.forwarded) - len(self.backwarded) + len(self.weight_pending))

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
        if type(instr) is BackwardInput:
            if instr.token_slice:
                self.fail(index, instr, "a split backward cannot run token slices (their key/value gradients "
                          "flow between the slices' backwards): use BackwardPass")
            self.weight_pending.add((mb, s))

    def _weight(self, index, instr):
        mb, s = instr.microbatch, instr.stage
        self._own(index, instr, s, "weight-gradient")
        if instr.buffer_ids:
            self.fail(index, instr, "BackwardWeight reads no slots (its graph is kept by its BackwardInput)")
        if (mb, s) not in self.weight_pending:
            why = ("its backward was a BackwardPass, which already accumulated the weight gradients"
                   if (mb, s) in self.backwarded else "no BackwardInput of it ran before")
            self.fail(index, instr, f"weight gradient of micro-batch {mb}, stage {s}: {why}")
        self.weight_pending.discard((mb, s))

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
            self._check_piece(index, instr, piece)
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
                        self._add_piece(index, instr, slot, _block(self.plan, piece, shape))
                        continue
                    self._write(index, instr, slot, tag, shape, ready=False)
                    if piece:
                        self.assembly[slot] = [[_block(self.plan, piece, shape)], 1]
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
                    if pieces[1] or sum(b[1] * b[3] for b in pieces[0]) != \
                            _rows(self.plan, mb)[1] * self.slots[slot][1][0]:
                        continue
                    del self.assembly[slot]
                self.slots[slot][2] = True

    def _check_piece(self, index, instr, piece):
        """Rules of a batch-split message (see the module docstring)."""
        if not self.plan.batch_split:
            self.fail(index, instr, "batch_slice on a plan without a batch_split")
        if len(piece) not in (2, 4) or piece[1] < 1 or (len(piece) == 4 and piece[3] < 1):
            self.fail(index, instr, "a plan with a batch split needs batch_slice = (first row, count >= 1) or "
                      "(first row, count >= 1, first token, tokens >= 1) on every message")
        rows = _rows(self.plan, instr.microbatch)
        if rows is None or not (rows[0] <= piece[0] and piece[0] + piece[1] <= rows[0] + rows[1]):
            self.fail(index, instr, f"rows {piece[0]}..{piece[0] + piece[1] - 1} are not inside this rank's rows "
                      f"{rows} of micro-batch {instr.microbatch}")
        for shape in instr.buffer_shapes:
            if len(shape) < 2 or shape[1] != rows[1]:
                self.fail(index, instr, f"buffer shape {tuple(shape)} must hold this rank's {rows[1]} rows in "
                          "dimension 1 ([s, b, h])")
            if len(piece) == 4:
                a, n = _token_range(self.plan, shape)
                if not (a <= piece[2] and piece[2] + piece[3] <= a + n):
                    self.fail(index, instr, f"tokens {piece[2]}..{piece[2] + piece[3] - 1} are not inside this "
                              f"rank's tokens {a}..{a + n - 1} (dimension 0 of its buffer {tuple(shape)})")

    def _add_piece(self, index, instr, slot, piece):
        pieces = self.assembly[slot]
        for first, count, tok, ntok in pieces[0]:
            if piece[0] < first + count and first < piece[0] + piece[1] \
                    and piece[2] < tok + ntok and tok < piece[2] + piece[3]:
                self.fail(index, instr, f"rows {piece[0]}..{piece[0] + piece[1] - 1}, tokens {piece[2]}.."
                          f"{piece[2] + piece[3] - 1} overlap rows {first}..{first + count - 1}, tokens "
                          f"{tok}..{tok + ntok - 1} already received into slot {slot}")
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
        if self.weight_pending:
            mb, s = min(self.weight_pending)
            raise PlanValidationError(f"{end}: BackwardInput of micro-batch {mb}, stage {s} has no "
                                      "BackwardWeight before the end of the plan (the optimizer step would "
                                      "miss its weight gradients)")
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
