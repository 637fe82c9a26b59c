"""Checkpoints in Megatron's layout, written atomically, checksummed and validated on load.

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000100/mp_rank_XX[_YYY]/model_optim_rng.pt          (XX = TP rank, YYY = PP rank)
    <dir>/iter_0000100/mp_rank_XX[_YYY]/model_optim_rng.pt.sha256   (checksum, written after the file)
    <dir>/iter_0000100/manifest.json                                (every file + sha256; marks it complete)

What a checkpoint guarantees:
- Each file is written to a temporary name, fsynced, renamed, and its directory fsynced, so a
  crash or power loss at any point leaves either the old or the new file, never a torn one.
- The manifest is written after every rank has finished (barrier), and the tracker moves only
  after the manifest: the tracker never names an incomplete checkpoint.
- Loading verifies each rank's file against its checksum. A corrupted or missing file makes
  every rank fall back, together, to the newest older checkpoint that verifies, with a loud
  message naming the file; if none verifies, loading fails. It never trains on corrupted state.
- Stray temporaries of killed writers and iteration folders that a killed save left incomplete
  (marked `.saving.json` by a writer that is gone) are removed by the next job writing the same
  --save; a job that only reads never changes the folder, and two jobs never write one folder
  (megatron/checkpointing/ownership.py).
- Files get the mode a plain write would (0666 minus the umask), so a team can read them.
Loading also compares the saved configuration with the current one and names every mismatch
with its flag.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import sys
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron import safe_paths
from megatron.atomic import atomic_open, fsync_dir as _fsync_dir
from megatron.checkpointing import contents as checkpoint_contents
from megatron.checkpointing import ownership as checkpoint_ownership
from megatron.checkpointing import moe_experts
from megatron.checkpointing import megatron_legacy as checkpoint_megatron_legacy
from megatron.checkpointing import mcore_dist as checkpoint_mcore_dist
from megatron.checkpointing import megatron_write as checkpoint_megatron_write
from megatron.checkpointing import dist_format as checkpointing_dist
from megatron.checkpointing.cleanup import _ITER_RE, _STAGED_RE, _TMP_PREFIX, MANIFEST, remove_stale_files  # noqa: F401
from megatron.checkpointing.hints import (MUST_MATCH, _saved_layout, convert_hint, missing_load_dir_message,  # noqa: F401
                                         vocab_mismatch)
from megatron.checkpointing.safety import UnsafeCheckpointError, numpy_rng_from_plain, numpy_rng_to_plain, safe_load
from megatron.core.comm_device import comm_tensor
from megatron.core.tensor_parallel.random import get_rng_tracker

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


class CheckpointError(RuntimeError):
    pass


def checkpoint_path(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    sub = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(root, f"iter_{iteration:07d}", sub, "model_optim_rng.pt")



class _HashingWriter:
    """File wrapper that hashes what passes through, so a checkpoint is read from disk only once."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()

    def write(self, b):
        self.h.update(b)
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def _atomic_write_bytes(path: str, write_fn) -> str:
    """Write via a temporary file + fsync + rename + directory fsync; returns the sha256 hex digest."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # The writer's host and pid in the name let a later run tell a dead writer's leftovers apart.
    prefix = f"{_TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-"
    with atomic_open(path, "wb", suffix="", prefix=prefix, fsync=True) as f:
        w = _HashingWriter(f)
        write_fn(w)
    return w.h.hexdigest()


def _sha256_file(path: str) -> str:
    return checkpointing_dist.sha256_digest(path).hex()


def claim_and_clean(ps, root: str) -> None:
    """Every rank of a job that writes `root`: rank 0 takes the folder's writer lock (a second
    job writing it is refused, named) and removes its predecessors' leftovers; all ranks agree."""
    problem = None
    if ps.rank == 0:
        try:
            checkpoint_ownership.claim(root)
            for gone in remove_stale_files(root):
                print(f"checkpoint: removed {gone} (left by an interrupted save of this project)", flush=True)
        except checkpoint_ownership.FolderInUseError as e:
            problem = f"{ps.describe()}: {e}"
    if not _all_ok(problem is None):
        raise CheckpointError(problem or f"{ps.describe()}: rank 0 could not take --save {root} (its error names why)")


def rng_state() -> dict:
    # Plain values only (no numpy arrays), so the file loads with torch.load(weights_only=True).
    return {"random": random.getstate(), "numpy": numpy_rng_to_plain(np.random.get_state()),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_rng_tracker().get_states()}


def set_rng_state(st: dict) -> None:
    random.setstate(st["random"])
    np.random.set_state(numpy_rng_from_plain(st["numpy"]))
    torch.set_rng_state(st["torch"])
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
    get_rng_tracker().set_states(st["tracker"])


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _all_ok(ok: bool) -> bool:
    """True only if `ok` holds on every rank (so all ranks take the same branch)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    t = comm_tensor([1 if ok else 0], dtype=torch.int64)  # NCCL takes CUDA tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _checkpoint_files(root: str, iteration: int) -> list:
    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    out = []
    for dirpath, _dirs, files in os.walk(it_dir):
        for f in files:
            if f == "model_optim_rng.pt":
                out.append(os.path.relpath(os.path.join(dirpath, f), it_dir))
    return sorted(out)


def _write_manifest(root: str, iteration: int) -> None:
    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    entries = {}
    for rel in _checkpoint_files(root, iteration):
        full = os.path.join(it_dir, rel)
        with open(full + ".sha256") as f:
            digest = f.read().split()[0]
        entries[rel] = {"sha256": digest, "bytes": os.path.getsize(full)}
    body = json.dumps({"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION, "files": entries},
                      indent=1, sort_keys=True).encode()
    _atomic_write_bytes(os.path.join(it_dir, MANIFEST), lambda f: f.write(body))


def save_checkpoint(trainer, root: Optional[str] = None) -> str:
    cfg, ps = trainer.cfg, trainer.ps
    root = root or cfg.checkpoint.save
    if getattr(cfg.checkpoint, "ckpt_format", "torch") == "torch_dist":
        return _save_dist(trainer, root)
    if cfg.checkpoint.ckpt_format == "megatron-legacy":  # what Megatron-LM's own --load reads
        from types import SimpleNamespace
        try:  # (MegatronCheckpointError is a ValueError) a layout the writer cannot map: one line, the run stops
            return checkpoint_megatron_write.save_from_trainer(trainer, root, SimpleNamespace(
                atomic_write=_atomic_write_bytes, barrier=_barrier, move_tracker=_move_tracker,
                write_error=_write_error, claim_and_clean=claim_and_clean, mark_saving=checkpoint_ownership.mark_saving,
                unmark=checkpoint_ownership.unmark))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(checkpoint_megatron_write.save_failed(ps, root, trainer.iteration, e,
                                                                        read_tracker)) from None
    path = checkpoint_path(root, trainer.iteration, ps.tp_rank, ps.pp_rank, ps.pp_size)
    try:
        state = collect_state(trainer, root, path)
        if state is not None:
            write_rank_file(path, state)
        finalize(ps, root, trainer.iteration, path)
    except OSError as e:
        raise _write_error(ps, root, e) from e
    return path


def collect_state(trainer, root: str, path: str) -> Optional[dict]:
    """Every rank (collective): claim --save, mark the iteration folder as a save in progress and
    gather what this rank's file holds; None on the ranks that write no file. The tensors are the
    live ones (the model's and optimizer's own): write them before the next step, or copy them."""
    cfg, ps = trainer.cfg, trainer.ps
    claim_and_clean(ps, root)
    if ps.rank == 0:
        checkpoint_ownership.mark_saving(os.path.dirname(os.path.dirname(path)))
    _barrier()
    opt_state = trainer.optimizer.state_dict()
    if getattr(trainer.optimizer, "reduces_data_parallel_grads", False) and ps.grad_size > 1:
        # Distributed optimizer: gather every DP (x CP) rank's shard (with its range) into the
        # file, so a run with another DP or CP size can take its own ranges from it.
        shards = [None] * ps.grad_size
        dist.all_gather_object(shards, opt_state, group=ps.grad_group)
        opt_state = shards
    # Every rank: an extra state may gather across data parallelism (collective).
    extras = {key: obj.state_dict() for key, obj in getattr(trainer, "extra_checkpoint_state", {}).items()}
    model_state = {sid: m.state_dict() for sid, m in trainer.stages.items()}
    if cfg.model.moe is not None:  # every rank: the EP group's experts into DP rank 0's file
        moe_experts.gather_experts(trainer, model_state, opt_state)
    if ps.dp_rank != 0 or ps.cp_rank != 0:  # CP ranks hold the same weights: one writes
        return None
    state = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "config": cfg.to_dict(),
        "iteration": trainer.iteration,
        "consumed_samples": trainer.consumed_samples,
        "skipped_iters": trainer.skipped_iters,
        "consumed_tokens": getattr(trainer, "consumed_tokens", 0),
        "logger": trainer.logger.state_dict() if hasattr(trainer.logger, "state_dict") else {},
        "model": model_state,
        "optimizer": opt_state,
        "opt_param_scheduler": trainer.lr_scheduler.state_dict(),
        "rng_state": rng_state(),
    }
    state.update(extras)
    return state


def write_rank_file(path: str, state: dict) -> None:
    """This rank's file, then its checksum beside it (the checksum's presence means the file is whole)."""
    digest = _atomic_write_bytes(path, lambda f: torch.save(state, f))
    _atomic_write_bytes(path + ".sha256", lambda f: f.write(f"{digest}  model_optim_rng.pt\n".encode()))


def finalize(ps, root: str, iteration: int, path: str) -> None:
    """Every rank (collective), once every rank's file is written: rank 0 writes the manifest,
    which marks the iteration complete, and only then moves the tracker to it."""
    _barrier()
    if ps.rank == 0:
        name_checkpoint(ps, root, iteration, path)
    _barrier()


def name_checkpoint(ps, root: str, iteration: int, path: str) -> None:
    """Rank 0, once every rank's file and checksum are on disk: manifest, then the tracker."""
    _write_manifest(root, iteration)
    checkpoint_ownership.unmark(os.path.dirname(os.path.dirname(path)))
    _move_tracker(root, iteration)
    from megatron.checkpointing.hints import note_torch_format
    note_torch_format(root, ps.tp_size, ps.pp_size, _atomic_write_bytes)


def _move_tracker(root: str, iteration: int, fmt: str = "") -> None:
    """Rank 0, last step of both save formats (after the iteration's manifest, so the tracker
    never names an incomplete checkpoint): point the tracker at `iteration`, atomically (a
    reader sees the old number or the new one), and say so."""
    _atomic_write_bytes(os.path.join(root, TRACKER), lambda f: f.write(f"{iteration}\n".encode()))
    print(f"saved checkpoint{f' ({fmt})' if fmt else ''} at iteration {iteration} to {root}", flush=True)


def _write_error(ps, root: str, e: OSError) -> CheckpointError:
    return CheckpointError(f"{ps.describe()}: cannot write checkpoint under --save {root}: "
                           f"{e.strerror or e} ({e.filename or root}); check the folder exists, is "
                           f"writable and has free space")


def _common_state(trainer) -> dict:
    opt = trainer.optimizer
    return {"checkpoint_version": CHECKPOINT_VERSION, "format": "torch_dist",
            "config": json.loads(json.dumps(trainer.cfg.to_dict(), default=str)),
            "iteration": trainer.iteration, "consumed_samples": trainer.consumed_samples,
            "skipped_iters": trainer.skipped_iters, "consumed_tokens": getattr(trainer, "consumed_tokens", 0),
            "logger": trainer.logger.state_dict() if hasattr(trainer.logger, "state_dict") else {},
            "opt_param_scheduler": trainer.lr_scheduler.state_dict(),
            "grad_scaler": opt.grad_scaler.state_dict() if getattr(opt, "grad_scaler", None) else None}


def _save_dist(trainer, root: str) -> str:
    """--ckpt-format torch_dist: DCP shards from every rank, then (rank 0) common.json, the
    manifest and the tracker, in that order, so the tracker never names an incomplete folder."""
    ps = trainer.ps
    it_dir = os.path.join(root, f"iter_{trainer.iteration:07d}")
    # A complete save of this iteration may exist (a final save after an interval save): the new
    # one is written beside it and swapped in by two renames, so a crash never leaves neither.
    try:
        claim_and_clean(ps, root)
        restage = comm_tensor([int(ps.rank == 0 and os.path.isdir(it_dir))])  # decided after the cleanup
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(restage, 0)  # (one rank's view: a rank may not see the marked folder yet)
        stage = it_dir + ".saving" if restage.item() else it_dir
        if ps.rank == 0:
            checkpoint_ownership.mark_saving(stage)
        _barrier()
        checkpointing_dist.save(trainer, stage)
        _barrier()
        files = checkpointing_dist.file_digests(stage, checkpointing_dist.shard_files(stage), ps.rank,
                                                ps.world_size if dist.is_initialized() else 1)
        if ps.rank == 0:
            body = checkpointing_dist.common_bytes(trainer, _common_state(trainer))
            _atomic_write_bytes(os.path.join(stage, checkpointing_dist.COMMON), lambda f: f.write(body))
            files[checkpointing_dist.COMMON] = {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
            man = json.dumps({"iteration": trainer.iteration, "checkpoint_version": CHECKPOINT_VERSION,
                              "format": "torch_dist", "files": files}, indent=1, sort_keys=True).encode()
            _atomic_write_bytes(os.path.join(stage, MANIFEST), lambda f: f.write(man))
            checkpoint_ownership.unmark(stage)
            if stage != it_dir:
                os.replace(it_dir, it_dir + ".replaced")
                os.replace(stage, it_dir)
                _fsync_dir(root)
                shutil.rmtree(it_dir + ".replaced", ignore_errors=True)
            _move_tracker(root, trainer.iteration, "torch_dist")
        _barrier()
    except OSError as e:
        raise _write_error(ps, root, e) from e
    return it_dir


def _load_dist(trainer, root: str, tracked: int) -> bool:
    """The newest torch_dist checkpoint at or below the tracked iteration that verifies (every
    rank checks a share of its files against the manifest; all agree), as the torch format does."""
    ps = trainer.ps
    first = None
    for iteration in [tracked] + _older_complete_iterations(root, tracked):
        problem = checkpointing_dist.verify(os.path.join(root, f"iter_{iteration:07d}"), MANIFEST, ps.rank,
                                            ps.world_size)
        if _all_ok(problem is None):
            if iteration != tracked and ps.rank == 0:
                print(f"WARNING: loading iteration {iteration} instead of the tracked iteration {tracked}, whose "
                      f"files do not verify; training resumes from the older state", file=sys.stderr, flush=True)
            return _read_dist(trainer, root, iteration)
        if problem:
            print(f"CHECKPOINT CORRUPT: {ps.describe()}: {problem}", file=sys.stderr, flush=True)
            first = first or problem
    raise CheckpointError(f"{ps.describe()}: no torch_dist checkpoint under --load {root} verifies (tracked iteration "
                          f"{tracked} and every older complete one failed; {first or 'see the other ranks'})")


def _read_dist(trainer, root: str, iteration: int) -> bool:
    cfg, ps = trainer.cfg, trainer.ps
    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    try:
        common = checkpointing_dist.read_common(it_dir)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    current = json.loads(json.dumps(cfg.to_dict(), default=str))
    # Only the model's shape must match: the layout is free (that is what the format is for).
    problems = [f"{flag}: checkpoint has {common['config'].get(sec, {}).get(key)}, "
                f"this run has {current.get(sec, {}).get(key)}" if key != "vocab_size"
                else vocab_mismatch(common["config"], current, flag)
                for sec, key, flag in MUST_MATCH if sec == "model"
                and common["config"].get(sec, {}).get(key) != current.get(sec, {}).get(key)]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(f"checkpoint {it_dir} does not match this run:\n  " + "\n  ".join(problems))
    load_optim = not cfg.checkpoint.no_load_optim and not cfg.checkpoint.finetune
    try:
        checkpointing_dist.load(trainer, it_dir, common, load_optim,
                                not cfg.checkpoint.no_load_rng and not cfg.checkpoint.finetune,
                                not cfg.checkpoint.finetune)
        problem = None
    except (ValueError, RuntimeError, TypeError, KeyError, IndexError) as e:  # forged contents: one line
        problem = (f"cannot read torch_dist checkpoint {it_dir}: "
                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
    checkpoint_contents.agree(ps, problem, f"load its part of {it_dir}", CheckpointError)
    if not cfg.checkpoint.finetune:
        trainer.iteration = common["iteration"]
        trainer.consumed_samples = common["consumed_samples"]
        trainer.skipped_iters = common.get("skipped_iters", 0)
        trainer.consumed_tokens = common.get("consumed_tokens", 0)
        if hasattr(trainer.logger, "load_state_dict"):
            trainer.logger.load_state_dict(common.get("logger", {}))
        if load_optim:
            trainer.lr_scheduler.load_state_dict(common["opt_param_scheduler"])
            gs = getattr(trainer.optimizer, "grad_scaler", None)
            if gs is not None and common.get("grad_scaler"):
                gs.load_state_dict(common["grad_scaler"])
        else:
            trainer.lr_scheduler.num_steps = trainer.iteration
    _barrier()
    if ps.rank == 0:
        print(f"loaded checkpoint (torch_dist) {root} at iteration {trainer.iteration}", flush=True)
    return True


def read_tracker(root: str) -> Optional[int]:
    tracker = os.path.join(root, TRACKER)
    if not os.path.lexists(tracker):
        return None
    try:  # a FIFO would block, a link to /dev/zero fill memory: refused before any read
        text = safe_paths.read_text(root, TRACKER, safe_paths.TRACKER_BYTES, "tracker file").strip()
    except (OSError, ValueError) as e:
        raise CheckpointError(str(e)) from None
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}; "
                              f"the tracker file is corrupt (fix it or point --load elsewhere)") from None


def config_mismatches(saved: dict, current: dict) -> list:
    out = []
    for section, key, flag in MUST_MATCH:
        a = saved.get(section, {}).get(key)
        b = current.get(section, {}).get(key)
        if key == "vocab_size":
            problem = vocab_mismatch(saved, current, flag)
            out += [problem] if problem else []
        elif a != b:
            out.append(f"{flag}: checkpoint has {a}, this run has {b}")
    return out


def _verify_file(path: str) -> Optional[str]:
    """None when `path` matches its recorded checksum, else why not. Files saved before checksums
    existed (no .sha256 beside them) are accepted as they are."""
    if not os.path.exists(path):
        return "the file is missing"
    side = path + ".sha256"
    if not os.path.exists(side):
        it_dir = os.path.dirname(os.path.dirname(path))
        if os.path.exists(os.path.join(it_dir, MANIFEST)):
            return f"its checksum file {side} is missing"
        return None
    try:
        expected = safe_paths.read_text(os.path.dirname(side), os.path.basename(side), safe_paths.CHECKSUM_BYTES,
                                        "checksum file").split()[0]
    except (OSError, IndexError):
        return f"its checksum file {side} is unreadable"
    actual = _sha256_file(path)
    if actual != expected:
        return f"sha256 {actual[:16]}... does not match the recorded {expected[:16]}... (the file is corrupted)"
    return None


def _listed_in_manifest(root: str, iteration: int, path: str) -> bool:
    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    try:
        files = json.loads(safe_paths.read_text(it_dir, MANIFEST, safe_paths.JSON_BYTES, "manifest"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return os.path.relpath(path, it_dir) in files


def _older_complete_iterations(root: str, below: int) -> list:
    out = []
    for name in os.listdir(root):
        m = _ITER_RE.match(name)
        if m and int(m.group(1)) < below and os.path.exists(os.path.join(root, name, MANIFEST)):
            out.append(int(m.group(1)))
    return sorted(out, reverse=True)


def load_checkpoint(trainer, root: Optional[str] = None) -> bool:
    """Load the latest checkpoint under `root` (--load) that verifies. Returns False if there is none.

    Every rank verifies its own file; if any rank's file is corrupt or missing, all ranks fall back
    together to the newest older complete checkpoint, and the bad file is named loudly."""
    cfg, ps = trainer.cfg, trainer.ps
    root = root or cfg.checkpoint.load
    missing = missing_load_dir_message(root, cfg.checkpoint.save)
    if missing:
        raise CheckpointError(missing)
    if cfg.checkpoint.save:  # the job that writes --save cleans it; a reader never changes --load
        claim_and_clean(ps, cfg.checkpoint.save)
    tracked = read_tracker(root)
    if tracked is None:
        if ps.rank == 0:
            print(f"warning: no {TRACKER} under --load {root}; starting from scratch", flush=True)
        return False
    refused = safe_paths.first_refusal(root, [f"iter_{tracked:07d}", "release"], regular=False)
    if refused:  # every rank sees the same folder: all raise together
        raise CheckpointError(f"{ps.describe()}: {refused}")
    # Written by Megatron-LM itself: its torch formats, or Megatron-Core's torch_dist.
    try:
        megatron_reader = checkpoint_megatron_legacy if checkpoint_megatron_legacy.detect(root) else \
            checkpoint_mcore_dist if checkpoint_mcore_dist.detect(root) else None
    except OSError as e:  # a rank folder or file that is a link or a special file
        raise CheckpointError(f"{ps.describe()}: {e}") from None
    if megatron_reader is not None:
        try:
            from megatron.checkpointing import megatron_optim
            if megatron_reader is checkpoint_megatron_legacy:
                return checkpoint_megatron_legacy.load_into_trainer(trainer, root, training_state=megatron_optim)
            return megatron_reader.load_into_trainer(trainer, root)
        except (checkpoint_megatron_legacy.MegatronCheckpointError, UnsafeCheckpointError, OSError) as e:
            raise CheckpointError(f"{ps.describe()}: {e}") from None
    if checkpointing_dist.is_dist_checkpoint(os.path.join(root, f"iter_{tracked:07d}")):
        return _load_dist(trainer, root, tracked)
    iteration, path = tracked, None
    for iteration in [tracked] + _older_complete_iterations(root, tracked):
        path = checkpoint_path(root, iteration, ps.tp_rank, ps.pp_rank, ps.pp_size)
        rel = os.path.relpath(path, root)  # a link (iter_N, the file, its .sha256) is refused, not followed
        refused = safe_paths.first_refusal(root, [rel, rel + ".sha256"])
        if not _all_ok(refused is None):
            raise CheckpointError(f"{ps.describe()}: {refused or 'another rank refused its checkpoint file'}")
        problem = _verify_file(path)
        not_in_layout = (problem is not None and not os.path.exists(path)
                         and not _listed_in_manifest(root, iteration, path))
        if not _all_ok(not not_in_layout):
            # A layout mismatch, not corruption: falling back would only hide the real problem.
            it_dir = os.path.join(root, f"iter_{iteration:07d}")
            hint = ""
            if os.path.isdir(it_dir):
                hint = f" (it holds {sorted(os.listdir(it_dir))}: was it saved with another TP/PP layout?)"
            what = f"checkpoint file {path} is missing{hint}" if not_in_layout else \
                f"another rank's checkpoint file under {it_dir} is missing (was it saved with another TP/PP layout?)"
            if _saved_layout(it_dir) not in (None, (ps.tp_size, ps.pp_size)) and cfg.parallel.stage_parallel is None:
                what += "; " + convert_hint(root, iteration, ps.tp_size, ps.pp_size)
            raise CheckpointError(f"{ps.describe()}: {what}")
        if problem is not None:
            print(f"CHECKPOINT CORRUPT: {ps.describe()}: {path}: {problem}", file=sys.stderr, flush=True)
        if _all_ok(problem is None):
            break
        if ps.rank == 0:
            print(f"CHECKPOINT: iteration {iteration} under {root} failed verification on at least one rank; "
                  f"trying an older complete checkpoint", file=sys.stderr, flush=True)
    else:
        raise CheckpointError(f"{ps.describe()}: no checkpoint under --load {root} verifies (tracked iteration "
                              f"{tracked} and every older complete one failed); see the CHECKPOINT CORRUPT lines")
    if iteration != tracked and ps.rank == 0:
        print(f"WARNING: loading iteration {iteration} instead of the tracked iteration {tracked}, whose files are "
              f"corrupt; training resumes from the older state", file=sys.stderr, flush=True)
    problem, state = None, None
    try:
        state = safe_load(path)
    except UnsafeCheckpointError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - truncated or foreign file without a checksum
        problem = f"cannot read checkpoint {path}: {checkpoint_contents.one_line(e)}"
    problem = problem or checkpoint_contents.structure_problem(state, path)
    if not problem and cfg.model.moe is not None:
        try:  # the file holds every expert: keep this EP rank's
            moe_experts.slice_experts(trainer, state)
        except (KeyError, ValueError) as e:
            problem = f"checkpoint {path}: {e}"
    mismatch = [] if problem else config_mismatches(state["config"], cfg.to_dict())
    if any(p.startswith(("--tensor-model", "--pipeline-model-parallel-size")) for p in mismatch) \
            and cfg.parallel.stage_parallel is None:
        mismatch.append(convert_hint(root, iteration, ps.tp_size, ps.pp_size))
    if mismatch:
        problem = f"checkpoint {path} does not match this run:\n  " + "\n  ".join(mismatch)
    problem = problem or checkpoint_contents.load_models(trainer, state, path)
    checkpoint_contents.agree(ps, problem, f"load its checkpoint under --load {root}", CheckpointError)
    try:
        checkpoint_contents.apply_state(trainer, state, path, set_rng_state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as e:
        problem = (f"checkpoint {path}: its counters, optimizer or RNG state do not fit "
                   f"({checkpoint_contents.one_line(e)})")
    checkpoint_contents.agree(ps, problem, f"load its checkpoint under --load {root}", CheckpointError)
    _barrier()
    if ps.rank == 0:
        print(f"loaded checkpoint {root} at iteration {trainer.iteration}", flush=True)
    return True
