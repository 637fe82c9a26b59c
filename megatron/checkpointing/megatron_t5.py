"""T5 in Megatron-LM's checkpoint formats: the name mapping both ways and the pipeline layout.

Megatron-LM (core_v0.9.0, and the legacy model before it) writes T5 in the same files as GPT
(`megatron_legacy` reads the files, `megatron_write` writes them); only the model's entries
differ:

- Megatron-Core `T5Model` (`--ckpt-format torch`, flat names): `embedding.word_embeddings`,
  `embedding.position_embeddings` (also once more as top-level `position_embeddings`),
  `encoder.layers.N.{input_layernorm, self_attention.linear_qkv, self_attention.linear_proj,
  pre_mlp_layernorm, mlp.linear_fc1, mlp.linear_fc2}`, decoder layers adding
  `pre_cross_attn_layernorm` and `cross_attention.{linear_q, linear_kv, linear_proj}`,
  `encoder.final_layernorm`, `decoder.final_layernorm`, and the LM head's vocab-parallel bias
  `lm_head.output_layer.bias` (also as `output_layer.bias`); an untied head adds its weight.
- legacy `megatron.legacy.model.T5Model`: `language_model.{embedding, encoder, decoder}` with
  `layers.N.{input_norm, self_attention.*, post_attention_norm, mlp.*}` (the decoder's
  `post_attention_norm` comes before the cross-attention `inter_attention.{query, key_value,
  dense}`, its `post_inter_attention_norm` before the MLP), `final_norm` per block (before
  core_v0.5: `*_layernorm`), `lm_head.bias`; a last pipeline stage without the embedding holds
  the tied table as `word_embeddings_for_head`.

Both compute what this project's T5 computes with `--position-embedding-type learned_absolute`
(one position table shared by encoder and decoder, tied LM head plus bias, per-head
[q k v] / [k v] order as the checkpoint version 3.0 GPT), so the tensors move unchanged.
Pipeline layout (as this project's): encoder layers on ranks [0, split), decoder on [split, pp).
"""
from __future__ import annotations

import re
from typing import Dict, Tuple

import torch

from megatron.checkpointing.megatron_base import MegatronCheckpointError
from megatron.checkpointing.megatron_base import flatten as _flatten

_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(.*)$")

# Megatron-Core layer names -> ours (TE's fused norms as the local spec's separate ones).
_CORE = [
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "post_attention_layernorm."),
    ("input_layernorm.", "input_layernorm."),
    ("self_attention.linear_qkv.", "self_attention.query_key_value."),
    ("self_attention.linear_proj.", "self_attention.dense."),
    ("pre_cross_attn_layernorm.", "pre_cross_attn_layernorm."),
    ("cross_attention.linear_q.", "inter_attention.query."),
    ("cross_attention.linear_kv.", "inter_attention.key_value."),
    ("cross_attention.linear_proj.", "inter_attention.dense."),
    ("pre_mlp_layernorm.", "post_attention_layernorm."),
    ("mlp.linear_fc1.", "mlp.dense_h_to_4h."),
    ("mlp.linear_fc2.", "mlp.dense_4h_to_h."),
]

# The legacy model's norm names -> ours, per block (either spelling).
_LEGACY_NORMS = {
    "encoder": [("input_norm.", "input_layernorm."), ("post_attention_norm.", "post_attention_layernorm.")],
    "decoder": [("input_norm.", "input_layernorm."), ("post_attention_norm.", "pre_cross_attn_layernorm."),
                ("post_attention_layernorm.", "pre_cross_attn_layernorm."),
                ("post_inter_attention_norm.", "post_attention_layernorm."),
                ("post_inter_attention_layernorm.", "post_attention_layernorm.")],
}


def _rename(rest: str, table):
    """`rest` with its first matching prefix replaced; None when no prefix matches."""
    for a, b in table:
        if rest.startswith(a):
            return b + rest[len(a):]
    return None


def _same(out: dict, name: str, v: torch.Tensor, where: str) -> None:
    """Megatron saves some tensors under two names; keep one, and only if both agree."""
    if name in out and not torch.equal(out[name], v):
        raise MegatronCheckpointError(f"{where}: the two copies of {name} in the file differ")
    out[name] = v


def convert_core_t5(model: dict, where: str = "model") -> Dict[str, torch.Tensor]:
    """One Megatron-Core T5 stage's state dict -> ours (stage-local layer indices)."""
    out: Dict[str, torch.Tensor] = {}
    for k, v in model.items():
        if k.endswith("_extra_state") or v is None:
            continue
        if not isinstance(v, torch.Tensor):
            raise MegatronCheckpointError(f"{where}: model entry {k} is a {type(v).__name__}, not a tensor")
        m = _LAYER.match(k)
        if m:
            rest = _rename(m.group(3), _CORE)
            if rest is None:
                raise MegatronCheckpointError(f"{where}: unknown Megatron-Core T5 layer parameter {k!r}")
            out[f"{m.group(1)}.layers.{m.group(2)}.{rest}"] = v
        elif k in ("embedding.position_embeddings.weight", "position_embeddings.weight"):
            _same(out, "embedding.position_embeddings", v, where)
        elif k == "embedding.word_embeddings.weight":
            out[k] = v
        elif re.match(r"^(encoder|decoder)\.final_layernorm\.(weight|bias)$", k):
            out[k.replace(".final_layernorm.", "_final_layernorm.")] = v
        elif k in ("lm_head.output_layer.bias", "output_layer.bias"):
            _same(out, "lm_head_bias", v, where)
        elif k in ("lm_head.output_layer.weight", "output_layer.weight"):
            _same(out, "output_layer.weight", v, where)
        else:
            raise MegatronCheckpointError(f"{where}: unknown Megatron-Core T5 parameter {k!r}")
    return out


def convert_legacy_t5(model: dict, where: str = "model") -> Dict[str, torch.Tensor]:
    """One legacy T5 stage's nested state dict -> ours (stage-local layer indices)."""
    out: Dict[str, torch.Tensor] = {}
    for k, v in _flatten(model).items():
        if k.endswith("_extra_state"):
            continue
        if not isinstance(v, torch.Tensor):
            raise MegatronCheckpointError(f"{where}: model entry {k} is a {type(v).__name__}, not a tensor")
        k = k.replace("language_model.", "", 1)
        m = _LAYER.match(k)
        if m:
            rest = m.group(3)
            if rest.startswith("attention."):  # Megatron v2.x spelling
                rest = "self_" + rest
            out[f"{m.group(1)}.layers.{m.group(2)}.{_rename(rest, _LEGACY_NORMS[m.group(1)]) or rest}"] = v
        elif k == "embedding.word_embeddings.weight":
            out[k] = v
        elif k == "embedding.position_embeddings.weight":
            out["embedding.position_embeddings"] = v
        elif re.match(r"^(encoder|decoder)\.final_(layer)?norm\.(weight|bias)$", k):
            out[k.split(".", 1)[0] + "_final_layernorm." + k.rsplit(".", 1)[1]] = v
        elif k == "lm_head.bias":
            out["lm_head_bias"] = v
        elif k in ("word_embeddings_for_head.weight", "output_layer.weight"):
            out["output_layer.weight"] = v
        else:
            raise MegatronCheckpointError(f"{where}: unknown legacy Megatron T5 parameter {k!r}")
    return out


def split_rank(args, pp: int) -> int:
    """The first decoder pipeline rank of a Megatron T5 run with `pp` pipeline ranks in all
    (core_v0.9.0 records it as encoder_pipeline_model_parallel_size, older releases and this
    project's writer as pipeline_model_parallel_split_rank)."""
    if pp == 1:
        return 0
    r = getattr(args, "encoder_pipeline_model_parallel_size", None) or \
        getattr(args, "pipeline_model_parallel_split_rank", None)
    if not r or not 0 < r < pp:
        raise MegatronCheckpointError(f"T5 checkpoint with {pp} pipeline ranks records no split rank between the "
                                      f"encoder and the decoder (encoder_pipeline_model_parallel_size / "
                                      f"pipeline_model_parallel_split_rank: {r})")
    return r


def stage_ranges(enc_layers: int, dec_layers: int, pp: int, r: int) -> list:
    """Per pipeline rank ((enc_start, enc_end), (dec_start, dec_end)): Megatron's even split."""
    if pp == 1:
        return [((0, enc_layers), (0, dec_layers))]
    if enc_layers % r or dec_layers % (pp - r):
        raise MegatronCheckpointError(f"T5 with {enc_layers} encoder / {dec_layers} decoder layers does not split "
                                      f"evenly over {r} encoder and {pp - r} decoder pipeline ranks")
    ne, nd = enc_layers // r, dec_layers // (pp - r)
    return [((i * ne, (i + 1) * ne), (0, 0)) for i in range(r)] + \
        [((0, 0), (i * nd, (i + 1) * nd)) for i in range(pp - r)]


def layer_offset(args, pp: int, p: int, block: str) -> int:
    """Global index of pipeline rank p's first layer of `block` (encoder / decoder)."""
    enc = getattr(args, "encoder_num_layers", None) or args.num_layers
    dec = getattr(args, "decoder_num_layers", None) or args.num_layers
    (e0, _), (d0, _) = stage_ranges(enc, dec, pp, split_rank(args, pp))[p]
    return e0 if block == "encoder" else d0


def drop_encoder_head(local: Dict[str, torch.Tensor], args, pp: int, p: int) -> Dict[str, torch.Tensor]:
    """Megatron-Core builds an LM head on the encoder's last pipeline rank too (post_process
    holds there); it never trains. Only the decoder's last rank's head is the model's."""
    if pp > 1 and p < split_rank(args, pp):
        return {k: v for k, v in local.items() if k not in ("lm_head_bias", "output_layer.weight")}
    return local


# ---- writing -------------------------------------------------------------------------------
def _legacy_layer(block: str, rest: str, norm_names: str) -> str:
    new = "norm" if norm_names == "norm" else "layernorm"
    table = {"input_layernorm.": f"input_{new}.",
             "post_attention_layernorm.": f"post_inter_attention_{new}." if block == "decoder"
             else f"post_attention_{new}.",
             "pre_cross_attn_layernorm.": f"post_attention_{new}."}
    for a, b in table.items():
        if rest.startswith(a):
            return b + rest[len(a):]
    return rest


def to_legacy_t5(local: Dict[str, torch.Tensor], pre_process: bool, post_process: bool,
                 norm_names: str = "norm") -> dict:
    """One T5 stage's state dict in our names (stage-local layers, this TP rank's shards) -> the
    legacy T5Model's nested dict (`state_dict_for_save_checkpoint`)."""
    lm: dict = {}
    out: dict = {"language_model": lm}
    final = "final_norm" if norm_names == "norm" else "final_layernorm"
    for k, v in local.items():
        m = _LAYER.match(k)
        if m:
            rest = _legacy_layer(m.group(1), m.group(3), norm_names)
            lm.setdefault(m.group(1), {})[f"layers.{m.group(2)}.{rest}"] = v
        elif k == "embedding.word_embeddings.weight":
            lm.setdefault("embedding", {}).setdefault("word_embeddings", {})["weight"] = v
        elif k == "embedding.position_embeddings":
            lm.setdefault("embedding", {}).setdefault("position_embeddings", {})["weight"] = v
        elif k.startswith(("encoder_final_layernorm.", "decoder_final_layernorm.")):
            block, leaf = k.split("_", 1)[0], k.rsplit(".", 1)[1]
            lm.setdefault(block, {})[f"{final}.{leaf}"] = v
        elif k == "lm_head_bias":
            out["lm_head"] = {"bias": v}
        elif k == "output_layer.weight" and post_process and not pre_process:
            out["word_embeddings_for_head"] = {"weight": v}
        elif k != "output_layer.weight":
            raise MegatronCheckpointError(f"no legacy Megatron T5 name for {k}")
    return out


def check_writable(model: dict) -> None:
    """What Megatron's legacy T5 can hold: learned absolute positions, a tied LM head, LayerNorm,
    GeLU with biases. Anything else would load into Megatron and compute something else."""
    problems = []
    if model.get("position_embedding_type", "learned_absolute") != "learned_absolute":
        problems.append(f"--position-embedding-type {model.get('position_embedding_type')} (Megatron's T5 has "
                        "learned_absolute)")
    if model.get("untie_embeddings_and_output_weights"):
        problems.append("--untie-embeddings-and-output-weights (the legacy T5 head uses the word embeddings)")
    if model.get("normalization", "LayerNorm") != "LayerNorm" or not model.get("add_bias_linear", True):
        problems.append("RMSNorm / --disable-bias-linear (Megatron's T5 has LayerNorm and biases)")
    if model.get("swiglu") or model.get("gated_linear_unit") or model.get("activation_func", "gelu") != "gelu":
        problems.append("a gated or non-GeLU MLP")
    if problems:
        raise MegatronCheckpointError("Megatron-LM's legacy T5 cannot hold this model: " + "; ".join(problems))


def t5_args_fields(model: dict, pp: int, split: int) -> dict:
    """The T5 fields of Megatron's `args` (num_layers is the encoder's, as Megatron's
    validate_args sets it)."""
    return dict(num_layers=model["encoder_num_layers"], encoder_num_layers=model["encoder_num_layers"],
                decoder_num_layers=model["decoder_num_layers"], seq_length=model["encoder_seq_length"],
                encoder_seq_length=model["encoder_seq_length"], decoder_seq_length=model["decoder_seq_length"],
                pipeline_model_parallel_split_rank=split if pp > 1 else None,
                encoder_pipeline_model_parallel_size=split if pp > 1 else 0,
                encoder_tensor_model_parallel_size=0, add_position_embedding=True)


def stage_of(name: str, ranges: list, p: int, split: int, pp: int) -> Tuple[bool, str]:
    """(whether pipeline rank p holds `name` of the full model, its stage-local name)."""
    (e0, e1), (d0, d1) = ranges[p]
    m = _LAYER.match(name)
    if m:
        i = int(m.group(2))
        lo, hi = (e0, e1) if m.group(1) == "encoder" else (d0, d1)
        return lo <= i < hi, f"{m.group(1)}.layers.{i - lo}.{m.group(3)}"
    if name.startswith("embedding."):
        return p in (0, split), name
    if name.startswith("encoder_final_layernorm."):
        return p == (split - 1 if pp > 1 else 0), name
    if name.startswith(("decoder_final_layernorm.", "lm_head_bias", "output_layer.")):
        return p == pp - 1, name
    raise MegatronCheckpointError(f"no T5 pipeline stage for {name}")
