"""The fused-kernel build's lock: one builder per extension, a dead builder's lock taken over.

torch's `cpp_extension.load` guards a build folder with an empty file named `lock` and waits,
silently and without limit, while it exists. A build killed midway (kill -9, a closed terminal)
leaves it behind and every later run would wait forever. So the build takes its own lock first,
`<cache>/<name>.building`, holding the builder's pid, host and start time:

* no lock: create it (O_EXCL) and build; a torch `lock` found in the build folder then can only
  be a dead builder's (a live one would hold ours), so it is removed with one line;
* a lock whose process is gone (same host, pid not running), or, from another host whose pids
  cannot be checked, older than the wait bound: taken over with one line;
* a live builder's lock: waited for, with a line every `progress_s`, until its `.ok` stamp
  appears (its build is then used) or the bound passes (a TimeoutError naming the lock file).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Optional


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_owner(lock: Path) -> Optional[dict]:
    """The lock's owner record, or None when the file is gone; {} when unreadable (being written)."""
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        owner = json.loads(text)
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def stale_reason(lock: Path, owner: dict, bound_s: float) -> Optional[str]:
    """Why the lock's owner cannot be building any more, or None if it may be."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    pid, host = owner.get("pid"), owner.get("host")
    if isinstance(pid, int) and host == socket.gethostname():  # a pid we can check
        return None if _alive(pid) else f"process {pid} on {host} is not running"
    if not owner and age > 10:  # an empty or garbled record that nobody finished writing
        return f"unreadable owner record, {age:.0f}s old"
    if age > bound_s:
        return f"held by pid {pid} on {host} for {age:.0f}s, past the {bound_s:.0f}s bound"
    return None


def _try_create(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, f)
    return True


def acquire(lock: Path, done: Callable[[], bool], bound_s: float, progress_s: float = 30.0,
            poll_s: float = 0.5) -> bool:
    """Take `lock` (True), or return False once another builder's `done()` holds; raises
    TimeoutError after `bound_s` seconds of waiting for a live builder."""
    start = last_report = time.time()
    while True:
        if _try_create(lock):
            return True
        owner = read_owner(lock)
        if owner is None:
            continue  # released between our attempt and the read: try again at once
        if done():
            return False
        reason = stale_reason(lock, owner, bound_s)
        if reason:
            _say(f"fused kernels: taking over the build lock {lock} ({reason})")
            lock.unlink(missing_ok=True)
            continue
        waited = time.time() - start
        if waited > bound_s:
            raise TimeoutError(
                f"waited {waited:.0f}s for pid {owner.get('pid')} on {owner.get('host')} to build the fused kernels "
                f"(lock {lock}); if no such build is running, delete that file, or raise MEGATRON_FUSED_KERNELS_WAIT")
        if time.time() - last_report >= progress_s:
            last_report = time.time()
            _say(f"fused kernels: waiting {waited:.0f}s for pid {owner.get('pid')} on {owner.get('host')} "
                 f"to finish building (lock {lock}, limit {bound_s:.0f}s)")
        time.sleep(poll_s)


def release(lock: Path) -> None:
    owner = read_owner(lock)
    if owner and owner.get("pid") == os.getpid():
        lock.unlink(missing_ok=True)


def clear_torch_lock(build_dir: Path) -> None:
    """Remove torch's own `lock` left in build_dir by a dead build (call only while holding ours)."""
    torch_lock = build_dir / "lock"
    if torch_lock.exists():
        _say(f"fused kernels: removing {torch_lock} left by an interrupted build")
        torch_lock.unlink(missing_ok=True)
