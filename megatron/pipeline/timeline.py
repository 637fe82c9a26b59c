"""Pipeline timelines (Chrome / Perfetto trace JSON) of one iteration: what the executor ran,
and the same instruction streams replayed with unit costs (the schedule as planned).

Both have one track (process) per pipeline rank of each DP group, a compute row (F/B/W events
named with their micro-batch id) and a communication row, and each point-to-point message as a
flow arrow from its send to the receive that waited for it. Open them in https://ui.perfetto.dev
or chrome://tracing. The unit-cost replay (F 1, B 2, split backward 1 + 1, messages free) shows
the schedule's bubbles without any cost model; where the run's planner has one (DynaPipe,
--dynapipe-trace-dir) its own simulated timeline is written beside these.
"""
from __future__ import annotations

import collections
from typing import Dict, List

# instruction -> time units (a split backward's input and weight halves take one unit each)
UNIT_COST = {"ForwardPass": 1.0, "BackwardPass": 2.0, "BackwardInput": 1.0, "BackwardWeight": 1.0}


def _kind(ev) -> str:
    return ev.get("args", {}).get("type", "")


def _channel(ev, pp_size: int):
    """(message kind, sender pid, receiver pid) of a send or receive event, else None."""
    t, peer = _kind(ev), ev.get("args", {}).get("peer", -1)
    if peer < 0 or not t.startswith(("Send", "Recv")):
        return None
    what = "act" if "Activation" in t else "grad"
    peer_pid = ev["pid"] - ev["pid"] % pp_size + peer  # the peer of the same DP group
    return (what, ev["pid"], peer_pid) if t.startswith("Send") else (what, peer_pid, ev["pid"])


def add_flows(events: List[dict], pp_size: int) -> List[dict]:
    """`events` plus one flow (send -> receive) per message, matched in order on each channel
    (a channel's messages are received in the order they were sent)."""
    sends: Dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    recvs: Dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    for ev in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"]):
        ch = _channel(ev, pp_size)
        if ch is None:
            continue
        t = _kind(ev)
        if t.endswith("Start") and t.startswith("Send"):
            sends[ch].append(ev)
        elif t.endswith("Finish") and t.startswith("Recv"):
            recvs[ch].append(ev)
    flows, n = [], 0
    for ch, queue in sends.items():
        for s, r in zip(queue, recvs.get(ch, ())):
            n += 1
            name = f"{ch[0]} mb{s['args']['microbatch']}"
            flows.append({"name": name, "cat": "p2p", "ph": "s", "id": n, "pid": s["pid"], "tid": s["tid"],
                          "ts": s["ts"]})
            flows.append({"name": name, "cat": "p2p", "ph": "f", "bp": "e", "id": n, "pid": r["pid"],
                          "tid": r["tid"], "ts": r["ts"] + r["dur"]})
    return events + flows


def unit_replay(events: List[dict], pp_size: int) -> List[dict]:
    """The instruction streams of `events` (each pid's, in the order it ran them) replayed with
    unit costs: a receive waits for its send, compute takes UNIT_COST, everything else no time.
    Times are in units (1 unit = 1 ms in the viewer)."""
    streams = collections.defaultdict(list)
    for ev in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"]):
        streams[ev["pid"]].append(ev)
    clock = {pid: 0.0 for pid in streams}
    pos = {pid: 0 for pid in streams}
    posted: Dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    out = []
    while True:
        progressed = False
        for pid, stream in streams.items():
            while pos[pid] < len(stream):
                ev = stream[pos[pid]]
                t, ch = _kind(ev), _channel(ev, pp_size)
                start = clock[pid]
                if ch is not None and t.startswith("Recv") and t.endswith("Finish"):
                    if not posted[ch]:
                        break  # its send has not run yet
                    start = max(start, posted[ch].popleft())
                cost = UNIT_COST.get(t, 0.0)
                if ch is not None and t.startswith("Send") and t.endswith("Start"):
                    posted[ch].append(start)
                out.append(dict(ev, ts=start * 1e3, dur=cost * 1e3))
                clock[pid] = start + cost
                pos[pid] += 1
                progressed = True
        if all(pos[p] == len(s) for p, s in streams.items()):
            break
        if not progressed:  # cannot happen for a plan the validator accepted
            raise ValueError("unit replay: every rank waits for a message no rank sends")
    return out
