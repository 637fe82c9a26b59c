"""Our MoE GPT with Mixtral's shape <-> Hugging Face `MixtralForCausalLM`.

Everything but the MLP is Llama's mapping (`hf_llama`: RoPE, RMSNorm, GQA, no biases). Each
layer's MLP is a sparse MoE block on disk as
`model.layers.N.block_sparse_moe.gate.weight` [E, H] (our `mlp.router.weight`) and
`block_sparse_moe.experts.e.{w1, w3, w2}.weight` (gate [F, H], up [F, H], down [H, F]); our
`mlp.experts.weight1[e]` is [gate; up] and `weight2[e]` is w2.

The router: Mixtral takes the softmax over all experts, keeps the top k and renormalises them
to sum 1. That equals Megatron-Core's default (post-softmax) top-k, a softmax over the k
chosen logits: exp(l_i) / sum_{j in top-k} exp(l_j) either way, and the same experts are chosen
(softmax is monotonic). So a Mixtral model is our `--moe-router-topk k` without
`--moe-router-pre-softmax` (which does not renormalise), dropless, no shared experts, every
layer an MoE layer; anything else is refused with the flag to change.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron.config.core import ModelConfig
from tools.checkpoint import hf_llama


def is_mixtral(model_fields: dict) -> bool:
    return bool(model_fields.get("moe"))


def _check(m: ModelConfig) -> None:
    moe, bad = m.moe, []
    if moe.router_pre_softmax or moe.router_score_function != "softmax" or moe.router_topk_scaling_factor:
        bad.append("the default softmax router (no --moe-router-pre-softmax, --moe-router-score-function softmax, "
                   "no --moe-router-topk-scaling-factor)")
    if moe.shared_expert_intermediate_size:
        bad.append("no --moe-shared-expert-intermediate-size")
    if not all(moe.moe_layers(m.num_layers)):
        bad.append("every layer an MoE layer (--moe-layer-freq 1)")
    if moe.expert_capacity_factor is not None:
        bad.append("dropless routing (no --moe-expert-capacity-factor)")
    if moe.router_enable_expert_bias:
        bad.append("no --moe-router-enable-expert-bias")
    if bad:
        raise ValueError("the Mixtral architecture needs " + "; ".join(bad))


def to_hf(config: dict, full: Dict[str, torch.Tensor]) -> Tuple[dict, Dict[str, torch.Tensor]]:
    m = ModelConfig(**config["model"])
    _check(m)
    moe = m.moe
    ffn = moe.ffn_hidden_size or m.ffn_hidden_size
    # Llama's mapping for attention, norms and embeddings; its dense-MLP names get placeholders
    # and are dropped.
    stand_in = dict(full)
    for i in range(m.num_layers):
        for k in ("dense_h_to_4h_gate", "dense_h_to_4h", "dense_4h_to_h"):
            stand_in[f"decoder.layers.{i}.mlp.{k}.weight"] = torch.empty(0)
    hf_config, sd = hf_llama.to_hf(config, stand_in)
    sd = {k: v for k, v in sd.items() if ".mlp." not in k}
    for i in range(m.num_layers):
        p, h = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        sd[h + "gate.weight"] = full[p + "router.weight"].contiguous().clone()
        w1, w2 = full[p + "experts.weight1"], full[p + "experts.weight2"]
        for e in range(moe.num_experts):
            sd[h + f"experts.{e}.w1.weight"] = w1[e, :ffn].contiguous().clone()
            sd[h + f"experts.{e}.w3.weight"] = w1[e, ffn:].contiguous().clone()
            sd[h + f"experts.{e}.w2.weight"] = w2[e].contiguous().clone()
    for k in ("mlp_bias", "head_dim"):
        hf_config.pop(k, None)
    hf_config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=ffn,
                     num_local_experts=moe.num_experts, num_experts_per_tok=moe.router_topk,
                     router_aux_loss_coef=moe.aux_loss_coeff, output_router_logits=False, sliding_window=None)
    if m.kv_channels != m.hidden_size // m.num_attention_heads:
        hf_config["head_dim"] = m.kv_channels  # MixtralConfig reads head_dim when it is given
    return hf_config, sd


def from_hf(c: dict, sd: Dict[str, torch.Tensor]) -> Tuple[dict, Dict[str, torch.Tensor]]:
    nl, e = c["num_hidden_layers"], c.get("num_local_experts")
    if not isinstance(e, int) or isinstance(e, bool) or e < 1:
        raise ValueError(f"config.json: num_local_experts is {e!r}, expected a positive integer")
    k = c.get("num_experts_per_tok", 2)
    if c.get("sliding_window"):
        raise ValueError(f"config.json: sliding_window {c['sliding_window']} (Mistral's windowed attention) is not "
                         "implemented here; only full causal attention (sliding_window null) converts")
    # Llama's mapping for the rest: its dense-MLP names are given placeholders, then replaced.
    stand_in = dict(sd)
    for i in range(nl):
        for n in ("gate_proj", "up_proj", "down_proj"):
            stand_in[f"model.layers.{i}.mlp.{n}.weight"] = torch.empty(0)
    model, full = hf_llama.from_hf(c, stand_in)
    full = {n: v for n, v in full.items() if ".mlp.dense" not in n}
    model["moe"] = dict(num_experts=e, router_topk=k, aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)))
    for i in range(nl):
        p, h = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        full[p + "router.weight"] = sd[h + "gate.weight"].contiguous().clone()
        full[p + "experts.weight1"] = torch.stack([torch.cat([sd[h + f"experts.{j}.w1.weight"],
                                                              sd[h + f"experts.{j}.w3.weight"]]) for j in range(e)])
        full[p + "experts.weight2"] = torch.stack([sd[h + f"experts.{j}.w2.weight"] for j in range(e)])
    return model, full


def hf_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits
