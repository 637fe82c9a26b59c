"""What each composition feature must show after training, so that a smoke run of a feature set
cannot pass with one of its features silently off (a builder that drops a plan pass, a flag that
parses but never reaches the trainer).

`instrument(trainer)` counts, per transformer layer, how often its MLP and its attention cores
run, and how often each stage's forward runs; `inactive(name, trainer, history, counts)` returns
None when feature `name` (megatron.cli.composition.FEATURES) was at work on this rank, else why not.
Full recompute runs a recomputed layer's MLP twice per stage forward; selective recompute runs
the attention core twice but the MLP once.
"""
from __future__ import annotations

import importlib
import itertools
import os
import re
from collections import Counter
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def instrument(trainer) -> Counter:
    from megatron.models.moe.layer import MoELayer
    from megatron.models.transformer import ParallelAttention, ParallelMLP
    counts: Counter = Counter()

    def counted(fn, key):
        # Wrapped callables, not forward hooks: the recompute of a checkpointed layer does not
        # fire module hooks (measured), but it calls the same bound methods again.
        def run(*a, **kw):
            counts[key] += 1
            return fn(*a, **kw)
        return run

    for sid, stage in trainer.stages.items():
        stage.register_forward_hook(lambda *_, key=("stage", sid): counts.update([key]))
        for name, m in stage.named_modules():
            if isinstance(m, ParallelMLP):
                # its second GEMM: run by ParallelMLP.forward and by the per-operator path alike
                m.dense_4h_to_h.forward = counted(m.dense_4h_to_h.forward, ("mlp", sid, name))
            elif isinstance(m, ParallelAttention):
                m.core_attention = counted(m.core_attention, ("core", sid, name))
            elif isinstance(m, MoELayer):
                counts[("moe", sid, name)] += 0  # held here: must dispatch
                m.dispatcher = counted(m.dispatcher, ("moe", sid, name))
    return counts


def _layer_calls(counts: Counter, kind: str):
    return {k[1:]: v for k, v in counts.items() if k[0] == kind}


def _bytes(history, what):
    rows = [h.get("comm_bytes") or {} for h in history]
    return [(r.get(what), r.get(what + "_raw")) for r in rows]


def inactive(name: str, trainer, history: list, counts: Counter) -> Optional[str]:
    info = [h.get("planner") or {} for h in history]
    if name == "dynapipe":
        bad = [i.get("planner") for i in info if i.get("planner") != "dynapipe"]
        return f"iterations planned by {bad}, not DynaPipe" if bad else None
    if name == "terapipe":
        # (over packed rows the batches are packing's, and its line carries the slices)
        slices = [i.get("slices") for i in info if i.get("planner") == "terapipe" or "slices" in i]
        if len(slices) != len(history) or not all(s and len(s) > 1 for s in slices):
            return f"TeraPipe slicings {slices} over {len(history)} iterations (want > 1 slice each)"
        return None
    if name == "aceso":
        return None if trainer.ps.stage_layouts else "no per-stage TP/DP layout (ps.stage_layouts is empty)"
    if name == "cb_lep":
        pairs = _bytes(history, "pp_grad")
        if not all(sent is not None and raw and sent < raw for sent, raw in pairs):
            return f"pipeline gradient bytes (sent, raw) per iteration {pairs}: nothing compressed"
        lep = getattr(trainer.grad_compressor, "lep", False)
        return None if lep else "--use-error-feedback did not reach the pipeline compressor (lep off)"
    if name == "powersgd":
        pairs = _bytes(history, "dp")
        ok = all(sent is not None and raw and sent < raw for sent, raw in pairs)
        return None if ok else f"data-parallel gradient bytes (sent, raw) per iteration {pairs}: nothing compressed"
    if name == "embsync":
        if trainer.ps.stage_layouts:
            return None  # per-stage TP/DP: the re-split tied sync already spans every replica (compression/embedding.py)
        return None if trainer.fused_embedding_group is not None else "no fused embedding group"
    if name == "distopt":
        kind = type(trainer.optimizer).__name__
        return None if kind == "DistributedOptimizer" else f"optimizer is {kind}"
    if name == "sp":
        if trainer.ps.tp_size == 1:
            return None  # a TP-1 stage of a per-stage layout: sequence parallelism splits over TP only
        on = any(getattr(m, "sequence_parallel", False) for s in trainer.stages.values() for m in s.modules())
        return None if on else "no layer runs sequence parallel"
    if name == "interleaved":
        return None if len(trainer.stages) > 1 else f"{len(trainer.stages)} model chunk(s) on this rank"
    if name == "packing":
        bad = [i.get("planner") for i in info if i.get("planner") != "packing"]
        if bad:
            return f"iterations batched by {bad}, not packing"
        dp = 1 if trainer.ps.stage_layouts else trainer.ps.dp_size  # per-stage DP: every rank sees every row
        rows = [sum(s[0] for s in i.get("microbatch_shapes", [])) * dp for i in info]
        samples = [h.get("num_samples") for h in history]
        return None if all(n > r for n, r in zip(samples, rows)) else \
            f"{samples} samples in {rows} rows: no row holds two samples"
    if name in ("rc_full", "rc_sel"):
        stage_fwd = _layer_calls(counts, "stage")
        if not stage_fwd or not all(stage_fwd.values()):
            return f"no stage forward was counted ({stage_fwd}): the hooks saw nothing"
        # MoE layers count as MLPs: a rank of the interleaved schedule may hold only MoE layers
        mlp, core = {**_layer_calls(counts, "mlp"), **_layer_calls(counts, "moe")}, _layer_calls(counts, "core")
        if name == "rc_full":
            twice = [k for k, v in mlp.items() if v > stage_fwd.get((k[0],), 0)]
            return None if twice else f"no MLP ran more often than its stage's forward ({mlp} vs {stage_fwd})"
        # selective: some attention core re-runs while every MLP runs once per stage forward
        again = [k for k, v in core.items() if v > stage_fwd.get((k[0],), 0)]
        once = all(v == stage_fwd.get((k[0],), 0) for k, v in mlp.items())
        return None if again and once else f"attention cores {core}, MLPs {mlp}, stage forwards {stage_fwd}"
    if name in ("fp16", "bf16"):
        want = torch.float16 if name == "fp16" else torch.bfloat16
        got = trainer.executor.autocast_dtype
        if got != want:
            return f"the forward runs under autocast {got}, not {want}"
        if name == "fp16" and getattr(trainer.optimizer, "grad_scaler", None) is None:
            return "fp16 without a loss scaler"
        return None
    if name == "cp":
        if trainer.ps.cp_size < 2:
            return f"context-parallel size {trainer.ps.cp_size}"
        src = type(trainer.batch_source).__name__
        if src != "ContextParallelSource":
            return f"batches come from {src}, not ContextParallelSource: sequences are not cut into CP chunks"
        # the source stamps every micro-batch with its chunk index, which routes attention through
        # the K/V exchange (models/gpt.py: build_cp_spec)
        return None
    if name in ("moe", "ep"):
        # (an interleaved rank may hold only the dense layers: --moe-layer-freq 2)
        routed = _layer_calls(counts, "moe")
        if not all(routed.values()):
            return f"MoE layers held here but never dispatching tokens: {routed}"
        want = 2 if name == "ep" else 1
        return None if trainer.ps.ep_size == want else f"expert-parallel size {trainer.ps.ep_size}, not {want}"
    raise KeyError(f"no activity check for feature {name!r}: add one to tests/cli/composition_checks.py")


def check_all(names, trainer, history, counts) -> list:
    """['<feature>: <why>' for every named feature not at work on this rank]."""
    return [f"{n}: {why}" for n in names for why in [inactive(n, trainer, history, counts)] if why]


# -- the pair smoke runs, shared by tests/cli/test_composition.py (GPT) and test_composition_t5.py --
def write_multitask_data(d) -> tuple:
    """Input and target .bin/.idx prefixes under directory `d` for the multi-task features."""
    import numpy as np

    from megatron.data.indexed_dataset import IndexedDatasetBuilder, bin_path, idx_path

    def write(prefix, docs):
        b = IndexedDatasetBuilder(bin_path(prefix), dtype=np.int32)
        for doc in docs:
            b.add_item(doc)
            b.end_document()
        b.finalize(idx_path(prefix))
    rng = np.random.RandomState(0)
    n = 300
    lin = np.clip(rng.lognormal(2.3, 0.7, n).astype(int), 2, 24)
    lout = np.clip(rng.lognormal(1.5, 0.6, n).astype(int), 1, 8)
    write(str(d / "in"), [rng.randint(0, 97, k) for k in lin])
    write(str(d / "tg"), [rng.randint(0, 97, k) for k in lout])
    return str(d / "in"), str(d / "tg")


def train_groups(rank, world, groups, workdir, data, model="gpt", nccl_rule=False):
    """Train every feature set for 2 iterations in this process group, one after another, as the
    model's program builds it; returns {set: (losses, is last stage, features not at work)}.
    nccl_rule: build and train under tests/comm_device_check.py's NCCL device rule instead and
    return {set: [host tensors handed to torch.distributed]}."""
    import multiprocessing as mp
    import os
    from datetime import timedelta

    from megatron.cli import composition as C
    from megatron.cli.arguments import build_parser, config_from_args
    from megatron.training.initialize import initialize_parallel, set_seeds

    mp.current_process().daemon = False
    aceso = os.path.join(workdir, f"aceso_{model}.json")
    out = {}
    for group in groups:
        cfg = config_from_args(build_parser(model).parse_args(C.argv(group, world, aceso, data, model)), model, world)
        ps = initialize_parallel(cfg, timedelta(minutes=1))
        set_seeds(cfg.training.seed, ps, torch.device("cpu"))
        if model == "t5":
            from megatron.training.t5_builder import build_t5_trainer as build
        else:
            from megatron.training.pretrain import build_gpt_trainer as build
        if nccl_rule:
            from tests.comm_device_check import nccl_device_rule
            violations = []
            with nccl_device_rule(violations) as device:
                build(cfg, ps, device).train()
            out[group] = sorted(set(violations))
            continue
        trainer = build(cfg, ps, torch.device("cpu"))
        counts = instrument(trainer)
        history = trainer.train()
        out[group] = ([h["loss"] for h in history], ps.is_pipeline_last_stage,
                      check_all(group, trainer, history, counts))
    return out


# -- resolving the test node ids the tables name ---------------------------------------------
def _param_ids(fn) -> set:
    """The ids pytest gives `fn`'s parametrized cases: per parametrize mark explicit ids (a list
    or a function of the value), a `pytest.param(..., id=...)`, else the values joined by '-' (a
    value that is not a str/int/float/bool/None shown as argname + index); stacked marks join
    their ids closest-decorator first."""
    per_mark = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = mark.args[0]
        names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
        explicit = mark.kwargs.get("ids")
        ids = []
        for i, v in enumerate(mark.args[1]):
            given = getattr(v, "id", None)
            v = v.values if hasattr(v, "values") and hasattr(v, "marks") else (v if len(names) > 1 else (v,))
            if given is not None:
                ids.append(given)
            elif explicit is not None and not callable(explicit):
                ids.append(explicit[i])
            else:
                parts = []
                for n, x in zip(names, v):
                    got = explicit(x) if callable(explicit) else None
                    parts.append(str(got) if got is not None else
                                 str(x) if isinstance(x, (str, int, float, bool, type(None))) else f"{n}{i}")
                ids.append("-".join(parts))
        per_mark.append(ids)
    return {"-".join(combo) for combo in itertools.product(*per_mark)} if per_mark else set()


def _test_exists(node_id: str) -> bool:
    m = re.fullmatch(r"(tests/[\w/]+)\.py::(?:(\w+)::)?(\w+)(?:\[(.+)\])?", node_id)
    if m is None:
        return False
    path, cls, func, param = m.groups()
    if not os.path.isfile(os.path.join(ROOT, path + ".py")):
        return False
    owner = importlib.import_module(path.replace("/", "."))
    owner = getattr(owner, cls, None) if cls else owner
    fn = getattr(owner, func, None)
    if fn is None:
        return False
    return param is None or param in _param_ids(fn)
