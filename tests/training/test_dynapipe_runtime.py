"""Run-time behaviour of `--dynapipe` training beyond one step's gradient: evaluation planned
like training batches (loss per real target token, the same whatever the layout and
micro-batching), bit-exact resume with the plan service restarted from the consumed-samples
position, and `--dynapipe-trace-dir`."""
import json
import multiprocessing as mp
import os

import numpy as np
import pytest
import torch

from tests.dist_harness import run_distributed
from tests.training.test_dynapipe_training import VOCAB, _cfg, _write

TOTAL = 4


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("multitask_rt")
    rng = np.random.RandomState(1)
    n = 300
    lin = np.clip(rng.lognormal(2.6, 0.8, n).astype(int), 2, 60)
    lout = np.clip(rng.lognormal(1.8, 0.7, n).astype(int), 1, 30)
    _write(str(d / "in"), [rng.randint(0, VOCAB, k) for k in lin])
    _write(str(d / "out"), [rng.randint(0, VOCAB, k) for k in lout])
    return str(d / "in"), str(d / "out")


def _build(world, data, pp, workers=0, iters=TOTAL, save=None, load=None, trace_dir=None, trace_iters=0,
           split="100,0,0", eval_iters=0):
    from datetime import timedelta

    from megatron.config.core import CheckpointConfig
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.pretrain import build_gpt_trainer

    mp.current_process().daemon = False  # rank 0 starts planner worker processes
    cfg = _cfg(world, "gpt", data, "dynapipe", pp=pp, iters=iters, workers=workers)
    cfg.model.vocab_size = VOCAB
    cfg.training.lr_decay_iters = TOTAL  # the same schedule whether or not the run is split
    cfg.training.eval_iters = eval_iters
    cfg.data.split = split
    cfg.data.dynapipe_trace_dir, cfg.data.dynapipe_trace_iters = trace_dir, trace_iters
    cfg.checkpoint = CheckpointConfig(save=save, load=load)
    ps = initialize_model_parallel(1, pp, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    return build_gpt_trainer(cfg, ps, torch.device("cpu")), ps


def _state(trainer):
    params = {f"{k}.{n}": p.detach().clone() for k, m in trainer.stages.items() for n, p in m.named_parameters()}
    return params, trainer.consumed_samples


# ---- evaluation ------------------------------------------------------------------------------
def _evaluate(rank, world, data, pp):
    trainer, ps = _build(world, data, pp, iters=1, split="70,30,0", eval_iters=2)
    before = trainer.evaluate(trainer.valid_source, 2)
    again = trainer.evaluate(trainer.valid_source, 2)  # cached plans, same batches
    trainer.train()
    after = trainer.evaluate(trainer.valid_source, 2)
    src = trainer.valid_source
    shapes = [s for k in sorted(src._plans) for g in src._plans[k].groups for s in g.shapes]
    return {"before": before, "again": again, "after": after, "last": ps.rank == world - 1, "shapes": shapes}


def test_evaluation_is_planned_and_per_real_token(data):
    one = run_distributed(_evaluate, 1, data, 1)[0]
    outs = run_distributed(_evaluate, 4, data, 2)  # PP2 x DP2: other micro-batches, other plans
    pp = [o for o in outs if o["last"]][0]
    assert len(set(one["shapes"])) > 1 and len(set(pp["shapes"])) > 1  # really variable micro-batches
    assert sorted(one["shapes"]) != sorted(pp["shapes"])
    assert one["before"] == one["again"]
    # Loss summed over real target tokens / their count: independent of how the batch was cut.
    assert pp["before"] == pytest.approx(one["before"], rel=1e-5)
    assert pp["after"] == pytest.approx(one["after"], rel=1e-5)
    assert one["after"] != one["before"]  # the step changed the model
    assert 3.0 < one["before"] < 6.0  # ~ln(97) for an untrained model: a per-token mean, not a sum


# ---- resume + traces -------------------------------------------------------------------------
def _straight(rank, world, data, trace_dir):
    trainer, _ = _build(world, data, 2, workers=1, trace_dir=trace_dir, trace_iters=3)
    hist = trainer.train()
    return _state(trainer), [h["planner"]["microbatch_shapes"] for h in hist]


def _first_half(rank, world, data, ckpt):
    from megatron.checkpointing.torch_format import save_checkpoint
    trainer, _ = _build(world, data, 2, workers=1, iters=TOTAL // 2, save=ckpt)
    trainer.train()
    save_checkpoint(trainer)
    return True


def _second_half(rank, world, data, ckpt, trace_dir):
    from megatron.checkpointing.torch_format import load_checkpoint
    trainer, _ = _build(world, data, 2, workers=1, load=ckpt, trace_dir=trace_dir, trace_iters=1)
    assert load_checkpoint(trainer)
    assert trainer.iteration == TOTAL // 2
    hist = trainer.train()
    assert trainer.batch_source.first_iteration == TOTAL // 2 + 1  # plan service restarted there
    return _state(trainer), [h["planner"]["microbatch_shapes"] for h in hist]


def test_resume_is_bit_exact_and_traces_are_written(data, tmp_path):
    straight_traces, resumed_traces = tmp_path / "t1", tmp_path / "t2"
    straight = run_distributed(_straight, 2, data, str(straight_traces))
    run_distributed(_first_half, 2, data, str(tmp_path / "ckpt"))
    resumed = run_distributed(_second_half, 2, data, str(tmp_path / "ckpt"), str(resumed_traces))
    for ((a, ca), shapes_a), ((b, cb), shapes_b) in zip(straight, resumed):
        assert ca == cb
        assert shapes_a[TOTAL // 2:] == shapes_b  # the same plans after the restart
        assert set(a) == set(b)
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # Traces: the first K iterations planned by each run, one file each, written by rank 0.
    assert sorted(os.listdir(straight_traces)) == sorted(
        [f"iter_{i:07d}.{kind}.json" for i in (1, 2, 3) for kind in ("sim", "measured")])
    assert sorted(os.listdir(resumed_traces)) == ["iter_0000003.measured.json", "iter_0000003.sim.json"]
    # The measured timeline beside it: every instruction span of both pipeline ranks.
    measured = json.loads((straight_traces / "iter_0000001.measured.json").read_text())
    ran = [e for e in measured["traceEvents"] if e.get("cat") == "compute"]
    n_mb0 = len(straight[0][1][0])
    for pid in (0, 1):
        assert sorted(e["name"] for e in ran if e["pid"] == pid) == sorted(
            [f"F{k}" for k in range(n_mb0)] + [f"B{k}" for k in range(n_mb0)])
    assert all(e["dur"] >= 0 for e in measured["traceEvents"] if e.get("ph") == "X")
    assert any(e.get("cat") == "comm" for e in measured["traceEvents"])
    assert measured["otherData"]["simulated_ms"] > 0
    trace = json.loads((straight_traces / "iter_0000001.sim.json").read_text())
    compute = [e for e in trace["traceEvents"] if e.get("cat") == "compute"]
    assert {e["pid"] for e in compute} == {0, 1}  # both pipeline ranks
    n_mb = len(straight[0][1][0])
    assert sorted(e["name"] for e in compute if e["pid"] == 0) == sorted(
        [f"F{k}" for k in range(n_mb)] + [f"B{k}" for k in range(n_mb)])
    end = max(e["ts"] + e["dur"] for e in compute) / 1e3
    assert end == pytest.approx(trace["otherData"]["pipeline_ms"], rel=1e-9)
    assert trace["otherData"]["simulated_ms"] >= trace["otherData"]["pipeline_ms"]  # + the step overhead
