"""Plans cross the TCP store as a fixed-schema record, never a pickle: a real DynaPipe plan
round-trips exactly; a pickle (with a valid digest), a truncated or an oversized record is
refused, naming the iteration."""
import os
import pickle

import numpy as np
import pytest

from megatron.planner.service import wire
from megatron.planner.dynapipe.planner import DynaPipePlanner
from megatron.planner.service.service import NO_BATCH, PlanService, PlanServiceError, plan_record
from megatron.planner.service.worker import strip
from tests.planner.dynapipe.test_dynapipe import gpt_config, lengths
from tests.planner.service.test_service import local_store


def _plan():
    planner = DynaPipePlanner(gpt_config(pipeline_parallel=2, data_parallel=2))
    return strip(planner.plan(lengths(np.random.default_rng(0), 48, 1024), iteration=7))


def test_dynapipe_plan_round_trips_exactly():
    plan = _plan()
    data = wire.encode(plan)
    assert b"\x80" not in data[:2]  # not a pickle
    assert wire.decode(data) == plan
    assert wire.decode(wire.encode({"a": [1, 2.5, None]})) == {"a": [1, 2.5, None]}


def test_truncated_forged_and_oversized_records_are_refused(monkeypatch):
    data = wire.encode(_plan())
    for cut in (3, 20, len(data) // 2, len(data) - 1):
        with pytest.raises(ValueError, match="truncated"):
            wire.decode(data[:cut])
    with pytest.raises(ValueError, match="trailing"):
        wire.decode(data + b"\0")
    # A header claiming four billion blobs or a 4 GB JSON part: refused before any allocation.
    magic, ver, kind, res, jlen, n = wire._HEADER.unpack_from(data)
    with pytest.raises(ValueError, match="claims 4294967295 plan blobs"):
        wire.decode(wire._HEADER.pack(magic, ver, kind, res, jlen, 0xFFFFFFFF) + data[wire._HEADER.size:])
    with pytest.raises(ValueError, match="truncated"):
        wire.decode(wire._HEADER.pack(magic, ver, kind, res, 0xFFFFFFFF, n) + data[wire._HEADER.size:])
    monkeypatch.setattr(wire, "MAX_RECORD_BYTES", len(data) - 1)
    with pytest.raises(ValueError, match="over the"):
        wire.decode(data)
    monkeypatch.undo()
    # Right sizes, wrong field type.
    forged = wire.encode({"iteration": "7"})
    forged = forged[:6] + bytes([wire.KIND_DYNAPIPE]) + forged[7:]
    with pytest.raises(ValueError, match="plan.iteration is str"):
        wire.decode(forged)


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_in_the_store_is_refused_naming_the_iteration(tmp_path):
    store = local_store()
    svc = PlanService(None, 1, 2, store, prefix="hostile", timeout_s=2)
    store.set("hostile/job", b"j" * 16)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Hostile(marker))
    store.set("hostile/5", plan_record(5, b"j" * 16, NO_BATCH, payload))
    with pytest.raises(PlanServiceError, match="plan of iteration 5 refused: not a plan record"):
        svc.get(5)
    assert not marker.exists()
    store.set("hostile/6", b"P\x06")  # a record cut short of its own header
    with pytest.raises(PlanServiceError, match="iteration 6 .* not a plan record"):
        svc.get(6)


def test_packed_rows_and_token_slices_round_trip():
    """What the trainer reads besides the plans: packed rows (which samples share a row) and the
    token slices of a sliced plan must survive the plan service."""
    for kw in ({"packed_rows": True, "packed_max_len": 1024}, {"token_slices": 2}):
        planner = DynaPipePlanner(gpt_config(pipeline_parallel=4, data_parallel=2, **kw))
        if kw.get("packed_rows"):  # make the packed candidate win, as the packed-rows training test does
            from megatron.planner.dynapipe import packed
            got = packed.search_packed(planner, "gpt", lengths(np.random.default_rng(1), 48, 1024), 1024)
            plan = strip(planner._finish_packed(got, 3, lengths(np.random.default_rng(1), 48, 1024), 0.0, True))
            assert plan.groups[0].rows is not None
        else:
            plan = strip(planner.plan(lengths(np.random.default_rng(1), 48, 1024), iteration=3))
            assert plan.groups[0].token_slices is not None
        assert wire.decode(wire.encode(plan)) == plan
