"""Aceso's memory rule against the bytes the runtime really keeps, per GPT layer.

For one shape (hidden, sequence, micro-batch, TP 1): profile our GPT layer with the project's
Aceso profiler (the tables the search reads), then for every recompute set the search can emit
for a layer (each prefix of its ranking of the layer's operators by MB saved per ms recomputed,
plus Megatron's whole-layer ``full`` of the grid baseline) compare

- predicted: ``PerfModel.activation_terms`` for a stage holding exactly that layer (activations
  kept per micro-batch), and
- measured: ``measure_saved`` on the layer running that set (``kept_bytes``: what the forward
  pass leaves alive for backward, checkpoint inputs included).

and the same for the peak over forward + backward: ``peak_predicted_bytes`` (kept + the
model's working peak: the rebuilt run, the backward working set of the op where the layer
peaks, the gradients around it) against ``peak_measured_bytes`` (``measure_saved.peak_bytes``),
``peak_error`` = predicted / measured - 1.

``aceso_rows`` yields one dict per (shape, set) with planner, model, setting, measured_bytes,
predicted_bytes and error (predicted / measured - 1), and the peak fields;
benchmarks/bench_memory_model.py prints them.
"""
from __future__ import annotations

import dataclasses
import tempfile
from typing import Dict, Iterator, List, Sequence, Tuple

import torch

from megatron.aceso.db import OpDatabase
from megatron.aceso.model import ModelSpec, Plan, PerfModel, Stage
from megatron.aceso.profiler import profile_gpt
from megatron.aceso.search import Searcher
from megatron.config.core import ModelConfig
from megatron.core import recompute as rc
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import model_parallel_seed
from megatron.profiling.saved_memory import measure_saved

MB = 1024.0 * 1024.0

# Sets the search's ranking may not reach at a given shape but a stage can run: the residual
# adds, runs that recompute a layernorm mid-segment (the residual case), the examples.
EXTRA_SETTINGS = (
    "enc-MLP-gelu", "enc-MLP-GEMM-1+enc-MLP-gelu", "enc-attention-core+enc-attention-dense",
    "enc-post-MLP-dropout", "enc-post-attention-dropout+enc-2nd-layernorm",
    "enc-post-attention-dropout+enc-2nd-layernorm+enc-MLP-gelu+enc-MLP-GEMM-2+enc-post-MLP-dropout",
    "enc-attention-core+enc-attention-dense+enc-post-attention-dropout+enc-2nd-layernorm+enc-MLP-GEMM-1",
)


def layer_flag_sets(pm: PerfModel, mbs: int, tp: int = 1) -> List[Tuple[int, ...]]:
    """Per-layer flags the search can produce: prefixes of its recompute ranking restricted to
    one layer (a stage's prefix restricted to any of its layers is such a prefix), and full."""
    lay = [i for i, o in enumerate(pm.ops) if o.layer == 0]
    order = [i for i in Searcher(pm, 1, mbs)._rank_ops(mbs, tp) if i in lay]
    sets = []
    for k in range(len(order) + 1):
        chosen = set(order[:k])
        sets.append(tuple(int(i in chosen) for i in lay))
    sets.append((1,) * len(lay))
    out = []
    for s in sets:
        if s not in out:
            out.append(s)
    return out


def _measure_layer(stage, setting: str, cfg: ModelConfig, mbs: int) -> Dict[str, float]:
    block = stage.decoder
    block.layer_recompute = [setting]
    gen = torch.Generator().manual_seed(0)

    def make():
        # non-leaf, as a stage's activation (a leaf is kept by its gradient accumulator)
        return [torch.randn(cfg.seq_length, mbs, cfg.hidden_size, generator=gen).requires_grad_() * 1.0]

    # gradients exist from a step's second micro-batch on: accumulating into them is part of
    # the peak, whichever row ran first
    for p in block.parameters():
        p.grad = torch.zeros_like(p)
    model_parallel_seed(1234, 0, 0)
    m = measure_saved(lambda x: block(x), make, params=list(block.parameters()))
    return {"kept": m.kept_bytes, "saved": m.saved_bytes, "peak": m.peak_bytes}


def aceso_rows(shapes: Sequence[Tuple[int, int, int]] = ((256, 512, 1), (256, 512, 2)), *,
               heads: int = 8, vocab: int = 1024, fused: bool = True,
               extra: Sequence[str] = EXTRA_SETTINGS, db_dir: str = None) -> Iterator[Dict]:
    """Rows for each (hidden, seq, micro-batch) shape and each recompute set of the search.
    ``fused``: profile and run the layer with the bias-GeLU / bias-dropout-add epilogues (the
    training default) or without them."""
    by_model: Dict[Tuple[int, int], List[int]] = {}
    for h, s, m in shapes:
        by_model.setdefault((h, s), []).append(m)
    for (h, s), mbs_values in by_model.items():
        cfg = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=heads, seq_length=s,
                          vocab_size=vocab, make_vocab_size_divisible_by=8)
        if not fused:
            cfg = dataclasses.replace(cfg, bias_gelu_fusion=False, bias_dropout_fusion=False)
        with tempfile.TemporaryDirectory() as tmp:
            root = db_dir or tmp
            size = f"h{h}s{s}"
            profile_gpt(cfg, root, size=size, mbs_values=tuple(mbs_values), repeats=1)
            pm = PerfModel(OpDatabase(root, "gpt", size), ModelSpec("gpt", size, (1,), h, s, 1), 1e9)
        from megatron.models.gpt import GPTStage
        run_cfg = cfg
        model_parallel_seed(1234, 0, 0)
        stage = GPTStage(run_cfg, ParallelState(), layer_start=0, layer_end=1, pre_process=False,
                         post_process=False, seed=1234).train()
        lay = [i for i, o in enumerate(pm.ops) if o.layer == 0]
        names = [pm.db.op_names[pm.ops[i].row] for i in lay]
        for mbs in mbs_values:
            a = pm.arrays(mbs, 1)
            emitted = layer_flag_sets(pm, mbs)
            todo = [(f, "search") for f in emitted]
            todo += [(f, "extra") for f in (rc.layer_flags(rc.decode(e)) for e in extra) if f not in emitted]
            for flags, source in todo:
                setting = rc.encode(rc.from_flags(names, flags))
                kept_mb, peak_mb = pm.activation_terms(a, Stage(lay[0], lay[-1] + 1, 1, 1, flags))
                meas = _measure_layer(stage, setting, run_cfg, mbs)
                pred = kept_mb * MB
                yield {"planner": "aceso", "model": f"gpt-h{h}-s{s}", "setting": setting, "source": source,
                       "mbs": mbs, "tp": 1,
                       "fused": fused, "measured_bytes": int(meas["kept"]), "predicted_bytes": int(round(pred)),
                       "error": round(pred / meas["kept"] - 1, 4), "saved_hooks_bytes": int(meas["saved"]),
                       "peak_measured_bytes": int(meas["peak"]),
                       "peak_predicted_bytes": int(round((kept_mb + peak_mb) * MB)),
                       "peak_error": round((kept_mb + peak_mb) * MB / meas["peak"] - 1, 4),
                       "recompute_peak_predicted_bytes": int(round(peak_mb * MB))}


def aceso_time_rows(shape: Tuple[int, int, int] = (256, 512, 1), *, heads: int = 8, vocab: int = 1024,
                    repeats: int = 5) -> Iterator[Dict]:
    """Step time and kept bytes of one layer with no recompute, a recompute set of the search
    (the shortest prefix of its ranking that frees half the activations) and the whole layer,
    measured (median forward + backward) beside the model's (stage time and kept MB); the last
    row says whether both orderings agree."""
    import statistics
    import time
    from megatron.models.gpt import GPTStage
    h, s, mbs = shape
    cfg = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=heads, seq_length=s,
                      vocab_size=vocab, make_vocab_size_divisible_by=8)
    with tempfile.TemporaryDirectory() as root:
        profile_gpt(cfg, root, size="t", mbs_values=(mbs,), repeats=repeats)
        pm = PerfModel(OpDatabase(root, "gpt", "t"), ModelSpec("gpt", "t", (1,), h, s, mbs), 1e9)
    model_parallel_seed(1234, 0, 0)
    stage = GPTStage(cfg, ParallelState(), layer_start=0, layer_end=1, pre_process=False,
                     post_process=False, seed=1234).train()
    lay = [i for i, o in enumerate(pm.ops) if o.layer == 0]
    names = [pm.db.op_names[pm.ops[i].row] for i in lay]
    a = pm.arrays(mbs, 1)
    none_mb = pm.activation_terms(a, Stage(lay[0], lay[-1] + 1, 1, 1))[0]
    sets = layer_flag_sets(pm, mbs)
    half = next(f for f in sets if pm.activation_terms(a, Stage(lay[0], lay[-1] + 1, 1, 1, f))[0] <= none_mb / 2)
    rows = []
    for flags in ((0,) * len(lay), half, (1,) * len(lay)):
        st = Stage(lay[0], lay[-1] + 1, 1, 1, flags)
        pred = pm.predict(Plan(pm.spec.key, mbs, mbs, [st])).stages[0]
        setting = rc.encode(rc.from_flags(names, flags))
        stage.decoder.layer_recompute = [setting]
        x = torch.randn(s, mbs, h).requires_grad_()
        ts = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            stage.decoder(x * 1.0).sum().backward()
            ts.append(time.perf_counter() - t0)
        meas = _measure_layer(stage, setting, cfg, mbs)
        rows.append({"planner": "aceso", "model": f"gpt-h{h}-s{s}", "setting": setting, "mbs": mbs,
                     "measured_ms": round(statistics.median(ts[1:]) * 1e3, 2),
                     "predicted_ms": round(pred.time_ms, 2), "measured_bytes": int(meas["kept"]),
                     "predicted_bytes": int(round(pred.act_per_mb_mb * MB))})
    yield from rows

    def order(key):
        return sorted(range(len(rows)), key=lambda i: rows[i][key])
    yield {"planner": "aceso", "model": f"gpt-h{h}-s{s}", "setting": "ordering",
           "time_order_matches": order("measured_ms") == order("predicted_ms"),
           "memory_order_matches": order("measured_bytes") == order("predicted_bytes")}


if __name__ == "__main__":
    import json
    for row in aceso_rows():
        print(json.dumps(row), flush=True)
    for row in aceso_time_rows():
        print(json.dumps(row), flush=True)
