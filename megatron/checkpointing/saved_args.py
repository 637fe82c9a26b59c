"""--use-checkpoint-args: the model-shape flags a --load checkpoint was trained with, read from its
small metadata (this project's config in `torch` / `torch_dist` folders; Megatron-LM's `args`
in its legacy, Megatron-Core torch and torch_dist folders), applied as Megatron-LM's
`load_args_from_checkpoint` applies them: sizes fill flags the command line left unset; the
architecture choices (and TP / PP sizes) are taken from the checkpoint whatever was typed."""
from __future__ import annotations

import glob
import os
from typing import List, Tuple

from megatron.config.errors import ConfigError

# (our CLI dest, forced?): forced ones follow the checkpoint even when typed, as in Megatron-LM
FIELDS = (("num_layers", False), ("hidden_size", False), ("ffn_hidden_size", False), ("seq_length", False),
          ("num_attention_heads", False), ("kv_channels", False), ("max_position_embeddings", False),
          ("position_embedding_type", True), ("rotary_percent", True), ("rotary_base", True),
          ("add_bias_linear", True), ("swiglu", True), ("untie_embeddings_and_output_weights", True),
          ("normalization", True), ("activation_func", True), ("gated_linear_unit", True),
          ("encoder_num_layers", False), ("decoder_num_layers", False), ("encoder_seq_length", False),
          ("decoder_seq_length", False))


def _rank0_file(it_dir: str) -> str:
    files = sorted(glob.glob(os.path.join(it_dir, "mp_rank_00*", "model_optim_rng.pt")))
    if not files:
        raise ConfigError(f"--use-checkpoint-args: no mp_rank_00*/model_optim_rng.pt under {it_dir}")
    return files[0]


def saved_fields(root: str) -> Tuple[dict, dict, int, int]:
    """(model fields in this project's names, tokenizer fields, TP, PP) of the tracked iteration."""
    from megatron.checkpointing import dist_format, mcore_dist
    from megatron.checkpointing import megatron_legacy as legacy
    try:
        folder, _ = legacy.read_tracker(root)
        it_dir = os.path.join(root, folder)
        if os.path.exists(os.path.join(it_dir, "common.json")):  # this project's torch_dist
            config = dist_format.read_common(it_dir)["config"]
            return _ours(config)
        if mcore_dist.detect(root):
            return _megatron(mcore_dist.read_common(it_dir)["args"])
        if legacy.detect(root):
            return _megatron(legacy.safe_load_megatron(_rank0_file(it_dir))["args"])
        import torch
        state = torch.load(_rank0_file(it_dir), map_location="cpu", weights_only=True)
        return _ours(state["config"])
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"--use-checkpoint-args: cannot read the model settings of --load {root}: {e}") from None


def _ours(config: dict):
    m, p, d = config["model"], config["parallel"], config.get("data") or {}
    fields = dict(m)
    if m.get("model_type") == "t5":  # the flag --num-layers is per stack
        fields["num_layers"] = m.get("encoder_num_layers")
    fields["group_query_attention"] = m.get("num_query_groups") is not None
    tok = {k: d.get(k) for k in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")}
    tok["vocab_size"] = m.get("vocab_size") if not d.get("tokenizer_type") else None
    return fields, tok, p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"]


def _megatron(args):
    from megatron.checkpointing import megatron_legacy as legacy
    fields = legacy.model_fields(args)
    if fields.get("model_type") == "t5":  # back to the flags' meaning: --num-layers is per stack
        fields["num_layers"] = fields["encoder_num_layers"]
    fields["group_query_attention"] = fields.get("num_query_groups") is not None
    fields["rotary_percent"] = getattr(args, "rotary_percent", None)
    fields["rotary_base"] = getattr(args, "rotary_base", None)
    tok = {"tokenizer_type": getattr(args, "tokenizer_type", None), "vocab_size": None}
    if tok["tokenizer_type"] == "NullTokenizer":
        tok["vocab_size"] = getattr(args, "vocab_size", None)
    return fields, tok, getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)


def apply_checkpoint_args(args) -> List[str]:
    """Megatron's load_args_from_checkpoint on our flags; returns one note per changed flag."""
    if not args.load:
        raise ConfigError("--use-checkpoint-args needs --load")
    fields, tok, tp, pp = saved_fields(args.load)
    notes = []

    def put(name, value, force):
        if value is None or not hasattr(args, name):
            return
        current = getattr(args, name)
        if current == value or (not force and current is not None):
            return
        setattr(args, name, value)
        notes.append(f"note: --use-checkpoint-args: {name} = {value} from {args.load}")

    for name, force in FIELDS:
        put(name, fields.get(name), force)
    put("group_query_attention", fields.get("group_query_attention"), True)
    put("num_query_groups", fields.get("num_query_groups"), True)
    put("tokenizer_type", tok.get("tokenizer_type"), False)
    if args.tokenizer_type is None or args.tokenizer_type == "NullTokenizer":
        put("vocab_size", tok.get("vocab_size"), False)
    put("tensor_model_parallel_size", tp, True)
    put("pipeline_model_parallel_size", pp, True)
    return notes
