"""Which rank is actually stuck: per-rank heartbeats in the job's TCPStore.

A rank blocked in a collective or a receive looks, to its peers, exactly like a rank that is
stopped (SIGSTOP, a hung kernel, swapped out): both stop answering. Timeouts therefore blame
the nearest peer, which is often a healthy rank waiting on the real culprit. Each rank runs a
daemon thread that bumps a counter in the store every `interval` seconds and publishes the
instruction its executor is on. A thread keeps beating while its main thread waits in a
collective, but not when the whole process is stopped or dead; so on a timeout a survivor
samples every counter twice and names the ranks whose counter did not move, with their last
instruction. Counters, not timestamps: clocks on different hosts need not agree.

Nobody has to time out first for a stall to be named: two watcher ranks (global 0 and the
last) read every counter at each beat, and a rank whose counter has not moved for `stall_s`
(default: min(10 s, half the job's --distributed-timeout-minutes), at least 3 beats;
MEGATRON_HEARTBEAT_STALL_SECONDS overrides) is reported at once, on the watcher's stderr and in
the store, with its last iteration and instruction; a later timeout's diagnosis quotes it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional

_PREFIX = "megatron/heartbeat"
_active: Optional["Heartbeat"] = None


class Heartbeat:
    def __init__(self, store, rank: int, world_size: int, interval_s: float = 1.0, stall_s: float = 10.0):
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.stall_s = max(stall_s, 3 * interval_s)
        self.watcher = world_size > 1 and rank in (0, world_size - 1)
        self._seen = {}  # rank -> (count, monotonic time it last moved)
        self._reported = set()
        clone = getattr(store, "clone", None)
        self._beat_store = clone() if clone is not None else store
        self._query_store = clone() if clone is not None else store
        self.current = None  # (iteration, instruction) the executor is on; formatted lazily
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)
        self._thread.start()

    def note(self, iteration: int, instruction, describe=repr) -> None:
        """`describe(instruction)` runs on the heartbeat thread, only when it beats: the caller
        (the pipeline layer) passes its own formatter, so core does not import the pipeline."""
        self.current = (iteration, instruction, describe)

    def _what(self) -> str:
        cur = self.current
        if cur is None:
            return "outside the pipeline executor (data loading, optimizer step, collectives or start-up)"
        return f"iteration {cur[0]}: {cur[2](cur[1])}"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._beat_store.set(f"{_PREFIX}/what/{self.rank}", self._what())
                self._beat_store.add(f"{_PREFIX}/count/{self.rank}", 1)
                if self.watcher:
                    self._watch()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating and wait for the thread: a daemon thread still inside a store call when
        the interpreter exits aborts the process ("terminate called without an active
        exception") after training has finished."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        try:  # a rank that ends is not a stalled one
            self._query_store.set(f"{_PREFIX}/done/{self.rank}", b"1")
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
            pass

    def _watch(self) -> None:
        now = time.monotonic()
        for r in range(self.world_size):
            if r == self.rank:
                continue
            count = self._beat_store.add(f"{_PREFIX}/count/{r}", 0)
            last = self._seen.get(r)
            if count == 0:
                continue  # not started yet: start-up has its own timeouts
            if last is None or count != last[0]:
                self._seen[r] = (count, now)
                if r in self._reported:  # it was only slow (a loaded host): withdraw the accusation
                    self._reported.discard(r)
                    self._beat_store.delete_key(f"{_PREFIX}/stalled/{r}")
            elif now - last[1] >= self.stall_s and r not in self._reported:
                self._reported.add(r)
                if self._beat_store.check([f"{_PREFIX}/done/{r}"]):
                    continue
                what = self._last_what(self._beat_store, r)
                msg = (f"global rank {r} (last at {what}) has not answered for {now - last[1]:.0f}s (process "
                       f"stopped, hung or dead)")
                self._beat_store.set(f"{_PREFIX}/stalled/{r}", msg)
                print(f"HEARTBEAT (seen by global rank {self.rank}): {msg}", file=sys.stderr, flush=True)

    @staticmethod
    def _last_what(store, r: int) -> str:
        # check() first: get() of a key nobody set waits for the store's whole timeout (minutes)
        key = f"{_PREFIX}/what/{r}"
        if not store.check([key]):
            return "never started"
        return store.get(key).decode(errors="replace")

    def _reports(self) -> dict:
        out = {}
        for r in range(self.world_size):
            key = f"{_PREFIX}/stalled/{r}"
            if r != self.rank and self._query_store.check([key]):
                out[r] = self._query_store.get(key).decode(errors="replace")
        return out

    def stalled(self) -> list:
        """What the watchers have reported stalled so far (fast: no waiting)."""
        return list(self._reports().values())

    def _counts(self) -> list:
        return [self._query_store.add(f"{_PREFIX}/count/{r}", 0) for r in range(self.world_size)]

    def diagnose(self) -> str:
        """One sentence naming the ranks that stopped beating.

        A rank is named only if its counter does not move during the whole sampling window: on
        a loaded host a live rank's heartbeat thread can miss several beats, so one short window
        (or a watcher's report from a moment ago) is not proof. The window is 3 beats when a
        watcher has already reported someone (we only confirm it), else the stall limit, and it
        stretches while this process's own heartbeat is late."""
        try:
            known = self._reports()
            window = 3 * self.interval_s if known else max(3 * self.interval_s, self.stall_s)
            before = self._counts()
            others = [r for r in range(self.world_size) if r != self.rank]
            moved, deadline = set(), time.monotonic() + window
            # Our own heartbeat thread is the yardstick: on a loaded host it is starved like the
            # others' (on this host at least), so silence counts only once ours has beaten 3 times
            # in the window; a hard limit keeps a starved process from waiting for ever.
            hard = deadline + max(10 * self.interval_s, window)
            while True:
                time.sleep(self.interval_s)
                now = self._counts()
                moved |= {r for r in others if now[r] != before[r]}
                t = time.monotonic()
                if len(moved) == len(others) or t >= hard or \
                        (t >= deadline and now[self.rank] - before[self.rank] >= 3):
                    break
            stuck = [r for r in others if r not in moved]
            if not stuck:
                return "every other rank is still alive (its heartbeat advances): the peer is slow or waiting itself"
            if all(r in known for r in stuck):
                return ("not responding (reported by the heartbeat watchers): "
                        + "; ".join(known[r] for r in stuck))
            parts = []
            for r in stuck:
                what = self._last_what(self._query_store, r)
                parts.append(f"global rank {r} (last at {what})")
            return ("not responding (heartbeat stopped: process stopped, hung or dead): " + "; ".join(parts))
        except Exception as e:  # noqa: BLE001 - diagnosis must never hide the original error
            return f"heartbeat diagnosis unavailable ({e})"


def start(store, rank: int, world_size: int, timeout_s: float = 600.0) -> Heartbeat:
    """Start this process's heartbeat once (later calls return the running one). `timeout_s`:
    the job's collective timeout; a stall is reported well before it."""
    global _active
    if _active is None or _active.rank != rank or _active.world_size != world_size:
        interval = float(os.environ.get("MEGATRON_HEARTBEAT_SECONDS", "1.0"))
        stall = float(os.environ.get("MEGATRON_HEARTBEAT_STALL_SECONDS", min(10.0, timeout_s / 2)))
        _active = Heartbeat(store, rank, world_size, interval, stall)
    return _active


def active() -> Optional[Heartbeat]:
    return _active


def shutdown() -> None:
    """Stop this process's heartbeat (before the process group and its store go away)."""
    global _active
    if _active is not None:
        _active.stop()
        _active = None
