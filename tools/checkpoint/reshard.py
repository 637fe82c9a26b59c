"""Re-split a GPT or T5 checkpoint of this project to another tensor / pipeline parallel layout.

Library half of `tools/checkpoint/convert.py`: read every `mp_rank_*` file of one iteration,
join the tensor-parallel shards into full tensors with global layer names, and cut them again
for the target layout (T5: encoder layers on pipeline ranks [0, split), decoder layers on
[split, pp), as `megatron.models.t5.t5_stage_layers` lays them out).
Only the model moves: optimizer state is sharded like the model and
is dropped (the loader starts it fresh and says so), as Megatron's converter does.
"""
from __future__ import annotations

import copy
import os
import re
from types import SimpleNamespace
from typing import Dict, Optional, Tuple

import torch

from megatron import safe_paths
from megatron.checkpointing.safety import UnsafeCheckpointError, safe_load
from megatron.checkpointing.torch_format import (CHECKPOINT_VERSION, TRACKER, CheckpointError, _atomic_write_bytes,
                                                 _write_manifest, checkpoint_path, read_tracker)
from megatron.config.core import ConfigError, ModelConfig
from megatron.planner.schedule.static import stage_layer_split

# Split along the output dimension (column-parallel and the vocabulary-parallel tables).
_DIM0 = re.compile(r"(query_key_value|\.query|key_value|dense_h_to_4h|dense_h_to_4h_gate)\.(weight|bias)$"
                   r"|(word_embeddings|output_layer)\.weight$|^lm_head_bias$")
# Split along the input dimension (row-parallel weights; their biases are replicated).
# T5's relative attention bias tables are [buckets, heads]: split by heads.
_DIM1 = re.compile(r"(self_attention\.dense|inter_attention\.dense|dense_4h_to_h|relative_bias)\.weight$")
_VOCAB = re.compile(r"(word_embeddings|output_layer)\.weight$|^lm_head_bias$")
_T5_LAYER = re.compile(r"(encoder|decoder)\.layers\.(\d+)\.(.*)")
_FILE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


class ReshardError(ValueError):
    pass


def partition_dim(name: str):
    if _DIM0.search(name):
        return 0
    if _DIM1.search(name):
        return 1
    return None


def _model_cfg(config: dict) -> ModelConfig:
    return ModelConfig(**config["model"])


def _stage_starts(config: dict, pp: int) -> Tuple[list, list]:
    par = config["parallel"]
    m = config["model"]
    vpp = par.get("num_layers_per_virtual_pipeline_stage")
    chunks = 1 if not vpp else m["num_layers"] // pp // vpp
    split = stage_layer_split(m["num_layers"], pp * chunks, par.get("pipeline_stage_layers"))
    return [sum(split[:i]) for i in range(len(split))], split


def t5_layout(config: dict) -> Tuple[list, int]:
    """(per pipeline rank ((enc_lo, enc_hi), (dec_lo, dec_hi)), split rank) of a T5 config dict."""
    from megatron.models.t5 import t5_split_rank, t5_stage_layers
    cfg = SimpleNamespace(model=_model_cfg(config), parallel=SimpleNamespace(**config["parallel"]))
    try:
        return t5_stage_layers(cfg), t5_split_rank(cfg)
    except ConfigError as e:
        raise ReshardError(str(e)) from None


def _t5_global(name: str, stage_layers) -> str:
    m = _T5_LAYER.match(name)
    if not m:
        return name
    lo = stage_layers[0 if m.group(1) == "encoder" else 1][0]
    return f"{m.group(1)}.layers.{lo + int(m.group(2))}.{m.group(3)}"


def read_full_model(root: str, iteration: int = None) -> Tuple[dict, Dict[str, torch.Tensor], dict]:
    """-> (config, {global name: full tensor}, metadata) for one iteration of a GPT or T5 checkpoint.
    Tied copies (T5's first decoder stage embedding and last stage LM head) are read once."""
    try:
        iteration = read_tracker(root) if iteration is None else iteration
    except CheckpointError as e:  # a tracker that is a FIFO, a link, or not a number
        raise ReshardError(str(e)) from None
    if iteration is None:
        raise ReshardError(f"{root}: no {TRACKER}; give --iteration")
    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    if not os.path.isdir(it_dir):
        raise ReshardError(f"{it_dir} does not exist")
    shards: Dict[str, dict] = {}
    config = meta = None
    for sub in sorted(os.listdir(it_dir)):
        m = _FILE.match(sub)
        if not m:
            continue
        tp_rank, pp_rank = int(m.group(1)), int(m.group(2) or 0)
        try:  # a link (iteration or rank folder, file) or a special file is refused before torch.load
            state = safe_load(safe_paths.regular_file(root, os.path.join(os.path.basename(it_dir), sub,
                                                                         "model_optim_rng.pt"), "rank file"))
        except (UnsafeCheckpointError, safe_paths.UnsafePathError) as e:
            raise ReshardError(str(e)) from None
        config = config or state["config"]
        meta = meta or {k: state.get(k) for k in ("iteration", "consumed_samples", "skipped_iters", "consumed_tokens")}
        pp = config["parallel"]["pipeline_model_parallel_size"]
        t5 = config["model"]["model_type"] == "t5"
        if t5:
            layout, _ = t5_layout(config)
        else:
            starts, _ = _stage_starts(config, pp)
        for sid, sd in state["model"].items():
            for name, t in sd.items():
                if t5:
                    if name == "output_layer.weight" and not config["model"].get("untie_embeddings_and_output_weights"):
                        continue  # the last stage's copy of the tied word embedding
                    g = _t5_global(name, layout[sid])
                else:
                    lm = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
                    g = f"decoder.layers.{starts[sid] + int(lm.group(1))}.{lm.group(2)}" if lm else name
                shards.setdefault(g, {})[tp_rank] = t
    if config is None:
        raise ReshardError(f"{it_dir} holds no mp_rank_* checkpoint files")
    tp = config["parallel"]["tensor_model_parallel_size"]
    vocab = config["model"]["vocab_size"]
    full = {}
    for name, by_rank in shards.items():
        if sorted(by_rank) != list(range(tp)):
            raise ReshardError(f"{name}: found TP ranks {sorted(by_rank)}, expected 0..{tp - 1} (missing files?)")
        d = partition_dim(name)
        t = by_rank[0] if d is None else torch.cat([by_rank[r] for r in range(tp)], dim=d)
        if _VOCAB.search(name):
            t = t[:vocab]  # drop the padding of the source TP size
        full[name] = t
    return config, full, meta


def write_resharded(config: dict, full: Dict[str, torch.Tensor], meta: dict, out: str, tp: int, pp: int,
                    split_rank: Optional[int] = None) -> str:
    """Write `full` as a checkpoint at (tp, pp), uniform stages; returns the iteration folder.
    T5 at pp > 1 puts the decoder from pipeline rank `split_rank` on (default: the source's split
    when pp is unchanged, else pp // 2)."""
    cfg = copy.deepcopy(config)
    par = cfg["parallel"]
    t5 = cfg["model"]["model_type"] == "t5"
    if t5:
        if pp == 1:
            split_rank = None
        elif split_rank is None:
            same = par.get("pipeline_model_parallel_size") == pp
            split_rank = par.get("pipeline_model_parallel_split_rank") if same else pp // 2
        par["pipeline_model_parallel_split_rank"] = split_rank
    par.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp,
               num_layers_per_virtual_pipeline_stage=None, pipeline_stage_layers=None)
    model = _model_cfg(cfg)
    if model.num_attention_heads % tp or model.query_groups % tp or model.ffn_hidden_size % tp:
        raise ReshardError(f"--target-tensor-parallel-size {tp} does not divide the heads, query groups or FFN size")
    if t5:
        return _write_t5(cfg, model, full, meta, out, tp, pp)
    if model.num_layers % pp:
        raise ReshardError(f"--target-pipeline-parallel-size {pp} does not divide --num-layers {model.num_layers}")
    padded = model.padded_vocab_size(tp)
    starts, split = _stage_starts(cfg, pp)
    tied = not model.untie_embeddings_and_output_weights
    iteration = meta["iteration"]
    for p in range(pp):
        lo, hi = starts[p], starts[p] + split[p]
        for r in range(tp):
            sd = {}
            for name, t in full.items():
                lm = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
                if lm:
                    i = int(lm.group(1))
                    if not lo <= i < hi:
                        continue
                    local = f"decoder.layers.{i - lo}.{lm.group(2)}"
                elif name.startswith("embedding."):
                    if p != 0:
                        continue
                    local = name
                elif name.startswith(("final_layernorm.", "output_layer.")):
                    if p != pp - 1:
                        continue
                    local = name
                else:
                    raise ReshardError(f"do not know which stage holds {name}")
                if _VOCAB.search(name):
                    t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
                d = partition_dim(name)
                if d is not None:
                    per = t.shape[d] // tp
                    t = t.narrow(d, r * per, per)
                sd[local] = t.clone()
            if tied and pp > 1 and p == pp - 1 and "output_layer.weight" not in sd:
                w = full["embedding.word_embeddings.weight"]  # the last stage's tied copy of the table
                w = torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])])
                sd["output_layer.weight"] = w.narrow(0, r * (padded // tp), padded // tp).clone()
            if tied and pp == 1:
                sd.pop("output_layer.weight", None)  # one stage holds the table once
            _save_rank(out, cfg, meta, r, p, pp, sd)
    return _finish(out, iteration)


def _save_rank(out, cfg, meta, r, p, pp, sd) -> None:
    state = {"checkpoint_version": CHECKPOINT_VERSION, "config": cfg, **meta, "model": {p: sd},
             "optimizer": None, "opt_param_scheduler": None, "rng_state": None, "logger": {}}
    path = checkpoint_path(out, meta["iteration"], r, p, pp)
    digest = _atomic_write_bytes(path, lambda f: torch.save(state, f))
    _atomic_write_bytes(path + ".sha256", lambda f: f.write(f"{digest}  model_optim_rng.pt\n".encode()))


def _finish(out, iteration) -> str:
    _write_manifest(out, iteration)
    _atomic_write_bytes(os.path.join(out, TRACKER), lambda f: f.write(f"{iteration}\n".encode()))
    return os.path.join(out, f"iter_{iteration:07d}")


def _shard(name: str, t: torch.Tensor, padded: int, tp: int, r: int) -> torch.Tensor:
    if _VOCAB.search(name):
        t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
    d = partition_dim(name)
    if d is not None:
        per = t.shape[d] // tp
        t = t.narrow(d, r * per, per)
    return t.clone()


def _write_t5(cfg: dict, model: ModelConfig, full: Dict[str, torch.Tensor], meta: dict, out: str, tp: int,
              pp: int) -> str:
    """T5 stages: embedding on rank 0 and the split rank, the encoder's final norm where the
    encoder ends, the decoder's final norm, LM-head bias and `output_layer.weight` on the last
    rank: its own table when untied, else (unless the split rank is last) a copy of the tied
    word embedding."""
    layout, split = t5_layout(cfg)
    padded = model.padded_vocab_size(tp)
    for p in range(pp):
        (e0, e1), (d0, d1) = layout[p]
        for r in range(tp):
            sd = {}
            for name, t in full.items():
                m = _T5_LAYER.match(name)
                if m:
                    lo, hi = (e0, e1) if m.group(1) == "encoder" else (d0, d1)
                    i = int(m.group(2))
                    if not lo <= i < hi:
                        continue
                    local = f"{m.group(1)}.layers.{i - lo}.{m.group(3)}"
                elif name.startswith("embedding."):
                    if p not in (0, split):
                        continue
                    local = name
                elif name.startswith("encoder_final_layernorm."):
                    if not (e1 == model.encoder_num_layers and e1 > e0):
                        continue
                    local = name
                elif name.startswith("decoder_final_layernorm.") or name in ("lm_head_bias", "output_layer.weight"):
                    if p != pp - 1:
                        continue
                    local = name
                else:
                    raise ReshardError(f"do not know which T5 stage holds {name}")
                sd[local] = _shard(name, t, padded, tp, r)
            if pp > 1 and p == pp - 1 and p != split and not model.untie_embeddings_and_output_weights:
                sd["output_layer.weight"] = _shard("output_layer.weight", full["embedding.word_embeddings.weight"],
                                                   padded, tp, r)
            _save_rank(out, cfg, meta, r, p, pp, sd)
    return _finish(out, meta["iteration"])
