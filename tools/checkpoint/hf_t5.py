"""Our T5 <-> Hugging Face `T5ForConditionalGeneration` (safetensors + config.json).
`transformers`/`safetensors` are optional and only imported here.

What our T5 (megatron/models/t5.py) computes, and how it maps:
- attention: softmax(q k^T / sqrt(kv_channels) + relative bias); HF T5 does not scale, so the
  query weights (self and cross attention) carry the factor kv_channels**-0.5 in HF (exact
  in both directions when kv_channels is a power of 4, e.g. 16 or 64; otherwise rounded once);
- relative bias: T5's bucketing (bidirectional in the encoder, causal in the decoder), a
  [buckets, heads] table; HF T5 keeps one table per stack in block 0 and reuses it in every
  layer, ours has one per layer, so export needs every layer's table equal to layer 0's
  (import copies HF's table into every layer);
- pre-norm residual blocks with RMSNorm (weight only), final norm per stack, bias-free
  linears; the FFN is one of (ours -> HF `feed_forward_proj`): ReLU (--activation-func relu,
  "relu": the original T5), GeLU-tanh ("gelu_pytorch_tanh"; "gelu_new" imports too), gated
  GeLU-tanh (--gated-linear-unit, "gated-gelu": T5 v1.1 / Flan-T5, wi_0 = gate, wi_1 = up),
  gated ReLU (--gated-linear-unit --activation-func relu, "gated-relu") or gated SiLU (--swiglu,
  "gated-silu"). HF's plain "gelu" is the exact erf GeLU, which we do not have: refused;
- the word embedding is shared by encoder and decoder; the LM head is tied to it, or (with
  --untie-embeddings-and-output-weights; T5 v1.1 / Flan-T5) a table of its own. The decoder
  output is NOT scaled by d_model**-0.5: exported configs say `scale_decoder_outputs: false`
  (transformers 5) and `tie_word_embeddings: false` (how transformers 4 spells it;
  `lm_head.weight` is always written, a copy of `shared.weight` when tied). Importing a config
  that scales folds the factor into the decoder's final norm weight; an `lm_head.weight` that
  differs from `shared.weight` imports as an untied head;
- our LM head has a vocabulary bias (Megatron's T5); HF has none, so it must be zero to export
  and is zero after import. Vocabulary padding is cut on export and added on import.
What HF T5 cannot hold is refused with one line naming each difference."""
from __future__ import annotations

import math
import re
from typing import Dict, Tuple

import torch

from megatron.config.core import ModelConfig


def _unequal_tables(m: ModelConfig, full: Dict[str, torch.Tensor]) -> list:
    out = []
    for stack, n in (("encoder", m.encoder_num_layers), ("decoder", m.decoder_num_layers)):
        first = full[f"{stack}.layers.0.relative_bias.weight"]
        bad = [i for i in range(1, n) if not torch.equal(full[f"{stack}.layers.{i}.relative_bias.weight"], first)]
        if bad:
            out.append(f"per-layer relative attention bias tables ({stack} layers {bad} differ from layer 0; "
                       "HF T5 reuses layer 0's table in every layer)")
    return out


def check(m: ModelConfig, full: Dict[str, torch.Tensor] = None) -> None:
    bad = []
    if m.position_embedding_type != "relative":
        bad.append(f"--position-embedding-type {m.position_embedding_type} (HF T5 has only relative attention bias)")
    if m.normalization != "RMSNorm":
        bad.append(f"--normalization {m.normalization} (HF T5 uses RMSNorm)")
    if m.add_bias_linear:
        bad.append("linear biases (HF T5 has none; train with --disable-bias-linear)")
    if m.query_groups != m.num_attention_heads:
        bad.append(f"--num-query-groups {m.num_query_groups} (HF T5 has no grouped-query attention)")
    if full is not None:
        if m.position_embedding_type == "relative":
            bad += _unequal_tables(m, full)
        if "lm_head_bias" in full and bool(full["lm_head_bias"].ne(0).any()):
            bad.append("a non-zero LM-head bias (HF T5's lm_head has no bias)")
    if bad:
        raise ValueError("HF T5ForConditionalGeneration cannot express this T5: " + "; ".join(bad))


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    return (t.double() * factor).to(t.dtype)


def to_hf(config: dict, full: Dict[str, torch.Tensor]) -> Tuple[dict, Dict[str, torch.Tensor]]:
    m = ModelConfig(**config["model"])
    check(m, full)
    nh, hn, h = m.num_attention_heads, m.kv_channels, m.hidden_size
    qs = hn ** -0.5
    head = "output_layer.weight" if m.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"
    sd = {"shared.weight": full["embedding.word_embeddings.weight"],
          "lm_head.weight": full[head],
          "encoder.final_layer_norm.weight": full["encoder_final_layernorm.weight"],
          "decoder.final_layer_norm.weight": full["decoder_final_layernorm.weight"],
          "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
              full["encoder.layers.0.relative_bias.weight"],
          "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
              full["decoder.layers.0.relative_bias.weight"]}
    for stack, n in (("encoder", m.encoder_num_layers), ("decoder", m.decoder_num_layers)):
        for i in range(n):
            p, b = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            qkv = full[p + "self_attention.query_key_value.weight"].reshape(nh, 3, hn, h)
            sd[b + "0.SelfAttention.q.weight"] = _scaled(qkv[:, 0].reshape(nh * hn, h), qs)
            sd[b + "0.SelfAttention.k.weight"] = qkv[:, 1].reshape(nh * hn, h)
            sd[b + "0.SelfAttention.v.weight"] = qkv[:, 2].reshape(nh * hn, h)
            sd[b + "0.SelfAttention.o.weight"] = full[p + "self_attention.dense.weight"]
            sd[b + "0.layer_norm.weight"] = full[p + "input_layernorm.weight"]
            ff = "1"
            if stack == "decoder":
                kv = full[p + "inter_attention.key_value.weight"].reshape(nh, 2, hn, h)
                sd[b + "1.EncDecAttention.q.weight"] = _scaled(full[p + "inter_attention.query.weight"], qs)
                sd[b + "1.EncDecAttention.k.weight"] = kv[:, 0].reshape(nh * hn, h)
                sd[b + "1.EncDecAttention.v.weight"] = kv[:, 1].reshape(nh * hn, h)
                sd[b + "1.EncDecAttention.o.weight"] = full[p + "inter_attention.dense.weight"]
                sd[b + "1.layer_norm.weight"] = full[p + "pre_cross_attn_layernorm.weight"]
                ff = "2"
            f = b + ff + ".DenseReluDense."
            if m.gated_mlp:
                sd[f + "wi_0.weight"] = full[p + "mlp.dense_h_to_4h_gate.weight"]
                sd[f + "wi_1.weight"] = full[p + "mlp.dense_h_to_4h.weight"]
            else:
                sd[f + "wi.weight"] = full[p + "mlp.dense_h_to_4h.weight"]
            sd[f + "wo.weight"] = full[p + "mlp.dense_4h_to_h.weight"]
            sd[b + ff + ".layer_norm.weight"] = full[p + "post_attention_layernorm.weight"]
    hf_config = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": m.vocab_size,
                 "d_model": h, "d_kv": hn, "d_ff": m.ffn_hidden_size, "num_layers": m.encoder_num_layers,
                 "num_decoder_layers": m.decoder_num_layers, "num_heads": nh,
                 "relative_attention_num_buckets": m.relative_attention_num_buckets,
                 "relative_attention_max_distance": m.relative_attention_max_distance,
                 "dropout_rate": m.hidden_dropout, "layer_norm_epsilon": m.layernorm_epsilon,
                 "feed_forward_proj": _ffn_name(m),
                 # false = no d_model**-0.5 on the decoder output; the head is still the shared table
                 "tie_word_embeddings": False, "scale_decoder_outputs": False, "is_encoder_decoder": True,
                 "decoder_start_token_id": 0,
                 "pad_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}
    return hf_config, {k: v.contiguous().clone() for k, v in sd.items()}


def _ffn_name(m: ModelConfig) -> str:
    """HF T5's `feed_forward_proj` for our MLP (see the module docstring)."""
    if m.swiglu:
        return "gated-silu"
    if m.activation_func == "relu":
        return "gated-relu" if m.gated_linear_unit else "relu"
    return "gated-gelu" if m.gated_linear_unit else "gelu_pytorch_tanh"


# HF `feed_forward_proj` -> our MLP fields. HF's "gated-gelu" means the tanh GeLU (gelu_new);
# a plain "gelu" is the exact erf GeLU, which our MLP does not compute.
_FFN = {"relu": dict(activation_func="relu"), "gated-relu": dict(activation_func="relu", gated_linear_unit=True),
        "gelu_new": {}, "gelu_pytorch_tanh": {}, "gated-gelu": dict(gated_linear_unit=True),
        "gated-gelu_new": dict(gated_linear_unit=True), "gated-gelu_pytorch_tanh": dict(gated_linear_unit=True),
        "gated-silu": dict(swiglu=True)}


def from_hf(c: dict, sd: Dict[str, torch.Tensor]) -> Tuple[dict, Dict[str, torch.Tensor]]:
    act = c.get("feed_forward_proj", "relu")
    if act not in _FFN:
        raise ValueError(f"feed_forward_proj {act!r}: our T5 MLP is one of {', '.join(_FFN)} "
                         "(HF's plain 'gelu' is the exact erf GeLU, which it does not compute)")
    untied = "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["shared.weight"])
    stray = [k for k in sd if re.search(r"block\.[1-9]\d*\.layer\.0\.SelfAttention\.relative_attention_bias", k)]
    if stray:
        raise ValueError(f"{stray[0]}: HF T5 only uses block 0's relative attention bias")
    nh, hn, h = c["num_heads"], c["d_kv"], c["d_model"]
    ne, nd = c["num_layers"], c.get("num_decoder_layers") or c["num_layers"]
    gated = act.startswith("gated-")
    qs = math.sqrt(hn)
    model = dict(model_type="t5", encoder_num_layers=ne, decoder_num_layers=nd, hidden_size=h, num_attention_heads=nh,
                 kv_channels=hn, ffn_hidden_size=c["d_ff"], vocab_size=c["vocab_size"],
                 layernorm_epsilon=c.get("layer_norm_epsilon", 1e-6), normalization="RMSNorm",
                 add_bias_linear=False, position_embedding_type="relative", **_FFN[act],
                 untie_embeddings_and_output_weights=untied,
                 relative_attention_num_buckets=c.get("relative_attention_num_buckets", 32),
                 relative_attention_max_distance=c.get("relative_attention_max_distance", 128),
                 hidden_dropout=c.get("dropout_rate", 0.1), attention_dropout=c.get("dropout_rate", 0.1))
    dec_norm = sd["decoder.final_layer_norm.weight"]
    scale = c.get("scale_decoder_outputs", c.get("tie_word_embeddings", True) is not False)
    if scale:  # HF multiplies the decoder output by d_model**-0.5 before the (shared) LM head
        dec_norm = _scaled(dec_norm, h ** -0.5)
    full = {"embedding.word_embeddings.weight": sd["shared.weight"],
            "encoder_final_layernorm.weight": sd["encoder.final_layer_norm.weight"],
            "decoder_final_layernorm.weight": dec_norm,
            "lm_head_bias": torch.zeros(c["vocab_size"], dtype=sd["shared.weight"].dtype)}
    if untied:
        full["output_layer.weight"] = sd["lm_head.weight"]
    for stack, n in (("encoder", ne), ("decoder", nd)):
        table = sd[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        for i in range(n):
            p, b = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            a = b + "0.SelfAttention."
            q = _scaled(sd[a + "q.weight"], qs).reshape(nh, 1, hn, h)
            k, v = sd[a + "k.weight"].reshape(nh, 1, hn, h), sd[a + "v.weight"].reshape(nh, 1, hn, h)
            full[p + "self_attention.query_key_value.weight"] = torch.cat([q, k, v], dim=1).reshape(3 * nh * hn, h)
            full[p + "self_attention.dense.weight"] = sd[a + "o.weight"]
            full[p + "input_layernorm.weight"] = sd[b + "0.layer_norm.weight"]
            full[p + "relative_bias.weight"] = table
            ff = "1"
            if stack == "decoder":
                x = b + "1.EncDecAttention."
                full[p + "inter_attention.query.weight"] = _scaled(sd[x + "q.weight"], qs)
                k, v = sd[x + "k.weight"].reshape(nh, 1, hn, h), sd[x + "v.weight"].reshape(nh, 1, hn, h)
                full[p + "inter_attention.key_value.weight"] = torch.cat([k, v], dim=1).reshape(2 * nh * hn, h)
                full[p + "inter_attention.dense.weight"] = sd[x + "o.weight"]
                full[p + "pre_cross_attn_layernorm.weight"] = sd[b + "1.layer_norm.weight"]
                ff = "2"
            f = b + ff + ".DenseReluDense."
            if gated:
                full[p + "mlp.dense_h_to_4h_gate.weight"] = sd[f + "wi_0.weight"]
                full[p + "mlp.dense_h_to_4h.weight"] = sd[f + "wi_1.weight"]
            else:
                full[p + "mlp.dense_h_to_4h.weight"] = sd[f + "wi.weight"]
            full[p + "mlp.dense_4h_to_h.weight"] = sd[f + "wo.weight"]
            full[p + "post_attention_layernorm.weight"] = sd[b + ff + ".layer_norm.weight"]
    return model, {k: v.contiguous().clone() for k, v in full.items()}


def random_tokens(model_fields: dict, seed: int = 0):
    """(encoder tokens [2, s_enc], decoder tokens [2, s_dec]) for --verify, at most 16 / 8 long."""
    g = torch.Generator().manual_seed(seed)
    m = ModelConfig(**model_fields)
    enc = torch.randint(0, m.vocab_size, (2, min(16, m.encoder_seq_length)), generator=g)
    dec = torch.randint(0, m.vocab_size, (2, min(8, m.decoder_seq_length)), generator=g)
    return enc, dec


def our_logits(model_fields: dict, full: Dict[str, torch.Tensor], enc: torch.Tensor, dec: torch.Tensor):
    """Logits [b, s_dec, vocab] of our single-process T5 holding `full` (eval mode, no padding)."""
    import torch.nn.functional as F
    from megatron.core.parallel_state import ParallelState
    from megatron.models.t5 import T5Stage, t5_masks
    m = ModelConfig(**{**model_fields, "hidden_dropout": 0.0, "attention_dropout": 0.0})
    stage = T5Stage(m, ParallelState(), encoder_layers=(0, m.encoder_num_layers),
                    decoder_layers=(0, m.decoder_num_layers), pre_process=True, pre_process_decoder=True,
                    post_process=True, encoder_end=True, seed=0)
    padded = m.padded_vocab_size(1)
    sd = dict(full)
    for name in ("embedding.word_embeddings.weight", "lm_head_bias", "output_layer.weight"):
        if name not in sd:
            continue
        t = sd[name]
        sd[name] = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
    stage.load_state_dict(sd)
    stage.eval()
    batch = {"enc_mask": torch.ones_like(enc, dtype=torch.bool), "dec_mask": torch.ones_like(dec, dtype=torch.bool)}
    enc_mask, dec_mask, cross_mask = t5_masks(batch)
    with torch.no_grad():
        x = stage.encoder_final_layernorm(stage.encoder(stage._embed(enc), enc_mask))
        y = stage.decoder(stage._embed(dec), dec_mask, x, cross_mask)
        y = stage.decoder_final_layernorm(y)
        logits = F.linear(y, stage.output_weight(), stage.lm_head_bias)[..., :m.vocab_size]
    return logits.transpose(0, 1)


def hf_logits(folder: str, enc: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
    from transformers import T5ForConditionalGeneration
    model = T5ForConditionalGeneration.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=enc, decoder_input_ids=dec).logits


def logit_diff(model_fields: dict, full: Dict[str, torch.Tensor], folder: str) -> float:
    enc, dec = random_tokens(model_fields)
    return float((our_logits(model_fields, full, enc, dec) - hf_logits(folder, enc, dec)).abs().max())
