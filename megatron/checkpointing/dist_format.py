"""`--ckpt-format torch_dist`: checkpoints through `torch.distributed.checkpoint` (DCP) that load
at any tensor / pipeline / data parallel layout, without the offline converter.

    <dir>/iter_0000100/__R_0.distcp    tensors, one file per writing rank (written in parallel)
    <dir>/iter_0000100/.metadata       DCP's index: every tensor's name, dtype, shape and chunks
    <dir>/iter_0000100/common.json     config, counters, scheduler, grad scaler, saved layout
    <dir>/iter_0000100/manifest.json   every file + sha256 (written last: marks it complete)

Layout independence: every tensor is stored under its global name (`decoder.layers.<global
index>...`) at its full, unsharded shape, vocabulary tables cut to the real vocabulary. Each rank
offers its stages' tensors (TP shards gathered over its TP group); DCP's planner de-duplicates
the copies that TP and DP replicas hold and spreads the writes over the ranks. On load each rank
reads the full tensors of its own stages and cuts its TP shard, so any TP/PP/DP split of the
same model finds what it needs. The cost is that a rank holds its stages' full tensors for the
moment of the save and load (a rank's share of a model, times TP) — DTensor-sharded saving
would avoid it and is the next step for models whose stage does not fit unsharded.

Nothing is unpickled and nothing outside the folder is read: saving goes through DCP, loading
never does (`megatron/checkpointing/dist_reader.py` checks DCP's index whole, then reads each
chunk with `weights_only=True` from files the manifest lists), and the rest is JSON. What the
format holds: model, AdamW state (per parameter, resharded like it: the optimizer's
`param_states()` / `load_param_states()`, where the distributed optimizer gathers its DP shards
into whole moments and cuts its own shard back out), RNG states and Optimus-CC compression
state per rank (restored only when the job's layout is the same: they belong to one rank of
one layout), counters. GPT and T5 (encoder and decoder layers each under their global index),
uniform or per-stage (--aceso-config) layouts. Mixture-of-experts layers: expert weights and their
moments are stored with every expert ([num_experts, ...], gathered over the EP group like the TP
gather) and the router's `expert_bias` buffer with them, so any EP size reads the same folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron import safe_paths
from megatron.checkpointing import dist_reader as reader
from megatron.core.comm_device import to_comm
COMMON = "common.json"
_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(.*)$")
# Tensors with a row per (padded) vocabulary entry: stored cut to the real vocabulary.
_VOCAB = re.compile(r"(word_embeddings\.weight|output_layer\.weight|lm_head_bias)$")
_TIED = "embedding.word_embeddings.weight"


# ---- DCP's index, read without running code (megatron/checkpointing/dist_reader.py) -----------
def read_index(it_dir: str) -> Dict[str, tuple]:
    """{tensor name: (shape, dtype)} of a torch_dist iteration folder, without building a model;
    the index is checked against the folder's manifest first."""
    md = reader.read_metadata(it_dir)
    reader.check_index(md, it_dir, reader.read_manifest(it_dir))
    return reader.tensor_index(md)


def is_dist_checkpoint(it_dir: str) -> bool:
    return os.path.exists(os.path.join(it_dir, COMMON))


def verify(it_dir: str, manifest: str, rank: int = 0, world: int = 1) -> Optional[str]:
    """This rank's share of the files of `it_dir` checked against its manifest: the first
    problem, or None (the caller makes every rank agree)."""
    if not is_dist_checkpoint(it_dir):
        return f"{it_dir} is not a complete torch_dist checkpoint (no {COMMON})"
    try:
        files = reader.read_manifest(it_dir)  # (always manifest.json; the argument is kept for callers)
    except reader.DistCheckpointError as e:
        return str(e)
    for name in sorted(files)[rank::world]:
        path = os.path.join(it_dir, name)
        refused = safe_paths.first_refusal(it_dir, [name])  # a link or a FIFO: named as such, never opened
        if refused:
            return refused
        try:
            got = sha256_digest(path).hex() if safe_paths.is_regular_inside(it_dir, name) else None
        except OSError:
            got = None
        if got != files[name]["sha256"]:
            return f"{path} is {'missing' if got is None else 'corrupted'}"
    return None


# ---- names and shards ----------------------------------------------------------------------
def _global(stage, name: str) -> str:
    """A layer's name with its index in the whole encoder / decoder (GPT stages start at
    `layer_start`, T5 stages at `encoder_layers[0]` / `decoder_layers[0]`)."""
    m = _LAYER.match(name)
    if not m:
        return name
    start = (stage.encoder_layers if m.group(1) == "encoder" else stage.decoder_layers)[0] \
        if hasattr(stage, "decoder_layers") else stage.layer_start
    return f"{m.group(1)}.layers.{start + int(m.group(2))}.{m.group(3)}"


def _params(trainer):
    """(global key, param, saved_here) of this rank's stages. Tied copies (GPT's and T5's last
    stage output layer, T5's first decoder stage embedding) read the first stage's entry and
    are not saved twice."""
    for stage in trainer.stages.values():
        for name, p in stage.named_parameters():
            shared = getattr(p, "shared_embedding", False)
            key = _TIED if shared and name == "output_layer.weight" else _global(stage, name)
            yield key, p, not shared


def _buffers(trainer):
    """(global key, buffer) of the persistent buffers of this rank's stages (the MoE router's
    aux-loss-free `expert_bias`: replicated, not trained by the optimizer, but it decides the
    routing, so a resume without it would route differently)."""
    for stage in trainer.stages.values():
        persistent = set(stage.state_dict(keep_vars=True))
        for name, b in stage.named_buffers():
            if name in persistent:
                yield _global(stage, name), b


def _experts(p) -> bool:
    """An expert-parallel parameter ([local experts, ...] on each EP rank): stored with every
    expert, in global order, so that the checkpoint is the same at every EP size."""
    return getattr(p, "expert_parallel", False)


def _ep_full(t: torch.Tensor, ps) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(ps.ep_group))]
    dist.all_gather(parts, t.detach().contiguous(), group=ps.ep_group)
    return torch.cat(parts, dim=0)


def _ep_cut(full: torch.Tensor, like: torch.Tensor, key: str, ps) -> torch.Tensor:
    n = like.shape[0]
    if full.shape[0] != n * ps.ep_size:
        raise ValueError(f"{key}: the checkpoint holds {full.shape[0]} experts, this run {n * ps.ep_size} "
                         f"(--num-experts differs)")
    return full.narrow(0, ps.ep_rank * n, n)


def _dim(p) -> Optional[int]:
    return getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` if it owns its whole storage, else a copy: torch.save (inside DCP) writes a view's
    entire storage, so a slice of a stacked or flat buffer would store the buffer."""
    t = t.detach()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def _full(t: torch.Tensor, dim, key: str, ps, vocab: int) -> torch.Tensor:
    if dim is not None and ps.tp_size > 1:
        parts = [torch.empty_like(t) for _ in range(ps.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
        t = torch.cat(parts, dim=dim)
    return t[:vocab] if _VOCAB.search(key) else t


def _shard(full: torch.Tensor, like: torch.Tensor, dim, key: str, ps, padded: int) -> torch.Tensor:
    if _VOCAB.search(key):
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
    if dim is not None:
        per = full.shape[dim] // ps.tp_size
        full = full.narrow(dim, ps.tp_rank * per, per)
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"{key}: checkpoint gives shape {tuple(full.shape)} for this rank, the model has "
                         f"{tuple(like.shape)}")
    return full.to(like.device, like.dtype).clone()


def _rng_tensors(rank: int) -> Dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.random import get_rng_tracker
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {f"rng.{rank}.torch": torch.get_rng_state(),
           f"rng.{rank}.random": torch.tensor([version, *mt], dtype=torch.int64),
           f"rng.{rank}.numpy": torch.tensor([int(k) for k in keys] + [pos, has_gauss], dtype=torch.int64),
           f"rng.{rank}.numpy_gauss": torch.tensor([cached], dtype=torch.float64)}
    if gauss is not None:
        out[f"rng.{rank}.random_gauss"] = torch.tensor([gauss], dtype=torch.float64)
    if torch.cuda.is_available():
        out[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state()
    for name, st in get_rng_tracker().get_states().items():
        out[f"rng.{rank}.tracker.{name}"] = st
    return out


def _set_rng(sd: Dict[str, torch.Tensor], rank: int) -> None:
    from megatron.core.tensor_parallel.random import get_rng_tracker
    p = f"rng.{rank}."
    torch.set_rng_state(sd[p + "torch"])
    r = sd[p + "random"].tolist()
    gauss = sd.get(p + "random_gauss")
    random.setstate((r[0], tuple(r[1:]), None if gauss is None else float(gauss[0])))
    n = sd[p + "numpy"].tolist()
    np.random.set_state(("MT19937", np.asarray(n[:-2], dtype=np.uint32), n[-2], n[-1],
                         float(sd[p + "numpy_gauss"][0])))
    if p + "cuda" in sd and torch.cuda.is_available():
        torch.cuda.set_rng_state(sd[p + "cuda"])
    tracker = {k[len(p + "tracker."):]: v for k, v in sd.items() if k.startswith(p + "tracker.")}
    get_rng_tracker().set_states(tracker)


def _compression_tensors(trainer, rank: int) -> Dict[str, torch.Tensor]:
    """This rank's Optimus-CC state (warm-start Q factors, error-feedback residuals: a
    `LowRankState` per compressor) as tensors `compression.<rank>.<name>.<q|error>.<key as
    JSON>`; like the RNG states they belong to one rank of one layout."""
    out = {}
    for name, holder in getattr(trainer, "extra_checkpoint_state", {}).items():
        st = holder.obj.state_dict()  # this rank's own entry (no DP gather: each rank writes its own)
        out[f"compression.{rank}.{name}.seed"] = torch.tensor([int(st["seed"])], dtype=torch.int64)
        for field in ("q", "error"):
            for k, v in st[field].items():
                out[f"compression.{rank}.{name}.{field}.{json.dumps(list(k), separators=(',', ':'))}"] = _own(v)
    return out


def _set_compression(trainer, sd: Dict[str, torch.Tensor], rank: int) -> None:
    def key(v):
        return tuple(key(x) for x in v) if isinstance(v, list) else v
    for name, holder in getattr(trainer, "extra_checkpoint_state", {}).items():
        p = f"compression.{rank}.{name}."
        if p + "seed" not in sd:
            continue  # saved without this compressor: it starts afresh
        st = {"seed": int(sd[p + "seed"][0]), "q": {}, "error": {}}
        for k, v in sd.items():
            if k.startswith(p) and k != p + "seed":
                field, _, js = k[len(p):].partition(".")
                st[field][key(json.loads(js))] = v
        holder.obj.load_state_dict(st)


def _layout(trainer) -> dict:
    """The job's layout (the same on every rank): per-stage sizes under --aceso-config, where
    this rank's TP / DP sizes are its stage's only."""
    ps, sp = trainer.ps, trainer.cfg.parallel.stage_parallel
    if sp is not None:
        return {"stage_parallel": [list(x) for x in sp], "pp": ps.pp_size, "world": ps.world_size}
    layout = {"tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size, "world": ps.world_size}
    if trainer.cfg.model.moe is not None:  # (only with experts: dense checkpoints keep their layout)
        layout["ep"] = ps.ep_size
    return layout


# ---- save / load ---------------------------------------------------------------------------
def save(trainer, it_dir: str) -> None:
    """Every rank: write this rank's part of iteration folder `it_dir` (collective); the caller
    writes common.json and the manifest once every rank is done."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    cfg, ps = trainer.cfg, trainer.ps
    vocab = cfg.model.vocab_size
    # Adam state per parameter, whole over DP (the distributed optimizer gathers its shards
    # here, collectively), then gathered over TP below like the weights.
    states = trainer.optimizer.param_states()
    sd: Dict[str, torch.Tensor] = {}
    for key, p, here in _params(trainer):
        dim = _dim(p)
        st = states.get(id(p), {})
        names = ["model"] + [k for k in ("exp_avg", "exp_avg_sq") if k in st]
        # One TP gather per parameter for the weight and its moments together (collective:
        # every TP rank walks the same parameters in the same order).
        parts = [p.detach()] + [st[k] for k in names[1:]]
        if dim is None or ps.tp_size == 1:
            full = parts  # nothing to gather: the tensors themselves (no copy unless a view)
        elif all(t.dtype == p.dtype for t in parts):
            full = _full(torch.stack(parts), dim + 1, "", ps, vocab).unbind(0)
        else:  # moments kept in another precision than the weight: gather each as it is
            full = [_full(t, dim, "", ps, vocab) for t in parts]
        if _experts(p):  # every EP rank offers the same full tensor; DCP's planner keeps one copy
            full = [_ep_full(t, ps) for t in full]  # (collective over the EP group, same order on each)
        if not here:
            continue
        for n, t in zip(names, full):
            t = t[:vocab] if _VOCAB.search(key) else t
            sd[f"model.{key}" if n == "model" else f"optimizer.{key}.{n}"] = _own(t)
        if "step" in st:
            sd[f"optimizer.{key}.step"] = torch.as_tensor(st["step"]).detach().clone().reshape(1)
    for key, b in _buffers(trainer):
        sd[f"model.{key}"] = _own(b)
    sd.update(_rng_tensors(ps.rank))
    sd.update(_compression_tensors(trainer, ps.rank))
    os.makedirs(it_dir, exist_ok=True)
    dcp.save(sd, storage_writer=FileSystemWriter(it_dir, thread_count=1))


def common_bytes(trainer, common: dict) -> bytes:
    return json.dumps({**common, "layout": _layout(trainer)}, indent=1, sort_keys=True, allow_nan=False,
                      default=str).encode()


def read_common(it_dir: str) -> dict:
    path = os.path.join(it_dir, COMMON)
    try:
        common = json.loads(safe_paths.read_text(it_dir, COMMON, safe_paths.JSON_BYTES, "torch_dist common file"))
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    for k, t in (("iteration", int), ("consumed_samples", int), ("config", dict), ("layout", dict)):
        if not isinstance(common.get(k), t):
            raise ValueError(f"{path}: field {k!r} is missing or not {t.__name__}")
    return common


def load(trainer, it_dir: str, common: dict, load_optim: bool, load_rng: bool, load_compression: bool) -> None:
    """Every rank: fill this rank's stages (and optimizer, RNG, compression state) from `it_dir`
    at its own layout; RNG and compression state only at the layout that saved them."""
    cfg, ps = trainer.cfg, trainer.ps
    finish = getattr(trainer.optimizer, "finish_param_gather", None)
    if finish is not None:  # --overlap-param-gather: no gather in flight may overwrite what loads
        finish()
    md = reader.read_metadata(it_dir)
    reader.check_index(md, it_dir, reader.read_manifest(it_dir))
    index = reader.tensor_index(md)
    padded = cfg.model.padded_vocab_size(ps.tp_size)
    sd, targets = {}, []
    for key, p, _ in _params(trainer):
        names = [f"model.{key}"] + ([f"optimizer.{key}.{k}" for k in ("exp_avg", "exp_avg_sq", "step")]
                                    if load_optim else [])
        for n in names:
            if n in index and n not in sd:
                shape, dtype = index[n]
                sd[n] = torch.empty(shape, dtype=dtype)
            elif n == names[0] and n not in index:
                raise ValueError(f"{it_dir} holds no tensor {n} (saved from another model?)")
        targets.append((key, p))
    buffers = list(_buffers(trainer))
    for key, b in buffers:
        n = f"model.{key}"
        if n not in index:
            raise ValueError(f"{it_dir} holds no tensor {n} (saved from another model?)")
        sd[n] = torch.empty(index[n][0], dtype=index[n][1])
    same_layout = common["layout"] == _layout(trainer)
    rng_keys = [k for k in index if k.startswith(f"rng.{ps.rank}.")] if load_rng and same_layout else []
    comp_keys = [k for k in index if k.startswith(f"compression.{ps.rank}.")] if load_compression else []
    if comp_keys and not same_layout:
        if ps.rank == 0:
            print(f"note: {it_dir} was saved at layout {common['layout']}, this run is {_layout(trainer)}: "
                  f"compression residuals and warm starts begin afresh", file=sys.stderr, flush=True)
        comp_keys = []
    for k in rng_keys + comp_keys:
        shape, dtype = index[k]
        sd[k] = torch.empty(shape, dtype=dtype)
    reader.read_tensors(md, it_dir, sd)  # never dcp.load: see checkpoint_dist_reader
    states = {}
    with torch.no_grad():
        for key, p in targets:
            dim = _dim(p)
            ep = _ep_cut if _experts(p) else (lambda full, *_: full)
            p.copy_(_shard(ep(sd[f"model.{key}"], p, key, ps), p, dim, key, ps, padded))
            if load_optim and f"optimizer.{key}.exp_avg" in sd:
                states[id(p)] = {"step": sd[f"optimizer.{key}.step"].reshape(()).clone(),
                                 **{k: _shard(ep(sd[f"optimizer.{key}.{k}"], p, key, ps), p, dim, key, ps, padded)
                                    for k in ("exp_avg", "exp_avg_sq")}}
        for key, b in buffers:
            b.copy_(_shard(sd[f"model.{key}"], b, None, key, ps, padded))
    # The plain optimizer takes them as they are; the distributed one cuts its DP shard.
    trainer.optimizer.load_param_states(states)
    if comp_keys:
        _set_compression(trainer, sd, ps.rank)
    if rng_keys:
        _set_rng(sd, ps.rank)
    elif load_rng and ps.rank == 0:
        print(f"note: {it_dir} was saved at layout {common['layout']}, this run is {_layout(trainer)}: "
              f"RNG states start from this run's seed", file=sys.stderr, flush=True)


def sha256_digest(path: str) -> bytes:
    """sha256 of a file, read in 4 MiB chunks (both checkpoint formats' manifests use it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.digest()


def file_digests(it_dir: str, names, rank: int = 0, world: int = 1) -> Dict[str, dict]:
    """sha256 of `names` in `it_dir`, each rank hashing every world-th file in parallel
    (collective when world > 1; digests meet in an all-reduce of bytes, not a pickle)."""
    names = sorted(names)
    buf = torch.zeros(len(names), 32, dtype=torch.int64)
    for i, name in enumerate(names):
        if i % world == rank:
            buf[i] = torch.tensor(list(sha256_digest(os.path.join(it_dir, name))), dtype=torch.int64)
    if world > 1:
        buf = to_comm(buf)  # NCCL takes CUDA tensors only
        dist.all_reduce(buf)
        buf = buf.cpu()
    return {n: {"sha256": bytes(buf[i].tolist()).hex(), "bytes": os.path.getsize(os.path.join(it_dir, n))}
            for i, n in enumerate(names)}


def shard_files(it_dir: str) -> list:
    return [n for n in os.listdir(it_dir) if n.endswith(".distcp") or n == ".metadata"]
