"""Our Llama-style GPT (RoPE at 100 %, RMSNorm, SwiGLU, no linear biases, optional GQA) <->
Hugging Face `LlamaForCausalLM`. Both use the "rotate half" RoPE layout, so q/k need no
permutation; only our fused per-group [q heads, k, v] projection is split into q/k/v_proj."""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron.config.core import ModelConfig


def _check(m: ModelConfig) -> None:
    bad = []
    if m.position_embedding_type != "rope" or m.rotary_percent != 1.0:
        bad.append("RoPE over the whole head (--position-embedding-type rope --rotary-percent 1.0)")
    if m.normalization != "RMSNorm":
        bad.append("--normalization RMSNorm")
    if not m.swiglu:
        bad.append("--swiglu")
    if m.add_bias_linear:
        bad.append("--disable-bias-linear")
    if bad:
        raise ValueError("the Llama architecture needs " + ", ".join(bad))


def is_llama(model_fields: dict) -> bool:
    return model_fields.get("position_embedding_type") == "rope" or model_fields.get("swiglu", False)


def to_hf(config: dict, full: Dict[str, torch.Tensor]) -> Tuple[dict, Dict[str, torch.Tensor]]:
    m = ModelConfig(**config["model"])
    _check(m)
    g, hn, nh = m.query_groups, m.kv_channels, m.num_attention_heads
    hpg = nh // g
    sd = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"],
          "model.norm.weight": full["final_layernorm.weight"]}
    if m.untie_embeddings_and_output_weights:
        sd["lm_head.weight"] = full["output_layer.weight"]
    for i in range(m.num_layers):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        w = full[p + "self_attention.query_key_value.weight"].reshape(g, hpg + 2, hn, m.hidden_size)
        sd[h + "self_attn.q_proj.weight"] = w[:, :hpg].reshape(nh * hn, m.hidden_size)
        sd[h + "self_attn.k_proj.weight"] = w[:, hpg].reshape(g * hn, m.hidden_size)
        sd[h + "self_attn.v_proj.weight"] = w[:, hpg + 1].reshape(g * hn, m.hidden_size)
        sd[h + "self_attn.o_proj.weight"] = full[p + "self_attention.dense.weight"]
        sd[h + "input_layernorm.weight"] = full[p + "input_layernorm.weight"]
        sd[h + "post_attention_layernorm.weight"] = full[p + "post_attention_layernorm.weight"]
        sd[h + "mlp.gate_proj.weight"] = full[p + "mlp.dense_h_to_4h_gate.weight"]
        sd[h + "mlp.up_proj.weight"] = full[p + "mlp.dense_h_to_4h.weight"]
        sd[h + "mlp.down_proj.weight"] = full[p + "mlp.dense_4h_to_h.weight"]
    hf_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
                 "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
                 "num_hidden_layers": m.num_layers, "num_attention_heads": nh, "num_key_value_heads": g,
                 "head_dim": hn, "max_position_embeddings": m.max_position_embeddings,
                 "rms_norm_eps": m.layernorm_epsilon, "rope_theta": m.rotary_base, "hidden_act": "silu",
                 "attention_bias": False, "mlp_bias": False, "attention_dropout": m.attention_dropout,
                 "initializer_range": m.init_method_std,
                 "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "torch_dtype": "float32"}
    return hf_config, {k: v.contiguous().clone() for k, v in sd.items()}


def from_hf(c: dict, sd: Dict[str, torch.Tensor]) -> Tuple[dict, Dict[str, torch.Tensor]]:
    nh, h, nl = c["num_attention_heads"], c["hidden_size"], c["num_hidden_layers"]
    g = c.get("num_key_value_heads") or nh
    hn = c.get("head_dim") or h // nh
    hpg = nh // g
    tied = c.get("tie_word_embeddings", False) or "lm_head.weight" not in sd
    model = dict(model_type="gpt", num_layers=nl, hidden_size=h, num_attention_heads=nh, kv_channels=hn,
                 ffn_hidden_size=c["intermediate_size"], seq_length=c["max_position_embeddings"],
                 max_position_embeddings=c["max_position_embeddings"], vocab_size=c["vocab_size"],
                 layernorm_epsilon=c.get("rms_norm_eps", 1e-6), init_method_std=c.get("initializer_range", 0.02),
                 position_embedding_type="rope", rotary_base=float(c.get("rope_theta", 10000.0)),
                 normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                 num_query_groups=g if g != nh else None, untie_embeddings_and_output_weights=not tied)
    full = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
            "final_layernorm.weight": sd["model.norm.weight"]}
    if not tied:
        full["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(nl):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        qw = sd[q + "self_attn.q_proj.weight"].reshape(g, hpg, hn, h)
        kw = sd[q + "self_attn.k_proj.weight"].reshape(g, 1, hn, h)
        vw = sd[q + "self_attn.v_proj.weight"].reshape(g, 1, hn, h)
        full[p + "self_attention.query_key_value.weight"] = torch.cat([qw, kw, vw], dim=1).reshape(-1, h)
        full[p + "self_attention.dense.weight"] = sd[q + "self_attn.o_proj.weight"]
        full[p + "input_layernorm.weight"] = sd[q + "input_layernorm.weight"]
        full[p + "post_attention_layernorm.weight"] = sd[q + "post_attention_layernorm.weight"]
        full[p + "mlp.dense_h_to_4h_gate.weight"] = sd[q + "mlp.gate_proj.weight"]
        full[p + "mlp.dense_h_to_4h.weight"] = sd[q + "mlp.up_proj.weight"]
        full[p + "mlp.dense_4h_to_h.weight"] = sd[q + "mlp.down_proj.weight"]
    return model, {k: v.contiguous().clone() for k, v in full.items()}


def hf_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits
