import random
import struct
from dataclasses import dataclass

import pytest

from megatron.pipeline import instructions as I
from megatron.pipeline.instructions import ExecutionPlan
from megatron.planner.schedule.static import build_static_plans

ALL_TYPES = [I.LoadInput, I.ForwardPass, I.BackwardPass, I.FreeBuffer,
             I.SendActivationStart, I.SendActivationFinish, I.RecvActivationStart,
             I.RecvActivationFinish, I.SendGradStart, I.SendGradFinish, I.RecvGradStart,
             I.RecvGradFinish]


def _shapes(rng, n):
    return tuple(tuple(rng.randint(0, 5000) for _ in range(rng.randint(0, 4))) for _ in range(n))


def _random_instruction(rng, cls):
    n = rng.randint(0, 3)
    kw = dict(microbatch=rng.randint(0, 100), stage=rng.randint(0, 16),
              buffer_ids=tuple(rng.randint(0, 50) for _ in range(n)), buffer_shapes=_shapes(rng, n))
    if cls in (I.ForwardPass, I.BackwardPass):
        m = rng.randint(0, 2)
        kw.update(output_buffer_ids=tuple(range(m)), output_shapes=_shapes(rng, m))
    elif issubclass(cls, I.CommInstruction):
        kw["peer"] = rng.randint(-1, 7)
        kw["compress_rank"] = rng.choice([0, 0, 1, 16])
    return cls(**kw)


def _random_plan(rng):
    return ExecutionPlan(
        rank=rng.randint(0, 7), num_ranks=8, num_stages=rng.randint(1, 16),
        assigned_stages=tuple(rng.sample(range(16), rng.randint(0, 3))),
        instructions=[_random_instruction(rng, rng.choice(ALL_TYPES))
                      for _ in range(rng.randint(0, 60))],
        microbatch_shapes=tuple(_shapes(rng, rng.randint(0, 2)) for _ in range(rng.randint(0, 5))),
        recompute=rng.choice(I.RECOMPUTE_LEVELS), num_buffers=rng.randint(0, 50),
        dtype=rng.choice(["float32", "bfloat16", "float16"]), iteration=rng.randint(0, 10**9))


def test_round_trip_every_instruction_type_multi_tensor_and_empty():
    t5 = ((4, 2, 8), (6, 2, 8))  # a T5 decoder stage receives two tensors
    plan = ExecutionPlan(
        rank=1, num_ranks=3, num_stages=6, assigned_stages=(1, 4),
        instructions=[cls(3, 4, (0, 1), t5, (2, 3), t5) if cls in (I.ForwardPass, I.BackwardPass)
                      else cls(3, 4, (0, 1), t5, 2) if issubclass(cls, I.CommInstruction)
                      else cls(3, 4, (0, 1), t5) for cls in ALL_TYPES]
        + [I.LoadInput(0, 1, (), ((2, 16), (2, 8))), I.ForwardPass(0, 1),
           I.BackwardPass(0, 5, (), (), (), ()), I.FreeBuffer(1, 1, (), ())],
        microbatch_shapes=(((2, 16), (2, 8)), ()), recompute="selective", num_buffers=4,
        dtype="bfloat16", iteration=12345)
    back = ExecutionPlan.deserialize(plan.serialize())
    assert back == plan
    assert [type(x) for x in back.instructions] == [type(x) for x in plan.instructions]
    assert isinstance(back.assigned_stages, tuple) and isinstance(back.instructions, list)


def test_round_trip_random_plans():
    rng = random.Random(0)
    for _ in range(200):
        plan = _random_plan(rng)
        assert ExecutionPlan.deserialize(plan.serialize()) == plan


def test_round_trip_lowered_plans():
    plans = build_static_plans("interleaved", 4, 2, 2, [((2, 8),)] * 4, ((8, 2, 16),),
                               recompute="full", dtype="float16", iteration=7)
    for plan in plans:
        assert ExecutionPlan.deserialize(plan.serialize()) == plan


def test_layout_is_little_endian_with_magic_and_version_header():
    data = ExecutionPlan(0, 1, 1, (0,)).serialize()
    magic, version = struct.unpack_from("<4sH", data)
    assert magic == b"MPLN" and version == 2


def _plan_bytes():
    return build_static_plans("1f1b", 3, 2, 1, [((2, 8),)] * 3, ((8, 2, 16),))[0].serialize()


def test_wrong_magic_version_and_truncation_raise_clear_errors():
    data = _plan_bytes()
    with pytest.raises(ValueError, match="not a serialized ExecutionPlan"):
        ExecutionPlan.deserialize(b"XXXX" + data[4:])
    with pytest.raises(ValueError, match="format version 99"):
        ExecutionPlan.deserialize(data[:4] + struct.pack("<H", 99) + data[6:])
    for cut in (0, 3, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(ValueError, match="truncated"):
            ExecutionPlan.deserialize(data[:cut])
    with pytest.raises(ValueError, match="trailing bytes"):
        ExecutionPlan.deserialize(data + b"\0\0\0\0")


def test_flipped_payload_byte_is_detected():
    data = bytearray(_plan_bytes())
    data[-5] ^= 0x40
    with pytest.raises(ValueError, match="corrupt"):
        ExecutionPlan.deserialize(bytes(data))


def test_unserializable_plans_raise_value_error():
    @dataclass(frozen=True)
    class Custom(I.Instruction):
        pass

    with pytest.raises(ValueError, match="Custom"):
        ExecutionPlan(0, 1, 1, (0,), [Custom(0, 0)]).serialize()
    with pytest.raises(ValueError, match="int32"):
        ExecutionPlan(0, 1, 1, (0,), [I.LoadInput(0, 0, (), ((2 ** 40,),))]).serialize()


def test_describe_names_type_fields_and_slots():
    text = I.describe(I.SendGradStart(3, 2, (5,), ((4, 2, 8),), 1))
    assert text == "SendGradStart(mb=3, stage=2, peer=1, buffers=(5,), shapes=((4, 2, 8),))"


def test_compress_rank_round_trips_and_version_1_plans_still_decode():
    shapes = ((4, 2, 8),)
    plan = ExecutionPlan(rank=0, num_ranks=2, num_stages=2, assigned_stages=(0,),
                         instructions=[I.RecvGradStart(0, 1, (0,), shapes, 1, 4),
                                       I.RecvGradFinish(0, 1, (0,), shapes, 1, 4)])
    back = ExecutionPlan.deserialize(plan.serialize())
    assert [x.compress_rank for x in back.instructions] == [4, 4]
    assert "compress_rank=4" in I.describe(back.instructions[0])
    with pytest.raises(ValueError, match="version 1 cannot carry"):
        I._encode_plan(plan, version=1)
    plain = ExecutionPlan(rank=0, num_ranks=2, num_stages=2, assigned_stages=(0,),
                          instructions=[I.RecvGradStart(0, 1, (0,), shapes, 1)])
    old = I._encode_plan(plain, version=1)
    assert struct.unpack_from("<4sH", old)[1] == 1
    assert ExecutionPlan.deserialize(old) == plain
