"""A peer that stops answering (SIGSTOP of one of 4 ranks, as a hung host or a debugger would):
the heartbeat watchers name it, with its iteration and last instruction, within the stall
limit and long before any collective times out; a later timeout's diagnosis quotes it."""
import os
import signal
import subprocess
import time

from tests.dist_harness import run_distributed

ENV = {"MEGATRON_HEARTBEAT_SECONDS": "0.3", "MEGATRON_HEARTBEAT_STALL_SECONDS": "2"}


def _one_rank_stops(rank, world):
    import torch.distributed as dist

    from megatron.core import heartbeat
    store = dist.distributed_c10d._get_default_store()
    beat = heartbeat.start(store, rank, world, timeout_s=60)
    beat.note(7, "RecvActivationFinish(microbatch=3, stage=2)", str)
    store.add("test/started", 1)
    while store.add("test/started", 0) < world:
        time.sleep(0.05)
    if rank == 2:
        time.sleep(1.0)  # beats a few times, then the whole process stops
        subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        out = None
    else:
        t0, out = time.monotonic(), None
        while time.monotonic() - t0 < 7 and not out:
            out = beat.stalled()
            time.sleep(0.1)
        out = (time.monotonic() - t0, out, beat.diagnose() if out else None)
    store.add("test/done", 1)
    while store.add("test/done", 0) < world:  # rank 0 hosts the store: nobody leaves early
        time.sleep(0.05)
    heartbeat.shutdown()
    return out


def test_stopped_rank_is_named_within_the_stall_limit(capfd):
    outs = run_distributed(_one_rank_stops, 4, env=ENV, timeout_s=120)
    for rank in (0, 1, 3):
        elapsed, stalled, diagnosis = outs[rank]
        assert stalled and elapsed < 6, (rank, outs[rank])
        assert "global rank 2" in stalled[0] and "iteration 7: RecvActivationFinish(microbatch=3" in stalled[0]
        assert "reported by the heartbeat watchers" in diagnosis and "global rank 2" in diagnosis
    err = capfd.readouterr().err
    assert "HEARTBEAT (seen by global rank 0): global rank 2 (last at iteration 7: " in err, err[-2000:]
