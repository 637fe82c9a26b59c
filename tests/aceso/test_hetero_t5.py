"""T5 on an Aceso layout (pretrain_t5.py --aceso-config): the config's encoder/decoder ops map
to stages of whole layers, and stages with their own TP/DP sizes train exactly like the
single-process run (fp32): the encoder output reaches every decoder stage in row pieces."""
import dataclasses
import json

import pytest

from megatron.aceso.runtime import AcesoConfigError
from megatron.aceso.t5_layout import DEC_CORE, DEC_OPS, ENC_OPS, t5_layout
from megatron.cli.arguments import parse_args
from tests.dist_harness import run_distributed
from tests.training.test_t5_parity import _compare, _shards, run_t5_layout, tiny_t5_config

pytestmark = pytest.mark.parity


def t5_dict(stage_layers, stage_parallel, enc=2, dec=2, rec=None, mbs=4, gbs=8):
    """An Aceso T5 config; stage_layers count the sequence encoder layers, then decoder layers.
    The encoder's final norm goes with the stage of the last encoder layer, the decoder
    embedding with the stage of the first decoder layer. rec[j]: flags of layer j."""
    layer_ops = [ENC_OPS] * enc + [DEC_OPS] * dec
    rec = rec or [[0] * n for n in layer_ops]
    counts, flags, start = [], [], 0
    for s, n in enumerate(stage_layers):
        ops, f = 0, []
        for j in range(start, start + n):
            if j == 0:
                ops, f = ops + 1, f + [0]            # encoder embedding
            if j == enc:
                ops, f = ops + 1, f + [0]            # decoder embedding
            ops, f = ops + layer_ops[j], f + rec[j]
            if j == enc - 1:
                ops, f = ops + 1, f + [0]            # encoder final norm
        if s == len(stage_layers) - 1:
            ops, f = ops + 2, f + [0, 0]             # decoder final norm, post-process
        counts.append(ops)
        flags.append(f)
        start += n
    return {"model_name": "t5", "model_size": "tiny", "num_layers": [enc, dec], "global_batch_size": gbs,
            "micro_batch_size": mbs, "num_stages": len(stage_layers),
            "num_gpus": [t * d for t, d in stage_parallel], "checkpoint_activations": [any(f) for f in flags],
            "resharding_stages": [False] * len(counts), "num_ops_in_each_stage": counts,
            "model_parallel_size_of_each_op": [[t] * c for (t, _), c in zip(stage_parallel, counts)],
            "data_parallel_size_of_each_op": [[d] * c for (_, d), c in zip(stage_parallel, counts)],
            "recompute_ops": flags, "algo_of_each_op": [[0] * c for c in counts]}


DEC_SELECTIVE = [1 if i in DEC_CORE else 0 for i in range(DEC_OPS)]


def test_layout_from_t5_config():
    rec = [[1] * ENC_OPS, [0] * ENC_OPS, [0] * DEC_OPS, DEC_SELECTIVE]
    lay = t5_layout(t5_dict([1, 3], [(2, 1), (1, 2)], rec=rec), 2, 2, 4)
    assert lay.stage_parallel == [[2, 1], [1, 2]] and lay.stage_layers == [1, 3] and lay.micro_batch_size == 4
    assert lay.recompute_layers == ["full", "none", "none", "selective"]
    d = t5_dict([2, 2], [(1, 1), (1, 1)])
    d["num_ops_in_each_stage"] = [d["num_ops_in_each_stage"][0] - 1, d["num_ops_in_each_stage"][1] + 1]
    assert t5_layout(d, 2, 2, 2).stage_layers == [2, 2]  # the encoder's final norm may sit on either side
    d["num_ops_in_each_stage"] = [d["num_ops_in_each_stage"][0] - 3, d["num_ops_in_each_stage"][1] + 3]
    with pytest.raises(AcesoConfigError, match="cut inside layer 1"):
        t5_layout(d, 2, 2, 2)
    with pytest.raises(AcesoConfigError, match="recomputes none, both attention cores"):
        t5_layout(t5_dict([2, 2], [(1, 1), (1, 1)], rec=[[0] * ENC_OPS] * 2 + [[0] * DEC_OPS, [0, 0, 1] + [0] * 18]),
                  2, 2, 2)
    with pytest.raises(AcesoConfigError, match="is for \\[2, 2\\]"):
        t5_layout(t5_dict([2, 2], [(1, 1), (1, 1)]), 2, 3, 2)


def test_t5_flag_fills_the_config(tmp_path):
    path = str(tmp_path / "t5.json")
    json.dump(t5_dict([1, 3], [(2, 1), (1, 2)]), open(path, "w"))
    cfg = parse_args(["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "32",
                      "--num-attention-heads", "4", "--encoder-seq-length", "16", "--decoder-seq-length", "8",
                      "--vocab-size", "101", "--mock-data", "--aceso-config", path], model_type="t5", world_size=4)
    assert cfg.parallel.stage_parallel == [[2, 1], [1, 2]] and cfg.parallel.pipeline_stage_layers == [1, 3]
    from megatron.models.t5 import t5_split_rank, t5_stage_layers
    assert t5_split_rank(cfg) == 1  # stage 1 ends the encoder and starts the decoder
    assert t5_stage_layers(cfg) == [((0, 1), (0, 0)), ((1, 2), (0, 2))]


def run_hetero_t5(rank, world, stage_parallel, stage_layers, recompute_layers=None, **kw):
    from datetime import timedelta

    import torch

    from megatron.training.initialize import initialize_parallel, set_seeds
    from megatron.training.t5_builder import build_t5_trainer
    from tests.parity_utils import tolerance_inputs
    cfg = tiny_t5_config(**kw)
    tp = max(t for t, _ in stage_parallel) if stage_parallel else 1  # None: one TP1 x DP1 rank per stage
    cfg = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, world_size=world, stage_parallel=stage_parallel,
                                          pipeline_stage_layers=stage_layers,
                                          pipeline_model_parallel_size=len(stage_layers),
                                          tensor_model_parallel_size=tp),
        training=dataclasses.replace(cfg.training, recompute_layers=recompute_layers))
    ps = initialize_parallel(cfg, timedelta(minutes=1))
    set_seeds(cfg.training.seed, ps, torch.device("cpu"))
    trainer = build_t5_trainer(cfg, ps, torch.device("cpu"))
    grads, zero = [], trainer.optimizer.zero_grad

    def snapshot_then_zero():
        grads.append(_shards(trainer, "grad")[0])
        zero()
    trainer.optimizer.zero_grad = snapshot_then_zero
    history = trainer.train()
    params, copies = _shards(trainer, "param")
    return {"loss": [h["loss"] for h in history], "grad_norm": [h["grad_norm"] for h in history], "grads": grads,
            "params": params, "copies": copies, "is_last": rank == world - 1, **tolerance_inputs(cfg)}


@pytest.mark.parametrize("stage_parallel,rec,pos", [
    # TP2 encoder stage | TP1xDP2 stage ending the encoder and holding the decoder; learned
    # positions summed over all replicas of both stages; per-layer recompute from the config
    ([(2, 1), (1, 2)], [[1] * ENC_OPS, [0] * ENC_OPS, [0] * DEC_OPS, DEC_SELECTIVE], "learned_absolute"),
    # DP2 encoder | TP2 first decoder stage (receives only the encoder output) | one-rank last stage
    ([(1, 2), (2, 1), (1, 1)], None, "relative"),
])
def test_t5_on_heterogeneous_stages_matches_single_process(stage_parallel, rec, pos):
    layers = [1, 3] if len(stage_parallel) == 2 else [2, 1, 1]
    world = sum(t * d for t, d in stage_parallel)
    lay = t5_layout(t5_dict(layers, stage_parallel, rec=rec), 2, 2, world)
    ref = run_distributed(run_t5_layout, 1, dict(pos=pos, iters=2, mbs=4))
    outs = run_distributed(run_hetero_t5, world, lay.stage_parallel, lay.stage_layers, lay.recompute_layers,
                           pos=pos, iters=2, mbs=lay.micro_batch_size, gbs=lay.global_batch_size)
    copies = _compare(ref, outs)
    assert copies  # the decoder's and the head's tied copies stayed equal to stage 0's tables


def test_t5_uneven_stage_layers_match_single_process():
    """--pipeline-stage-layers for T5 without per-stage sizes (what a uniform-TP/DP Aceso T5
    config sets): stage 0 holds encoder layer 0, stage 1 the last encoder layer and the decoder."""
    ref = run_distributed(run_t5_layout, 1, dict(iters=2))
    _compare(ref, run_distributed(run_hetero_t5, 2, None, [1, 3], iters=2))
