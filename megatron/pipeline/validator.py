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
* split backward (zero-bubble): a `BackwardInput` counts as the backward (same slots and
  shapes); its `BackwardWeight` follows it on the same rank, once, before the end of the plan
  (the optimizer step), and no `BackwardPass` has one. A forward's graph is kept from the
  forward to its backward, or to its weight pass when split: `kept_peaks(plans)` gives the most
  graphs each rank keeps at once, and `validate_plans(plans, max_kept=...)` bounds them.
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
  rank's rows before the buffer is read. With token slices each message carries both (rows of
  one slice); a compressed gradient message may be split (each piece carries its own low-rank
  factors).
* deadlock: all ranks are simulated together with "Start never blocks; RecvFinish waits
  until the peer executed the matching SendStart; SendFinish waits until the peer executed
  the matching RecvStart; compute never blocks". If every unfinished rank is waiting, the
  error lists where each one is stuck.
"""
from __future__ import annotations

from collections import deque

from megatron.pipeline.instructions import (
    BackwardPass, ExecutionPlan, ForwardPass, describe,
)
from megatron.pipeline.validator_rank import (  # noqa: F401 (PlanValidationError re-exported)
    _COMM, PlanValidationError, _RankChecker, _wire_shapes,
)


def validate_plans(plans: list[ExecutionPlan], max_kept=None) -> list:
    """Raise `PlanValidationError` unless `plans` (one per pipeline rank) can run together.
    `max_kept[r]`: the most forward graphs rank r may keep at once (activations, and the
    deferred weight-gradient state of a split backward); None = unbounded. Returns
    `kept_peaks` of the plans (by rank)."""
    plans = _check_headers(plans)
    stage_to_rank = _check_stage_assignment(plans)
    # Pairing first: a missing or mis-ordered message is best reported as a rank-pair error,
    # before it surfaces on the receiver as "input not received".
    _check_matching(plans, [_comm_sequences(plan) for plan in plans])
    _check_slices(plans)
    ranks = [_RankChecker(plan, stage_to_rank).run() for plan in plans]
    _check_deadlock(plans, ranks)
    peaks = [rc.peak_kept for rc in ranks]
    if max_kept is not None:
        for r, (peak, limit) in enumerate(zip(peaks, max_kept)):
            if limit is not None and peak > limit:
                raise PlanValidationError(f"rank {r} keeps {peak} forward graphs at once (activations plus "
                                          f"deferred weight-gradient state), more than its limit {limit}")
    return peaks


def kept_peaks(plans: list[ExecutionPlan]) -> list:
    """Per rank, the most forward graphs kept at once (see `validate_plans`)."""
    return validate_plans(plans)


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
            bs = tuple(plan.batch_split)
            if len(bs) not in (2, 4) or not all(0 <= bs[k] < bs[k + 1] for k in range(0, len(bs), 2)):
                raise PlanValidationError(f"rank {plan.rank}: batch_split must be (index, parts) or (index, parts, "
                                          f"seq_index, seq_parts) with 0 <= index < parts, got {bs}")
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
