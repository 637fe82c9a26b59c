"""Checkpoints in Megatron's layout, written atomically and validated on load.

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000100/mp_rank_XX[_YYY]/model_optim_rng.pt     (XX = TP rank, YYY = PP rank)

Each file is written to a temporary name, fsynced and renamed; the tracker file moves to the
new iteration only after every rank has finished (barrier), so a crash at any point of a save
leaves the previous checkpoint loadable. Loading compares the saved configuration with the
current one and names every mismatch with its flag.
"""
from __future__ import annotations

import os
import random
import tempfile
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.random import get_rng_tracker

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0

# (config section, field, flag) that must match between a checkpoint and the run loading it.
MUST_MATCH = [
    ("model", "model_type", "model type (pretrain_gpt.py vs pretrain_t5.py)"),
    ("model", "num_layers", "--num-layers"),
    ("model", "encoder_num_layers", "--encoder-num-layers"),
    ("model", "decoder_num_layers", "--decoder-num-layers"),
    ("model", "hidden_size", "--hidden-size"),
    ("model", "num_attention_heads", "--num-attention-heads"),
    ("model", "ffn_hidden_size", "--ffn-hidden-size"),
    ("model", "kv_channels", "--kv-channels"),
    ("model", "max_position_embeddings", "--max-position-embeddings"),
    ("model", "vocab_size", "--vocab-size / tokenizer vocabulary"),
    ("model", "make_vocab_size_divisible_by", "--make-vocab-size-divisible-by"),
    ("model", "untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("model", "position_embedding_type", "--position-embedding-type"),
    ("parallel", "tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("parallel", "pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("parallel", "num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
    ("parallel", "pipeline_stage_layers", "--pipeline-stage-layers"),
    ("parallel", "pipeline_model_parallel_split_rank", "--pipeline-model-parallel-split-rank"),
]


class CheckpointError(RuntimeError):
    pass


def checkpoint_path(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    sub = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(root, f"iter_{iteration:07d}", sub, "model_optim_rng.pt")


def _atomic_write_bytes(path: str, write_fn) -> None:
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def rng_state() -> dict:
    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_rng_tracker().get_states()}


def set_rng_state(st: dict) -> None:
    random.setstate(st["random"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
    get_rng_tracker().set_states(st["tracker"])


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(trainer, root: Optional[str] = None) -> str:
    cfg, ps = trainer.cfg, trainer.ps
    root = root or cfg.checkpoint.save
    path = checkpoint_path(root, trainer.iteration, ps.tp_rank, ps.pp_rank, ps.pp_size)
    if ps.dp_rank == 0:
        state = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "config": cfg.to_dict(),
            "iteration": trainer.iteration,
            "consumed_samples": trainer.consumed_samples,
            "skipped_iters": trainer.skipped_iters,
            "model": {sid: m.state_dict() for sid, m in trainer.stages.items()},
            "optimizer": trainer.optimizer.state_dict(),
            "opt_param_scheduler": trainer.lr_scheduler.state_dict(),
            "rng_state": rng_state(),
        }
        _atomic_write_bytes(path, lambda f: torch.save(state, f))
    _barrier()
    if ps.rank == 0:
        _atomic_write_bytes(os.path.join(root, TRACKER), lambda f: f.write(f"{trainer.iteration}\n".encode()))
        print(f"saved checkpoint at iteration {trainer.iteration} to {root}", flush=True)
    _barrier()
    return path


def read_tracker(root: str) -> Optional[int]:
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    text = open(tracker).read().strip()
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
        if a != b:
            out.append(f"{flag}: checkpoint has {a}, this run has {b}")
    return out


def load_checkpoint(trainer, root: Optional[str] = None) -> bool:
    """Load the latest checkpoint under `root` (--load). Returns False if there is none."""
    cfg, ps = trainer.cfg, trainer.ps
    root = root or cfg.checkpoint.load
    iteration = read_tracker(root)
    if iteration is None:
        if ps.rank == 0:
            print(f"warning: no {TRACKER} under --load {root}; starting from scratch", flush=True)
        return False
    path = checkpoint_path(root, iteration, ps.tp_rank, ps.pp_rank, ps.pp_size)
    if not os.path.exists(path):
        hint = ""
        it_dir = os.path.join(root, f"iter_{iteration:07d}")
        if os.path.isdir(it_dir):
            hint = f" (it holds {sorted(os.listdir(it_dir))}: was it saved with another TP/PP layout?)"
        raise CheckpointError(f"{ps.describe()}: checkpoint file {path} is missing{hint}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or foreign file
        raise CheckpointError(f"{ps.describe()}: cannot read checkpoint {path}: {e}") from e
    problems = config_mismatches(state.get("config", {}), cfg.to_dict())
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match this run:\n  " + "\n  ".join(problems))
    for sid, m in trainer.stages.items():
        if sid not in state["model"]:
            raise CheckpointError(f"checkpoint {path} has no weights for pipeline stage {sid}")
        m.load_state_dict(state["model"][sid])
    if cfg.checkpoint.finetune:
        _barrier()
        return True
    trainer.iteration = state["iteration"]
    trainer.consumed_samples = state["consumed_samples"]
    trainer.skipped_iters = state.get("skipped_iters", 0)
    if not cfg.checkpoint.no_load_optim:
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.lr_scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        trainer.lr_scheduler.num_steps = trainer.iteration
    if not cfg.checkpoint.no_load_rng:
        set_rng_state(state["rng_state"])
    _barrier()
    if ps.rank == 0:
        print(f"loaded checkpoint {root} at iteration {trainer.iteration}", flush=True)
    return True
