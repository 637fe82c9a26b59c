"""Ctrl-C during a run: one line per node and exit status 130, not a traceback from every rank.

A Ctrl-C in a terminal sends SIGINT to the whole foreground process group: torchrun and every
worker. torchrun then sends each worker a second SIGINT. The first one raises KeyboardInterrupt
as usual; the copy that follows within a second is ignored so the shutdown (process group,
heartbeat) is not interrupted halfway. A later, deliberate Ctrl-C quits at once. A rank whose
peer stopped first usually sees its collective fail (connection closed) before its own SIGINT
is delivered: once a SIGINT has been received, that failure is reported as the interruption too.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Optional

_REPEAT_S = 1.0  # torchrun's forwarded copy arrives within milliseconds of the terminal's SIGINT
_state: dict = {"at": None, "previous": None, "defer": 0, "pending": False}


def _handler(signum, frame):
    now = time.monotonic()
    if _state["at"] is None:
        _state["at"] = now
        if _state["defer"]:
            _state["pending"] = True  # raised when the deferred section ends
            return
        raise KeyboardInterrupt
    if now - _state["at"] > _REPEAT_S:
        os._exit(130)  # a second Ctrl-C while shutting down: stop now, quietly


def install() -> None:
    """Handle SIGINT as above until `uninstall()` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state["at"] = None
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return  # started with SIGINT ignored (nohup, `cmd &` in a script): keep it so
    _state["previous"] = signal.signal(signal.SIGINT, _handler)


def uninstall() -> None:
    if _state["previous"] is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _state["previous"])
        _state["previous"] = None


@contextmanager
def deferred():
    """A checkpoint being written finishes before a Ctrl-C takes effect: it is then complete,
    named and verifiable, instead of a temporary the next run has to clean up (the ranks of a
    save wait for each other, so every rank finishes it). A second, deliberate Ctrl-C still
    quits at once."""
    _state["defer"] += 1
    try:
        yield
    except BaseException:
        _state["defer"] -= 1
        raise
    _state["defer"] -= 1
    if not _state["defer"] and _state["pending"]:
        _state["pending"] = False
        raise KeyboardInterrupt


def received() -> bool:
    """True once this process got a SIGINT since `install()`."""
    return _state["at"] is not None


def last_checkpoint(save_dir: Optional[str]) -> str:
    if not save_dir:
        return "no checkpoint saved (no --save)"
    from megatron.checkpointing.torch_format import read_tracker
    try:
        it = read_tracker(save_dir)
    except Exception:  # noqa: BLE001 - an unreadable tracker is reported as none
        it = None
    if it is None:
        return f"no checkpoint saved yet in {save_dir}"
    return f"last checkpoint: iteration {it} in {save_dir}"


def report(save_dir: Optional[str], trainer=None) -> int:
    """Print the one line (local rank 0 of each node) and return the exit status 130."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        where = f"at iteration {trainer.iteration + 1}" if trainer is not None else "during start-up"
        print(f"interrupted {where}; {last_checkpoint(save_dir)}", file=sys.stderr, flush=True)
    return 130
