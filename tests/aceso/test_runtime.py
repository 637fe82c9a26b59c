"""--aceso-config: per-stage layer counts and per-layer recompute on the existing executor.

Parity: an uneven 2-stage pipeline (1 + 3 layers) whose layers recompute full / none /
selective / full trains exactly like the single-process run without recompute (fp32)."""
import json

import pytest

from megatron.aceso.runtime import AcesoConfigError, gpt_layout
from megatron.arguments import parse_args
from tests.dist_harness import run_distributed
from tests.parity_utils import assemble, run_layout, shards, tiny_config

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
PARTIAL = [0] * 9 + [0, 1, 0, 0]                      # GeLU only -> the layer is checkpointed


def test_layout_from_config():
    lay = gpt_layout(aceso_dict([1, 3], rec=[FULL, NONE, SELECTIVE, PARTIAL], mbs=4, dp=2), 4, 4)
    assert (lay.tp, lay.pp, lay.dp) == (1, 2, 2)
    assert lay.stage_layers == [1, 3] and lay.micro_batch_size == 2 and lay.global_batch_size == 8
    assert lay.recompute_layers == ["full", "none", "selective", "full"]


def test_layout_rejects_what_the_runtime_cannot_run():
    d = aceso_dict([2, 2])
    d["model_parallel_size_of_each_op"][1] = [2] * len(d["model_parallel_size_of_each_op"][1])
    d["num_gpus"][1] = 2
    with pytest.raises(AcesoConfigError, match="different TP/DP sizes.*stage 1: TP 2 x DP 1"):
        gpt_layout(d, 4, 3)
    d = aceso_dict([2, 2])
    d["num_ops_in_each_stage"] = [1 + 2 * K + 3, 2 * K + 2 - 3]
    with pytest.raises(AcesoConfigError, match="cut inside a layer"):
        gpt_layout(d, 4, 2)
    d = aceso_dict([2, 2])
    d["recompute_ops"][0][0] = 1
    with pytest.raises(AcesoConfigError, match="embedding or the head"):
        gpt_layout(d, 4, 2)
    with pytest.raises(AcesoConfigError, match="job has 4"):
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
    assert cfg.training.recompute_layers == ["full", "none", "selective", "full"]
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
    r = [o for o in ref if o["is_last"]][0]
    last = [o for o in outs if o["is_last"]][0]
    assert last["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-6)
    assert last["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
    import torch
    ref_g = assemble([g for o in ref for g in o["grads"]])
    got_g = assemble([g for o in outs for g in o["grads"]])
    assert set(got_g) == set(ref_g)
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], atol=2e-5, rtol=1e-4)
    ref_p, got_p = assemble([o["params"] for o in ref]), assemble([o["params"] for o in outs])
    for name in ref_p:
        torch.testing.assert_close(got_p[name], ref_p[name], atol=2e-5, rtol=1e-4)


def test_modes_reach_the_layers(monkeypatch):
    """Each layer runs in its own mode: `full` checkpoints the layer, `selective` the attention."""
    import torch
    from megatron.core.parallel_state import ParallelState
    from megatron.core.tensor_parallel.random import model_parallel_seed
    from megatron.models import transformer
    from megatron.models.gpt import build_gpt_stages

    cfg = tiny_config()
    cfg.training.recompute_layers = ["full", "none", "selective", "full"]
    model_parallel_seed(1234, 0, 0)
    (stage,) = build_gpt_stages(cfg, ParallelState()).values()
    assert stage.decoder.layer_recompute == ["full", "none", "selective", "full"]
    calls = []
    real = transformer.checkpoint

    def counting(fn, *a):
        calls.append(getattr(fn, "__name__", "?"))
        return real(fn, *a)

    monkeypatch.setattr(transformer, "checkpoint", counting)
    tokens = torch.randint(0, 101, (2, 16))
    out = stage({"tokens": tokens, "labels": tokens}, [])
    out[0].sum().backward()
    assert calls == ["<lambda>", "core_attention", "<lambda>"]
