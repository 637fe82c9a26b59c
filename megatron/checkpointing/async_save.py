"""--async-save: training goes on while the checkpoint files are written (--ckpt-format torch).

A save has three steps:
1. every rank gathers its state, exactly as a synchronous save does (collective: the
   distributed optimizer's shards, MoE experts), and copies it to host memory, because the next
   step changes the parameters and the Adam moments in place;
2. a writer thread writes the copy with the synchronous save's writer (temporary file, fsync,
   rename, then the .sha256 beside it) while the main thread trains on;
3. finalize (rank-collective, as Megatron-LM's `maybe_finalize_async_save`): after each step
   while a save is pending, the ranks agree whether every writer is done; once all are, rank 0
   writes the manifest and only then moves the tracker.

So the tracker never names a checkpoint whose files or manifest are incomplete; until it moves,
the iteration folder carries the `.saving.json` marker, and a process killed mid-write leaves
the previous checkpoint named (the next job writing --save removes the unfinished folder, as
after a killed synchronous save). A second save first waits for the one in flight; the end of
training (also after --exit-interval and --exit-duration-in-mins) waits and finalizes. After
Ctrl-C each rank finishes its own file and rank 0 names the checkpoint if every rank's checksum
file appears within `INTERRUPT_WAIT_S` (no collective: a peer may be gone).
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.checkpointing import contents as checkpoint_contents
from megatron.checkpointing import torch_format

ATTR = "async_checkpoint"  # the trainer's save in flight (a _Pending), or None
INTERRUPT_WAIT_S = 60.0


@dataclass
class _Pending:
    iteration: int
    root: str
    path: str
    expected: List[str]  # every writing rank's file, relative to root
    thread: Optional[threading.Thread] = None
    error: Optional[BaseException] = None


def host_copy(obj, memo: Optional[dict] = None):
    """A copy of `obj` whose tensors are new host tensors (a tensor reached twice, such as a tied
    weight, is copied once and stays shared, as torch.save keeps it)."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}  # (state_dicts are OrderedDicts)
        for k, v in obj.items():
            out[k] = host_copy(v, memo)
        if hasattr(obj, "_metadata"):  # a module state_dict's versions, read by load_state_dict
            out._metadata = obj._metadata
        return out
    if type(obj) in (list, tuple):
        return type(obj)(host_copy(v, memo) for v in obj)
    return obj  # numbers, strings, None: immutable; the config and counters are fresh objects


def _write(pending: _Pending, state: dict) -> None:
    try:
        torch_format.write_rank_file(pending.path, state)
    except BaseException as e:  # noqa: BLE001 - reported by finalize, on every rank together
        pending.error = e


def save_checkpoint_async(trainer, root: Optional[str] = None) -> str:
    """Every rank: steps 1 and 2 of an asynchronous save; returns this rank's file path."""
    cfg, ps = trainer.cfg, trainer.ps
    root = root or cfg.checkpoint.save
    if cfg.checkpoint.ckpt_format != "torch":
        raise torch_format.CheckpointError(f"--async-save writes --ckpt-format torch only, not "
                                           f"{cfg.checkpoint.ckpt_format}: drop --async-save")
    maybe_finalize(trainer, blocking=True)  # a save in flight completes (and is named) first
    path = torch_format.checkpoint_path(root, trainer.iteration, ps.tp_rank, ps.pp_rank, ps.pp_size)
    try:
        state = torch_format.collect_state(trainer, root, path)
    except OSError as e:
        raise torch_format._write_error(ps, root, e) from e
    snapshot = host_copy(state) if state is not None else None
    mine = [os.path.relpath(path, root)] if state is not None else []
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        mine = sorted({p for part in every for p in part})
    pending = _Pending(trainer.iteration, root, path, mine)
    if snapshot is not None:
        pending.thread = threading.Thread(target=_write, args=(pending, snapshot), daemon=True,
                                          name=f"checkpoint-writer-iter{trainer.iteration}")
        pending.thread.start()
    setattr(trainer, ATTR, pending)
    return path


def maybe_finalize(trainer, blocking: bool = False) -> bool:
    """Every rank, at the same points (a save is pending on all ranks or on none): when every
    rank's writer is done (`blocking`: wait for it), name the checkpoint. True if one was named."""
    pending = getattr(trainer, ATTR, None)
    if pending is None:
        return False
    ps = trainer.ps
    if blocking and pending.thread is not None:
        pending.thread.join()
    done = pending.thread is None or not pending.thread.is_alive()
    if not torch_format._all_ok(done):
        return False
    setattr(trainer, ATTR, None)
    problem = None
    if pending.error is not None:
        e = pending.error
        problem = str(torch_format._write_error(ps, pending.root, e)) if isinstance(e, OSError) else \
            f"cannot write checkpoint {pending.path}: {checkpoint_contents.one_line(e)}"
    checkpoint_contents.agree(ps, problem, f"write its checkpoint file of iteration {pending.iteration}",
                              torch_format.CheckpointError)
    try:
        torch_format.finalize(ps, pending.root, pending.iteration, pending.path)
    except OSError as e:
        raise torch_format._write_error(ps, pending.root, e) from e
    return True


def finish_after_interrupt(trainer) -> None:
    """After Ctrl-C (no collective: a peer may have stopped): finish this rank's file; rank 0
    names the checkpoint once every rank's checksum file is there (each rank writes its checksum
    after its whole file), or says why not within INTERRUPT_WAIT_S."""
    pending = getattr(trainer, ATTR, None) if trainer is not None else None
    if pending is None:
        return
    setattr(trainer, ATTR, None)
    if pending.thread is not None:
        pending.thread.join()
    ps = trainer.ps
    if ps.rank != 0 or pending.error is not None:
        return
    deadline = time.monotonic() + INTERRUPT_WAIT_S
    missing = pending.expected
    while True:
        missing = [p for p in missing if not os.path.exists(os.path.join(pending.root, p + ".sha256"))]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if missing:
        print(f"checkpoint of iteration {pending.iteration} not named: {missing[0]} was still being written "
              f"when training stopped (the next run writing {pending.root} removes it)", file=sys.stderr, flush=True)
        return
    try:
        torch_format.name_checkpoint(ps, pending.root, pending.iteration, pending.path)
    except OSError as e:
        print(str(torch_format._write_error(ps, pending.root, e)), file=sys.stderr, flush=True)
