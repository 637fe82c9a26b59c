"""Mutation fuzzing of plans: every mutant that would deadlock or mis-shape at run time is rejected.

Each mutation below is harmful by construction (an unmatched message, a wrong shape or peer, a
second receive into the same message, a free before the last use, a use before the load), so
the validator must refuse every one. Byte flips of a serialized plan must never decode. Swaps of
two adjacent instructions may be harmless: the validator refuses the harmful ones, and the ones it
accepts are run on 2 gloo ranks and must train to the unmutated plan's loss and gradient norm.
A fixed seed keeps the default run fast and reproducible; `-m slow` runs thousands of mutants.
"""
import dataclasses
import random

import pytest

from megatron.pipeline import instructions as I
from megatron.pipeline.validator import PlanValidationError, validate_plans
from megatron.planner.schedule.static import build_static_plans
from tests.dist_harness import run_distributed

COMM = (I.SendActivationStart, I.SendActivationFinish, I.RecvActivationStart, I.RecvActivationFinish,
        I.SendGradStart, I.SendGradFinish, I.RecvGradStart, I.RecvGradFinish)


def _valid_plans(rng):
    pp = rng.choice([2, 3, 4])
    schedule = rng.choice(["gpipe", "gpipe-fifo", "1f1b", "interleaved"])
    chunks = 2 if schedule == "interleaved" else 1
    m = pp * rng.choice([1, 2]) if schedule == "interleaved" else rng.randint(1, 6)
    seqs = [8 * rng.randint(1, 4) for _ in range(m)]  # variable micro-batch shapes, as DynaPipe makes
    shapes = [((2, s),) for s in seqs]
    return build_static_plans(schedule, m, pp, chunks, shapes, lambda mb, stage: ((seqs[mb], 2, 8),))


def _pick(rng, plans, kinds):
    cands = [(r, i) for r, p in enumerate(plans) for i, x in enumerate(p.instructions) if isinstance(x, kinds)]
    return rng.choice(cands) if cands else None


def _bump(shape):
    return tuple(shape[:-1]) + (shape[-1] + 1,)


def _mutate(rng, plans):
    """Apply one harmful mutation in place; returns its name (None if the plan has no target)."""
    kind = rng.choice(["drop_comm", "shape", "peer", "dup_recv", "early_free", "use_before_load",
                       "finish_shape", "send_after_finish"])
    if kind == "drop_comm":
        hit = _pick(rng, plans, COMM)
        if hit:
            del plans[hit[0]].instructions[hit[1]]
    elif kind in ("shape", "finish_shape"):
        hit = _pick(rng, plans, (I.SendActivationStart, I.RecvGradStart, I.RecvActivationStart, I.SendGradStart)
                    if kind == "shape" else (I.SendActivationFinish, I.RecvActivationFinish, I.SendGradFinish,
                                             I.RecvGradFinish))
        if hit:
            x = plans[hit[0]].instructions[hit[1]]
            plans[hit[0]].instructions[hit[1]] = dataclasses.replace(
                x, buffer_shapes=(_bump(x.buffer_shapes[0]),) + tuple(x.buffer_shapes[1:]))
    elif kind == "peer":
        hit = _pick(rng, plans, COMM)
        if hit:
            x = plans[hit[0]].instructions[hit[1]]
            others = [r for r in range(len(plans)) if r != x.peer]
            plans[hit[0]].instructions[hit[1]] = dataclasses.replace(x, peer=rng.choice(others))
    elif kind == "dup_recv":
        hit = _pick(rng, plans, (I.RecvActivationStart, I.RecvGradStart))
        if hit:
            x = plans[hit[0]].instructions[hit[1]]
            plans[hit[0]].instructions.insert(hit[1] + 1, x)
    elif kind == "early_free":
        hit = _pick(rng, plans, I.FreeBuffer)
        if hit:
            r, i = hit
            ins = plans[r].instructions
            slots = set(ins[i].buffer_ids)
            # The last earlier instruction that reads or writes one of the freed slots.
            users = [j for j in range(i) if slots & set(getattr(ins[j], "buffer_ids", ()) or ())
                     and not isinstance(ins[j], I.FreeBuffer)]
            if users:
                free = ins.pop(i)
                ins.insert(users[-1], free)  # now before its last use
            else:
                kind = None
    elif kind == "use_before_load":
        hit = _pick(rng, plans, I.LoadInput)
        if hit:
            r, i = hit
            ins = plans[r].instructions
            load = ins.pop(i)
            fwd = next(j for j in range(i, len(ins)) if isinstance(ins[j], I.ForwardPass)
                       and ins[j].microbatch == load.microbatch)
            ins.insert(fwd + 1, load)
    elif kind == "send_after_finish":
        hit = _pick(rng, plans, (I.SendActivationStart, I.SendGradStart))
        if hit:
            r, i = hit
            ins = plans[r].instructions
            start = ins[i]
            fin = next(j for j in range(i + 1, len(ins)) if isinstance(ins[j], (I.SendActivationFinish,
                       I.SendGradFinish)) and ins[j].microbatch == start.microbatch and ins[j].stage == start.stage
                       and ins[j].peer == start.peer and ins[j].batch_slice == start.batch_slice)
            ins.insert(fin, ins.pop(i))  # the Finish now precedes its Start
    return kind if hit else None


def _fuzz(n, seed, make=None):
    rng = random.Random(seed)
    tried = 0
    while tried < n:
        plans = (make or _valid_plans)(rng)
        validate_plans(plans)
        kind = _mutate(rng, plans)
        if kind is None:
            continue
        tried += 1
        with pytest.raises(PlanValidationError):
            validate_plans(plans)
            pytest.fail(f"mutant #{tried} ({kind}) was accepted")


def _flips(n, seed):
    rng = random.Random(seed)
    for t in range(n):
        data = bytearray(_valid_plans(rng)[0].serialize())
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(ValueError):
            I.ExecutionPlan.deserialize(bytes(data))


def test_harmful_mutants_rejected():
    _fuzz(300, seed=0)


# -- instruction attributes added by the other planners: compress_rank (Optimus-CC) and
#    token_slice (TeraPipe). Each mutation breaks an agreement the executor relies on.

def _compressed_plans(rng):
    from megatron.planner.passes.compression import mark_compressed_grads
    plans = _valid_plans(rng)
    if rng.random() < 0.5:  # plans of one data-parallel group, marked as the trainer does
        return mark_compressed_grads(plans, rng.choice([1, 2, 4]), epilogue_only=rng.random() < 0.3)
    return plans


def _sliced_plans(rng):
    from megatron.planner.terapipe.lowering import build_terapipe_plans
    pp, m = rng.choice([2, 3, 4]), rng.randint(1, 3)
    slicings = []
    for _ in range(m):
        s = rng.randint(2, 24)
        cuts = sorted(rng.sample(range(1, s), rng.randint(1, min(4, s - 1))))
        slicings.append([b - a for a, b in zip([0] + cuts, cuts + [s])])
    # also over virtual stages (v * pp + r on rank r), as --num-layers-per-virtual-pipeline-stage runs them
    return build_terapipe_plans(slicings, [((1, sum(sl)),) for sl in slicings], pp, 8,
                                num_model_chunks=rng.choice([1, 2]))


def _split_plans(rng):
    """Stages with their own TP/DP sizes: one plan per global rank, row-sliced messages; with
    sequence parallelism blocks of rows x tokens, and some gradient messages compressed."""
    from megatron.planner.passes.compression import mark_compressed_grads
    from megatron.planner.passes.layout import split_plans
    layouts = rng.choice([((2, 1), (1, 2)), ((1, 2), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (2, 1), (1, 1)),
                          ((1, 4), (2, 2)), ((4, 1), (2, 1))])
    m = rng.randint(1, 5)
    plans = build_static_plans(rng.choice(["1f1b", "gpipe"]), m, len(layouts), 1, [((4, 8),)] * m,
                               lambda mb, stage: ((8, 4, 8),))
    if rng.random() < 0.5:
        plans = mark_compressed_grads(plans, 2, epilogue_only=rng.random() < 0.5)
    return split_plans(plans, layouts, sequence_parallel=rng.random() < 0.5)


def _sliced_split_plans(rng):
    """TeraPipe token slices lowered onto stages with their own TP/DP sizes: both attributes."""
    from megatron.planner.passes.layout import split_plans
    from megatron.planner.terapipe.lowering import build_terapipe_plans
    layouts = rng.choice([((2, 1), (1, 2)), ((1, 2), (2, 1), (1, 1)), ((1, 4), (2, 2))])
    slicings = [[rng.randint(1, 4), rng.randint(1, 8)] for _ in range(rng.randint(1, 3))]
    plans = build_terapipe_plans(slicings, [((4, sum(sl)),) for sl in slicings], len(layouts), 8)
    return split_plans(plans, layouts)


def _mutate_attribute(rng, plans):
    sliced = any(getattr(x, "token_slice", ()) for p in plans for x in p.instructions)
    split = bool(plans[0].batch_split)
    kinds = ["compress_one_end", "compress_activation"] + (["slice_offset", "slice_length", "slice_dropped"]
                                                            if sliced else [])
    kinds += ["rows_shifted", "rows_grown", "rows_dropped", "tokens_shifted", "tokens_grown"] if split else []
    kind = rng.choice(kinds)
    if kind.startswith(("rows_", "tokens_")):  # one end of a row-sliced message names other rows / tokens
        hit = _pick(rng, plans, COMM)
        if hit:
            x = plans[hit[0]].instructions[hit[1]]
            first, count = x.batch_slice[:2]
            tok, ntok = x.batch_slice[2:] if len(x.batch_slice) == 4 else (0, x.buffer_shapes[0][0])
            new = {"rows_shifted": (first + 1, count, tok, ntok) if first == 0 else (first - 1, count, tok, ntok),
                   "rows_grown": (first, count + 1, tok, ntok), "rows_dropped": (),
                   "tokens_shifted": (first, count, tok + 1 if tok == 0 else tok - 1, ntok),
                   "tokens_grown": (first, count, tok, ntok + 1)}[kind]
            if len(x.batch_slice) == 2 and kind.startswith("rows_") and new:
                new = new[:2]
            plans[hit[0]].instructions[hit[1]] = dataclasses.replace(x, batch_slice=new)
        return kind if hit else None
    if kind == "compress_one_end":  # one of the four instructions of a gradient message disagrees
        hit = _pick(rng, plans, (I.SendGradStart, I.SendGradFinish, I.RecvGradStart, I.RecvGradFinish))
        if hit:
            x = plans[hit[0]].instructions[hit[1]]
            plans[hit[0]].instructions[hit[1]] = dataclasses.replace(
                x, compress_rank=rng.choice([r for r in (0, 1, 3, 8) if r != x.compress_rank]))
    elif kind == "compress_activation":  # activations are never compressed
        hit = _pick(rng, plans, (I.SendActivationStart, I.RecvActivationStart))
        if hit:
            x = plans[hit[0]].instructions[hit[1]]
            plans[hit[0]].instructions[hit[1]] = dataclasses.replace(x, compress_rank=rng.choice([1, 4]))
    else:
        hit = _pick(rng, plans, (I.LoadInput, I.ForwardPass, I.BackwardPass) + COMM)
        if hit:
            x = plans[hit[0]].instructions[hit[1]]
            seq, off, length = x.token_slice
            new = {"slice_offset": (seq, off + rng.choice([-1, 1]) if off else off + 1, length),
                   "slice_length": (seq, off, length + 1),
                   "slice_dropped": ()}[kind]
            plans[hit[0]].instructions[hit[1]] = dataclasses.replace(x, token_slice=new)
    return kind if hit else None


@pytest.mark.parametrize("make", [_compressed_plans, _sliced_plans, _split_plans, _sliced_split_plans],
                         ids=["compress_rank", "token_slice", "batch_slice", "token_slice+batch_slice"])
def test_attribute_mutants_rejected(make):
    _attribute_fuzz(make, seed=7, n=100)


def _attribute_fuzz(make, seed, n):
    """`n` plans from `make`, each valid, each then given one attribute mutation the validator
    must reject (`_mutate_attribute`; plans it finds nothing to mutate in are skipped)."""
    rng = random.Random(seed)
    tried = 0
    while tried < n:
        plans = make(rng)
        validate_plans(plans)
        kind = _mutate_attribute(rng, plans)
        if kind is None:
            continue
        tried += 1
        with pytest.raises(PlanValidationError):
            validate_plans(plans)
            pytest.fail(f"mutant #{tried} ({kind}) was accepted")


def test_harmful_mutants_rejected_on_split_plans():
    _fuzz(200, seed=5, make=_split_plans)


def test_harmful_mutants_rejected_on_sliced_split_plans():
    _fuzz(100, seed=8, make=_sliced_split_plans)


def test_byte_flips_rejected():
    _flips(300, seed=1)


def test_reserved_header_must_be_zero():
    data = bytearray(build_static_plans("1f1b", 2, 2, 1, [((2, 8),)] * 2, ((8, 2, 8),))[0].serialize())
    data[6] = 1  # the u16 reserved field after magic and version
    with pytest.raises(ValueError, match="reserved header field"):
        I.ExecutionPlan.deserialize(bytes(data))


@pytest.mark.slow
def test_harmful_mutants_rejected_many():
    _fuzz(3000, seed=2)
    _fuzz(1000, seed=6, make=_split_plans)
    _flips(3000, seed=3)


# -- swaps: the one mutation that may be harmless. The validator must reject the swaps that would
#    hang or mis-shape, and every swap it accepts must run on gloo ranks to the same result.

def _tiny_plans():
    from tests.parity_utils import tiny_config
    cfg = tiny_config(world=2, pp=2)  # 4 micro-batches of [2, 16], hidden 32: what _swap_run trains
    m = cfg.num_microbatches
    return build_static_plans("1f1b", m, 2, 1, [((2, 16),)] * m, lambda mb, st: ((16, 2, 32),))


def _swapped(plans, rng):
    r = rng.randrange(len(plans))
    ins = list(plans[r].instructions)
    i = rng.randrange(len(ins) - 1)
    if type(ins[i]) is type(ins[i + 1]) and ins[i] == ins[i + 1]:
        return None
    ins[i], ins[i + 1] = ins[i + 1], ins[i]
    out = list(plans)
    out[r] = dataclasses.replace(plans[r], instructions=ins)
    return out


def _swap_run(rank, world, mutants):
    from tests.parity_utils import make_trainer, tiny_config
    out = []
    for blob in [None] + mutants:
        t = make_trainer(tiny_config(world=world, pp=2, iters=1))
        if blob is not None:
            plans = [I.ExecutionPlan.deserialize(b) for b in blob]
            t.batch_source.planner.plans = lambda it, shapes, plans=plans: [
                dataclasses.replace(p, iteration=it) for p in plans]
        step = t.train_step()
        out.append((step["loss"], step["grad_norm"]))
    return out


def test_accepted_swaps_run_to_the_same_result():
    rng = random.Random(11)
    base = _tiny_plans()
    accepted, rejected = [], 0
    while len(accepted) < 8:
        mutant = _swapped(base, rng)
        if mutant is None:
            continue
        try:
            validate_plans(mutant)
        except PlanValidationError:
            rejected += 1
            continue
        accepted.append([p.serialize() for p in mutant])
    assert rejected > 0  # swaps do break plans; those never run
    results = run_distributed(_swap_run, 2, accepted)
    last = results[1]  # pipeline rank 1 holds the loss
    for loss, norm in last[1:]:
        assert loss == pytest.approx(last[0][0], rel=1e-6) and norm == pytest.approx(last[0][1], rel=1e-6)
