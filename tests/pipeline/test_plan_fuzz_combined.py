"""Mutation fuzzing of plans that carry several instruction attributes at once.

Systems compose through the attributes (DESIGN.md): a TeraPipe plan whose slices' gradient
messages are compressed (token_slice + compress_rank), a plan lowered onto stages with their
own TP/DP sizes whose gradient pieces are compressed (batch_slice + compress_rank). The plans
are built the way the trainers build them (the planners, then the plan passes), must validate,
and every harmful mutant (tests/pipeline/test_plan_fuzz.py's mutations, generic and of each
attribute) must be rejected.
"""
import random

import pytest

from megatron.pipeline import instructions as I
from megatron.pipeline.validator import validate_plans
from megatron.planner.passes.compression import mark_compressed_grads
from megatron.planner.schedule.static import build_static_plans
from tests.pipeline.test_plan_fuzz import _attribute_fuzz, _fuzz, _sliced_plans


def _sliced_compressed_plans(rng):
    """TeraPipe plans whose gradient messages are marked (all, or the epilogue only)."""
    return mark_compressed_grads(_sliced_plans(rng), rng.choice([1, 2, 4]), epilogue_only=rng.random() < 0.3)


def _split_compressed_plans(rng):
    """Stage plans marked compressed, then lowered onto per-stage TP/DP sizes (the order the
    GPT trainer applies the passes in): every row piece of a gradient message is compressed."""
    from megatron.planner.passes.layout import split_plans
    layouts = rng.choice([((2, 1), (1, 2)), ((1, 2), (2, 1), (1, 1)), ((1, 4), (2, 2))])
    m = rng.randint(1, 4)
    plans = build_static_plans(rng.choice(["1f1b", "gpipe"]), m, len(layouts), 1, [((4, 8),)] * m,
                               lambda mb, stage: ((8, 4, 8),))
    return split_plans(mark_compressed_grads(plans, rng.choice([1, 2])), layouts)


def _attrs(plans):
    ins = [x for p in plans for x in p.instructions]
    return (any(getattr(x, "token_slice", ()) for x in ins), any(getattr(x, "compress_rank", 0) for x in ins),
            any(getattr(x, "batch_slice", ()) for x in ins))


def test_sliced_compressed_plans_validate_and_carry_both_attributes():
    rng = random.Random(3)
    for _ in range(20):
        plans = _sliced_compressed_plans(rng)
        validate_plans(plans)
        sliced, compressed, _ = _attrs(plans)
        assert sliced and compressed
        # each slice's gradient message is marked on both ends with the same rank
        for p in plans:
            for x in p.instructions:
                if isinstance(x, (I.SendActivationStart, I.RecvActivationStart)):
                    assert x.compress_rank == 0


def test_sliced_compressed_mutants_rejected():
    _attribute_fuzz(_sliced_compressed_plans, seed=13, n=100)
    _fuzz(100, seed=14, make=_sliced_compressed_plans)


def test_split_compressed_mutants_rejected():
    rng = random.Random(17)
    plans = _split_compressed_plans(rng)
    validate_plans(plans)
    assert _attrs(plans)[1:] == (True, True)
    _attribute_fuzz(_split_compressed_plans, seed=15, n=100)
    _fuzz(100, seed=16, make=_split_compressed_plans)



@pytest.mark.slow
def test_sliced_compressed_mutants_rejected_many():
    _attribute_fuzz(_sliced_compressed_plans, seed=101, n=1000)
    _fuzz(1000, seed=102, make=_sliced_compressed_plans)
