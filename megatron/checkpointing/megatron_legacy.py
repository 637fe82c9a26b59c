"""Checkpoints that Megatron-LM itself wrote (and writing them for Megatron-LM).

Two on-disk formats share Megatron's file layout (`latest_checkpointed_iteration.txt`, holding a
number or `release`, and `iter_NNNNNNN|release/mp_rank_XX[_YYY]/model_optim_rng.pt`):

- legacy models (`megatron.model` / `megatron.legacy.model`, checkpoint_version 3.0): the model
  is nested, `model['language_model']['embedding'|'encoder'|'output_layer']`, the last
  pipeline stage of a tied GPT adds `word_embeddings_for_head`;
- Megatron-Core models saved with `--ckpt-format torch`: flat names
  (`decoder.layers.N.self_attention.linear_qkv.weight`, ...) and `_extra_state` entries.

Both carry `args` (an `argparse.Namespace`), `iteration`, `rng_state` (a list of dicts, one per
data-parallel rank), `opt_param_scheduler` (Megatron's keys) and optionally `optimizer`.
Virtual pipeline stages are `model0`, `model1`, ...; layer indices restart at 0 in each stage.

Reading never runs code: `torch.load(weights_only=True)` with exactly these extra types allowed:
`argparse.Namespace` (`types.SimpleNamespace` in transformers' converter's output), numpy
arrays of boolean / integer / float dtypes (numpy's RNG state) and Megatron-Core's `ModelType`
enum (stood in for by a local enum with the same members). After the load every array's dtype
is checked again (no object arrays).

Here each file's model is translated to this project's names (`convert_*`), the tensor-parallel
shards are joined and layer indices made global (`read_full`): one {global name: full tensor}
dict, which any of this project's layouts cuts its own shards from (`load_into_trainer`).
T5's names (Megatron-Core and legacy) and its encoder/decoder pipeline split: `megatron_t5`.
"""
from __future__ import annotations

import argparse
import enum
import os
import re
import types
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from megatron import safe_paths
from megatron.checkpointing import megatron_moe
from megatron.checkpointing.megatron_base import MegatronCheckpointError, undo_layernorm_1p
from megatron.checkpointing.megatron_base import flatten as _flatten
from megatron.checkpointing.safety import _arrays

TRACKER = "latest_checkpointed_iteration.txt"


# ---- loading without code ------------------------------------------------------------------
class ModelType(enum.Enum):
    """Megatron-Core's `megatron.core.enums.ModelType` (args.model_type), by value."""
    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


_PLAIN_DTYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                 np.float16, np.float32, np.float64)


def _safe_globals() -> list:
    mod = getattr(np, "_core", None) or np.core
    rec = mod.multiarray._reconstruct
    # transformers' Megatron converter stores its args as a types.SimpleNamespace.
    out = [argparse.Namespace, types.SimpleNamespace, rec, (rec, "numpy.core.multiarray._reconstruct"), np.ndarray,
           np.dtype]
    out += [type(np.dtype(t)) for t in _PLAIN_DTYPES]
    out += [(ModelType, "megatron.core.enums.ModelType"), (ModelType, "megatron.model.enums.ModelType")]
    return out


def safe_load_megatron(path: str):
    """A Megatron-LM checkpoint file, loaded with weights_only=True and the allowlist above."""
    import pickle
    from megatron.checkpointing.safety import UnsafeCheckpointError, _offending
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: refused to load: the file references `{_offending(e)}`; a Megatron-LM checkpoint may hold "
            f"tensors, argparse.Namespace / types.SimpleNamespace, numpy arrays of plain dtypes and ModelType, "
            f"nothing else") from None
    except Exception as e:  # noqa: BLE001 - ModelType(999), a 2^40-element array, a truncated or empty file
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise MegatronCheckpointError(f"{path}: not a readable Megatron-LM checkpoint ({type(e).__name__}: {first}); "
                                      f"the file is truncated, corrupt or not written by Megatron-LM") from None
    for where, arr in _arrays(state):
        if arr.dtype.kind not in "biuf":
            raise UnsafeCheckpointError(f"{path}: refused to load: a numpy array of dtype {arr.dtype} at "
                                        f"{'/'.join(map(str, where))} (only boolean, integer and float arrays)")
    if not isinstance(state, dict):
        raise MegatronCheckpointError(f"{path}: not a checkpoint (top level is {type(state).__name__})")
    return state


# ---- names ---------------------------------------------------------------------------------
# Megatron-Core layer names -> ours (layer-local part). TE fuses the norms into the linears.
_CORE_LAYER = [
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "post_attention_layernorm.bias"),
    ("self_attention.linear_qkv.", "self_attention.query_key_value."),
    ("self_attention.linear_proj.", "self_attention.dense."),
    ("cross_attention.linear_q.", "inter_attention.query."),
    ("cross_attention.linear_kv.", "inter_attention.key_value."),
    ("cross_attention.linear_proj.", "inter_attention.dense."),
    ("pre_cross_attn_layernorm.", "post_attention_layernorm."),
    ("pre_mlp_layernorm.", "post_attention_layernorm."),
    ("mlp.linear_fc1.", "mlp.dense_h_to_4h."),
    ("mlp.linear_fc2.", "mlp.dense_4h_to_h."),
    ("input_layernorm.", "input_layernorm."),
]


def _core_layer_name(rest: str) -> str:
    moe = megatron_moe.core_name(rest)  # router and experts (megatron_moe)
    if moe is not None:
        return moe
    for a, b in _CORE_LAYER:
        if rest.startswith(a):
            return b + rest[len(a):]
    raise MegatronCheckpointError(f"unknown Megatron-Core layer parameter {rest!r}")


def _split_gate(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Megatron's gated MLP keeps [gate; up] in one column-parallel matrix per TP rank (its
    forward chunks the rank's output in two and applies the activation to the first half); this
    project keeps them as two linears."""
    out = {}
    for k, v in sd.items():
        if k.endswith(("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")):
            gate, up = v.chunk(2, dim=0)
            out[k.replace("dense_h_to_4h", "dense_h_to_4h_gate")] = gate
            out[k] = up
        else:
            out[k] = v
    return out


def convert_core(model: dict, gated: bool) -> Dict[str, torch.Tensor]:
    """One Megatron-Core (`torch` format) stage's state dict -> ours (stage-local layer indices)."""
    out = {}
    for k, v in model.items():
        if k.endswith("_extra_state") or v is None:
            continue
        if not isinstance(v, torch.Tensor):
            raise MegatronCheckpointError(f"model entry {k} is a {type(v).__name__}, not a tensor")
        m = re.match(r"^(encoder|decoder)\.layers\.(\d+)\.(.*)$", k)
        if m:
            out[f"{m.group(1)}.layers.{m.group(2)}.{_core_layer_name(m.group(3))}"] = v
        elif k == "embedding.position_embeddings.weight":
            out["embedding.position_embeddings"] = v
        elif k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out[k] = v
        elif k.startswith("decoder.final_layernorm."):
            out["final_layernorm." + k.rsplit(".", 1)[1]] = v
        else:
            raise MegatronCheckpointError(f"unknown Megatron-Core parameter {k!r}")
    return _split_gate(out) if gated else out


def convert_legacy(model: dict, gated: bool) -> Dict[str, torch.Tensor]:
    """One legacy-model stage's nested state dict -> ours (stage-local layer indices)."""
    out = {}
    for k, v in _flatten(model).items():
        if k.endswith("_extra_state"):
            continue
        if not isinstance(v, torch.Tensor):
            raise MegatronCheckpointError(f"model entry {k} is a {type(v).__name__}, not a tensor")
        k = k.replace("language_model.", "", 1)
        m = re.match(r"^(encoder|decoder|transformer)\.layers\.(\d+)\.(.*)$", k)
        if m:
            block = "decoder" if m.group(1) == "transformer" else m.group(1)
            # Older releases named the attention `attention` and the norms `*_layernorm`; newer `*_norm`.
            rest = m.group(3).replace("input_norm.", "input_layernorm.").replace(
                "post_attention_norm.", "post_attention_layernorm.").replace("attention.", "self_attention.", 1) \
                if m.group(3).startswith(("attention.", "input_norm", "post_attention_norm")) else m.group(3)
            out[f"{block}.layers.{m.group(2)}.{rest}"] = v
        elif k.startswith("embedding.word_embeddings."):
            out["embedding.word_embeddings.weight"] = v
        elif k.startswith("embedding.position_embeddings."):
            out["embedding.position_embeddings"] = v
        elif re.match(r"^(encoder|transformer|decoder)\.final_(layer)?norm\.", k):
            out[k.split(".", 1)[0] + "_final_layernorm." + k.rsplit(".", 1)[1]] = v
        elif k in ("output_layer.weight", "word_embeddings_for_head.weight"):
            out["output_layer.weight"] = v
        elif k == "lm_head.bias":
            out["lm_head_bias"] = v
        else:
            raise MegatronCheckpointError(f"unknown legacy Megatron parameter {k!r}")
    return _split_gate(out) if gated else out


# Split along the output dimension (column-parallel, vocabulary tables) / the input dimension.
_DIM0 = re.compile(r"(query_key_value|\.query|key_value|dense_h_to_4h|dense_h_to_4h_gate)\.(weight|bias)$"
                   r"|(word_embeddings|output_layer)\.weight$|^lm_head_bias$")
_DIM1 = re.compile(r"(self_attention\.dense|inter_attention\.dense|dense_4h_to_h)\.weight$")
_VOCAB = re.compile(r"(word_embeddings|output_layer)\.weight$|^lm_head_bias$")


def partition_dim(name: str) -> Optional[int]:
    return 0 if _DIM0.search(name) else 1 if _DIM1.search(name) else None


# ---- whole checkpoints ---------------------------------------------------------------------
def read_tracker(root: str) -> Tuple[str, int]:
    """(iteration folder name, iteration) from Megatron's tracker; `release` -> ('release', 0)."""
    path = os.path.join(root, TRACKER)
    text = safe_paths.read_text(root, TRACKER, safe_paths.TRACKER_BYTES, "tracker file").strip()
    if text == "release":
        return "release", 0
    try:
        it = int(text)
    except ValueError:
        raise MegatronCheckpointError(f"{path}: expected an iteration number or 'release', found {text[:40]!r}") \
            from None
    return f"iter_{it:07d}", it


def _verify_manifest(it_dir: str) -> Optional[str]:
    """The files a manifest.json (written by this project's Megatron writer) lists, checked
    against their sha256; None when they match or there is no manifest (Megatron wrote it)."""
    import json
    from megatron.checkpointing.dist_format import sha256_digest
    path = os.path.join(it_dir, "manifest.json")
    if not os.path.lexists(path):
        return None
    try:
        files = json.loads(safe_paths.read_text(it_dir, "manifest.json", safe_paths.JSON_BYTES, "manifest"))["files"]
        for rel, rec in files.items():
            full = os.path.join(it_dir, rel)
            try:  # the name is judged before anything is looked up: no oracle for files outside
                safe_paths.regular_file(it_dir, rel, f"file listed in {path}")
            except FileNotFoundError:
                return f"{full} is missing (listed in {path})"
            if sha256_digest(full).hex() != rec["sha256"]:
                return f"{full} is corrupted (sha256 in {path})"
    except safe_paths.UnsafePathError as e:
        return str(e)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        return f"{path} is unreadable ({e})"
    return None


def rank_files(it_dir: str) -> Dict[Tuple[int, int, int], str]:
    """{(tp rank, pp rank, ep rank): model file} of one iteration folder (model_optim_rng.pt, or
    model_rng.pt when the distributed optimizer wrote its state apart; `_EEE` folders: megatron_moe)."""
    return megatron_moe.rank_files(it_dir, lambda path: safe_load_megatron(path).get("args"))


_ARGS_TYPES = (argparse.Namespace, types.SimpleNamespace)


def is_megatron_checkpoint(state: dict) -> bool:
    return isinstance(state.get("args"), _ARGS_TYPES) and "config" not in state


def _stage_models(state: dict) -> list:
    if "model" in state:
        return [state["model"]]
    chunks = sorted((int(k[5:]), v) for k, v in state.items() if re.match(r"^model\d+$", k))
    if not chunks:
        raise MegatronCheckpointError("the file holds no 'model' or 'model0' entry")
    return [v for _, v in chunks]


def _is_core(model: dict) -> bool:
    return not any(k in model for k in ("language_model", "word_embeddings_for_head", "lm_head"))


def _layer_offsets(args, n_stages: int, block_layers: int) -> list:
    """Global index of each virtual stage's first layer (Megatron's uniform split: virtual stage
    v of pipeline rank p holds layers at offset v*L/V + p*L/(V*P))."""
    per = block_layers // n_stages
    return [i * per for i in range(n_stages)]


def _gpt_name(name: str) -> str:
    if name.startswith("encoder.layers."):
        return "decoder" + name[len("encoder"):]
    if name.startswith(("encoder_final_layernorm.", "decoder_final_layernorm.")):
        return name.split("_", 1)[1]
    return name


def _activation(a: dict) -> str:
    """Megatron's MLP GeLU is exact (erf) unless its fused bias-GeLU kernel (tanh form, the default)
    or --openai-gelu (tanh) computed it; ReLU-family settings are not GeLU at all."""
    if a.get("swiglu") or a.get("squared_relu"):
        return "gelu"
    if a.get("openai_gelu") or a.get("bias_gelu_fusion", True):
        return "gelu"
    return "gelu-erf"


def model_fields(args) -> dict:
    """This project's model settings from Megatron's args (what the run must match)."""
    a = vars(args)
    t5 = is_t5(args)
    heads = a["num_attention_heads"]
    out = dict(model_type="t5" if t5 else "gpt", num_layers=a["num_layers"], hidden_size=a["hidden_size"],
               num_attention_heads=heads, ffn_hidden_size=a.get("ffn_hidden_size") or 4 * a["hidden_size"],
               max_position_embeddings=a.get("max_position_embeddings"),
               seq_length=a.get("seq_length") or a.get("max_position_embeddings"),
               make_vocab_size_divisible_by=a.get("make_vocab_size_divisible_by", 128),
               swiglu=bool(a.get("swiglu")), normalization=a.get("normalization") or "LayerNorm",
               add_bias_linear=a.get("add_bias_linear", True),
               untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights")),
               position_embedding_type=a.get("position_embedding_type") or "learned_absolute",
               num_query_groups=a.get("num_query_groups") if a.get("group_query_attention") else None,
               layernorm_epsilon=a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5)),
               activation_func=_activation(a), moe=megatron_moe.model_fields(args) or None)
    if a.get("kv_channels"):
        out["kv_channels"] = a["kv_channels"]
    if t5:  # Megatron's num_layers is the encoder's; ours counts both stacks
        enc, dec = a["encoder_num_layers"] or a["num_layers"], a.get("decoder_num_layers") or a["num_layers"]
        out.update(num_layers=enc + dec, encoder_num_layers=enc, decoder_num_layers=dec,
                   encoder_seq_length=a.get("encoder_seq_length") or a.get("seq_length"),
                   decoder_seq_length=a.get("decoder_seq_length"))
        out["seq_length"] = out["encoder_seq_length"]
    return out


def is_t5(args) -> bool:
    """Megatron's args of a T5 run: its ModelType, or (files this project wrote, which cannot
    pickle Megatron's enum) both layer counts and a decoder sequence length."""
    a = vars(args)
    kind = str(a.get("model_type"))
    if kind in (str(ModelType.encoder_and_decoder), str(ModelType.encoder_or_decoder)):
        return kind == str(ModelType.encoder_and_decoder)
    # GPT args of Megatron v2.x (the DynaPipe fork) carry decoder_num_layers 0: a count, not a T5
    return all(a.get(k) for k in ("encoder_num_layers", "decoder_num_layers", "decoder_seq_length"))


def tokenizer_vocab_size(args) -> int:
    """The tokenizer's vocabulary as far as Megatron's args tell it: NullTokenizer adds an
    end-of-document id to --vocab-size; transformers' converter records `orig_vocab_size` (the
    HF model's, e.g. 50257); Megatron's file-based tokenizers leave only padded_vocab_size."""
    if getattr(args, "orig_vocab_size", None):
        return args.orig_vocab_size
    v = getattr(args, "vocab_size", None)
    if v and getattr(args, "tokenizer_type", None) == "NullTokenizer":
        return v + 1
    return v or args.padded_vocab_size


def read_full(root: str, on_state=None) -> Tuple[argparse.Namespace, Dict[str, torch.Tensor], dict]:
    """-> (Megatron's args, {our global name: full tensor, vocabulary rows as saved (padded)},
    metadata: iteration, release, consumed samples, scheduler, source layout, format)."""
    folder, iteration = read_tracker(root)
    it_dir = os.path.join(root, folder)
    if os.path.lexists(it_dir):
        safe_paths.inside(root, folder, "iteration folder")  # iter_N or release/ as a link: refused
    files = rank_files(it_dir) if os.path.isdir(it_dir) else {}
    if not files:
        raise MegatronCheckpointError(f"{it_dir}: no mp_rank_*/model_optim_rng.pt files")
    problem = _verify_manifest(it_dir)
    if problem:
        raise MegatronCheckpointError(problem)
    tp, pp, ep = (max(k[i] for k in files) + 1 for i in range(3))
    if sorted(files) != [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)]:
        raise MegatronCheckpointError(f"{it_dir}: rank folders {sorted(files)} do not cover TP {tp} x PP {pp} x EP "
                                      f"{ep}")
    args = meta = None
    models: Dict[Tuple[int, int, int], list] = {}
    for (t, p, e), path in sorted(files.items()):
        state = safe_load_megatron(path)
        if not isinstance(state.get("args"), _ARGS_TYPES):
            raise MegatronCheckpointError(f"{path}: no Megatron `args` in the file")
        args = args or _checked_args(state["args"], path)
        if meta is None:
            meta = {"iteration": count_field(path, "iteration", state.get("iteration", iteration)),
                    "release": folder == "release",
                    "consumed_samples": count_field(path, "args.consumed_train_samples",
                                                    getattr(args, "consumed_train_samples", 0) or 0),
                    "opt_param_scheduler": state.get("opt_param_scheduler"),
                    "checkpoint_version": state.get("checkpoint_version"), "tp": tp, "pp": pp}
        models[(t, p, e)] = _stage_models(state)
        if on_state is not None and e == 0:  # e.g. megatron_optim: the optimizer and RNG state of the same file
            on_state((t, p), path, state)  # (an MoE file's optimizer is not read: see megatron_moe)
    full, meta["format"] = join_shards(args, megatron_moe.merge_ep(models, args, it_dir), tp, pp)
    full = megatron_moe.stack_experts(full, args, tp, it_dir)
    return args, undo_layernorm_1p(args, full), meta  # --apply-layernorm-1p stores w - 1


def count_field(path: str, field: str, value) -> int:
    """A counter of a Megatron file (iteration, consumed samples, batch size): a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise MegatronCheckpointError(f"{path}: field {field} is {str(value)[:40]!r} ({type(value).__name__}), "
                                      f"expected a non-negative integer")
    return int(value)


_REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads")


def _checked_args(args, path: str):
    """Megatron's args with the model sizes every reader needs present and positive."""
    for k in _REQUIRED_ARGS:
        v = getattr(args, k, None)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise MegatronCheckpointError(f"{path}: args.{k} is {'missing' if v is None else repr(v)[:40]}, expected "
                                          f"a positive integer")
    return args


def join_shards(args, models: Dict[Tuple[int, int], list], tp: int, pp: int) -> Tuple[Dict[str, torch.Tensor], str]:
    """{(tp rank, pp rank): [each virtual stage's model dict]} -> ({our global name: full tensor}, 'core' or
    'legacy'). Any dicts shaped like Megatron's model (e.g. Adam moments in the weights' places) join alike."""
    shards: Dict[str, Dict[int, torch.Tensor]] = {}
    fmt = None
    for (t, p), chunks in sorted(models.items()):
        gated = bool(getattr(args, "swiglu", False))
        n_stages = pp * len(chunks)
        t5 = is_t5(args)
        for v, model in enumerate(chunks):
            fmt = fmt or ("core" if _is_core(model) else "legacy")
            if t5:  # T5's names and pipeline layout: megatron_t5
                from megatron.checkpointing import megatron_t5
                local = (megatron_t5.convert_core_t5 if _is_core(model) else megatron_t5.convert_legacy_t5)(
                    model, f"the TP {t} / PP {p} rank file")
                local = megatron_t5.drop_encoder_head(local, args, pp, p)
            else:
                local = convert_core(model, gated) if _is_core(model) else convert_legacy(model, gated)
            stage = v * pp + p
            for name, tensor in local.items():
                m = re.match(r"^(encoder|decoder)\.layers\.(\d+)\.(.*)$", name)
                if m:
                    total = getattr(args, f"{m.group(1)}_num_layers", None) or args.num_layers
                    off = megatron_t5.layer_offset(args, pp, p, m.group(1)) if t5 else \
                        _layer_offsets(args, n_stages, total)[stage]
                    name = f"{m.group(1)}.layers.{off + int(m.group(2))}.{m.group(3)}"
                if name == "output_layer.weight" and not getattr(args, "untie_embeddings_and_output_weights", False):
                    continue  # the last stage's copy of the tied word embeddings
                shards.setdefault(name, {})[t] = tensor
    if model_fields(args)["model_type"] == "gpt":  # legacy GPT calls its one block `encoder`
        shards = {_gpt_name(k): v for k, v in shards.items()}
    full = {}
    for name, by_rank in shards.items():
        if sorted(by_rank) != list(range(tp)):
            raise MegatronCheckpointError(f"{name}: found TP ranks {sorted(by_rank)}, expected 0..{tp - 1}")
        d = partition_dim(name)
        try:
            full[name] = by_rank[0] if d is None else torch.cat([by_rank[r] for r in range(tp)], dim=d)
        except (RuntimeError, IndexError, TypeError) as e:
            shapes = [tuple(getattr(by_rank[r], "shape", ())) for r in range(tp)]
            raise MegatronCheckpointError(f"{name}: the TP shards (shapes {shapes}) do not join along dim {d} "
                                          f"({str(e).splitlines()[0][:80]})") from None
    return full, fmt


# ---- --load of a Megatron-LM checkpoint ----------------------------------------------------
def detect(root: str) -> bool:
    """True when --load names a checkpoint Megatron-LM wrote (tracker `release`, or the rank-0
    file holds Megatron's `args` and no project `config`)."""
    try:
        folder, _ = read_tracker(root)
    except (OSError, MegatronCheckpointError):
        return False
    it_dir = os.path.join(root, folder)
    if folder == "release":
        return True
    if os.path.exists(os.path.join(it_dir, "common.json")) or not os.path.isdir(it_dir):
        return False
    files = rank_files(it_dir)
    if not files or any(os.path.exists(p + ".sha256") for p in files.values()):
        return False  # this project's own torch format writes a checksum beside each file
    try:
        return is_megatron_checkpoint(safe_load_megatron(files[min(files)]))
    except Exception:
        return False  # not ours to judge: the project's own loader reports what is wrong


def _fit_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary table with `rows` rows: Megatron's padding kept when the sizes agree, else
    cut to the run's vocabulary and padded with zeros."""
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def load_into_trainer(trainer, root: str, training_state=None, read=None) -> bool:
    """`_load_into_trainer`, with every error a malformed file can raise as one MegatronCheckpointError line."""
    from megatron.checkpointing.safety import UnsafeCheckpointError
    try:
        return _load_into_trainer(trainer, root, training_state, read)
    except (MegatronCheckpointError, UnsafeCheckpointError, OSError):
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError, OverflowError, RecursionError,
            MemoryError) as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise MegatronCheckpointError(f"Megatron-LM checkpoint {root}: a field does not hold what Megatron-LM writes "
                                      f"({type(e).__name__}: {first})") from None


def _load_into_trainer(trainer, root: str, training_state=None, read=None) -> bool:
    """Fill every stage of this rank from a Megatron-LM checkpoint at this run's layout.
    Resumes the iteration, consumed samples and LR schedule unless --finetune, the optimizer's
    state unless --no-load-optim and the RNG unless --no-load-rng, where `training_state` (the
    module `megatron_optim`, passed in by the dispatcher) is given. `read` is another format's
    `read_full` (mcore_dist.py: Megatron-Core's torch_dist, which resumes its optimizer itself)."""
    import sys
    from megatron.checkpointing.dist_format import _dim, _params
    cfg, ps = trainer.cfg, trainer.ps
    # Like Megatron: a `release` checkpoint (a converter's output) carries weights only, whatever
    # optimizer-looking keys a converter left in it.
    release = read_tracker(root)[0] == "release"
    collect = training_state.Collector(read_optim=not (cfg.checkpoint.no_load_optim or cfg.checkpoint.finetune
                                                       or release)) if training_state is not None else None
    args, full, meta = read(root) if read is not None else read_full(root, on_state=collect)
    problems = []
    theirs = model_fields(args)
    ours = cfg.model
    for key, flag in (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                      ("num_attention_heads", "--num-attention-heads"), ("ffn_hidden_size", "--ffn-hidden-size"),
                      ("swiglu", "--swiglu"), ("normalization", "--normalization"),
                      ("add_bias_linear", "--disable-bias-linear"), ("position_embedding_type",
                                                                      "--position-embedding-type"),
                      ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
                      ("encoder_num_layers", "--encoder-num-layers"), ("decoder_num_layers", "--decoder-num-layers")):
        if key not in theirs:
            continue
        if getattr(ours, key, None) != theirs[key]:
            problems.append(f"{flag}: checkpoint has {theirs[key]}, this run has {getattr(ours, key, None)}")
    problems += megatron_moe.mismatches(args, getattr(ours, "moe", None))
    if theirs["model_type"] != ours.model_type:
        problems.append(f"model type: checkpoint is {theirs['model_type']}, this run is {ours.model_type}")
    if ours.position_embedding_type == "learned_absolute" and \
            theirs["max_position_embeddings"] != ours.max_position_embeddings:
        problems.append(f"--max-position-embeddings: checkpoint has {theirs['max_position_embeddings']}, "
                        f"this run has {ours.max_position_embeddings}")
    padded_src = full["embedding.word_embeddings.weight"].shape[0]
    if ours.vocab_size > padded_src:
        problems.append(f"--vocab-size / tokenizer: this run's vocabulary ({ours.vocab_size}) is larger than the "
                        f"checkpoint's padded table ({padded_src} rows)")
    if problems:
        raise MegatronCheckpointError(f"Megatron-LM checkpoint {root} does not match this run:\n  "
                                      + "\n  ".join(problems))
    padded = ours.padded_vocab_size(ps.tp_size)
    finish = getattr(trainer.optimizer, "finish_param_gather", None)
    if finish is not None:
        finish()
    with torch.no_grad():
        for key, p, _ in _params(trainer):
            if key not in full:
                raise MegatronCheckpointError(f"Megatron-LM checkpoint {root} holds no weights for {key}")
            t = full[key]
            if _VOCAB.search(key):
                t = _fit_rows(t, padded)
            t = megatron_moe.slice_expert(key, t, p, ps)
            d = _dim(p)
            if d is not None:
                per = t.shape[d] // ps.tp_size
                t = t.narrow(d, ps.tp_rank * per, per)
            if tuple(t.shape) != tuple(p.shape):
                raise MegatronCheckpointError(f"{key}: Megatron-LM checkpoint {root} gives shape {tuple(t.shape)} on "
                                              f"{ps.describe()}, the model has {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))
    optim, rng = meta.get("optimizer_note", "the optimizer starts fresh"), "the RNG from this run's seed"
    if not cfg.checkpoint.finetune and not meta["release"]:
        trainer.iteration = meta["iteration"]
        trainer.consumed_samples = meta["consumed_samples"]
        sched = meta.get("opt_param_scheduler") or {}
        # Megatron counts scheduler steps in samples (--train-iters x --global-batch-size); ours in iterations.
        gbs = count_field(root, "args.global_batch_size", getattr(args, "global_batch_size", 1) or 1)
        trainer.lr_scheduler.num_steps = int(sched.get("num_steps", trainer.iteration * gbs)) // gbs \
            if not cfg.checkpoint.no_load_optim else trainer.iteration
        if training_state is not None:
            optim, rng = training_state.resume(trainer, collect, args, meta, (optim, rng),
                                               lambda key, t: _fit_rows(t, padded) if _VOCAB.search(key) else t)
    if ps.rank == 0:
        if meta["release"]:  # Megatron-LM itself starts a release checkpoint at iteration 0, weights only
            where = (f"release weights (its args say iteration {meta['iteration']}); training starts at iteration 0 "
                     "as Megatron-LM starts a release checkpoint: counters, schedule and optimizer fresh")
        else:
            where = f"at iteration {meta['iteration']}" + (" (--finetune: counters from 0)" if cfg.checkpoint.finetune
                                                          else "")
        print(f"loaded Megatron-LM checkpoint ({meta['format']} model, TP {meta['tp']} x PP {meta['pp']}) {root} "
              f"{where}; {optim}; {rng}", file=sys.stderr, flush=True)
        if not ours.swiglu and theirs["activation_func"] != ours.activation_func:
            print(f"note: the Megatron-LM run computed its MLP with --activation-func {theirs['activation_func']} "
                  f"(its --bias-gelu-fusion / --openai-gelu settings) and this run uses {ours.activation_func}; pass "
                  f"--activation-func {theirs['activation_func']} to compute what it computed", file=sys.stderr,
                  flush=True)
    return True

