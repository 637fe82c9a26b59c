"""A checkpoint that is well-formed (it unpickles with weights_only, its checksums match) but
does not hold what this project saves: a list for the state dict, no `model`, a string
iteration, a bad RNG state, a tensor of the wrong shape. Each is one line naming the file and
what is wrong, printed by the rank that read it, while every other rank says which rank failed
(they agree in one all-reduce, so nobody waits for a collective the failing rank never joins).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.comm_device import comm_tensor

# What a file of this project holds at the top level, with the type each field must have.
_FIELDS = (("model", dict), ("iteration", int), ("consumed_samples", int), ("config", dict))


def structure_problem(state, path: str) -> Optional[str]:
    """The first way `state` is not a state dict of this project, or None."""
    if not isinstance(state, dict):
        return f"checkpoint {path} holds a {type(state).__name__}, not a state dict"
    for key, t in _FIELDS:
        v = state.get(key)
        if not isinstance(v, t) or isinstance(v, bool):
            return (f"checkpoint {path}: field {key!r} is {'missing' if key not in state else type(v).__name__}, "
                    f"expected {t.__name__}")
    for key in ("skipped_iters", "consumed_tokens"):
        if key in state and (not isinstance(state[key], int) or isinstance(state[key], bool)):
            return f"checkpoint {path}: field {key!r} is {type(state[key]).__name__}, expected int"
    rng = state.get("rng_state")
    if rng is not None and not (isinstance(rng, dict) and {"random", "numpy", "torch", "tracker"} <= set(rng)):
        return f"checkpoint {path}: field 'rng_state' is not the RNG state this project saves"
    return None


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def load_models(trainer, state: dict, path: str) -> Optional[str]:
    """Each pipeline stage's weights from `state` (local: no collective). The problem, or None."""
    for sid, m in trainer.stages.items():
        if sid not in state["model"]:
            return f"checkpoint {path} has no weights for pipeline stage {sid}"
        try:
            m.load_state_dict(state["model"][sid])
        except (RuntimeError, KeyError, TypeError, ValueError, AttributeError) as e:
            return (f"checkpoint {path}: the weights of pipeline stage {sid} do not fit this model "
                    f"({one_line(e)})")
    return None


def agree(ps, problem: Optional[str], what: str, error=RuntimeError) -> None:
    """Every rank: raise `error(problem)` on the rank that has it, and on every other rank a line
    naming the lowest failing rank, so all stop together."""
    failed = ps.rank if problem else ps.world_size
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = comm_tensor([failed], dtype=torch.int64)  # NCCL takes CUDA tensors only
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        failed = int(t.item())
    if problem:
        raise error(f"{ps.describe()}: {problem}")
    if failed < ps.world_size:
        raise error(f"{ps.describe()}: global rank {failed} could not {what} (its own line names the file "
                              f"and why); stopping with it")


def apply_state(trainer, state: dict, path: str, set_rng_state) -> None:
    """Counters, optimizer, scheduler, extra and RNG state of a checked `state` (after the weights)."""
    cfg, ps = trainer.cfg, trainer.ps
    if cfg.checkpoint.finetune:
        return
    trainer.iteration = state["iteration"]
    trainer.consumed_samples = state["consumed_samples"]
    trainer.skipped_iters = state.get("skipped_iters", 0)
    trainer.consumed_tokens = state.get("consumed_tokens", 0)
    if hasattr(trainer.logger, "load_state_dict"):
        trainer.logger.load_state_dict(state.get("logger", {}))
    for key, obj in getattr(trainer, "extra_checkpoint_state", {}).items():
        if key in state:
            obj.load_state_dict(state[key])
    if not cfg.checkpoint.no_load_optim and state.get("optimizer") is not None:
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.lr_scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        if state.get("optimizer") is None and ps.rank == 0 and not cfg.checkpoint.no_load_optim:
            print(f"note: {path} holds no optimizer state (a converted checkpoint); the optimizer starts fresh "
                  f"at iteration {trainer.iteration}", flush=True)
        trainer.lr_scheduler.num_steps = trainer.iteration
    if not cfg.checkpoint.no_load_rng and state.get("rng_state") is not None:
        set_rng_state(state["rng_state"])
