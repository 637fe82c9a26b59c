"""The heartbeat blames only ranks that stay silent: one that was merely slow (a loaded host
starving its heartbeat thread for a while) is cleared as soon as it beats again."""
import threading
import time

import torch.distributed as dist

from megatron.core.heartbeat import Heartbeat, _PREFIX


def _store():
    return dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)


def _until(cond, limit_s=20.0):
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_slow_rank_is_cleared_when_it_beats_again():
    store = _store()
    beat = Heartbeat(store, 0, 2, interval_s=0.05, stall_s=0.3)  # rank 0: a watcher
    try:
        store.add(f"{_PREFIX}/count/1", 1)  # rank 1 beat once, then went quiet
        store.set(f"{_PREFIX}/what/1", "iteration 3: Forward(microbatch=0)")
        _until(lambda: beat.stalled())
        assert "global rank 1 (last at iteration 3: Forward(microbatch=0))" in beat.stalled()[0]
        store.add(f"{_PREFIX}/count/1", 1)  # ... and beats again: it was only slow
        _until(lambda: not beat.stalled())
    finally:
        beat.stop()


def test_diagnosis_names_a_silent_rank_and_spares_a_beating_one():
    store = _store()
    beat = Heartbeat(store, 0, 2, interval_s=0.05, stall_s=0.3)
    try:
        store.add(f"{_PREFIX}/count/1", 1)
        msg = beat.diagnose()
        assert "not responding" in msg and "global rank 1" in msg, msg
        stop = threading.Event()

        def beating():
            while not stop.is_set():
                store.add(f"{_PREFIX}/count/1", 1)
                time.sleep(0.05)
        t = threading.Thread(target=beating)
        t.start()
        try:
            msg = beat.diagnose()
        finally:
            stop.set()
            t.join()
        assert "every other rank is still alive" in msg, msg
    finally:
        beat.stop()
