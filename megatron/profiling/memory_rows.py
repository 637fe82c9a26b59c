"""DynaPipe's stage memory and time model against the project's real stages, one row per
(model, recompute setting, stage role, shape).

The planner is asked for a pipeline whose stages are exactly the ones built here: GPT with
three stages of `layers` layers (first: embedding + layers; middle: layers; last: layers +
head + loss) and the whole model on one stage; T5 with an encoder stage and a decoder stage,
and the whole model on one stage. Each real stage (`GPTStage` / `T5Stage`, the code the
trainer runs) is run forward and backward on CPU or GPU and measured by `memory_probe`:
stored (unique saved storages), peak (forward + backward) and the backward working set; and
timed. Beside each measurement: what `DynaPipePlanner.stage_costs` predicts for the stage.
"""
from __future__ import annotations

import dataclasses

import math
from typing import List, Optional

import torch

from megatron.config.core import ModelConfig
from megatron.core.parallel_state import ParallelState
from megatron.models.gpt import GPTStage
from megatron.models.t5 import T5Stage
from megatron.planner.cost.cost_model import CostModel
from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
from megatron.profiling.measure import Workload, _ensure_grads, time_workload
from megatron.profiling.memory_probe import probe
from megatron.profiling.profiler import _seeded

MB = 1e6


def model_config(cm: CostModel, layers: int) -> ModelConfig:
    """The model a cost-model file was profiled for, with `layers` layers (per side for T5)."""
    m = cm.model
    t5 = cm.kind == "t5"
    kw = dict(model_type=cm.kind, num_layers=layers, hidden_size=m["hidden_size"],
              num_attention_heads=m["num_attention_heads"], ffn_hidden_size=m["ffn_hidden_size"],
              kv_channels=m.get("kv_channels"), vocab_size=m["vocab_size"], make_vocab_size_divisible_by=128,
              max_position_embeddings=m["max_position_embeddings"], seq_length=m["max_position_embeddings"],
              hidden_dropout=m.get("hidden_dropout", 0.1), attention_dropout=m.get("attention_dropout", 0.1),
              position_embedding_type=m.get("position_embedding_type") or ("relative" if t5 else "learned_absolute"))
    if t5:
        kw.update(encoder_num_layers=layers, decoder_num_layers=layers, encoder_seq_length=m["max_position_embeddings"],
                  decoder_seq_length=m["max_position_embeddings"])
    return ModelConfig(**kw)


def _planner(cm: CostModel, cfg: ModelConfig, pp: int, layers: int, dtype_bytes: int) -> DynaPipePlanner:
    t5 = cm.kind == "t5"
    c = DynaPipeConfig(cost_model_path="(in memory)", model_kind=cm.kind, hidden_size=cfg.hidden_size,
                       num_layers=layers * pp, encoder_layers=layers * max(pp // 2, 1) if t5 else 0,
                       decoder_layers=layers * max(pp // 2, 1) if t5 else 0, pipeline_parallel=pp,
                       layers_per_stage=layers, memory_limit_mb=1e12, activation_bytes=dtype_bytes,
                       num_attention_heads=cfg.num_attention_heads)
    return DynaPipePlanner(c, cm)


def _gpt_stages(cfg, ps, layers, seed):
    """role -> (stage module, planner pipeline size, planner stage index)."""
    def mk(lo, hi, pre, post):
        return GPTStage(cfg, ps, layer_start=lo, layer_end=hi, pre_process=pre, post_process=post, seed=seed)
    return {"first": (mk(0, layers, True, False), 3, 0), "middle": (mk(layers, 2 * layers, False, False), 3, 1),
            "last": (mk(2 * layers, 3 * layers, False, True), 3, 2), "whole": (mk(0, layers, True, True), 1, 0)}


def _t5_stages(cfg, ps, layers, seed):
    def mk(enc, dec, pre, pre_dec, post, end):
        return T5Stage(cfg, ps, encoder_layers=enc, decoder_layers=dec, pre_process=pre, pre_process_decoder=pre_dec,
                       post_process=post, encoder_end=end, seed=seed)
    n = (0, layers)
    return {"encoder": (mk(n, (0, 0), True, False, False, True), 2, 0),
            "decoder": (mk((0, 0), n, False, True, True, False), 2, 1),
            "whole": (mk(n, n, True, True, True, True), 1, 0)}


def _inputs(cfg, kind, role, mbs, seq, dec, device, dtype):
    """(batch, activation inputs) a stage in `role` receives for one micro-batch."""
    def h(s):
        return torch.randn(s, mbs, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    ids = lambda s: torch.randint(0, cfg.vocab_size, (mbs, s), device=device)  # noqa: E731
    if kind == "gpt":
        batch = {"tokens": ids(seq), "labels": ids(seq)}
        return batch, ([] if role in ("first", "whole") else [h(seq)])
    ones = lambda s: torch.ones(mbs, s, dtype=torch.bool, device=device)  # noqa: E731
    batch = {"text_enc": ids(seq), "text_dec": ids(dec), "labels": ids(dec), "enc_mask": ones(seq),
             "dec_mask": ones(dec)}
    return batch, ([h(seq)] if role == "decoder" else [])


def dynapipe_rows(cm: CostModel, settings=("none", "selective", "full"), shapes=((2, 64),), layers: int = 2,
                  device: str = "cpu", time_iters: int = 0, seed: int = 1234, roles: Optional[List[str]] = None):
    """Yield one dict per (setting, shape, stage role). `shapes`: (mbs, seq) for GPT,
    (mbs, enc, dec) for T5. `time_iters` > 0 also times each stage (min over iterations)."""
    dev = torch.device(device)
    dtype = torch.float32 if cm.meta.get("dtype", "float32") == "float32" else torch.bfloat16
    nbytes = torch.finfo(dtype).bits // 8
    cfg, ps = model_config(cm, layers), ParallelState()
    longest = max(max(s[1:]) for s in shapes)
    if longest > cfg.max_position_embeddings:
        # A shape past the table's grid prices the planner's extrapolation; the model run beside it
        # needs positions that far (only the first stage's position table grows).
        cfg = dataclasses.replace(cfg, max_position_embeddings=longest, seq_length=longest,
                                  **({"encoder_seq_length": longest, "decoder_seq_length": longest}
                                     if cm.kind == "t5" else {}))
    kind = cm.kind
    planners = {pp: _planner(cm, cfg, pp, layers, nbytes) for pp in ((1, 3) if kind == "gpt" else (1, 2))}
    with _seeded(seed, 0, dev.type):
        stages = (_gpt_stages if kind == "gpt" else _t5_stages)(cfg, ps, layers, seed)
        for role in list(stages):
            if roles is not None and role not in roles:
                stages.pop(role)
                continue
            mod = stages[role][0].to(dev, dtype)
            _ensure_grads(mod)
        for rc in settings:
            for shape in shapes:
                mbs, seq = shape[0], shape[1]
                dec = shape[2] if kind == "t5" else None
                for role, (mod, pp, s) in stages.items():
                    mod.recompute = rc
                    sc = planners[pp].stage_costs(rc, float(mbs), float(seq), None if dec is None else float(dec))
                    batch, acts = _inputs(cfg, kind, role, mbs, seq, dec, dev, dtype)
                    run = (lambda m=mod, b=batch, a=acts: m(b, a)[0])
                    m = probe(run, dev, exclude=list(mod.parameters()))
                    owned = sum(t.untyped_storage().nbytes() for t in acts)  # the planner's peak includes them
                    pred_st, pred_pk = float(sc["stored"][s]) * MB, float(sc["peak"][s]) * MB
                    meas_pk = m.peak + owned
                    # a shape the model has no answer for (past the grid, the fit not trusted): null
                    fin = lambda x: round(x) if math.isfinite(x) else None  # noqa: E731
                    rel = lambda p, m: round(p / m - 1, 4) if math.isfinite(p) else None  # noqa: E731
                    row = dict(planner="dynapipe", model=kind, setting=rc, role=role, mbs=mbs, seq=seq,
                               hidden=cfg.hidden_size, layers=layers, device=dev.type,
                               measured_bytes=m.stored, predicted_bytes=fin(pred_st),
                               error=rel(pred_st, m.stored),
                               measured_peak_bytes=meas_pk, predicted_peak_bytes=fin(pred_pk),
                               peak_error=rel(pred_pk, meas_pk),
                               backward_working_set_bytes=m.backward_peak,
                               # where the single micro-batch's peak falls: the published DynaPipe
                               # simulator charges a layer's peak only while its forward runs
                               measured_forward_peak_bytes=m.forward_peak + owned,
                               peak_in="backward" if m.live_after_forward + m.backward_peak > m.forward_peak
                               else "forward",
                               memory_method="cuda max_memory_allocated" if dev.type == "cuda"
                               else "torch.profiler memory events, replayed")
                    if dec is not None:
                        row["dec_seq"] = dec
                    if time_iters > 0:
                        w = Workload(mod, lambda b=batch, a=acts: (b, [t.detach().requires_grad_() for t in a]),
                                     lambda b, a, m=mod: m(b, a)[0])
                        f, bwd = time_workload(w, dev, 1, time_iters, None, statistic="min")
                        pred_ms = float(sc["fwd"][s] + sc["bwd"][s])
                        ok = math.isfinite(pred_ms)
                        row.update(measured_ms=round(f + bwd, 3), predicted_ms=round(pred_ms, 3) if ok else None,
                                   time_ratio=round((f + bwd) / pred_ms, 3) if ok else None)
                    yield row



def zb_rows(cm: CostModel, shapes=((2, 64),), layers: int = 2, device: str = "cpu", seed: int = 1234,
            time_iters: int = 1):
    """Yield one dict per (shape, GPT stage role) for the zero-bubble weight pass: the bytes the
    executor's weight store keeps between a micro-batch's input pass and its weight pass
    (`megatron.profiling.weight_pass`), against the planner's `stage_costs(...)["wstored"]`
    (planner/cost/wpass_memory.py), beside the whole graph it kept before; and B / W times.
    The first stage has no input pass (its W is the whole backward, priced as `stored`)."""
    from megatron.profiling.weight_pass import measure_split
    if cm.kind != "gpt":
        raise ValueError(f"{cm.name}: the weight-pass rows cover GPT stages (T5 prices the whole graph)")
    dev = torch.device(device)
    dtype = torch.float32 if cm.meta.get("dtype", "float32") == "float32" else torch.bfloat16
    nbytes = torch.finfo(dtype).bits // 8
    cfg, ps = model_config(cm, layers), ParallelState()
    planner = _planner(cm, cfg, 3, layers, nbytes)
    with _seeded(seed, 0, dev.type):
        stages = {r: v for r, v in _gpt_stages(cfg, ps, layers, seed).items() if r in ("middle", "last")}
        for mod, _, _ in stages.values():
            mod.to(dev, dtype)
        for mbs, seq in shapes:
            sc = planner.stage_costs("none", float(mbs), float(seq))
            for role, (mod, _, s) in stages.items():
                batch, acts = _inputs(cfg, "gpt", role, mbs, seq, None, dev, dtype)
                m = measure_split(mod, lambda b=batch, a=acts: (b, a), dev, iters=time_iters, warmup=0)
                pred = float(sc["wstored"][s]) * MB
                yield dict(planner="dynapipe", model="gpt", setting="none", role=role, mbs=mbs, seq=seq,
                           hidden=cfg.hidden_size, layers=layers, device=dev.type, kind="zb-weight-store",
                           measured_bytes=m["wstore_bytes"], predicted_bytes=round(pred),
                           error=round(pred / m["wstore_bytes"] - 1, 4),
                           graph_bytes=m["graph_bytes"], kept_graph_bytes=m["kept_graph_bytes"],
                           predicted_stored_bytes=round(float(sc["stored"][s]) * MB),
                           b_ms=m["b_ms"], w_ms=m["w_ms"], bwd_ms=m["bwd_ms"],
                           memory_method="unique saved storages of the weight store (saved_tensors_hooks boxes)")
