"""Performance model on a synthetic database, against hand-computed numbers (see synth.py)."""
import os

import pytest

from megatron.aceso.db import SHIPPED_DIR, OpDatabase
from megatron.aceso.model import PerfModel, Plan, Stage, build_op_list

from .synth import SPEC, write_synthetic_db


@pytest.fixture
def db(tmp_path):
    return OpDatabase(write_synthetic_db(str(tmp_path)), "gpt", "tiny")


def test_op_list_and_lookups(db):
    ops = build_op_list(db.op_names, (2,))
    assert [o.row for o in ops] == [0, 1, 2, 1, 2, 3, 4]
    assert [o.layer for o in ops] == [-1, 0, 0, 1, 1, -1, -1]
    assert db.collective_ms("all_reduce", 2, 150) == pytest.approx(1.5)   # interpolated
    assert db.collective_ms("all_reduce", 2, 400) == pytest.approx(4.0)   # by bandwidth
    assert db.collective_ms("all_reduce", 2, 50) == pytest.approx(0.5)
    # no 4-GPU table: the 2-GPU one scaled by the ring factor (3/4) / (1/2)
    assert db.collective_ms("all_reduce", 4, 100) == pytest.approx(1.5)
    assert db.collective_ms("all_reduce", 1, 100) == 0.0
    assert db.p2p_ms(10, inter_node=False) == pytest.approx(1.0)
    assert db.p2p_ms(10, inter_node=True) == pytest.approx(2.0)
    with pytest.raises(KeyError, match="tp 4"):
        db.ops(1, 4)


def test_shipped_t5_borrows_allreduce_and_falls_back_to_all_gathers(tmp_path):
    t5 = OpDatabase(os.path.join(SHIPPED_DIR, "eurosys"), "t5", "770M")
    gpt = OpDatabase(os.path.join(SHIPPED_DIR, "eurosys"), "gpt", "13B")
    assert t5.borrowed_collectives == "gpt_13B"
    assert t5.collective_ms("all_reduce", 4, 100) == gpt.collective_ms("all_reduce", 4, 100)
    assert len(t5.op_names) == 39 and t5.tp_values == [1, 2, 4, 8] and t5.algos == [0]
    # alone in a directory: 2 x all_gather
    for fn in os.listdir(os.path.join(SHIPPED_DIR, "eurosys")):
        if fn.startswith(("t5_770M_mbs1_", "prim_t5_770M_")):
            (tmp_path / fn).write_text(open(os.path.join(SHIPPED_DIR, "eurosys", fn)).read())
    alone = OpDatabase(str(tmp_path), "t5", "770M")
    assert alone.borrowed_collectives is None
    assert alone.collective_ms("all_reduce", 4, 100) == pytest.approx(
        2 * alone.collective_ms("all_gather", 4, 100))
    gpt = OpDatabase(os.path.join(SHIPPED_DIR, "eurosys"), "gpt", "1_3B")
    assert gpt.collective_ms("all_reduce", 8, 512) == pytest.approx(7.347)  # exact table row
    assert gpt.p2p_inter is not None and gpt.p2p_ms(1024, True) > gpt.p2p_ms(1024, False)


def test_two_stage_1f1b_time_and_memory(db):
    pm = PerfModel(db, SPEC, memory_limit_mb=1e9)
    plan = Plan("gpt-tiny", 1, 4, [Stage(0, 3, 1, 1), Stage(3, 7, 1, 1)])
    p = pm.predict(plan)
    s0, s1 = p.stages
    # stage 0: fwd 1+2+1, bwd 2+4+1, 10 MB out at 10 GB/s = 1 ms, forward and backward
    assert (s0.fwd_ms, s0.bwd_ms, s0.p2p_fwd_ms, s0.p2p_bwd_ms) == pytest.approx((4, 7, 1, 1))
    assert s0.time_ms == pytest.approx(13)
    assert s1.time_ms == pytest.approx(6.5 + 8.5 + 2)
    # 4 micro-batches: (M-1) * max + sum
    assert p.iteration_ms == pytest.approx(3 * 17 + 30)
    # memory: 8 W + kept activations x in-flight micro-batches + reserved
    assert s0.memory_mb == pytest.approx(8 * 150 + 75 * 2 + 7)
    assert s1.memory_mb == pytest.approx(8 * 150 + 130 * 1 + 20)


def test_recompute_time_and_memory(db):
    pm = PerfModel(db, SPEC, memory_limit_mb=1e9)
    plan = Plan("gpt-tiny", 1, 4, [Stage(0, 3, 1, 1), Stage(3, 7, 1, 1, (1, 1, 0, 0))])
    s1 = pm.predict(plan).stages[1]
    assert s1.recompute_ms == pytest.approx(3)               # forward of a1 and b1 again
    assert s1.time_ms == pytest.approx(20)
    assert s1.act_per_mb_mb == pytest.approx(130 - 30 - 40 + 10)  # the run keeps its input
    assert s1.peak_recompute_mb == pytest.approx(70)
    assert s1.memory_mb == pytest.approx(1200 + 70 + 70 + 20)
    # a run does not cross a layer boundary: b0 and a1 recomputed are two runs
    st = Stage(0, 7, 1, 1, (0, 0, 1, 1, 0, 0, 0))
    a = pm.arrays(1, 1)
    kept, peak = pm.activation_terms(a, st)
    assert kept == pytest.approx(5 + 30 + 20 + 40 + 10 + 50 + 10)
    assert peak == pytest.approx(40)


@pytest.mark.parametrize("gpus_per_node,bw,allreduce", [(8, 10.0, 1.5), (2, 5.0, 1.5)])
def test_heterogeneous_stages_and_dp_allreduce(db, gpus_per_node, bw, allreduce):
    """Stage 0: TP1 x DP2 (1 sample per rank); stage 1: TP2 x DP1 (2 samples)."""
    pm = PerfModel(db, SPEC, memory_limit_mb=1e9, gpus_per_node=gpus_per_node)
    plan = Plan("gpt-tiny", 2, 8, [Stage(0, 3, 1, 2), Stage(3, 7, 2, 1)])
    p = pm.predict(plan)
    s0, s1 = p.stages
    # whole boundary tensor 10 MB x DP 2 = 20 MB; each sender ships 20 * tp_next / 2 GPUs
    p2p = 20 / bw
    assert s0.p2p_fwd_ms == pytest.approx(p2p)
    assert s1.p2p_fwd_ms == pytest.approx(p2p)        # receiver gets 20 / DP 1
    assert s0.time_ms == pytest.approx(11 + 2 * p2p)
    assert s1.time_ms == pytest.approx(15 + 2 * p2p)  # (2 samples / tp 2) = base times
    assert s0.allreduce_ms == pytest.approx(allreduce)   # 150 MB of grads over DP 2
    assert s1.allreduce_ms == 0.0
    pipe = 3 * s1.time_ms + s0.time_ms + s1.time_ms
    assert p.pipeline_ms == pytest.approx(pipe)
    # stage 0 finishes its last backward at the end and then all-reduces
    assert p.iteration_ms == pytest.approx(max(pipe + allreduce, pipe - (7 + p2p)))
    assert s1.memory_mb == pytest.approx(8 * 75 + 130 + 20)
    noar = PerfModel(db, SPEC, 1e9, gpus_per_node=gpus_per_node, include_allreduce=False)
    assert noar.predict(plan).iteration_ms == pytest.approx(pipe)


def test_micro_batch_must_divide_dp(db):
    pm = PerfModel(db, SPEC, memory_limit_mb=1e9)
    with pytest.raises(ValueError, match="divisible by stage DP"):
        pm.predict(Plan("gpt-tiny", 1, 4, [Stage(0, 3, 1, 2), Stage(3, 7, 1, 1)]))


def test_working_set_tables_price_the_peak_op_by_op(tmp_path):
    """Tables marked as holding working sets (our profiler's) get the position-aware peak:
    max over ops of backward working set + rebuilt run - what later ops kept (+ the residual
    gradient beside a non-last layer), plus the stage output and its gradient."""
    import json
    root = write_synthetic_db(str(tmp_path))
    with open(os.path.join(root, "gpt_tiny_profile.json"), "w") as f:
        json.dump({"reserved_columns": "working_set"}, f)
    db = OpDatabase(root, "gpt", "tiny")
    assert db.working_set
    pm = PerfModel(db, SPEC, memory_limit_mb=1e9)
    a = pm.arrays(1, 1)
    # no recompute: the last layer's ops peak at 0 above its kept; layer 0's b (+10 residual)
    # is 70 MB below the last layer's kept; plus 2 x 10 MB output and gradient
    assert pm.activation_terms(a, Stage(1, 5, 1, 1)) == pytest.approx((140, 20))
    # layer 1 recomputed: it keeps its input (10); backward of its b rebuilds a's 30 less the
    # input (kept) + b's 40 = 60
    st = Stage(1, 5, 1, 1, (0, 0, 1, 1))
    assert pm.activation_terms(a, st) == pytest.approx((80, 80))
    c = pm.predict(Plan("gpt-tiny", 1, 4, [st])).stages[0]
    assert c.recompute_ms == pytest.approx(3) and c.reserved_mb == 0
    assert c.memory_mb == pytest.approx(8 * 100 + 80 + 80)
    # the published tables keep Aceso's rule: largest run + largest reserve
    plain = PerfModel(OpDatabase(write_synthetic_db(str(tmp_path / "plain")), "gpt", "tiny"), SPEC, 1e9)
    assert not plain.working_set
    assert plain.activation_terms(plain.arrays(1, 1), st) == pytest.approx((80, 70))


def test_a_corrupt_profile_marker_is_named(tmp_path):
    root = write_synthetic_db(str(tmp_path))
    with open(os.path.join(root, "gpt_tiny_profile.json"), "w") as f:
        f.write("{half")
    with pytest.raises(ValueError, match="gpt_tiny_profile.json: not JSON"):
        OpDatabase(root, "gpt", "tiny")
