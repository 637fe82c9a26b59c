"""Writing checkpoints as Megatron-LM's legacy code writes them (GPT; T5 via `megatron_t5`), for Megatron-LM's own
`--load`, its `tools/checkpoint` loaders and transformers' Megatron converters. The reading side
and the name mapping are in `checkpoint_megatron_legacy`."""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Dict, Optional

import torch

from megatron.checkpointing.megatron_base import _pad_rows, megatron_rng_state, megatron_scheduler  # noqa: F401
from megatron.checkpointing.megatron_legacy import (_VOCAB, TRACKER, MegatronCheckpointError,
                                                 partition_dim)


def tokenizer_fields(data: Optional[dict], vocab_size: int) -> dict:
    """Megatron's tokenizer args for a run whose data config is `data` (None: no tokenizer).

    Megatron's `check_checkpoint_args` compares `tokenizer_type` whenever `--vocab-file` is given,
    and transformers' Megatron GPT-2 converter picks the tokenizer from it, so it is never None.
    A run without a tokenizer (generated tokens, --vocab-size) is what Megatron calls
    NullTokenizer, whose --vocab-size is one less than the model's (it adds an end-of-document id)."""
    data = data or {}
    kind = data.get("tokenizer_type") or "NullTokenizer"
    out = dict(tokenizer_type=kind, vocab_file=data.get("vocab_file"), merge_file=data.get("merge_file"),
               tokenizer_model=data.get("tokenizer_model"), vocab_size=vocab_size)
    if kind == "NullTokenizer":
        out["vocab_size"] = vocab_size - 1
    return out


def megatron_args(model: dict, tp: int, pp: int, iteration: int, consumed_samples: int,
                  vocab_size: int, padded_vocab: int, extra: Optional[dict] = None,
                  tokenizer: Optional[dict] = None) -> argparse.Namespace:
    """Megatron's `args` with every field its loaders (`check_checkpoint_args`,
    `tools/checkpoint_util.py`'s loader) and transformers' Megatron converters read.
    `tokenizer`: the run's data config (its tokenizer fields), see `tokenizer_fields`."""
    gqa = model.get("num_query_groups") not in (None, model["num_attention_heads"])
    a = dict(num_layers=model["num_layers"], hidden_size=model["hidden_size"],
             num_attention_heads=model["num_attention_heads"], ffn_hidden_size=model["ffn_hidden_size"],
             kv_channels=model.get("kv_channels") or model["hidden_size"] // model["num_attention_heads"],
             max_position_embeddings=model.get("max_position_embeddings"), seq_length=model.get("seq_length"),
             encoder_seq_length=model.get("seq_length"), padded_vocab_size=padded_vocab, vocab_size=vocab_size,
             orig_vocab_size=vocab_size,  # transformers' converters export this many rows (else the padded)
             make_vocab_size_divisible_by=model.get("make_vocab_size_divisible_by", 128),
             tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
             virtual_pipeline_model_parallel_size=None, data_parallel_random_init=False,
             consumed_train_samples=consumed_samples, consumed_valid_samples=0, iteration=iteration,
             swiglu=bool(model.get("swiglu")), normalization=model.get("normalization", "LayerNorm"),
             add_bias_linear=model.get("add_bias_linear", True), add_position_embedding=model.get(
                 "position_embedding_type", "learned_absolute") == "learned_absolute",
             position_embedding_type=model.get("position_embedding_type", "learned_absolute"),
             untie_embeddings_and_output_weights=bool(model.get("untie_embeddings_and_output_weights")),
             group_query_attention=gqa, num_query_groups=model.get("num_query_groups") if gqa else None,
             layernorm_epsilon=model.get("layernorm_epsilon", 1e-5), norm_epsilon=model.get("layernorm_epsilon", 1e-5),
             params_dtype=torch.float32, fp16=False, bf16=False, openai_gelu=False, onnx_safe=None,
             bias_gelu_fusion=model.get("activation_func", "gelu") != "gelu-erf",
             apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True,
             apply_residual_connection_post_layernorm=False, hidden_dropout=model.get("hidden_dropout", 0.1),
             attention_dropout=model.get("attention_dropout", 0.1), use_distributed_optimizer=False,
             num_experts=None, rotary_percent=model.get("rotary_percent", 1.0),
             rotary_base=model.get("rotary_base", 10000), use_rotary_position_embeddings=model.get(
                 "position_embedding_type") == "rope")
    if model.get("model_type") == "t5":
        a.update(encoder_num_layers=model.get("encoder_num_layers"), decoder_num_layers=model.get("decoder_num_layers"),
                 decoder_seq_length=model.get("decoder_seq_length"), encoder_seq_length=model.get("encoder_seq_length"))
    a.update(tokenizer_fields(tokenizer, vocab_size))
    a.update(extra or {})
    return argparse.Namespace(**a)


# Megatron-LM's legacy model named its norms `*_layernorm` up to 23.x (v2.x, the DynaPipe fork,
# what transformers' Megatron converters read) and `*_norm` from core_v0.5 on.
NORM_NAMES = ("layernorm", "norm")


def _layer_to_legacy(rest: str, norm_names: str) -> str:
    # Our layer names are the legacy model's (and its checkpoint version 3.0 QKV order).
    if norm_names == "norm":
        rest = rest.replace("input_layernorm.", "input_norm.").replace("post_attention_layernorm.",
                                                                        "post_attention_norm.")
    return rest


def to_legacy_model(local: Dict[str, torch.Tensor], pre_process: bool, post_process: bool, tied: bool,
                    pp: int, norm_names: str = "layernorm") -> dict:
    """One GPT stage's state dict in our names (stage-local layers, this TP rank's shards) ->
    the legacy model's nested dict."""
    lm: dict = {}
    for k, v in local.items():
        if k.endswith("dense_h_to_4h_gate.weight") or k.endswith("dense_h_to_4h_gate.bias"):
            continue
        gate = k.replace("dense_h_to_4h", "dense_h_to_4h_gate")
        if k.endswith(("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")) and gate in local:
            v = torch.cat([local[gate], v])  # Megatron's [gate; up] per TP rank
        m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", k)
        if m:
            lm.setdefault("encoder", {})[f"layers.{m.group(1)}.{_layer_to_legacy(m.group(2), norm_names)}"] = v
        elif k == "embedding.word_embeddings.weight":
            lm.setdefault("embedding", {}).setdefault("word_embeddings", {})["weight"] = v
        elif k == "embedding.position_embeddings":
            lm.setdefault("embedding", {}).setdefault("position_embeddings", {})["weight"] = v
        elif k.startswith("final_layernorm."):
            name = k if norm_names == "layernorm" else k.replace("final_layernorm", "final_norm")
            lm.setdefault("encoder", {})[name] = v
        elif k == "output_layer.weight" and not tied:
            lm["output_layer"] = {"weight": v}
        elif k != "output_layer.weight":
            raise MegatronCheckpointError(f"no legacy Megatron name for {k}")
    out = {"language_model": lm}
    if tied and post_process and not pre_process:
        out["word_embeddings_for_head"] = {"weight": local["output_layer.weight"]}
    return out


def write_full(out: str, model: dict, full: Dict[str, torch.Tensor], meta: dict, tp: int, pp: int,
               release: bool = True, norm_names: Optional[str] = None, atomic_write=None,
               split: Optional[int] = None, tokenizer: Optional[dict] = None, ep: int = 1) -> str:
    """Write a GPT `full` model ({our global name: tensor}, vocabulary rows unpadded) as
    Megatron-LM writes it: `release/` (tracker `release`) for a converted checkpoint, else
    `iter_NNNNNNN`; `atomic_write(path, write_fn) -> sha256 hex` is the checkpoint writer's
    (`megatron.checkpointing.torch_format._atomic_write_bytes`, passed in: that module
    dispatches to this one); `norm_names` picks the release's spelling (NORM_NAMES; default
    `layernorm` for GPT, `norm` for T5). Integrity
    data (sha256 of every file) goes to `<folder>/manifest.json`, never beside a model file.
    T5 (`megatron_t5`): encoder on pipeline ranks [0, split), decoder on [split, pp) (split
    default pp // 2). `tokenizer`: the source run's data config (`tokenizer_fields`). An MoE GPT
    is written in Megatron-Core's names at EP `ep` (`megatron_moe_write`). Returns the
    iteration folder."""
    from megatron.config.core import ModelConfig
    t5 = model.get("model_type", "gpt") == "t5"
    cfg = ModelConfig(**model)
    L = cfg.num_layers
    norm_names = norm_names or ("norm" if t5 else "layernorm")  # core_v0.9.0's legacy T5 / GPT for converters
    if t5:
        from megatron.checkpointing import megatron_t5
        megatron_t5.check_writable(model)
        split = (split or pp // 2) if pp > 1 else 0
        ranges = megatron_t5.stage_ranges(cfg.encoder_num_layers, cfg.decoder_num_layers, pp, split)
    if (L % pp and not t5) or cfg.num_attention_heads % tp or cfg.ffn_hidden_size % tp:
        raise MegatronCheckpointError(f"TP {tp} x PP {pp} does not divide the layers, heads or FFN size")
    padded = cfg.padded_vocab_size(tp)
    tied = not cfg.untie_embeddings_and_output_weights
    iteration = meta.get("iteration", 0)
    folder = "release" if release else f"iter_{iteration:07d}"
    it_dir = os.path.join(out, folder)
    args = megatron_args(model, tp, pp, iteration, meta.get("consumed_samples", 0), cfg.vocab_size, padded,
                         megatron_t5.t5_args_fields(model, pp, split) if t5 else None, tokenizer)
    if model.get("moe"):
        from megatron.checkpointing import megatron_moe_write
        return megatron_moe_write.write_full(out, model, full, meta, tp, pp, ep, args, atomic_write, release)
    elif ep != 1:
        raise MegatronCheckpointError(f"expert parallel size {ep} for a model without experts: give 1")
    per = L // pp
    files = {}
    for p in range(pp):
        for r in range(tp):
            local = {}
            for name, t in full.items():
                m = None if t5 else re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
                if t5:
                    here, name = megatron_t5.stage_of(name, ranges, p, split, pp)
                    if not here:
                        continue
                elif m:
                    i = int(m.group(1))
                    if not p * per <= i < (p + 1) * per:
                        continue
                    name = f"decoder.layers.{i - p * per}.{m.group(2)}"
                elif name.startswith("embedding.") and p != 0:
                    continue
                elif name.startswith(("final_layernorm.", "output_layer.")) and p != pp - 1:
                    continue
                if _VOCAB.search(name):
                    t = _pad_rows(t, padded)
                d = partition_dim(name)
                if d is not None:
                    n = t.shape[d] // tp
                    t = t.narrow(d, r * n, n)
                local[name] = t.contiguous().clone()
            first = p in (0, split) if t5 else p == 0
            if tied and p == pp - 1 and pp > 1 and not first:
                w = _pad_rows(full["embedding.word_embeddings.weight"], padded)
                local["output_layer.weight"] = w.narrow(0, r * (padded // tp), padded // tp).clone()
            nested = megatron_t5.to_legacy_t5(local, first, p == pp - 1, norm_names) if t5 else \
                to_legacy_model(local, p == 0, p == pp - 1, tied, pp, norm_names)
            state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": nested,
                     "rng_state": megatron_rng_state()}
            sched = megatron_scheduler(meta.get("opt_param_scheduler"))
            if sched is not None:
                state["opt_param_scheduler"] = sched
            sub = f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{p:03d}"
            path = os.path.join(it_dir, sub, "model_optim_rng.pt")
            digest = atomic_write(path, lambda f: torch.save(state, f))
            files[os.path.join(sub, "model_optim_rng.pt")] = {"sha256": digest, "bytes": os.path.getsize(path)}
    body = json.dumps({"iteration": iteration, "checkpoint_version": 3.0, "format": "megatron-legacy",
                       "files": files}, indent=1, sort_keys=True).encode()
    atomic_write(os.path.join(it_dir, "manifest.json"), lambda f: f.write(body))
    tracker = "release" if release else str(iteration)
    atomic_write(os.path.join(out, TRACKER), lambda f: f.write(tracker.encode()))
    return it_dir


def save_from_trainer(trainer, root: str, ops) -> str:
    """`--ckpt-format megatron-legacy` (GPT and T5): every rank's stages as Megatron-LM's legacy code
    writes them (`iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt`, virtual stages `model0`,
    `model1`, ...), then (rank 0) the manifest with every file's sha256 and the tracker.
    What it keeps is what Megatron-LM can use: weights, counters in `args`, scheduler, RNG and
    the optimizer in Megatron's non-distributed form (`megatron_optim.megatron_optimizer_state`),
    or with --use-distributed-optimizer in Megatron-Core's `distrib_optim.pt` beside the model
    file. `ops`: the checkpoint writer's atomic_write, barrier, move_tracker, write_error,
    claim_and_clean, mark_saving and unmark."""
    _atomic_write_bytes, _barrier, _move_tracker = ops.atomic_write, ops.barrier, ops.move_tracker
    _write_error = ops.write_error
    from megatron.checkpointing.dist_format import sha256_digest
    cfg, ps = trainer.cfg, trainer.ps
    model = cfg.to_dict()["model"]
    t5 = model.get("model_type", "gpt") == "t5"
    t5_fields = _t5_trainer_fields(cfg, ps, model) if t5 else None
    it_dir = os.path.join(root, f"iter_{trainer.iteration:07d}")
    tied = not cfg.model.untie_embeddings_and_output_weights
    padded = cfg.model.padded_vocab_size(ps.tp_size)
    try:
        # the writer's lock on --save and the in-progress marker, as every save of this project
        ops.claim_and_clean(ps, root)
        if ps.rank == 0:
            ops.mark_saving(it_dir)
        _barrier()
        # The optimizer's per-parameter state (a collective over DP with the distributed optimizer).
        moments = None if getattr(cfg.checkpoint, "no_save_optim", False) else trainer.optimizer.param_states()
        if ps.dp_rank == 0:
            from megatron.checkpointing.megatron_optim import legacy_order, optimizer_for_file
            gbs = cfg.training.global_batch_size
            args = megatron_args(model, ps.tp_size, ps.pp_size, trainer.iteration, trainer.consumed_samples,
                                 cfg.model.vocab_size, padded, dict(t5_fields or {}, global_batch_size=gbs,
                                                                    micro_batch_size=cfg.training.micro_batch_size),
                                 tokenizer=cfg.to_dict()["data"])
            args.virtual_pipeline_model_parallel_size = len(trainer.stages) if len(trainer.stages) > 1 else None
            state = {"args": args, "checkpoint_version": 3.0, "iteration": trainer.iteration,
                     "rng_state": megatron_rng_state(),
                     "opt_param_scheduler": megatron_scheduler(trainer.lr_scheduler.state_dict(),
                                                               cfg.training.weight_decay, gbs)}
            chunks = [trainer.stages[sid] for sid in sorted(trainer.stages)]
            if t5:  # Megatron's legacy T5 of core_v0.5 and later (`*_norm` names)
                from megatron.checkpointing.megatron_t5 import to_legacy_t5

                def to_nested(s, sd):
                    return to_legacy_t5(sd, s.pre_process or s.pre_process_decoder, s.post_process, "norm")
            else:
                def to_nested(s, sd):
                    return to_legacy_model(sd, s.pre_process, s.post_process, tied, ps.pp_size)
            nested = [to_nested(s, {k: v.detach().clone() for k, v in s.state_dict().items()}) for s in chunks]
            # Megatron's optimizer order is rebuilt from the legacy GPT's parameter order; T5's is not
            # reproduced, so a T5 file carries no optimizer (Megatron then needs --no-load-optim).
            optim, distrib = (None, None) if t5 else optimizer_for_file(trainer, chunks, moments, to_nested)
            if not t5:
                nested = [legacy_order(n) for n in nested]
            if optim is not None:
                state["optimizer"] = optim
            args.use_distributed_optimizer = distrib is not None
            args.data_parallel_size = ps.dp_size
            if len(nested) == 1:
                state["model"] = nested[0]
            else:
                state.update({f"model{i}": m for i, m in enumerate(nested)})
            sub = f"mp_rank_{ps.tp_rank:02d}" if ps.pp_size == 1 else f"mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}"
            _atomic_write_bytes(os.path.join(it_dir, sub, "model_optim_rng.pt"), lambda f: torch.save(state, f))
            if distrib is not None:  # Megatron-Core's distributed optimizer: its state beside the model file
                _atomic_write_bytes(os.path.join(it_dir, sub, "distrib_optim.pt"), lambda f: torch.save(distrib, f))
        _barrier()
        if ps.rank == 0:
            files = {}
            for sub in sorted(os.listdir(it_dir)):
                for name in ("model_optim_rng.pt", "distrib_optim.pt"):
                    path = os.path.join(it_dir, sub, name)
                    if os.path.exists(path):
                        files[os.path.join(sub, name)] = {"sha256": sha256_digest(path).hex(),
                                                          "bytes": os.path.getsize(path)}
            body = json.dumps({"iteration": trainer.iteration, "checkpoint_version": 3.0,
                               "format": "megatron-legacy", "files": files}, indent=1, sort_keys=True).encode()
            _atomic_write_bytes(os.path.join(it_dir, "manifest.json"), lambda f: f.write(body))
            ops.unmark(it_dir)
            _move_tracker(root, trainer.iteration, "megatron-legacy")
        _barrier()
    except OSError as e:
        raise _write_error(ps, root, e) from e
    return it_dir


def save_failed(ps, root: str, iteration: int, e: BaseException, read_tracker) -> str:
    """The one line of a save that failed before its tracker moved: what was kept and that the run stops."""
    try:
        kept = read_tracker(root)
    except Exception:  # noqa: BLE001 - the line is about the failed save; the tracker is only context
        kept = None
    what = f"the previous checkpoint (iteration {kept}) is intact" if kept is not None else "no earlier checkpoint"
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return (f"{ps.describe()}: --ckpt-format megatron-legacy could not save iteration {iteration} "
            f"({type(e).__name__}: {first}); nothing under --save {root} was replaced ({what}); the "
            f"run stops: save with --ckpt-format torch")


def cannot_save(cfg, ps) -> Optional[str]:
    """At start-up, what a megatron-legacy save of this run would refuse (T5's split, which needs the
    model's stage layout): the reason, before the first iteration instead of at the first save."""
    if cfg.checkpoint.ckpt_format != "megatron-legacy" or not cfg.checkpoint.save or cfg.model.model_type != "t5":
        return None
    try:
        _t5_trainer_fields(cfg, ps, cfg.to_dict()["model"])
    except MegatronCheckpointError as e:
        return str(e)
    return None


def _t5_trainer_fields(cfg, ps, model: dict) -> dict:
    """Megatron's T5 args fields for this run; refuses what Megatron's T5 cannot hold (uneven
    --pipeline-stage-layers included: Megatron splits each stack evenly)."""
    from megatron.checkpointing import megatron_t5
    from megatron.models.t5 import t5_split_rank, t5_stage_layers
    try:
        megatron_t5.check_writable(model)
        split = t5_split_rank(cfg)
        even = megatron_t5.stage_ranges(model["encoder_num_layers"], model["decoder_num_layers"], ps.pp_size, split)
    except MegatronCheckpointError as e:
        raise MegatronCheckpointError(f"--ckpt-format megatron-legacy (rank {ps.rank}): {e}; save with "
                                      f"--ckpt-format torch instead") from None
    if [tuple(map(tuple, x)) for x in t5_stage_layers(cfg)] != [tuple(map(tuple, x)) for x in even]:
        raise MegatronCheckpointError(f"--ckpt-format megatron-legacy (rank {ps.rank}): --pipeline-stage-layers "
                                      f"splits T5 unevenly, which Megatron-LM cannot load; use --ckpt-format torch")
    return megatron_t5.t5_args_fields(model, ps.pp_size, split)
