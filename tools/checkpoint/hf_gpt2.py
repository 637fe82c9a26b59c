"""Our GPT (learned positions, LayerNorm, GeLU-tanh MLP, biases, tied output) <-> Hugging Face
`GPT2LMHeadModel` (safetensors + config.json). `transformers`/`safetensors` are optional and
only imported here.

Layout differences handled: HF's Conv1D stores weights as [in, out] (ours [out, in]), and HF's
fused c_attn is [all q | all k | all v] where ours is per head [q_h, k_h, v_h]."""
from __future__ import annotations

import json
import os
from typing import Dict, Tuple

import torch

from megatron.config.core import ModelConfig


def _check(m: ModelConfig) -> None:
    bad = []
    if m.position_embedding_type != "learned_absolute":
        bad.append(f"--position-embedding-type {m.position_embedding_type}")
    if m.normalization != "LayerNorm":
        bad.append(f"--normalization {m.normalization}")
    if m.swiglu:
        bad.append("--swiglu")
    if m.activation_func not in ("gelu", "gelu-erf"):
        bad.append(f"--activation-func {m.activation_func}")
    if m.gated_linear_unit:
        bad.append("--gated-linear-unit")
    if not m.add_bias_linear:
        bad.append("--disable-bias-linear")
    if m.query_groups != m.num_attention_heads:
        bad.append("--num-query-groups")
    if m.untie_embeddings_and_output_weights:
        bad.append("--untie-embeddings-and-output-weights")
    if m.kv_channels * m.num_attention_heads != m.hidden_size:
        bad.append("--kv-channels")
    if bad:
        raise ValueError("the GPT-2 architecture cannot hold a model with " + ", ".join(bad)
                         + " (models with RoPE, RMSNorm, --swiglu and no biases export as Llama)")


def boundary_token_id(config: dict, vocab_size: int):
    """The end-of-text id the exported config names as bos/eos: the training tokenizer's eod when
    its files are still there, else GPT-2's <|endoftext|> (50256) when the vocabulary holds it,
    else None (no such token known; HF then has no bos/eos rather than one out of range)."""
    d = config.get("data") or {}
    eod = None
    if d.get("tokenizer_type"):
        from megatron.tokenizer import build_tokenizer
        extra = d.get("vocab_extra_ids") or 0
        try:  # NullTokenizer's --vocab-size N holds ids 0..N-1, then eod and the extra ids
            eod = build_tokenizer(d["tokenizer_type"], vocab_file=d.get("vocab_file"), merge_file=d.get("merge_file"),
                                  tokenizer_model=d.get("tokenizer_model"), vocab_size=vocab_size - 1 - extra,
                                  vocab_extra_ids=extra).eod
        except (ValueError, OSError):
            eod = None  # tokenizer files moved or absent
    if eod is None and d.get("tokenizer_type") in (None, "GPT2BPETokenizer") and vocab_size > 50256:
        eod = 50256
    return eod if eod is not None and 0 <= eod < vocab_size else None


def _qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads*3*hn, ...] per-head interleaved -> [3*heads*hn, ...] grouped by q/k/v."""
    rest = t.shape[1:]
    hn = t.shape[0] // (3 * heads)
    return t.reshape(heads, 3, hn, *rest).transpose(0, 1).reshape(3 * heads * hn, *rest)


def _qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    hn = t.shape[0] // (3 * heads)
    return t.reshape(3, heads, hn, *rest).transpose(0, 1).reshape(3 * heads * hn, *rest)


def to_hf(config: dict, full: Dict[str, torch.Tensor]) -> Tuple[dict, Dict[str, torch.Tensor]]:
    m = ModelConfig(**config["model"])
    _check(m)
    nh = m.num_attention_heads
    sd = {"transformer.wte.weight": full["embedding.word_embeddings.weight"],
          "transformer.wpe.weight": full["embedding.position_embeddings"],
          "transformer.ln_f.weight": full["final_layernorm.weight"],
          "transformer.ln_f.bias": full["final_layernorm.bias"]}
    for i in range(m.num_layers):
        p, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        sd[h + "ln_1.weight"], sd[h + "ln_1.bias"] = full[p + "input_layernorm.weight"], full[p + "input_layernorm.bias"]
        sd[h + "ln_2.weight"] = full[p + "post_attention_layernorm.weight"]
        sd[h + "ln_2.bias"] = full[p + "post_attention_layernorm.bias"]
        sd[h + "attn.c_attn.weight"] = _qkv_to_hf(full[p + "self_attention.query_key_value.weight"], nh).t()
        sd[h + "attn.c_attn.bias"] = _qkv_to_hf(full[p + "self_attention.query_key_value.bias"], nh)
        sd[h + "attn.c_proj.weight"] = full[p + "self_attention.dense.weight"].t()
        sd[h + "attn.c_proj.bias"] = full[p + "self_attention.dense.bias"]
        sd[h + "mlp.c_fc.weight"] = full[p + "mlp.dense_h_to_4h.weight"].t()
        sd[h + "mlp.c_fc.bias"] = full[p + "mlp.dense_h_to_4h.bias"]
        sd[h + "mlp.c_proj.weight"] = full[p + "mlp.dense_4h_to_h.weight"].t()
        sd[h + "mlp.c_proj.bias"] = full[p + "mlp.dense_4h_to_h.bias"]
    hf_config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
                 "n_positions": m.max_position_embeddings, "n_embd": m.hidden_size, "n_layer": m.num_layers,
                 "n_head": nh, "n_inner": m.ffn_hidden_size,
                 "activation_function": "gelu" if m.activation_func == "gelu-erf" else "gelu_new",
                 "layer_norm_epsilon": m.layernorm_epsilon, "resid_pdrop": m.hidden_dropout,
                 "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
                 "initializer_range": m.init_method_std, "tie_word_embeddings": True,
                 "torch_dtype": "float32"}
    # GPT2Config's defaults (50256) would name a token outside a smaller vocabulary.
    hf_config["bos_token_id"] = hf_config["eos_token_id"] = boundary_token_id(config, m.vocab_size)
    return hf_config, {k: v.contiguous().clone() for k, v in sd.items()}


# HF GPT-2's activation_function -> ours: "gelu" is the exact (erf) GeLU in transformers.
_HF_GELU = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "gelu": "gelu-erf"}


def from_hf(hf_config: dict, sd: Dict[str, torch.Tensor]) -> Tuple[dict, Dict[str, torch.Tensor]]:
    if hf_config.get("model_type") != "gpt2":
        raise ValueError(f"model_type {hf_config.get('model_type')!r}: only gpt2 import is implemented")
    sd = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in sd.items()}
    nh, nl, h = hf_config["n_head"], hf_config["n_layer"], hf_config["n_embd"]
    act = _HF_GELU.get(hf_config.get("activation_function", "gelu_new"))
    if act is None:
        raise ValueError(f"activation_function {hf_config.get('activation_function')!r}: GPT-2 import supports "
                         f"{', '.join(sorted(_HF_GELU))}")
    model = dict(activation_func=act, model_type="gpt", num_layers=nl, hidden_size=h, num_attention_heads=nh,
                 ffn_hidden_size=hf_config.get("n_inner") or 4 * h, seq_length=hf_config["n_positions"],
                 max_position_embeddings=hf_config["n_positions"], vocab_size=hf_config["vocab_size"],
                 layernorm_epsilon=hf_config.get("layer_norm_epsilon", 1e-5),
                 init_method_std=hf_config.get("initializer_range", 0.02))
    full = {"embedding.word_embeddings.weight": sd["wte.weight"], "embedding.position_embeddings": sd["wpe.weight"],
            "final_layernorm.weight": sd["ln_f.weight"], "final_layernorm.bias": sd["ln_f.bias"]}
    for i in range(nl):
        p, q = f"decoder.layers.{i}.", f"h.{i}."
        full[p + "input_layernorm.weight"], full[p + "input_layernorm.bias"] = sd[q + "ln_1.weight"], sd[q + "ln_1.bias"]
        full[p + "post_attention_layernorm.weight"] = sd[q + "ln_2.weight"]
        full[p + "post_attention_layernorm.bias"] = sd[q + "ln_2.bias"]
        full[p + "self_attention.query_key_value.weight"] = _qkv_from_hf(sd[q + "attn.c_attn.weight"].t(), nh)
        full[p + "self_attention.query_key_value.bias"] = _qkv_from_hf(sd[q + "attn.c_attn.bias"], nh)
        full[p + "self_attention.dense.weight"] = sd[q + "attn.c_proj.weight"].t()
        full[p + "self_attention.dense.bias"] = sd[q + "attn.c_proj.bias"]
        full[p + "mlp.dense_h_to_4h.weight"] = sd[q + "mlp.c_fc.weight"].t()
        full[p + "mlp.dense_h_to_4h.bias"] = sd[q + "mlp.c_fc.bias"]
        full[p + "mlp.dense_4h_to_h.weight"] = sd[q + "mlp.c_proj.weight"].t()
        full[p + "mlp.dense_4h_to_h.bias"] = sd[q + "mlp.c_proj.bias"]
    return model, {k: v.contiguous().clone() for k, v in full.items()}


def save_hf(out: str, hf_config: dict, sd: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)


# Integer fields of the HF configs we read: a forged string or a billion layers is refused up front.
_INT_FIELDS = ("n_head", "n_layer", "n_embd", "n_positions", "n_inner", "vocab_size", "hidden_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "max_position_embeddings", "d_model", "d_ff", "d_kv", "num_layers", "num_decoder_layers",
               "num_heads", "relative_attention_num_buckets", "relative_attention_max_distance",
               "num_local_experts", "num_experts_per_tok")


def load_hf(folder: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """config.json (checked field types) + model.safetensors (no pickle)."""
    from safetensors.torch import load_file
    from megatron import safe_paths
    path = os.path.join(folder, "config.json")
    text = safe_paths.read_text(folder, "config.json", safe_paths.JSON_BYTES, "JSON config")  # no FIFO, link
    try:
        cfg = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: the top level must be a JSON object")
    for k in _INT_FIELDS:
        v = cfg.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 < v < 1 << 24):
            raise ValueError(f"{path}: field {k!r} is {v!r}, expected a positive integer below 2**24")
    for size, heads in (("n_embd", "n_head"), ("hidden_size", "num_attention_heads"),
                        ("num_attention_heads", "num_key_value_heads")):
        if isinstance(cfg.get(size), int) and isinstance(cfg.get(heads), int) and cfg[size] % cfg[heads]:
            raise ValueError(f"{path}: {size} {cfg[size]} is not divisible by {heads} {cfg[heads]}; not a model "
                             f"this converter (or Hugging Face) can build")
    weights = safe_paths.regular_file(folder, "model.safetensors", "safetensors file")
    try:
        sd = load_file(weights)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: a truncated or foreign file
        raise ValueError(f"{weights}: not a readable safetensors file ({str(e).splitlines()[0][:200]}); the "
                         f"download is truncated or the file is not safetensors") from None
    _sizes_fit_weights(path, cfg, sd)
    return cfg, sd


def _sizes_fit_weights(path: str, cfg: dict, sd: Dict[str, torch.Tensor]) -> None:
    """The config's sizes must describe the weights beside it: a model built from the config (by
    --verify, or transformers) holds at least its embedding table and hidden^2 per layer, which
    may not exceed what model.safetensors holds (sizes just under the field cap with a tiny file
    would allocate gigabytes)."""
    hidden = max(cfg.get(k) or 0 for k in ("n_embd", "hidden_size", "d_model"))
    layers = sum(cfg.get(k) or 0 for k in ("n_layer", "num_hidden_layers", "num_layers", "num_decoder_layers"))
    implied = (cfg.get("vocab_size") or 0) * hidden + layers * hidden * hidden
    held = sum(t.numel() for t in sd.values())
    if implied > held:
        raise ValueError(f"{path}: its sizes (hidden {hidden}, {layers} layers, vocabulary {cfg.get('vocab_size')}) "
                         f"describe at least {implied} parameters, model.safetensors holds {held}: not the config of "
                         f"these weights")


def our_logits(model_fields: dict, full: Dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, vocab] of our single-process GPT holding `full` (eval mode, fp32)."""
    import torch.nn.functional as F
    from megatron.core.parallel_state import ParallelState
    from megatron.models.gpt import GPTStage
    m = ModelConfig(**{**model_fields, "hidden_dropout": 0.0, "attention_dropout": 0.0})
    stage = GPTStage(m, ParallelState(), layer_start=0, layer_end=m.num_layers, pre_process=True,
                     post_process=True, seed=0)
    padded = m.padded_vocab_size(1)
    sd = dict(full)
    w = sd["embedding.word_embeddings.weight"]
    sd["embedding.word_embeddings.weight"] = torch.cat([w, w.new_zeros(padded - w.shape[0], w.shape[1])])
    if m.untie_embeddings_and_output_weights:
        o = sd["output_layer.weight"]
        sd["output_layer.weight"] = torch.cat([o, o.new_zeros(padded - o.shape[0], o.shape[1])])
    else:
        sd.pop("output_layer.weight", None)
    stage.load_state_dict(sd)
    stage.eval()
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        rotary = None
        if m.position_embedding_type == "rope":
            from megatron.models.rotary import rotary_cos_sin
            rotary = rotary_cos_sin(m, pos, torch.float32)
        x = stage.decoder(stage.embedding(tokens, pos), None, rotary=rotary)
        x = stage.final_layernorm(x)
        logits = F.linear(x, stage.output_weight())[..., :m.vocab_size]
    return logits.transpose(0, 1)


def hf_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits
