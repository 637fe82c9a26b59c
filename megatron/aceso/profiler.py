"""Profile our own GPT layers operator by operator and write Aceso-format op tables.

The operators are the units ``TransformerLayer.op_units`` runs (the same callables, fed the
inputs they get inside the layer), so a row prices the code op-level recompute checkpoints:

    encoder-embedding            word (+ position) embedding, [b, s] -> [s, b, h]
    enc-1st-layernorm            input_layernorm
    enc-attention-qkv            query_key_value (column-parallel)
    enc-attention-core           split heads + scaled_dot_product_attention (score, softmax,
                                 dropout and context are one fused kernel in our layer, so
                                 they are one row here, where Aceso's CUDA tables have four)
    enc-attention-dense          dense (row-parallel; its bias is left to the next op when fused)
    enc-post-attention-dropout   (bias +) dropout + residual add (one kernel with
                                 --bias-dropout-fusion, as in training)
    enc-2nd-layernorm            post_attention_layernorm
    enc-MLP-GEMM-1               dense_h_to_4h
    enc-MLP-gelu                 (bias +) GeLU (tanh) (one kernel with --bias-gelu-fusion)
    enc-MLP-GEMM-2               dense_4h_to_h
    enc-post-MLP-dropout         (bias +) dropout + residual add
    final-layernorm              final_layernorm
    gpt-post-process             output projection (tied embedding) + vocab cross-entropy

Per operator: forward and backward time (median of ``repeats`` runs after one warm-up, µs,
re-measured while their spread is past ``max_spread``: megatron/profiling/noise.py),
input / output size, weights, and activations = the bytes autograd saves for backward
(parameters excluded, each storage counted once), all in MB. ``fwd_reserved`` /
``bwd_reserved`` hold the operator's working set in its forward / backward
(``saved_memory.measure_working_set``: new storages beyond what is live around it, the
incoming and outgoing gradients and temporaries included), which the performance model places
op by op to price a stage's peak; ``<model>_<size>_profile.json`` says so (published tables
hold allocator reserves there instead). Only TP = 1 is profiled (one process); collective and
p2p tables are not measured here.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from megatron.aceso.db import OpRow, profile_meta_path, write_op_csv
from megatron.config.core import ModelConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.random import model_parallel_seed
from megatron.profiling import noise
from megatron.profiling.saved_memory import measure_working_set

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


def _time(fn: Callable[[], object], repeats: int, **noise_kw) -> noise.Timing:
    """µs of `fn` (median of `repeats` after one warm-up), with its spread (profiling/noise.py)."""
    t = noise.timed(fn, 1, repeats, **noise_kw)
    return noise.Timing((t.values[0] * 1e3,), t.spread, t.rounds, t.noisy, t.samples)


def gpt_operators(stage, cfg: ModelConfig, mbs: int):
    """[(name, fn, make_inputs, params)] for one GPT stage holding embedding, one layer, head.

    The layer's operators are the runtime's own units (``TransformerLayer.op_units``, what
    op-level recompute checkpoints), each fed the input it gets inside the layer: a table row
    prices exactly the code the runtime runs, fused epilogues included."""
    s, b, h = cfg.seq_length, mbs, cfg.hidden_size
    layer = stage.decoder.layers[0]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    labels = torch.randint(0, cfg.vocab_size, (s, b), generator=gen)

    def head(x):
        logits = F.linear(x, stage.output_weight())
        return vocab_parallel_cross_entropy(logits, labels, None, cfg.vocab_size)

    emb = stage.embedding
    ops = [("encoder-embedding", lambda t: emb(t, pos), lambda: [tokens], list(emb.parameters()))]
    ops += _layer_operators(layer, torch.randn(s, b, h, generator=gen))
    ops += [("final-layernorm", stage.final_layernorm, lambda: [torch.randn(s, b, h, generator=gen).requires_grad_()],
             list(stage.final_layernorm.parameters())),
            ("gpt-post-process", head, lambda: [torch.randn(s, b, h, generator=gen).requires_grad_()],
             [stage.output_weight()])]
    return ops


def _layer_operators(layer, x):
    """One entry per operator unit; inputs are the unit's real inputs (run once without grad),
    re-made as fresh leaves. A linear that leaves its bias to the next operator hands over
    (y, bias): y is the activation input, the bias stays a parameter of the next operator."""
    units = layer.op_units()
    ins = []
    with torch.no_grad():
        hh, r = x, x
        for names, fn in units:
            if len(names) != 1:
                raise ValueError(f"the Aceso profiler times one operator per table row; {'+'.join(names)} run "
                                 f"as one unit in this layer (gated MLP): profile without --swiglu or "
                                 f"--gated-linear-unit")
            ins.append((hh, r))
            hh, r = fn(hh, r)
    out = []
    for (names, fn), (h_in, r_in) in zip(units, ins):
        def make(h_in=h_in):
            if isinstance(h_in, tuple):
                return [h_in[0].clone().requires_grad_()]
            return [h_in.clone().requires_grad_()]

        def op(y, fn=fn, h_in=h_in, r_in=r_in):
            hh = (y, h_in[1]) if isinstance(h_in, tuple) else y
            res = fn(hh, r_in)[0]
            return res[0] if isinstance(res, tuple) else res   # (y, bias): the activation

        out.append((names[0], op, make, _unit_params(layer, names[0], h_in)))
    return out


def _unit_params(layer, name, h_in):
    """The parameters an operator uses (weights MB; excluded from activations)."""
    attn, mlp = layer.self_attention, layer.mlp
    mods = {"enc-1st-layernorm": [layer.input_layernorm], "enc-attention-qkv": [attn.query_key_value],
            "enc-attention-dense": [attn.dense], "enc-2nd-layernorm": [layer.post_attention_layernorm],
            "enc-MLP-GEMM-1": [mlp.dense_h_to_4h], "enc-MLP-GEMM-2": [mlp.dense_4h_to_h]}.get(name, [])
    # a linear that skips its bias add hands the bias to the next operator, which owns it here
    ps = [p for m in mods for p in m.parameters() if not (getattr(m, "skip_bias_add", False) and p is m.bias)]
    if isinstance(h_in, tuple) and h_in[1] is not None:  # the previous linear's bias, added here
        ps.append(h_in[1])
    return ps


def profile_operator(fn, make_inputs, params, repeats: int, *, noise_log=None, name: str = "",
                     **noise_kw) -> OpRow:
    """Time and size one operator; the name is filled in by the caller. Forward and backward are
    timed as separate cells of `noise_log` (re-measured past ``max_spread`` in `noise_kw`)."""
    inputs = make_inputs()
    act, out = _saved_bytes(fn, inputs, params)
    grad_out = torch.randn_like(out)
    fwd = _time(lambda: fn(*inputs), repeats, **noise_kw)   # autograd on, as in training

    def backward(_):
        y = fn(*make_inputs())
        t0 = noise.clock()
        torch.autograd.backward(y, grad_out)
        ms = (noise.clock() - t0) * 1e3
        for p in params:
            p.grad = None
        return (ms,)
    bwd = noise.repeat(backward, 1, repeats, **noise_kw)
    if noise_log is not None:
        noise_log.add(f"{name} forward", fwd)
        noise_log.add(f"{name} backward", bwd)
    ws = measure_working_set(fn, make_inputs, params=params)
    for p in params:
        p.grad = None
    return OpRow("", fwd.values[0], bwd.values[0] * 1e3, _nbytes(inputs) / MB, _nbytes(out) / MB,
                 sum(p.numel() * p.element_size() for p in params) / MB, act / MB,
                 ws.forward_bytes / MB, ws.backward_bytes / MB)


def profile_gpt(cfg: ModelConfig, out_dir: str, *, size: str, mbs_values: Sequence[int] = (1, 2),
                repeats: int = 5, seed: int = 1234, threads: int = 1, max_spread: float = float("inf"),
                remeasure: int = 0, noise_log=None, log: Callable[[str], None] = lambda s: None) -> List[str]:
    """Write ``gpt_<size>_mbs<M>_tp1_algo0.csv`` for each micro-batch size; returns the paths.
    Runs with `threads` torch threads (one, as each rank of a CPU job whose ranks share the
    cores); every operator's spread goes to `noise_log`, progress and warnings to `log`."""
    from megatron.models.gpt import GPTStage
    model_parallel_seed(seed, 0, 0)  # dropout inside attention draws from the TP stream
    stage = GPTStage(cfg, ParallelState(), layer_start=0, layer_end=1, pre_process=True,
                     post_process=True, seed=seed)
    stage.train()
    os.makedirs(out_dir, exist_ok=True)
    nl = noise_log if noise_log is not None else noise.NoiseLog(max_spread)
    paths, per_op = [], {}
    with noise.pin_threads(threads):
        ops = {m: gpt_operators(stage, cfg, m) for m in mbs_values}
        progress = noise.Progress(sum(len(v) for v in ops.values()))
        for m in mbs_values:
            rows = []
            for name, fn, make_inputs, params in ops[m]:
                r = profile_operator(fn, make_inputs, params, repeats, noise_log=nl, name=f"mbs{m} {name}",
                                     max_spread=max_spread, remeasure=remeasure)
                rows.append(OpRow(name, *[getattr(r, f) for f in (
                    "fwd_us", "bwd_us", "input_mb", "output_mb", "weight_mb", "act_mb",
                    "fwd_reserved_mb", "bwd_reserved_mb")]))
                per_op.setdefault(name, []).append((r.fwd_us + r.bwd_us) / 1e3)
                log(f"{progress.next()} mbs {m} {name}: fwd {r.fwd_us:.1f} us bwd {r.bwd_us:.1f} us")
            path = os.path.join(out_dir, f"gpt_{size}_mbs{m}_tp1_algo0.csv")
            write_op_csv(path, rows)
            paths.append(path)
    for name, ms in per_op.items():  # an operator's time across micro-batch sizes grows smoothly
        for line in noise.implausible_lines(ms, [list(mbs_values)], ["mbs"], f"{name} forward+backward"):
            log(line)
    with open(profile_meta_path(out_dir, "gpt", size), "w") as f:
        json.dump({"profiler": "megatron.aceso.profiler", "device": "cpu", "reserved_columns": "working_set"}, f)
    log(f"timing noise: {nl.summary()}")
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
