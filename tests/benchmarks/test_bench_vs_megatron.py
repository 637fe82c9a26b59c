"""benchmarks/bench_vs_megatron.py: the baton that makes Megatron's and this project's steps
alternate (fast, no Megatron needed), and the whole pairing at the tiniest size with one layout
when a Megatron-LM core_v0.9.0 checkout is given (MEGATRON_LM_PYTHONPATH, as the fixture makers
use; two torchrun launches: tens of seconds, so marked slow). Timings are printed by the
benchmark, never asserted here; the losses are, because both sides start from the same weights."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch.distributed as dist

from benchmarks import bench_vs_megatron as bench


def test_baton_alternates_megatron_and_ours_step_by_step(monkeypatch):
    """Two ranks per system on one store: every rank of Megatron's step k ends before any rank of
    our step k starts, and ours before Megatron's step k + 1 (ranks of one system overlap)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("BENCH_BATON_PORT", str(store.port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("BENCH_BATON_TIMEOUT", "60")
    events, lock, steps = [], threading.Lock(), 3
    batons = [bench.Baton(me) for me in ("M", "M", "O", "O")]  # built here: env is per process

    def rank(baton):
        for _ in range(steps):
            baton.before_step()
            with lock:
                events.append((baton.me, baton.k, "start"))
            with lock:
                events.append((baton.me, baton.k, "end"))
            baton.after_step()
    threads = [threading.Thread(target=rank, args=(b,)) for b in batons]
    for t in reversed(threads):  # ours first: it must still wait for Megatron's step 0
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    order = [(me, k) for me, k, _ in events]
    turns = [order[0]] + [b for a, b in zip(order, order[1:]) if a != b]
    assert turns == [(me, k) for k in range(steps) for me in ("M", "O")]
    assert all(len(b.times) == steps for b in batons)


def test_no_checkout_is_one_clear_line(capsys):
    with pytest.raises(SystemExit, match="MEGATRON_LM_PYTHONPATH"):
        bench.main(["--megatron", "/nonexistent"])


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PYTHONPATH"),
                    reason="set MEGATRON_LM_PYTHONPATH to a Megatron-LM core_v0.9.0 checkout and its deps (six), "
                           "see tests/fixtures/megatron/README.md")
def test_tiny_pp2_pair_same_losses_as_megatron(capsys):
    """Megatron's own train_step (1F1B at PP 2) and pretrain_gpt.py from Megatron's saved initial
    weights on the same samples: every iteration's loss agrees (Adam on both sides)."""
    assert bench.main(["--layouts", "pp2", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16",
                       "--iters", "3", "--warmup", "1", "--timeout", "280"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = out["layouts"]
    assert row["layout"] == "pp2" and row["schedule"] == "1F1B"
    assert row["losses_agree"] and row["max_loss_diff"] < 1e-5, row
    assert row["megatron_step_ms"] > 0 and row["ours_step_ms"] > 0 and row["ratio_ours_over_megatron"] > 0
    assert len(row["megatron_steps_ms"]) == len(row["ours_steps_ms"]) == 3
    assert row["megatron_peak_rss_mb"] > 0 and row["ours_peak_rss_mb"] > 0


def test_gpu_check_part_skips_without_a_checkout(tmp_path):
    """`make gpu-check` runs the pairing only when a checkout is named; else it skips, saying how."""
    from benchmarks import gpu_check as gc
    (part,) = [p for p in gc.PARTS if p.name == "vs_megatron"]
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_PYTHONPATH"}
    for cuda in (False, True):
        ctx = gc.Ctx(cuda=cuda, py="python", out_dir=tmp_path, tmp=tmp_path, env=env)
        assert part.argv(ctx) is None and "MEGATRON_LM_PYTHONPATH" in part.skip_reason(ctx)
        ctx.env = dict(env, MEGATRON_LM_PYTHONPATH="/x")
        assert part.argv(ctx)[1] == "benchmarks/bench_vs_megatron.py"
