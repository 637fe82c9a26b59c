"""A peer that writes the job's TCP store: it may replay a record of another run, re-label a
genuine plan for another iteration (recomputing its digest), forge an error record full of
terminal escapes, bump or drop a reader counter, or send JSON nested deep enough to exhaust the
stack. Each is refused in one line naming the key (an error record's text is shown quoted), and
a stuck counter is named long before the timeout."""
import functools
import gc
import time
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.planner.service import wire
from megatron.planner.service.service import NO_BATCH, PlanService, PlanServiceError, error_record, plan_record
from megatron.planner.service.worker import batch_digest, check_covers
from tests.planner.service.test_service import local_store

JOB = b"j" * 16
LENGTHS = np.arange(1, 41) * 7
BOUNDS = np.array([0, 12, 20, 40])
DIGEST = functools.partial(batch_digest, LENGTHS, BOUNDS, 0)


@pytest.fixture(autouse=True)
def _stores_closed():
    """The TCPStore servers these tests start must be gone before the next test forks ranks: a
    server kept alive by a traceback's reference cycle keeps its thread, and a rank forked while
    that thread holds a lock hangs (seen: the next file's 2-rank runs timed out)."""
    yield
    gc.collect()


def _reader(store, prefix, rank=1, readers=2, timeout_s=60.0, digest=DIGEST):
    store.set(f"{prefix}/job", JOB)
    return PlanService(None, rank, readers, store, prefix=prefix, timeout_s=timeout_s, batch_digest=digest)


def _refused(svc, iteration, *words):
    with pytest.raises(PlanServiceError) as e:
        svc.get(iteration)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    return msg


def test_genuine_record_is_read():
    store = local_store()
    svc = _reader(store, "ok", readers=1)
    store.set("ok/0", plan_record(0, JOB, DIGEST(0), wire.encode({"plan": 0})))
    assert svc.get(0) == {"plan": 0}


def test_record_of_another_run_is_refused():
    store = local_store()
    svc = _reader(store, "replay")
    store.set("replay/0", plan_record(0, b"x" * 16, DIGEST(0), wire.encode({"plan": 0})))
    _refused(svc, 0, "replay/0", "another run")


def test_plan_relabelled_for_the_next_iteration_is_refused():
    store = local_store()
    svc = _reader(store, "relabel")
    genuine = wire.encode({"plan": 0})
    store.set("relabel/1", plan_record(1, JOB, DIGEST(0), genuine))  # iteration and sha256 redone
    _refused(svc, 1, "relabel/1", "another global batch")


def test_plan_covering_another_batch_is_refused():
    # what a forger who also recomputes the batch digest still meets: the plan's samples must be
    # exactly the rank's batch (iteration 0 has 12 samples, iteration 1 has 8)
    plan = SimpleNamespace(groups=[SimpleNamespace(rows=None, cp=None, microbatches=[list(range(6)), list(range(6, 12))])])
    check_covers(plan, 0, 12)
    with pytest.raises(ValueError, match="another batch"):
        check_covers(plan, 1, 8)
    with pytest.raises(ValueError, match="another batch"):
        check_covers(plan, 2, 20)


def test_forged_error_record_prints_as_quoted_data():
    store = local_store()
    svc = _reader(store, "err")
    evil = "A" * 100_000 + "\n\x1b[2J\x1b]0;owned\x07rank 3: all good, ignore this\n"
    store.set("err/0", error_record(0, JOB, evil))
    with pytest.raises(PlanServiceError) as e:
        svc.get(0)
    msg = str(e.value)
    assert "\x1b" not in msg and "\x07" not in msg and "\\x1b[2J" in msg
    assert len(msg) < 5000 and "characters cut" in msg
    assert all(line.startswith("  | ") for line in msg.splitlines()[1:]), msg[:300]


def test_deep_json_is_one_line():
    import struct
    store = local_store()
    svc = _reader(store, "deep")
    body = b"[" * 200_000 + b"]" * 200_000
    payload = struct.pack("<4sHBBII", b"MPIR", 1, 0, 0, len(body), 0) + body
    store.set("deep/0", plan_record(0, JOB, DIGEST(0), payload))
    _refused(svc, 0, "iteration 0", "RecursionError")


def test_garbage_plan_blob_is_one_line():
    import struct
    store = local_store()
    svc = _reader(store, "blob", digest=None)
    head = b'{"iteration":0,"recompute":"none","makespan_ms":1,"padding_efficiency":1,"planning_ms":1,' \
           b'"lowering_ms":1,"memory_fallback":false,"groups":[{"microbatches":[[0]],"shapes":[[[1,8]]],' \
           b'"schedule":"1f1b","makespan_ms":1,"peak_memory_mb":[1],"num_plans":1}]}'
    blob = b"\xff" * 40
    payload = struct.pack("<4sHBBII", b"MPIR", 1, 1, 0, len(head), 1) + struct.pack("<I", len(blob)) + head + blob
    store.set("blob/0", plan_record(0, JOB, NO_BATCH, payload))
    _refused(svc, 0, "iteration 0")


def test_bumped_reader_counter_is_named_before_the_timeout():
    store = local_store()
    one, two = _reader(store, "bump", rank=1, readers=2), _reader(store, "bump", rank=2, readers=2)
    store.set("bump/0", plan_record(0, JOB, DIGEST(0), wire.encode(0)))
    store.add("bump/0/readers", 1)  # the attacker: rank 2's read now completes iteration 0 alone
    assert two.get(0) == 0
    t0 = time.monotonic()
    _refused(one, 0, "bump/0/readers", "counted complete")  # its record is gone; not a 60 s timeout
    assert time.monotonic() - t0 < 30


def test_dropped_reader_counter_is_named_before_the_timeout():
    store = local_store()
    one = _reader(store, "drop", rank=1, readers=2)
    store.set("drop/0", plan_record(0, JOB, DIGEST(0), wire.encode(0)))
    assert one.get(0) == 0
    store.add("drop/0/readers", -1)  # iteration 0 can never complete: the look-ahead stalls
    t0 = time.monotonic()
    _refused(one, 1, "drop/0/readers", "cannot progress")
    assert time.monotonic() - t0 < 30
