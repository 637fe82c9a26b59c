"""Megatron-LM's optimizer and RNG state, read onto this project's optimizer (any TP/PP/DP here).

Megatron stores Adam's moments per parameter in the order of its own parameter groups, never by
name. That order is rebuilt from the model's state dict in the same file, whose keys follow
`named_parameters()` (one module's parameters, then its children): Megatron-Core's
`_get_param_groups` walks the model chunks' named parameters, puts each in the group of its
(wd_mult, lr_mult, ...) key (no weight decay for `*.bias` and 1-D parameters), and the groups
appear in the order their keys first occur. What is checked against the file: the number of
parameters in each group, each group's `wd_mult`, and every moment's shape.

Forms read (Megatron-Core core_v0.9.0 and the legacy models it saves):
- `FP32Optimizer`: `optimizer` is torch's optimizer state dict (`state` by index, `param_groups`);
- `Float16OptimizerWithFloat16Params` (--fp16 / --bf16): `{optimizer: <that>, grad_scaler,
  fp32_from_fp16_params: [[fp32 main param per group entry]]}`;
- `DistributedOptimizer` (--use-distributed-optimizer): `optimizer` holds only the param groups
  (with `step`); `distrib_optim.pt` beside the model file holds, per grad buffer (one per model
  chunk and dtype), flat `param` / `exp_avg` / `exp_avg_sq` of `numel_unpadded` elements: the
  buffer's buckets without their end padding, parameters in reverse named order, each starting at
  a multiple of 64 (Megatron's `_ParamAndGradBuffer` layout; a tied embedding of a pipelined model
  starts a bucket of its own).

The moments are put back in the weights' places of the model dict and go through the weights'
own name conversion, layer renumbering and TP joining (`megatron_legacy.join_shards`); this
run's optimizer then takes its own cut (`load_param_states`). RNG: Megatron's `rng_state` list
(python `random`, numpy, torch CPU, CUDA, tracker) -> this process.
"""
from __future__ import annotations

import math
import os
import random
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron import safe_paths
from megatron.checkpointing.megatron_base import undo_layernorm_1p
from megatron.checkpointing.megatron_legacy import (MegatronCheckpointError, count_field, join_shards,
                                                    safe_load_megatron)

KINDS = ("exp_avg", "exp_avg_sq", "param")


def _named(d: dict, prefix: str = "") -> List[Tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of a (nested) model dict in its saved order, without `_extra_state`."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _named(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor) and not k.endswith("_extra_state"):
            out.append((prefix + k, v))
    return out


def _replace(d: dict, values: Dict[str, torch.Tensor], prefix: str = "") -> dict:
    """`d`'s nesting with each parameter replaced by `values[name]` (extra state dropped)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _replace(v, values, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor) and not k.endswith("_extra_state"):
            out[k] = values[prefix + k]
    return out


def group_order(chunks: list) -> List[List[Tuple[int, str, torch.Tensor]]]:
    """Megatron's default parameter groups over model chunks: [(chunk, name, weight)] per group,
    decayed group first when the first parameter is decayed (groups appear as keys first occur)."""
    groups: Dict[float, list] = {}
    for c, model in enumerate(chunks):
        for name, t in _named(model):
            wd = 0.0 if name.endswith(".bias") or t.ndim == 1 else 1.0
            groups.setdefault(wd, []).append((c, name, t))
    return [[(wd,) + e for e in g] for wd, g in groups.items()]


def _check_groups(path: str, groups, file_groups) -> None:
    if len(groups) != len(file_groups):
        raise MegatronCheckpointError(
            f"{path}: the optimizer has {len(file_groups)} parameter groups, the model's named parameters give "
            f"{len(groups)} (Megatron's default: weight-decayed / not); custom groups (--decoupled-lr, lr_mult, "
            f"experts) are not read: load with --no-load-optim")
    for i, (g, fg) in enumerate(zip(groups, file_groups)):
        if fg.get("is_decoupled_lr") or fg.get("is_expert_parallel") or fg.get("lr_mult", 1.0) != 1.0:
            raise MegatronCheckpointError(f"{path}: parameter group {i} is a decoupled-lr / expert / lr_mult group; "
                                          f"only Megatron's default groups are read: load with --no-load-optim")
        n = len(fg["params"]) if "params" in fg else None
        if (n is not None and n != len(g)) or float(fg.get("wd_mult", g[0][0])) != g[0][0]:
            raise MegatronCheckpointError(
                f"{path}: parameter group {i} holds {n} parameters with wd_mult {fg.get('wd_mult')}, the model's "
                f"named parameters give {len(g)} with wd_mult {g[0][0]}: not Megatron's default grouping")


def _torch_form(path: str, chunks: list, opt: dict, main: Optional[list]) -> Tuple[dict, float]:
    """FP32Optimizer / Float16Optimizer: {kind: {(chunk, name): tensor}}, step."""
    groups = group_order(chunks)
    _check_groups(path, groups, opt["param_groups"])
    out: Dict[str, dict] = {k: {} for k in KINDS}
    steps = set()
    for gi, (g, fg) in enumerate(zip(groups, opt["param_groups"])):
        for j, ((_, c, name, w), idx) in enumerate(zip(g, fg["params"])):
            st = opt["state"].get(idx)
            if not st:
                raise MegatronCheckpointError(f"{path}: no optimizer state for {name} (index {idx}); it never "
                                              f"stepped? load with --no-load-optim")
            for k in ("exp_avg", "exp_avg_sq"):
                if tuple(st[k].shape) != tuple(w.shape):
                    raise MegatronCheckpointError(f"{path}: {k} of {name} (index {idx}) has shape "
                                                  f"{tuple(st[k].shape)}, the weight {tuple(w.shape)}")
                out[k][(c, name)] = st[k]
            steps.add(float(st["step"] if "step" in st else fg["step"]))
            if main is not None and len(main[gi]) == len(g):  # else fp32 params sit among them: skip
                m = main[gi][j]
                if tuple(m.shape) != tuple(w.shape):
                    raise MegatronCheckpointError(f"{path}: fp32_from_fp16_params[{gi}][{j}] ({name}) has shape "
                                                  f"{tuple(m.shape)}, the weight {tuple(w.shape)}")
                out["param"][(c, name)] = m
    if len(steps) != 1:
        raise MegatronCheckpointError(f"{path}: parameters were stepped {sorted(steps)} times: one count expected")
    return out, steps.pop()


def _shared_embedding(c: int, name: str, chunks: int, args, pp_rank: int, pp: int) -> bool:
    """Megatron marks the tied word embedding `shared_embedding` on the first and last stage of a
    pipelined model; the distributed optimizer gives it a bucket of its own."""
    if pp == 1 or getattr(args, "untie_embeddings_and_output_weights", False):
        return False
    first = pp_rank == 0 and c == 0
    last = pp_rank == pp - 1 and c == chunks - 1
    return (first and name.endswith("word_embeddings.weight") and not last) or \
        (last and name in ("output_layer.weight", "word_embeddings_for_head.weight"))


def buffer_offsets(names: List[Tuple[str, int, bool]], dp: int, bucket_size: Optional[int]) -> Tuple[dict, int]:
    """Megatron-Core's `_ParamAndGradBuffer` layout with the distributed optimizer, as saved in
    distrib_optim.pt (each bucket's end padding removed): {name: offset}, numel_unpadded.
    `names`: (name, numel, shared_embedding) in named-parameter order."""
    def pad(n, d):
        return int(math.ceil(n / d) * d)
    end_pad = math.lcm(dp, 128)
    start = bucket_start = 0
    placed, buckets, in_bucket = {}, [], 0
    for name, numel, shared in reversed(names):
        start = pad(start, 64)
        if shared:
            if start % dp:
                start = pad(start, end_pad)
            if in_bucket:
                buckets.append((bucket_start, start))
                start = bucket_start = pad(start, end_pad)
                in_bucket = 0
        end = start + numel
        placed[name] = (start, len(buckets))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            buckets.append((bucket_start, end))
            start = bucket_start = pad(end, end_pad)
            in_bucket = 0
        else:
            start = end
    if in_bucket:
        buckets.append((bucket_start, end))
    base, acc = [], 0
    for lo, hi in buckets:
        base.append(acc - lo)
        acc += hi - lo
    return {n: s + base[b] for n, (s, b) in placed.items()}, acc


def _distributed_form(path: str, chunks: list, opt: dict, args, pp_rank: int, pp: int) -> Tuple[dict, float]:
    optim_path = os.path.join(os.path.dirname(path), "distrib_optim.pt")
    if os.path.lexists(optim_path):  # a link or a FIFO is refused before torch.load opens it
        safe_paths.regular_file(os.path.dirname(path), "distrib_optim.pt", "distributed optimizer file")
    else:
        raise MegatronCheckpointError(f"{path}: saved by --use-distributed-optimizer but {optim_path} is missing; "
                                      f"load with --no-load-optim")
    _check_groups(path, group_order(chunks), opt["optimizer"]["param_groups"])
    steps = {float(g["step"]) for g in opt["optimizer"]["param_groups"] if "step" in g}
    if len(steps) != 1:
        raise MegatronCheckpointError(f"{path}: the distributed optimizer's param groups give steps {sorted(steps)}")
    state = safe_load_megatron(optim_path)
    bufs = sorted(k for k in state if isinstance(k, int))
    if len(bufs) != len(chunks):
        raise MegatronCheckpointError(f"{optim_path}: {len(bufs)} grad buffers for {len(chunks)} model chunks; "
                                      f"only one dtype per chunk is read: load with --no-load-optim")
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    bucket = None
    if getattr(args, "overlap_grad_reduce", False):
        bucket = getattr(args, "ddp_bucket_size", None) or max(40000000, 1000000 * dp)
    try:
        return _buffers(optim_path, state, bufs, chunks, args, pp_rank, pp, dp, bucket), steps.pop()
    except MegatronCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        raise MegatronCheckpointError(f"{optim_path}: a grad buffer is not the flat param / exp_avg / exp_avg_sq "
                                      f"and numel_unpadded Megatron-Core writes ({type(e).__name__}: "
                                      f"{str(e)[:100]}); load with --no-load-optim") from None


def _buffers(optim_path, state, bufs, chunks, args, pp_rank, pp, dp, bucket) -> dict:
    out: Dict[str, dict] = {k: {} for k in KINDS}
    for c, (b, model) in enumerate(zip(bufs, chunks)):
        if len(state[b]) != 1 or not isinstance(next(iter(state[b].values())), dict):
            raise MegatronCheckpointError(f"{optim_path}: buffer {b} holds {len(state[b])} dtypes; one expected")
        flat = next(iter(state[b].values()))
        named = _named(model)
        # Megatron's virtual stages after the first are built without bucketing.
        offsets, total = buffer_offsets([(n, t.numel(), _shared_embedding(c, n, len(chunks), args, pp_rank, pp))
                                         for n, t in named], dp, bucket if c == 0 else None)
        if total != count_field(optim_path, f"buffer {b} numel_unpadded", flat["numel_unpadded"]) \
                or any(flat[k].numel() != total for k in KINDS):
            raise MegatronCheckpointError(
                f"{optim_path}: buffer {b} holds {int(flat['numel_unpadded'])} elements, the model's parameters "
                f"laid out as Megatron-Core's grad buffer give {total}: layout not understood; load with "
                f"--no-load-optim")
        if any(not isinstance(flat[k], torch.Tensor) or flat[k].dim() != 1 for k in KINDS):
            raise MegatronCheckpointError(f"{optim_path}: buffer {b}'s {'/'.join(KINDS)} are not flat (1-D) tensors; "
                                          f"load with --no-load-optim")
        for n, t in named:
            for k in KINDS:
                out[k][(c, n)] = flat[k][offsets[n]:offsets[n] + t.numel()].view(t.shape)
    return out


class Collector:
    """`read_full`'s per-file hook: the optimizer state and RNG list of every rank file."""

    def __init__(self, read_optim: bool = True):
        self.read_optim = read_optim  # False with --no-load-optim / --finetune: not even parsed
        self.models: Dict[str, Dict[Tuple[int, int], list]] = {k: {} for k in KINDS}
        self.steps, self.rng, self.missing = set(), None, []
        self.split = False  # Megatron v2.x's distributed optimizer: model_rng.pt + mp_rank_XX_DDD/optim.pt
        self.t5 = False  # T5's parameter order is not rebuilt: its optimizer state is left unread
        self.moe = False  # nor an MoE model's (its expert parameters are per EP file): left unread

    def __call__(self, rank: Tuple[int, int], path: str, state: dict) -> None:
        from megatron.checkpointing.megatron_legacy import _stage_models
        if self.rng is None:
            self.rng = state.get("rng_state")
        if not self.read_optim:
            return
        from megatron.checkpointing.megatron_legacy import is_t5
        if is_t5(state["args"]):
            self.t5 = True
            self.missing.append(path)
            return
        if getattr(state["args"], "num_experts", None):
            self.moe = True
            self.missing.append(path)
            return
        opt = state.get("optimizer")
        if not opt:
            self.missing.append(path)
            self.split = self.split or os.path.basename(path) == "model_rng.pt"
            return
        if not isinstance(opt, dict):
            raise MegatronCheckpointError(f"{path}: the optimizer state is a {type(opt).__name__} (several chained "
                                          f"optimizers?); only one optimizer is read: load with --no-load-optim")
        chunks = _stage_models(state)
        args = state["args"]
        if "state" in opt and "param_groups" in opt:
            per, step = _torch_form(path, chunks, opt, None)
        elif "fp32_from_fp16_params" in opt:
            per, step = _torch_form(path, chunks, opt["optimizer"], opt["fp32_from_fp16_params"])
        elif "optimizer" in opt and set(opt["optimizer"]) == {"param_groups"}:
            per, step = _distributed_form(path, chunks, opt, args, rank[1],
                                          int(getattr(args, "pipeline_model_parallel_size", 1) or 1))
        else:
            raise MegatronCheckpointError(f"{path}: optimizer state with keys {sorted(map(str, opt))} is not a form "
                                          f"this reader knows; load with --no-load-optim")
        self.steps.add(step)
        for k in KINDS:
            if per[k]:
                self.models[k][rank] = [_replace(m, {n: per[k][(c, n)] for (cc, n) in per[k] if cc == c})
                                        for c, m in enumerate(chunks)]

    def full(self, args, tp: int, pp: int) -> Tuple[Dict[str, Dict[str, torch.Tensor]], float]:
        """({kind: {our global name: full tensor}}, step), or ({}, 0) when no file holds an optimizer."""
        if self.missing and len(self.missing) < tp * pp:
            raise MegatronCheckpointError(f"{self.missing[0]} holds no optimizer state but other rank files do; "
                                          f"load with --no-load-optim")
        if self.missing:
            return {}, 0.0
        if len(self.steps) != 1:
            raise MegatronCheckpointError(f"rank files disagree on the optimizer's step count: {sorted(self.steps)}")
        out = {k: join_shards(args, self.models[k], tp, pp)[0] for k in KINDS if self.models[k]}
        if "param" in out:  # fp32 main params are the weights: --apply-layernorm-1p stores w - 1
            out["param"] = undo_layernorm_1p(args, out["param"])
        return out, self.steps.pop()


def load_optimizer(trainer, states: Dict[str, Dict[str, torch.Tensor]], step: float, fit) -> None:
    """Cut this rank's pieces of the full moments (as the weights are cut) into its optimizer;
    fp32 main params (mixed precision / distributed optimizer) replace float32 weights."""
    from megatron.checkpointing.dist_format import _dim, _params
    ps = trainer.ps
    per: Dict[int, dict] = {}
    for key, p, _ in _params(trainer):
        st = {}
        for k in KINDS:
            if k not in states:
                continue
            if key not in states[k]:
                raise MegatronCheckpointError(f"the Megatron-LM optimizer state holds no {k} for {key}")
            t = fit(key, states[k][key])
            d = _dim(p)
            if d is not None:
                per_rank = t.shape[d] // ps.tp_size
                t = t.narrow(d, ps.tp_rank * per_rank, per_rank)
            if tuple(t.shape) != tuple(p.shape):
                raise MegatronCheckpointError(f"{key}: Megatron-LM's {k} has shape {tuple(t.shape)} on "
                                              f"{ps.describe()}, the model has {tuple(p.shape)}")
            st[k] = t
        main = st.pop("param", None)
        if main is not None and p.dtype == torch.float32:
            with torch.no_grad():
                p.copy_(main)
        per[id(p)] = {"step": torch.tensor(float(step)),
                      **{k: v.to(device=p.device, dtype=torch.float32).clone() for k, v in st.items()}}
    trainer.optimizer.load_param_states(per)


def resume(trainer, collect: Collector, args, meta: dict, messages: Tuple[str, str], fit) -> Tuple[str, str]:
    """`load_into_trainer`'s hook (not --finetune, not a release): the optimizer unless
    --no-load-optim, the RNG unless --no-load-rng; returns the log's (optimizer, RNG) words."""
    optim, rng = messages
    ck = trainer.cfg.checkpoint
    if not ck.no_load_optim:
        states, step = collect.full(args, meta["tp"], meta["pp"])
        if states:
            load_optimizer(trainer, states, step, fit)
            optim = f"the optimizer's state resumed (step {int(step)})"
        elif collect.t5:
            optim = ("Megatron's T5 optimizer state is not read (its parameter order is rebuilt for GPT only): "
                     "the optimizer starts fresh")
        elif collect.moe:
            optim = "Megatron's optimizer state of an MoE model is not read yet: the optimizer starts fresh"
        elif collect.split:
            optim = ("Megatron v2.x's distributed-optimizer files (mp_rank_XX_DDD/optim.pt) are not read: the "
                     "optimizer starts fresh")
        else:
            optim = "the checkpoint holds no optimizer state: the optimizer starts fresh"
    if not ck.no_load_rng:
        rng = set_rng(collect.rng, args, trainer.ps, trainer.device.type)
    return optim, rng


def set_rng(rng_state, args, ps, device_type: str) -> str:
    """Megatron's `rng_state` (one dict per DP rank, or one for all) -> this process; returns
    what was restored, for the log line."""
    if not rng_state:
        return "no RNG state in the checkpoint"
    if isinstance(rng_state, dict):
        rng_state = [rng_state]
    i = ps.dp_rank if getattr(args, "data_parallel_random_init", False) and ps.dp_rank < len(rng_state) else 0
    try:
        st = rng_state[i]
        random.setstate(st["random_rng_state"])
        np.random.set_state(st["np_rng_state"])
        torch.set_rng_state(st["torch_rng_state"])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as e:
        raise MegatronCheckpointError(f"rng_state[{i}] is not the Python / numpy / torch RNG state Megatron-LM saves "
                                      f"({type(e).__name__}: {str(e)[:100]}); load with --no-load-rng") from None
    if device_type != "cuda":
        return "python, numpy and torch RNG restored (CUDA and tracker states are for GPUs; this run's tracker kept)"
    from megatron.core.tensor_parallel.random import get_rng_tracker
    torch.cuda.set_rng_state(st["cuda_rng_state"])
    if st.get("rng_tracker_states"):
        get_rng_tracker().set_states(st["rng_tracker_states"])
    return "python, numpy, torch, CUDA and tracker RNG restored"


# ---- writing: this project's optimizer in Megatron's FP32Optimizer form ----------------------------
_TOP = ("embedding.word_embeddings", "embedding.position_embeddings", "encoder.layers.", "encoder.final",
        "output_layer", "word_embeddings_for_head")
_INNER = ("input_", "query_key_value", "self_attention.dense", "post_attention_", "dense_h_to_4h", "dense_4h_to_h")


def _legacy_rank(name: str) -> tuple:
    import re
    top = next((i for i, t in enumerate(_TOP) if t in name), len(_TOP))
    m = re.search(r"layers\.(\d+)\.", name)
    inner = next((i for i, t in enumerate(_INNER) if t in name), len(_INNER))
    return top, int(m.group(1)) if m else -1, inner, name.endswith("bias")


def legacy_order(d: dict, prefix: str = "") -> dict:
    """A legacy GPT model dict in the legacy model's named-parameter order (Megatron's
    `state_dict` order, from which the optimizer's order is rebuilt on reading): word then
    position embeddings, layers by index (norm, QKV, dense, norm, MLP in, MLP out; weight
    before bias), final norm, output layer / tied head."""
    def rank(k, v):
        if isinstance(v, dict):
            return min((_legacy_rank(prefix + k + "." + n) for n, _ in _named(v)), default=(len(_TOP),))
        return _legacy_rank(prefix + k)
    return {k: legacy_order(v, f"{prefix}{k}.") if isinstance(v, dict) else v
            for k, v in sorted(d.items(), key=lambda kv: rank(*kv))}


def megatron_optimizer_state(nested: List[dict], moments: Dict[str, List[dict]], step: float, torch_group: dict,
                             weight_decay: float, lr: float, max_lr: float, min_lr: float) -> dict:
    """Megatron's non-distributed `optimizer` entry (torch's AdamW state dict in Megatron's
    default parameter groups) for one rank file. `nested`: the file's model chunks as written;
    `moments[kind]`: the same chunks with each weight replaced by its exp_avg / exp_avg_sq;
    `torch_group`: one of this run's torch param groups (its hyper-parameter keys, same torch)."""
    by_name = {k: [dict(_named(m)) for m in chunks] for k, chunks in moments.items()}
    state, groups, idx = {}, [], 0
    for g in group_order(nested):
        params = []
        for wd, c, name, w in g:
            state[idx] = {"step": torch.tensor(float(step)),
                          **{k: by_name[k][c][name].detach().clone().float() for k in ("exp_avg", "exp_avg_sq")}}
            params.append(idx)
            idx += 1
        group = {k: v for k, v in torch_group.items() if k != "params"}
        group.update(params=params, wd_mult=wd, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False,
                     lr=lr, weight_decay=weight_decay * wd, max_lr=max_lr, min_lr=min_lr)
        groups.append(group)
    return {"state": state, "param_groups": groups}


def megatron_distributed_state(nested: List[dict], moments: Dict[str, List[dict]], fp32: tuple, dp: int,
                               args=None, pp_rank: int = 0, pp: int = 1) -> dict:
    """Megatron-Core's `distrib_optim.pt` (core_v0.9.0, DP-rank-0 gathered form) for one rank
    file: per model chunk one fp32 grad buffer, `param` (the fp32 weights) and the moments laid
    out as `buffer_offsets` (no bucketing: Megatron's default without --overlap-grad-reduce)."""
    out = {"buckets_coalesced": True}
    for c, model in enumerate(nested):
        named = _named(model)
        offsets, total = buffer_offsets([(n, t.numel(), _shared_embedding(c, n, len(nested), args, pp_rank, pp))
                                         for n, t in named], dp, None)
        flat = {k: torch.zeros(total, dtype=torch.float32) for k in KINDS}
        by_name = {"param": dict(named), **{k: dict(_named(moments[k][c])) for k in ("exp_avg", "exp_avg_sq")}}
        for n, t in named:
            for k in KINDS:
                flat[k][offsets[n]:offsets[n] + t.numel()] = by_name[k][n].detach().reshape(-1).float()
        out[c] = {fp32: {**flat, "numel_unpadded": total}}
    return out


def optimizer_for_file(trainer, chunks: list, states: dict, to_nested) -> Tuple[Optional[dict], Optional[dict]]:
    """(the `optimizer` entry of this rank's file, the `distrib_optim.pt` contents or None);
    (None, None) before the first step. `states`: this run's `param_states()`;
    `to_nested(stage, {name: tensor})` is the writer's model nesting. With
    --use-distributed-optimizer the state goes to distrib_optim.pt as Megatron-Core writes it."""
    if not states:
        return None, None
    nested = [legacy_order(to_nested(s, {k: v.detach() for k, v in s.state_dict().items()})) for s in chunks]
    moments = {k: [to_nested(s, {n: states[id(p)][k] for n, p in s.named_parameters()}) for s in chunks]
               for k in ("exp_avg", "exp_avg_sq")}
    step = max(float(st["step"]) for st in states.values())
    t = trainer.cfg.training
    opt = megatron_optimizer_state(nested, moments, step, trainer.optimizer.optimizer.param_groups[0],
                                   t.weight_decay, trainer.lr_scheduler.lr(), t.lr, t.min_lr)
    if not t.use_distributed_optimizer:
        return opt, None
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": step} for g in opt["param_groups"]]
    return {"optimizer": {"param_groups": groups}}, \
        megatron_distributed_state(nested, moments, (torch.float32, torch.float32), max(trainer.ps.dp_size, 1),
                                   trainer.cfg.model, trainer.ps.pp_rank, trainer.ps.pp_size)
