"""--aceso-config: per-stage layer counts and per-layer recompute on the existing executor.

Parity: an uneven 2-stage pipeline (1 + 3 layers) whose layers recompute full / none /
selective / full trains exactly like the single-process run without recompute (fp32)."""
import json

import pytest

from megatron.aceso.runtime import AcesoConfigError, gpt_layout
from megatron.cli.arguments import parse_args
from tests.dist_harness import run_distributed
from tests.parity_utils import assemble, assert_parity, run_layout, shards, tiny_config

pytestmark = pytest.mark.parity

K = 13  # Aceso's ops per GPT layer


def aceso_dict(stage_layers, tp=1, dp=1, rec=None, mbs=2, gbs=8, layers=4):
    """An Aceso config for a GPT of `layers` layers; rec[j] = per-op flags of layer j."""
    rec = rec or [[0] * K for _ in range(layers)]
    flags = [0] + [f for r in rec for f in r] + [0, 0]
    counts, start = [], 0
    for s, n in enumerate(stage_layers):
        c = n * K + (1 if s == 0 else 0) + (2 if s == len(stage_layers) - 1 else 0)
        counts.append(c)
    out, a = [], 0
    for c in counts:
        out.append(flags[a:a + c])
        a += c
    S = len(stage_layers)
    return {"model_name": "gpt", "model_size": "tiny", "num_layers": layers,
            "global_batch_size": gbs, "micro_batch_size": mbs, "num_stages": S,
            "num_gpus": [tp * dp] * S, "checkpoint_activations": [any(x) for x in out],
            "resharding_stages": [False] * S, "num_ops_in_each_stage": counts,
            "model_parallel_size_of_each_op": [[tp] * c for c in counts],
            "data_parallel_size_of_each_op": [[dp] * c for c in counts],
            "recompute_ops": out, "algo_of_each_op": [[0] * c for c in counts]}


FULL = [1] * K
NONE = [0] * K
SELECTIVE = [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]   # score, softmax, dropout, context
PARTIAL = [0] * 9 + [0, 1, 0, 0]                      # GeLU only: exactly that op is recomputed


def test_layout_from_config():
    lay = gpt_layout(aceso_dict([1, 3], rec=[FULL, NONE, SELECTIVE, PARTIAL], mbs=4, dp=2), 4, 4)
    assert (lay.tp, lay.pp, lay.dp) == (1, 2, 2)
    assert lay.stage_layers == [1, 3] and lay.micro_batch_size == 2 and lay.global_batch_size == 8
    assert lay.recompute_layers == ["full", "none", "selective", "enc-MLP-gelu"]
    two_runs = [0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]   # qkv | context, dense | GEMM-2, dropout
    lay = gpt_layout(aceso_dict([2, 2], rec=[two_runs, NONE, NONE, NONE]), 4, 2)
    assert lay.recompute_layers[0] == ("enc-attention-qkv+enc-attention-core+enc-attention-dense+"
                                       "enc-MLP-GEMM-2+enc-post-MLP-dropout")


def hetero_dict(stage_layers, stage_parallel, **kw):
    """aceso_dict with its own (TP, DP) per stage."""
    d = aceso_dict(stage_layers, **kw)
    for s, (tp, dp) in enumerate(stage_parallel):
        n = d["num_ops_in_each_stage"][s]
        d["model_parallel_size_of_each_op"][s] = [tp] * n
        d["data_parallel_size_of_each_op"][s] = [dp] * n
        d["num_gpus"][s] = tp * dp
    return d


def test_layout_of_stages_with_their_own_tp_and_dp():
    lay = gpt_layout(hetero_dict([1, 3], [(2, 1), (1, 2)], mbs=4, rec=[FULL, NONE, SELECTIVE, NONE]), 4, 4)
    assert lay.stage_parallel == [[2, 1], [1, 2]] and lay.micro_batch_size == 4 and lay.tp == 2
    assert lay.stage_layers == [1, 3] and lay.recompute_layers == ["full", "none", "selective", "none"]
    with pytest.raises(AcesoConfigError, match="need TP 2 x DP 1 \\+ TP 1 x DP 2 = 4 ranks, but the job has 3"):
        gpt_layout(hetero_dict([1, 3], [(2, 1), (1, 2)], mbs=4), 4, 3)
    with pytest.raises(AcesoConfigError, match="micro_batch_size 3 is not divisible by stage 1's DP 2"):
        gpt_layout(hetero_dict([1, 3], [(2, 1), (1, 2)], mbs=3), 4, 4)


def test_layout_rejects_what_the_runtime_cannot_run():
    d = aceso_dict([2, 2])
    d["model_parallel_size_of_each_op"][1][3] = 2
    with pytest.raises(AcesoConfigError, match="stage 1 changes TP/DP between its ops"):
        gpt_layout(d, 4, 2)
    d = aceso_dict([2, 2])
    d["num_ops_in_each_stage"] = [1 + 2 * K + 3, 2 * K + 2 - 3]
    with pytest.raises(AcesoConfigError, match="cut inside a layer"):
        gpt_layout(d, 4, 2)
    d = aceso_dict([2, 2])
    d["recompute_ops"][0][0] = 1
    with pytest.raises(AcesoConfigError, match="embedding or the head"):
        gpt_layout(d, 4, 2)
    with pytest.raises(AcesoConfigError, match="the job has 4"):
        gpt_layout(aceso_dict([2, 2]), 4, 4)
    with pytest.raises(AcesoConfigError, match="--num-layers is 6"):
        gpt_layout(aceso_dict([2, 2]), 6, 2)


def _args(path, *extra):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "101", "--mock-data", "--aceso-config", path, *extra]


def test_flag_fills_the_config(tmp_path, capsys):
    path = str(tmp_path / "a.json")
    json.dump(aceso_dict([1, 3], rec=[FULL, NONE, SELECTIVE, PARTIAL], tp=2), open(path, "w"))
    cfg = parse_args(_args(path), world_size=4)
    assert cfg.parallel.pipeline_model_parallel_size == 2 and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.pipeline_stage_layers == [1, 3]
    assert cfg.training.recompute_layers == ["full", "none", "selective", "enc-MLP-gelu"]
    assert cfg.training.micro_batch_size == 2 and cfg.training.global_batch_size == 8
    with pytest.raises(SystemExit):
        parse_args(_args(path, "--pipeline-model-parallel-size", "4"), world_size=4)
    assert "--pipeline-model-parallel-size 4 conflicts with --aceso-config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(_args(path, "--recompute-granularity", "full"), world_size=4)
    assert "drop --recompute-granularity" in capsys.readouterr().err


def _run_aceso(rank, world, stage_layers, modes, tp=1):
    from tests import parity_utils
    orig = parity_utils.tiny_config

    def with_layout(**kw):
        cfg = orig(**kw)
        cfg.training.recompute_layers = modes
        return cfg

    parity_utils.tiny_config = with_layout
    try:
        return run_layout(rank, world, dict(pp=len(stage_layers), tp=tp, stage_layers=stage_layers))
    finally:
        parity_utils.tiny_config = orig


def test_uneven_stages_with_per_layer_recompute_match_single_process():
    ref = run_distributed(run_layout, 1, {})
    lay = gpt_layout(aceso_dict([1, 3], rec=[FULL, NONE, SELECTIVE, PARTIAL]), 4, 2)
    outs = run_distributed(_run_aceso, 2, lay.stage_layers, lay.recompute_layers)
    _compare(ref, outs)


def test_modes_reach_the_layers(monkeypatch):
    """Each layer runs its own setting: `full` checkpoints the layer, an operator set one
    segment per run of flagged operators (`selective` = the core-attention operator)."""
    import torch
    from megatron.core.parallel_state import ParallelState
    from megatron.core.tensor_parallel.random import model_parallel_seed
    from megatron.models import layer_ops, transformer
    from megatron.models.gpt import build_gpt_stages

    cfg = tiny_config()
    modes = ["full", "none", "selective", "enc-1st-layernorm+enc-MLP-gelu"]
    cfg.training.recompute_layers = modes
    model_parallel_seed(1234, 0, 0)
    (stage,) = build_gpt_stages(cfg, ParallelState()).values()
    assert stage.decoder.layer_recompute == modes
    calls = []

    def counting(module, kind):
        real = module.checkpoint

        def fn(f, *a):
            calls.append(kind)
            return real(f, *a)
        monkeypatch.setattr(module, "checkpoint", fn)

    counting(transformer, "layer")
    counting(layer_ops, "segment")
    tokens = torch.randint(0, 101, (2, 16))
    out = stage({"tokens": tokens, "labels": tokens}, [])
    out[0].sum().backward()
    assert calls == ["layer", "segment", "segment", "segment"]


def test_split_gated_mlp_is_rejected_at_build():
    from megatron.core.parallel_state import ParallelState
    from megatron.models.gpt import build_gpt_stages
    cfg = tiny_config(arch={"swiglu": True})
    cfg.training.recompute_layers = ["none", "enc-MLP-gelu", "none", "none"]
    with pytest.raises(ValueError, match="--aceso-config: layer 1: .*splits enc-MLP-GEMM-1"):
        build_gpt_stages(cfg, ParallelState())


def test_flag_fills_a_heterogeneous_layout(tmp_path, capsys):
    path = str(tmp_path / "h.json")
    json.dump(hetero_dict([1, 3], [(2, 1), (1, 2)], mbs=4, gbs=8), open(path, "w"))
    cfg = parse_args(_args(path), world_size=4)
    assert cfg.parallel.stage_parallel == [[2, 1], [1, 2]] and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.training.micro_batch_size == 4 and cfg.num_microbatches == 2
    assert parse_args(_args(path, "--use-distributed-optimizer"), world_size=4).training.use_distributed_optimizer
    json.dump(hetero_dict([1, 3], [(2, 1), (1, 2)], mbs=4, gbs=8), open(path, "w"))
    with pytest.raises(SystemExit):
        parse_args(_args(path, "--num-attention-heads", "3", "--hidden-size", "33"), world_size=4)
    assert "stage 0 runs TP 2, which does not divide its attention heads" in capsys.readouterr().err


def _compare(ref, outs):
    assert_parity(ref, outs)  # bounds derived in tests/parity_utils.py


def _run_with_tied_copy(rank, world, kw):
    """run_layout, plus the last stage's copy of the tied embedding (it must stay equal)."""
    from tests import parity_utils
    captured = {}
    orig = parity_utils.make_trainer

    def keep(cfg):
        captured["t"] = orig(cfg)
        return captured["t"]

    parity_utils.make_trainer = keep
    try:
        out = run_layout(rank, world, kw)
    finally:
        parity_utils.make_trainer = orig
    tr = captured["t"]
    out["tied_copy"] = {}
    last = tr.stages.get(tr.ps.pp_size - 1)
    if last is not None and 0 not in tr.stages and tr.ps.dp_rank == 0:
        out["tied_copy"] = {"embedding.word_embeddings.weight": (last.output_layer.weight.detach().clone(), 0,
                                                                 tr.ps.tp_rank)}
    return out


@pytest.mark.parametrize("world,stage_parallel,stage_layers,recompute", [
    (4, [[2, 1], [1, 2]], [1, 3], ["full", "none", "selective", "full"]),  # TP2 -> DP2
    (3, [[1, 2], [1, 1]], [2, 2], None),                                   # DP2 -> one rank
])
def test_heterogeneous_stages_match_single_process(world, stage_parallel, stage_layers, recompute):
    """Stages with their own TP and DP sizes (multi-peer, row-sliced sends) train exactly like the
    single-process run: losses, gradients, parameters, and the tied output copy stays equal."""
    ref = run_distributed(run_layout, 1, {})
    kw = dict(pp=2, stage_parallel=stage_parallel, stage_layers=stage_layers, recompute_layers=recompute)
    outs = run_distributed(_run_with_tied_copy, world, kw)
    _compare(ref, outs)
    import torch
    emb = assemble([o["params"] for o in outs])["embedding.word_embeddings.weight"]
    copy = assemble([o["tied_copy"] for o in outs])["embedding.word_embeddings.weight"]
    torch.testing.assert_close(copy, emb, atol=0, rtol=0)


def test_searched_heterogeneous_config_trains_like_single_process(tmp_path):
    """Profile our GPT on CPU, let the search split 4 GPUs into 3 stages (GPU counts 2 + 1 + 1,
    so the stages cannot share one TP x DP), write the config, read it back the way
    --aceso-config does, and train it on 4 gloo ranks: it matches the single-process run."""
    import os
    import shutil

    from megatron.aceso.config import save_plan
    from megatron.aceso.db import SHIPPED_DIR, OpDatabase
    from megatron.aceso.model import ModelSpec, PerfModel
    from megatron.aceso.profiler import profile_gpt
    from megatron.aceso.runtime import load_gpt_layout
    from megatron.aceso.search import search_all
    from megatron.config.core import ModelConfig

    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                      vocab_size=101, make_vocab_size_divisible_by=8)
    root = str(tmp_path / "db")
    profile_gpt(cfg, root, size="tiny", mbs_values=(1, 2), repeats=1)
    mini = os.path.join(SHIPPED_DIR, "miniset")
    for fn in os.listdir(mini):  # p2p and collectives from the shipped set (borrowed by name)
        if fn.startswith(("p2p_", "prim_gpt_1_3B_all_reduce")):
            shutil.copy(os.path.join(mini, fn), root)
    spec = ModelSpec("gpt", "tiny", (4,), 32, 16, 8)
    pm = PerfModel(OpDatabase(root, "gpt", "tiny"), spec, memory_limit_mb=1e6)
    res = search_all(pm, 4, 8, budget_trials=40, runnable=True)
    plan = next(r for r in res if r.num_stages == 3).best.plan
    layouts = [[s.tp, s.dp] for s in plan.stages]
    assert len({tuple(x) for x in layouts}) > 1 and sum(t * d for t, d in layouts) == 4
    path = str(tmp_path / "searched.json")
    save_plan(path, plan, spec)
    lay = load_gpt_layout(path, 4, 4)
    assert lay.stage_parallel == layouts and lay.global_batch_size == 8
    ref = run_distributed(run_layout, 1, {})
    outs = run_distributed(run_layout, 4, dict(
        pp=3, stage_parallel=lay.stage_parallel, stage_layers=lay.stage_layers,
        recompute_layers=lay.recompute_layers, mbs=lay.micro_batch_size, gbs=lay.global_batch_size))
    _compare(ref, outs)
