"""Profile our own GPT layers operator by operator and write Aceso-format op tables.

The operators are the pieces of ``megatron.models.gpt.GPTStage`` / ``TransformerLayer`` as
they run in training (the real modules and their parameters, called in the same order):

    encoder-embedding            word (+ position) embedding, [b, s] -> [s, b, h]
    enc-1st-layernorm            input_layernorm
    enc-attention-qkv            query_key_value (column-parallel)
    enc-attention-core           split heads + scaled_dot_product_attention (score, softmax,
                                 dropout and context are one fused kernel in our layer, so
                                 they are one row here, where Aceso's CUDA tables have four)
    enc-attention-dense          dense (row-parallel)
    enc-post-attention-dropout   dropout + residual add
    enc-2nd-layernorm            post_attention_layernorm
    enc-MLP-GEMM-1               dense_h_to_4h
    enc-MLP-gelu                 GeLU (tanh)
    enc-MLP-GEMM-2               dense_4h_to_h
    enc-post-MLP-dropout         dropout + residual add
    final-layernorm              final_layernorm
    gpt-post-process             output projection (tied embedding) + vocab cross-entropy

Per operator: forward and backward time (median of ``repeats`` runs after one warm-up, µs),
input / output size, weights, and activations = the bytes autograd saves for backward
(parameters excluded, each storage counted once), all in MB. ``fwd_reserved`` /
``bwd_reserved`` are 0: the CPU allocator has no caching reserve to measure. Only TP = 1 is
profiled (one process); collective and p2p tables are not measured here.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from megatron.aceso.db import OpRow, write_op_csv
from megatron.config import ModelConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.random import model_parallel_seed

MB = 1024.0 * 1024.0


def _nbytes(t) -> float:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (tuple, list)):
        return sum(_nbytes(x) for x in t)
    return 0.0


def _saved_bytes(fn, inputs, params) -> Tuple[float, object]:
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen = set()
    total = [0.0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key[0] not in param_ptrs and key not in seen:
            seen.add(key)
            total[0] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return total[0], out


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def gpt_operators(stage, cfg: ModelConfig, mbs: int):
    """[(name, fn, make_inputs, params)] for one GPT stage holding embedding, one layer, head."""
    s, b, h = cfg.seq_length, mbs, cfg.hidden_size
    layer = stage.decoder.layers[0]
    attn, mlp = layer.self_attention, layer.mlp
    gen = torch.Generator().manual_seed(0)

    def hidden(width=h, grad=True):
        return lambda: [torch.randn(s, b, width, generator=gen).requires_grad_(grad)]

    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    labels = torch.randint(0, cfg.vocab_size, (s, b), generator=gen)
    residual = torch.randn(s, b, h, generator=gen)
    qkv_width = attn.query_key_value.out_per_rank
    drop = layer.hidden_dropout

    def core(mixed):
        q, k, v = attn._split_qkv(mixed)
        return attn.core_attention(q, k, v, None, None)

    def post_drop(y):
        return residual + (F.dropout(y, drop, True) if drop > 0 else y)

    def head(x):
        logits = F.linear(x, stage.output_weight())
        return vocab_parallel_cross_entropy(logits, labels, None, cfg.vocab_size)

    emb = stage.embedding
    return [
        ("encoder-embedding", lambda t: emb(t, pos), lambda: [tokens], list(emb.parameters())),
        ("enc-1st-layernorm", layer.input_layernorm, hidden(), list(layer.input_layernorm.parameters())),
        ("enc-attention-qkv", attn.query_key_value, hidden(), list(attn.query_key_value.parameters())),
        ("enc-attention-core", core, hidden(qkv_width), []),
        ("enc-attention-dense", attn.dense, hidden(attn.np * attn.hn), list(attn.dense.parameters())),
        ("enc-post-attention-dropout", post_drop, hidden(), []),
        ("enc-2nd-layernorm", layer.post_attention_layernorm, hidden(),
         list(layer.post_attention_layernorm.parameters())),
        ("enc-MLP-GEMM-1", mlp.dense_h_to_4h, hidden(), list(mlp.dense_h_to_4h.parameters())),
        ("enc-MLP-gelu", lambda x: F.gelu(x, approximate="tanh"), hidden(mlp.dense_h_to_4h.out_per_rank), []),
        ("enc-MLP-GEMM-2", mlp.dense_4h_to_h, hidden(mlp.dense_h_to_4h.out_per_rank),
         list(mlp.dense_4h_to_h.parameters())),
        ("enc-post-MLP-dropout", post_drop, hidden(), []),
        ("final-layernorm", stage.final_layernorm, hidden(), list(stage.final_layernorm.parameters())),
        ("gpt-post-process", head, hidden(), [stage.output_weight()]),
    ]


def profile_operator(fn, make_inputs, params, repeats: int) -> OpRow:
    """Time and size one operator; the name is filled in by the caller."""
    inputs = make_inputs()
    act, out = _saved_bytes(fn, inputs, params)
    grad_out = torch.randn_like(out)
    fwd_us = _time(lambda: fn(*inputs), repeats)   # autograd on, as in training
    bwd_times = []
    for _ in range(repeats + 1):
        y = fn(*make_inputs())
        t0 = time.perf_counter()
        torch.autograd.backward(y, grad_out)
        bwd_times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
    bwd_us = statistics.median(bwd_times[1:]) * 1e6
    return OpRow("", fwd_us, bwd_us, _nbytes(inputs) / MB, _nbytes(out) / MB,
                 sum(p.numel() * p.element_size() for p in params) / MB, act / MB, 0.0, 0.0)


def profile_gpt(cfg: ModelConfig, out_dir: str, *, size: str, mbs_values: Sequence[int] = (1, 2),
                repeats: int = 5, seed: int = 1234) -> List[str]:
    """Write ``gpt_<size>_mbs<M>_tp1_algo0.csv`` for each micro-batch size; returns the paths."""
    import dataclasses
    from megatron.models.gpt import GPTStage
    model_parallel_seed(seed, 0, 0)  # dropout inside attention draws from the TP stream
    # Aceso's tables time bias+GeLU and bias+dropout+residual as operators of their own, so the
    # linears must add their bias themselves (no fused epilogues) while being profiled.
    cfg = dataclasses.replace(cfg, bias_gelu_fusion=False, bias_dropout_fusion=False)
    stage = GPTStage(cfg, ParallelState(), layer_start=0, layer_end=1, pre_process=True,
                     post_process=True, seed=seed)
    stage.train()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for m in mbs_values:
        rows = []
        for name, fn, make_inputs, params in gpt_operators(stage, cfg, m):
            r = profile_operator(fn, make_inputs, params, repeats)
            rows.append(OpRow(name, *[getattr(r, f) for f in (
                "fwd_us", "bwd_us", "input_mb", "output_mb", "weight_mb", "act_mb",
                "fwd_reserved_mb", "bwd_reserved_mb")]))
        path = os.path.join(out_dir, f"gpt_{size}_mbs{m}_tp1_algo0.csv")
        write_op_csv(path, rows)
        paths.append(path)
    return paths


def stage_param_mb(cfg: ModelConfig, seed: int = 1234) -> Dict[str, float]:
    """Parameter MB of a one-layer GPT stage by part, to check the tables against."""
    from megatron.models.gpt import GPTStage
    stage = GPTStage(cfg, ParallelState(), layer_start=0, layer_end=1, pre_process=True,
                     post_process=True, seed=seed)
    parts: Dict[str, float] = {}
    for n, p in stage.named_parameters():
        key = "layer" if n.startswith("decoder.") else n.split(".")[0]
        parts[key] = parts.get(key, 0.0) + p.numel() * p.element_size() / MB
    return parts
