"""One-line advice for a --load that cannot be used as it is, and the settings a checkpoint and
the run loading it must share (no model, no torch needed)."""
from __future__ import annotations

import os
import re
from typing import Optional

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
    ("model", "normalization", "--normalization"),
    ("model", "swiglu", "--swiglu"),
    ("model", "add_bias_linear", "--disable-bias-linear"),
    ("model", "num_query_groups", "--num-query-groups"),
    ("model", "rotary_percent", "--rotary-percent"),
    ("model", "rotary_base", "--rotary-base"),
    ("parallel", "tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("parallel", "pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("parallel", "num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
    ("parallel", "pipeline_stage_layers", "--pipeline-stage-layers"),
    ("parallel", "pipeline_model_parallel_split_rank", "--pipeline-model-parallel-split-rank"),
    ("parallel", "stage_parallel", "--aceso-config (per-stage TP x DP sizes)"),
]


def _padded(vocab, divisible_by, tp: int):
    multiple = (divisible_by or 1) * tp
    return -(-vocab // multiple) * multiple


def vocab_mismatch(saved: dict, current: dict, flag: str) -> Optional[str]:
    """Megatron compares the padded vocabulary (`padded_vocab_size`), not the tokenizer's: a
    checkpoint that records its padded table (50304, e.g. converted from Megatron-LM's GPT-2 BPE
    run or Hugging Face's Megatron converter) loads in a run whose tokenizer has 50257 ids when
    both pad to the same size at this run's TP. None when they agree, else one line."""
    a, b = saved.get("model", {}), current.get("model", {})
    va, vb = a.get("vocab_size"), b.get("vocab_size")
    if va == vb:
        return None
    tp = current.get("parallel", {}).get("tensor_model_parallel_size") or 1
    if not isinstance(va, int) or not isinstance(vb, int):
        return f"{flag}: checkpoint has {va}, this run has {vb}"
    pa = _padded(va, a.get("make_vocab_size_divisible_by"), tp)
    pb = _padded(vb, b.get("make_vocab_size_divisible_by"), tp)
    if pa == pb:
        return None
    return (f"{flag}: checkpoint has {va} (padded {pa}), this run has {vb} (padded {pb} with "
            f"--make-vocab-size-divisible-by {b.get('make_vocab_size_divisible_by')} x TP {tp}); give the "
            f"tokenizer the model was trained with (a checkpoint converted from Megatron-LM records its padded "
            f"table unless tools/checkpoint/convert.py was given --vocab-size)")


def missing_load_dir_message(load: Optional[str], save: Optional[str]) -> Optional[str]:
    """Why `--load` cannot be used, or None. A folder that does not exist is a typo (training from
    scratch would hide it), unless it is also --save: the resume-or-start pattern."""
    if not load or os.path.isdir(load):
        return None
    if save and os.path.abspath(save) == os.path.abspath(load):
        return None
    if os.path.exists(load):
        return f"--load {load}: not a folder"
    return (f"--load {load}: no such folder (mistyped? to resume when a checkpoint exists and start fresh "
            f"otherwise, give the same folder to --save)")


def _saved_layout(it_dir: str):
    """(TP, PP) a checkpoint iteration folder was saved with, from its file names; None if unknown."""
    try:
        names = os.listdir(it_dir)
    except OSError:
        return None
    ranks = [re.match(r"^mp_rank_(\d{2})(?:_(\d{3}))?$", n) for n in names]
    ranks = [(int(m.group(1)), int(m.group(2) or 0)) for m in ranks if m]
    if not ranks:
        return None
    return max(t for t, _ in ranks) + 1, max(p for _, p in ranks) + 1


def convert_hint(root: str, iteration: int, tp: int, pp: int) -> str:
    """The command that re-splits a checkpoint for this run's layout (and the format that needs none)."""
    src = _saved_layout(os.path.join(root, f"iter_{iteration:07d}"))
    saved = f"it was saved at TP {src[0]} x PP {src[1]}, this run is TP {tp} x PP {pp}; " if src else ""
    out = f"{root.rstrip(os.sep)}_tp{tp}_pp{pp}"
    return (f"{saved}convert it with: python tools/checkpoint/convert.py --load {root} --save {out} "
            f"--target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp} (then --load {out}); "
            f"checkpoints saved with --ckpt-format torch_dist load at any layout without converting")


OUTSIDE_TOOLS_NOTE = "README_MEGATRON_TOOLS.txt"
_noted_roots: set = set()


def note_torch_format(root: str, tp: int, pp: int, atomic_write) -> None:
    """After a `--ckpt-format torch` save (rank 0): this folder has Megatron-LM's file names but
    this project's contents, so Megatron-LM's --load and transformers' Megatron converters fail
    on it (KeyError 'language_model'). Say so once per run in the log, and in a file beside the
    tracker, with the command that writes what they read (docs/checkpoints.md says why the
    default is not Megatron's layout)."""
    cmd = (f"python tools/checkpoint/convert.py --to-megatron --load {root} --save {root.rstrip('/')}_megatron "
           f"--target-tensor-parallel-size {tp} --target-pipeline-parallel-size {pp}")
    if root not in _noted_roots:
        _noted_roots.add(root)
        print(f"note: {root} is this project's torch format (Megatron's file names, not its contents): Megatron-LM's "
              f"--load and transformers' convert_megatron_gpt2_checkpoint.py cannot read it; for them run `{cmd}` "
              "(or train with --ckpt-format megatron-legacy)", flush=True)
    path = os.path.join(root, OUTSIDE_TOOLS_NOTE)
    if os.path.exists(path):
        return
    text = (f"This folder holds checkpoints in this project's `--ckpt-format torch`: Megatron-LM's file names\n"
            f"(iter_NNNNNNN/mp_rank_XX/model_optim_rng.pt) with this project's contents (flat model state,\n"
            f"its optimizer, config and checksums). Megatron-LM's --load and transformers'\n"
            f"convert_megatron_gpt2_checkpoint.py cannot read them (KeyError: 'language_model').\n\n"
            f"Write Megatron-LM's legacy format (args with the tokenizer, nested language_model) from it:\n\n"
            f"    {cmd}\n\n"
            f"then point Megatron-LM's --load (or transformers' converter) at the new folder. Or train with\n"
            f"--ckpt-format megatron-legacy. See docs/checkpoints.md and docs/megatron_users.md.\n")
    atomic_write(path, lambda f: f.write(text.encode()))
