"""Who may change a checkpoint folder: only the one job writing to it, and only what it can
prove a writer of this project left behind.

    <save>/.writer.json               the writing job: {"job", "host", "pid", "start", "since"}
    <save>/iter_N/.saving.json        written before any file of a save, removed once its
                                      manifest is written: "this folder is a save in progress"

A job that only reads (`--load` without the same `--save`) never creates, renames or removes
anything under that folder. A job that writes claims `--save` first (rank 0, atomically: the
lock is created with O_EXCL); if another live job holds it, the claim fails naming that job's
host, pid and start time, so two jobs never write one folder. A lock whose process is gone
(same host: the pid is dead or belongs to a later process, told apart by its start time in
/proc; another host: not refreshed by a save for `OTHER_HOST_STALE_S`) is taken over.

The writer removes an iteration folder only when it carries a `.saving.json` marker of a
writer that is no longer alive (a killed save of this project), never for lacking a manifest:
a folder written by Megatron-LM, by hand, or by a live run is left as it is.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import time
from typing import Optional

LOCK = ".writer.json"
MARKER = ".saving.json"
OTHER_HOST_STALE_S = 6 * 3600.0

_held: dict = {}  # realpath of a --save folder -> this process's lock record


class FolderInUseError(RuntimeError):
    """Another live job writes the folder."""


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot) from /proc: with the pid it names one
    process, so a reused pid does not look like the old writer."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid)}


def writer_alive(rec: dict, mtime: float) -> bool:
    """Whether the writer named by a lock or marker record may still be running."""
    if not isinstance(rec, dict) or not isinstance(rec.get("pid"), int):
        return False
    if rec.get("host") != socket.gethostname():
        return time.time() - mtime < OTHER_HOST_STALE_S
    try:
        os.kill(rec["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return rec.get("start") is None or _start_time(rec["pid"]) in (None, rec["start"])


def _read(path: str):
    try:
        with open(path) as f:
            rec = json.load(f)
        return rec if isinstance(rec, dict) else {}, os.path.getmtime(path)
    except FileNotFoundError:
        return None, 0.0
    except (OSError, ValueError, RecursionError):
        return {}, 0.0  # unreadable: nobody we can name, treated as stale


def describe(rec: dict) -> str:
    since = rec.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return (f"job {str(rec.get('job'))[:32]} (host {str(rec.get('host'))[:64]}, pid {rec.get('pid')}, "
            f"writing since {when})")


def claim(root: str) -> dict:
    """Rank 0 of a job that writes `root`: take the folder's writer lock (once per process).
    Raises FolderInUseError naming the live job that holds it."""
    key = os.path.realpath(root)
    if key in _held and _held[key]["pid"] == os.getpid():  # (a forked child is not the holder)
        os.utime(os.path.join(root, LOCK))  # a save refreshes it: another host sees it live
        return _held[key]
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK)
    rec = dict(_me(), job=secrets.token_hex(8), since=time.time())
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            other, mtime = _read(path)
            if other is None:
                continue  # released meanwhile
            if writer_alive(other, mtime):
                raise FolderInUseError(
                    f"--save {root} is being written by another {describe(other)}; two jobs must not write one "
                    f"checkpoint folder: give this job its own --save (it may still --load {root}), or, if that "
                    f"job is gone, remove {path}") from None
            # The holder is gone: move its lock aside (one taker wins the rename) and retry.
            try:
                os.replace(path, f"{path}.stale-{os.getpid()}")
                os.unlink(f"{path}.stale-{os.getpid()}")
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
        _held[key] = rec
        atexit.register(release, root)
        return rec
    raise FolderInUseError(f"--save {root}: could not take {path} (another job keeps replacing it)")


def release(root: str) -> None:
    rec = _held.pop(os.path.realpath(root), None)
    path = os.path.join(root, LOCK)
    if rec is not None:
        cur, _ = _read(path)
        if cur and cur.get("job") == rec["job"]:
            try:
                os.unlink(path)
            except OSError:
                pass


def holds(root: str) -> bool:
    rec = _held.get(os.path.realpath(root))
    return rec is not None and rec["pid"] == os.getpid()


def mark_saving(folder: str) -> None:
    """Rank 0, before any rank writes `folder`: mark it as this job's save in progress."""
    rec = _held.get(os.path.realpath(os.path.dirname(folder.rstrip("/"))))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(rec or dict(_me(), job=None, since=time.time()), f)


def unmark(folder: str) -> None:
    try:
        os.unlink(os.path.join(folder, MARKER))
    except FileNotFoundError:
        pass


def abandoned_save(folder: str) -> bool:
    """True when `folder` carries the marker of a save whose writer is gone (never for a folder
    without a marker, nor for one this process or another live job is writing)."""
    rec, mtime = _read(os.path.join(folder, MARKER))
    if rec is None:
        return False
    mine = any(rec.get("job") == h["job"] for h in _held.values()) and rec.get("pid") == os.getpid()
    return not mine and not writer_alive(rec, mtime)
