"""Checkpoints Megatron-Core wrote with `--ckpt-format torch_dist` (Megatron-LM's default today).

    <dir>/latest_checkpointed_iteration.txt   an iteration number (or `release`)
    <dir>/iter_0000100/metadata.json          {"sharded_backend": "torch_dist", "common_backend": "torch", ...}
    <dir>/iter_0000100/common.pt              args (argparse.Namespace), iteration, opt_param_scheduler, ...
    <dir>/iter_0000100/.metadata              torch.distributed.checkpoint's index
    <dir>/iter_0000100/__R_I.distcp           the chunks, written by rank R (file I of it)

Names are Megatron-Core's sharded-state-dict keys: one global tensor per parameter of the whole
model, whatever the layout that wrote it. A transformer block's layers are stacked along a
leading axis of the global tensor (`decoder.layers.self_attention.linear_qkv.weight` is
[num_layers, 3 * hidden, hidden]); tensor-parallel shards and pipeline stages are separate
chunks of it at their global offsets. A gated MLP's `linear_fc1` is stored as [gate of all TP
ranks; up of all TP ranks]. Non-tensor state (`rng_state`, each layer's `_extra_state`) is
stored as pickled byte entries: this reader never opens them.

Reading never runs code and never leaves the folder. DCP's own loader is not used (it unpickles
byte entries and trusts the index's file names); `dist_reader` reads the index with an
unpickler that builds only DCP's metadata classes, checks it whole (tensor entries, chunks
inside their shapes, storage in a plain `__R_I.distcp` file of the folder, inside that file),
and reads each chunk with `torch.load(weights_only=True)`, which must give a tensor of the
declared dtype and shape. Here chunks must also tile each tensor exactly (no overlap, no
hole). `common.pt` goes through the Megatron-LM allowlist (`megatron_legacy.safe_load_megatron`).

The global tensors are then split per layer into Megatron-Core's flat names
(`decoder.layers.N.<...>`; T5's `encoder.layers` and `decoder.layers` with args.encoder_num_layers /
decoder_num_layers each), translated by `megatron_legacy.convert_core` (T5:
`megatron_t5.convert_core_t5`, which also knows the fused-norm names of the sharded keys), and handed to the same
`load_into_trainer` as Megatron's `torch` format: any TP/PP layout of this project cuts its own
shards from them. Adam's state, when Megatron-Core's (non-distributed) optimizer saved it, is
stored the same way under `optimizer.state.exp_avg.<parameter key>` / `exp_avg_sq`, with the step
in `common.pt` (`optimizer.state.common_step`): it goes through the same renaming and is cut
per parameter of this run (`load_param_states`: plain or distributed optimizer). The layouts of
Megatron's distributed optimizer (flattened, or per-bucket) are not read: the optimizer then
starts fresh and the log says so.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Dict, Optional, Tuple

import torch

from megatron import safe_paths
from megatron.checkpointing import dist_reader as reader
from megatron.checkpointing import megatron_legacy as legacy
from megatron.checkpointing.megatron_base import undo_layernorm_1p

BACKEND_FILE = "metadata.json"
COMMON = "common.pt"
_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")
# Byte (pickled object) entries Megatron-Core writes beside the tensors; named here, never opened.
_KNOWN_BYTES = re.compile(r"(^|\.)_extra_state(/shard_[0-9_.]+)?$|^rng_state(/shard_[0-9_.]+)?$|^optimizer\.")
_STACKED = re.compile(r"^(encoder|decoder)\.layers\.(.+)$")
SOURCE = "Megatron-Core's torch_dist save as this reader knows it"


class McoreDistError(legacy.MegatronCheckpointError):
    """A Megatron-Core torch_dist folder this reader refuses; one line naming the file."""


def _iteration_dir(root: str) -> Tuple[str, str, int]:
    folder, iteration = legacy.read_tracker(root)
    if os.path.lexists(os.path.join(root, folder)):
        safe_paths.inside(root, folder, "iteration folder")  # a link: refused
    return os.path.join(root, folder), folder, iteration


def detect(root: str) -> bool:
    """True when --load names a folder whose tracked iteration carries Megatron-Core's
    `metadata.json` (this project's own torch_dist writes `common.json` instead)."""
    try:
        it_dir, _, _ = _iteration_dir(root)
    except (OSError, ValueError):
        return False
    return os.path.isfile(os.path.join(it_dir, BACKEND_FILE)) and \
        not os.path.exists(os.path.join(it_dir, "common.json"))


def _check_backend(it_dir: str) -> None:
    path = os.path.join(it_dir, BACKEND_FILE)
    try:
        md = json.loads(safe_paths.read_text(it_dir, BACKEND_FILE, safe_paths.JSON_BYTES, "metadata.json"))
    except (OSError, ValueError, RecursionError) as e:
        raise McoreDistError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:120]})") from None
    backend = md.get("sharded_backend") if isinstance(md, dict) else None
    common = md.get("common_backend", "torch") if isinstance(md, dict) else None
    if backend != "torch_dist" or common != "torch":
        raise McoreDistError(f"{path}: sharded_backend {backend!r}, common_backend {common!r}; only Megatron-Core's "
                             f"'torch_dist' with 'torch' is read (re-save it with --ckpt-format torch_dist, or "
                             f"convert it with Megatron-LM's tools/checkpoint/convert.py)")


def _shard_files(it_dir: str) -> Dict[str, dict]:
    """The folder's `__R_I.distcp` files with their sizes (DCP writes no checksums: the index's
    offsets and lengths are checked against these sizes, and each chunk against its entry)."""
    out = {}
    for name in sorted(os.listdir(it_dir)):
        path = os.path.join(it_dir, name)
        if _SHARD_FILE.match(name):  # a link is listed so that the reader names it a link and refuses it
            out[name] = {"sha256": "", "bytes": os.lstat(path).st_size}
    return out


def _check_tiling(md, it_dir: str, names) -> None:
    """Each tensor's chunks must tile it: every element written exactly once. The reader already
    checks that each chunk lies inside the shape; here, in time linear in the chunk count (an
    index of 100,000 one-column chunks is cheap, where comparing all pairs was quadratic):

    - the chunks' volumes sum to the tensor's (no element counted twice, unless one is missed);
    - the corners of all chunks, each counted mod 2, are exactly the tensor's own 2^d corners.
      A box's indicator function is, mod 2, the sum of the orthant indicators at its corners, so
      this says every element is covered an odd number of times (at least once).
    Together: every element exactly once. A failure names the first corner out of place."""
    from collections import Counter
    from itertools import chain, product
    from math import prod
    where = os.path.join(it_dir, reader.INDEX)
    for name in names:
        entry = md.state_dict_metadata[name]
        shape = tuple(entry.size)
        chunks = entry.chunks  # offsets / sizes are torch.Size: tuples already, used as they are
        volume = sum(prod(c.sizes) for c in chunks)
        counts = Counter(chain.from_iterable(product(*zip(c.offsets, map(int.__add__, c.offsets, c.sizes)))
                                             for c in chunks))
        total = prod(shape)
        expected = set(product(*((0, x) for x in shape))) if total else set()
        got = {corner for corner, v in counts.items() if v & 1}
        if volume != total or got != expected:
            stray = sorted(got ^ expected)[:1]
            raise McoreDistError(f"{where}: chunks of {name[:120]!r} overlap or leave a gap ({len(chunks)} "
                                 f"chunks, {volume} elements for a shape of {total}"
                                 f"{f'; a corner out of place at {stray[0]}' if stray else ''}); refused")


def read_index(it_dir: str):
    """DCP's index of a Megatron-Core torch_dist folder, checked whole (see the module docstring)."""
    try:
        md = reader.read_metadata(it_dir)
        if not hasattr(md, "state_dict_metadata") or type(md.state_dict_metadata) is not dict:
            raise reader.DistCheckpointError(f"{os.path.join(it_dir, reader.INDEX)}: not a DCP Metadata; refused")
        allowed = [k for k in md.state_dict_metadata if isinstance(k, str) and _KNOWN_BYTES.search(k)]
        reader.check_index(md, it_dir, _shard_files(it_dir), allowed_bytes=allowed, source=SOURCE)
    except reader.DistCheckpointError as e:
        raise McoreDistError(str(e)) from None
    mcore = getattr(md, "mcore_data", None) or {}
    for name in reader.tensor_index(md):
        extra = mcore.get(name) if isinstance(mcore, dict) else None
        if extra and not name.startswith("optimizer."):
            what = sorted(map(str, extra))[:3] if isinstance(extra, dict) else type(extra).__name__
            raise McoreDistError(f"{os.path.join(it_dir, reader.INDEX)}: model tensor {name[:120]!r} is stored "
                                 f"reformulated ({what}); not read")
    return md


def read_common(it_dir: str) -> dict:
    """`common.pt`: Megatron's args, iteration, scheduler (through the Megatron-LM allowlist)."""
    path = os.path.join(it_dir, COMMON)
    if not os.path.lexists(path):
        raise McoreDistError(f"{path}: missing (a Megatron-Core torch_dist checkpoint keeps its args there)")
    try:
        safe_paths.regular_file(it_dir, COMMON, "common.pt")
    except OSError as e:
        raise McoreDistError(str(e)) from None
    state = legacy.safe_load_megatron(path)
    if not isinstance(state.get("args"), argparse.Namespace):
        raise McoreDistError(f"{path}: no Megatron `args` in the file")
    return state


def _num_layers(args, block: str, it_dir: str) -> int:
    n = getattr(args, f"{block}_num_layers", None) or getattr(args, "num_layers", None)
    if type(n) is not int or n < 1:
        raise McoreDistError(f"{os.path.join(it_dir, COMMON)}: args.num_layers is {str(n)[:40]!r}, not a layer count")
    return n


def _counter(it_dir: str, value, what: str) -> int:
    if type(value) is not int or value < 0:
        raise McoreDistError(f"{os.path.join(it_dir, COMMON)}: {what} is {str(value)[:40]!r}, not a count")
    return value


def _ours(targets: Dict[str, torch.Tensor], args, it_dir: str) -> Dict[str, torch.Tensor]:
    """Megatron-Core's global tensors (layer stacks split per layer) under this project's names."""
    flat = {}
    for name, t in targets.items():
        m = _STACKED.match(name)
        if m is None:
            flat[name] = t
            continue
        n = _num_layers(args, m.group(1), it_dir)
        if t.dim() < 1 or t.shape[0] != n:
            raise McoreDistError(f"{os.path.join(it_dir, reader.INDEX)}: {name[:120]!r} stacks {tuple(t.shape)[:1]} "
                                 f"layers, args.{m.group(1)}_num_layers / num_layers is {n}")
        for i in range(n):
            flat[f"{m.group(1)}.layers.{i}.{m.group(2)}"] = t[i]
    try:
        if legacy.is_t5(args):  # T5's own names (megatron_t5); the stacks are whole, no pipeline offset
            from megatron.checkpointing import megatron_t5
            return megatron_t5.convert_core_t5(flat, os.path.join(it_dir, reader.INDEX))
        return legacy.convert_core(flat, bool(getattr(args, "swiglu", False)))
    except legacy.MegatronCheckpointError as e:  # e.g. MoE experts, whose names this project has no layer for
        raise McoreDistError(f"{os.path.join(it_dir, reader.INDEX)}: {e}; not read") from None


def read_full(root: str) -> Tuple[argparse.Namespace, Dict[str, torch.Tensor], dict]:
    """Same contract as `megatron_legacy.read_full`: (Megatron's args, {our global name: full
    tensor, vocabulary rows as saved (padded)}, iteration / consumed samples / scheduler /
    source layout / format)."""
    it_dir, folder, iteration = _iteration_dir(root)
    if not os.path.isdir(it_dir):
        raise McoreDistError(f"{it_dir}: missing (named by {os.path.join(root, legacy.TRACKER)})")
    _check_backend(it_dir)
    common = read_common(it_dir)
    args = common["args"]
    md = read_index(it_dir)
    index = reader.tensor_index(md)
    names = [k for k in index if not k.startswith("optimizer.")]
    _check_tiling(md, it_dir, names)
    targets = {k: torch.empty(index[k][0], dtype=index[k][1]) for k in names}
    try:
        reader.read_tensors(md, it_dir, targets)
    except reader.DistCheckpointError as e:
        raise McoreDistError(str(e)) from None
    full = _ours(targets, args, it_dir)
    if not getattr(args, "untie_embeddings_and_output_weights", False):
        full.pop("output_layer.weight", None)  # the tied head is the word embeddings
    meta = {"iteration": _counter(it_dir, common.get("iteration", iteration), "iteration"),
            "release": folder == "release",
            "consumed_samples": _counter(it_dir, getattr(args, "consumed_train_samples", 0) or 0,
                                         "args.consumed_train_samples"),
            "opt_param_scheduler": common.get("opt_param_scheduler"),
            "checkpoint_version": common.get("checkpoint_version"),
            "tp": int(getattr(args, "tensor_model_parallel_size", 1) or 1),
            "pp": int(getattr(args, "pipeline_model_parallel_size", 1) or 1), "format": "core torch_dist",
            "optimizer_tensors": len(index) - len(names)}
    return args, undo_layernorm_1p(args, full), meta  # --apply-layernorm-1p stores w - 1


_MOMENTS = ("exp_avg", "exp_avg_sq")


def read_moments(root: str) -> Tuple[Optional[Dict[str, Dict[str, torch.Tensor]]], str]:
    """Adam's moments as Megatron-Core's (non-distributed) optimizer saves them in torch_dist,
    `optimizer.state.exp_avg.<parameter key>` at the parameter's global shape, and the step
    (`common.pt`'s optimizer.state.common_step): ({"exp_avg"|"exp_avg_sq": {our name: full
    tensor}, "step": tensor}, "") or (None, why they are not read)."""
    it_dir, _, _ = _iteration_dir(root)
    md = read_index(it_dir)
    index = reader.tensor_index(md)
    common = read_common(it_dir)
    names = {k: [n for n in index if n.startswith(f"optimizer.state.{k}.")] for k in _MOMENTS}
    if not names["exp_avg"]:
        other = sorted(n for n in md.state_dict_metadata if n.startswith("optimizer."))[:1]
        return None, (f"its optimizer entries ({other[0][:80]}, ...) are not Megatron-Core's per-parameter Adam "
                      f"state (the distributed optimizer's layouts are not read)" if other else
                      "it holds no optimizer state")
    mcore = getattr(md, "mcore_data", None) or {}
    if any((mcore.get(n) if isinstance(mcore, dict) else None) for k in _MOMENTS for n in names[k]):
        return None, "its optimizer state is the distributed optimizer's flattened layout (not read)"
    opt = common.get("optimizer")
    state = opt.get("state") if isinstance(opt, dict) else None
    step = state.get("common_step") if isinstance(state, dict) else None
    if not isinstance(step, torch.Tensor) or step.numel() != 1:
        return None, f"{os.path.join(it_dir, COMMON)} holds no optimizer.state.common_step"
    every = names["exp_avg"] + names["exp_avg_sq"]
    _check_tiling(md, it_dir, every)
    targets = {n: torch.empty(index[n][0], dtype=index[n][1]) for n in every}
    try:
        reader.read_tensors(md, it_dir, targets)
    except reader.DistCheckpointError as e:
        raise McoreDistError(str(e)) from None
    args = common["args"]
    out = {k: _ours({n[len(f"optimizer.state.{k}."):]: targets[n] for n in names[k]}, args, it_dir) for k in _MOMENTS}
    return {**out, "step": step.reshape(()).float()}, ""


def _load_moments(trainer, root: str, moments: dict) -> None:
    """Each parameter of this rank takes its TP shard of Megatron's moments (vocabulary rows fit
    to this run's padding, like the weights); the distributed optimizer cuts its DP shard."""
    from megatron.checkpointing.dist_format import _dim, _params
    ps = trainer.ps
    padded = trainer.cfg.model.padded_vocab_size(ps.tp_size)
    states = {}
    for key, p, _ in _params(trainer):
        if any(key not in moments[k] for k in _MOMENTS):
            raise McoreDistError(f"Megatron-Core checkpoint {root} holds Adam state for some parameters but not "
                                 f"{key}; load it with --no-load-optim")
        st = {"step": moments["step"].clone()}
        for k in _MOMENTS:
            t = moments[k][key]
            if legacy._VOCAB.search(key):
                t = legacy._fit_rows(t, padded)
            d = _dim(p)
            if d is not None:
                per = t.shape[d] // ps.tp_size
                t = t.narrow(d, ps.tp_rank * per, per)
            if tuple(t.shape) != tuple(p.shape):
                raise McoreDistError(f"{key}: Megatron-Core checkpoint {root} gives Adam state of shape "
                                     f"{tuple(t.shape)} on {ps.describe()}, the model has {tuple(p.shape)}")
            st[k] = t.to(p.device, torch.float32).clone()
        states[id(p)] = st
    trainer.optimizer.load_param_states(states)


def load_into_trainer(trainer, root: str) -> bool:
    """--load of a Megatron-Core torch_dist folder at this run's layout: the weights, counters
    and scheduler as `megatron_legacy.load_into_trainer` does, then Adam's moments and step when
    Megatron saved them per parameter (not with --no-load-optim or --finetune)."""
    import sys
    ck = trainer.cfg.checkpoint
    want = not (ck.no_load_optim or ck.finetune)
    moments, why = read_moments(root) if want else (None, "--no-load-optim / --finetune")
    note = {}

    def read(r):
        args, full, meta = read_full(r)
        if moments is not None:
            meta["optimizer_note"] = f"Adam's moments and step ({int(moments['step'])}) come from Megatron's optimizer"
        note.update(meta)
        return args, full, meta
    legacy.load_into_trainer(trainer, root, read=read)
    if moments is not None:
        _load_moments(trainer, root, moments)
    elif want and trainer.ps.rank == 0 and note.get("optimizer_tensors"):
        print(f"note: {root}: the optimizer starts fresh: {why}", file=sys.stderr, flush=True)
    return True
