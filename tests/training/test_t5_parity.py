"""T5 in every parallel layout matches the single-process run (fp32): losses, grad norms,
first-step gradients and parameters after 3 steps; tied embedding copies stay identical;
the loss falls on mock data."""
import re

import pytest
import torch

from megatron.config.core import (CheckpointConfig, DataConfig, LoggingConfig, MegatronConfig, ModelConfig,
                             ParallelConfig, TrainingConfig)
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, tolerance_inputs

pytestmark = pytest.mark.parity

VOCAB = 101  # not divisible by the padding multiple: padded rows must be cut before comparing


def tiny_t5_config(world=None, tp=1, pp=1, split=None, pos="relative", iters=3, lr=1e-3, mbs=2, gbs=8,
                   enc_layers=2, dec_layers=2, enc_seq=16, dec_seq=8, recompute=None):
    world = world or tp * pp
    return MegatronConfig(
        model=ModelConfig(model_type="t5", encoder_num_layers=enc_layers, decoder_num_layers=dec_layers,
                          hidden_size=32, num_attention_heads=4, encoder_seq_length=enc_seq, decoder_seq_length=dec_seq,
                          vocab_size=VOCAB, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                          attention_dropout=0.0, position_embedding_type=pos,
                          relative_attention_num_buckets=8, relative_attention_max_distance=16),
        parallel=ParallelConfig(world_size=world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                pipeline_model_parallel_split_rank=split, distributed_timeout_minutes=1.0),
        training=TrainingConfig(micro_batch_size=mbs, global_batch_size=gbs, train_iters=iters, lr=lr,
                                lr_warmup_iters=1, seed=1234, clip_grad=1.0, eval_interval=1000,
                                recompute_granularity=recompute),
        data=DataConfig(mock_data=True, vocab_extra_ids=5),
        checkpoint=CheckpointConfig(), logging=LoggingConfig(log_interval=1000),
    )


def _global_name(stage, name):
    m = re.match(r"(encoder|decoder)\.layers\.(\d+)\.(.*)", name)
    if m:
        start = (stage.encoder_layers if m.group(1) == "encoder" else stage.decoder_layers)[0]
        return f"{m.group(1)}.layers.{start + int(m.group(2))}.{m.group(3)}"
    return name


def _shards(trainer, what):
    """({global name: (tensor, partition dim, tp rank)}, same for tied copies) on DP rank 0."""
    main, copies = {}, {}
    if trainer.ps.dp_rank != 0:
        return main, copies
    for stage in trainer.stages.values():
        for name, p in stage.named_parameters():
            t = p.detach() if what == "param" else (p.grad if p.grad is not None else torch.zeros_like(p))
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            out = copies if getattr(p, "shared_embedding", False) else main
            key = f"stage{stage.ps.pp_rank}:{name}" if out is copies else _global_name(stage, name)
            out[key] = (t.detach().clone(), dim, trainer.ps.tp_rank)
    return main, copies


def _assemble(per_rank):
    pieces = {}
    for shards in per_rank:
        for name, (t, dim, tp_rank) in shards.items():
            pieces.setdefault(name, {})[tp_rank] = (t, dim)
    full = {}
    for name, by_rank in pieces.items():
        parts = [by_rank[r] for r in sorted(by_rank)]
        t = torch.cat([p[0] for p in parts], dim=parts[0][1]) if parts[0][1] is not None else parts[0][0]
        if re.search(r"word_embeddings|output_layer|lm_head_bias", name):
            t = t[:VOCAB]
        full[name] = t
    return full


def run_t5_layout(rank, world, cfg_kwargs):
    from megatron.core.parallel_state import initialize_model_parallel
    from megatron.training.initialize import set_seeds
    from megatron.training.t5_builder import build_t5_trainer

    cfg = tiny_t5_config(world=world, **cfg_kwargs)
    ps = initialize_model_parallel(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size)
    device = torch.device("cpu")
    set_seeds(cfg.training.seed, ps, device)
    trainer = build_t5_trainer(cfg, ps, device)
    grads, zero = [], trainer.optimizer.zero_grad

    def snapshot_then_zero():  # every step's gradients bound the parameters' tolerance
        grads.append(_shards(trainer, "grad")[0])
        zero()
    trainer.optimizer.zero_grad = snapshot_then_zero
    history = trainer.train()
    params, copies = _shards(trainer, "param")
    return {"loss": [h["loss"] for h in history], "grad_norm": [h["grad_norm"] for h in history],
            "grads": grads, "params": params, "copies": copies, "is_last": rank == world - 1,
            **tolerance_inputs(cfg)}


def _last(outs):
    return [o for o in outs if o["is_last"]][0]


def _compare(ref_outs, outs):
    assert_parity(ref_outs, outs, assemble_fn=_assemble)  # bounds derived in tests/parity_utils.py
    # Every tied copy (first decoder stage's embedding, last stage's LM head) still equals the original.
    params = _assemble([o["params"] for o in outs])
    copies = _assemble([o["copies"] for o in outs])
    for name, t in copies.items():
        orig = "embedding.word_embeddings.weight" if re.search("word_embeddings|output_layer", name) \
            else name.split(":", 1)[1]
        torch.testing.assert_close(t, params[orig], atol=0, rtol=0, msg=lambda m: f"tied copy {name}: {m}")
    return copies


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_t5_layout, 1, {})


LAYOUTS = {
    "pp2_split1": (2, dict(pp=2, split=1)),
    "tp2_pp2_split1": (4, dict(tp=2, pp=2, split=1)),
    "tp2": (2, dict(tp=2)),
    "dp2": (2, dict()),
    "pp4_split2": (4, dict(pp=4, split=2)),  # tied group {0, 2, 3}: three copies
    "pp2_split1_full_recompute": (2, dict(pp=2, split=1, recompute="full")),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_t5_layout_matches_single_process(reference, name):
    world, kwargs = LAYOUTS[name]
    copies = _compare(reference, run_distributed(run_t5_layout, world, kwargs))
    if kwargs.get("pp", 1) > 1:
        assert copies, "a pipelined T5 must hold tied embedding copies"


def test_t5_learned_absolute_positions_pp4_split2():
    # Position tables live on stages 0 and 2 only and are summed over that pair.
    ref = run_distributed(run_t5_layout, 1, dict(pos="learned_absolute"))
    copies = _compare(ref, run_distributed(run_t5_layout, 4, dict(pp=4, split=2, pos="learned_absolute")))
    assert any("position_embeddings" in n for n in copies)


def test_t5_loss_falls_on_mock_data():
    out = run_distributed(run_t5_layout, 1, dict(iters=30, lr=1e-2, gbs=16, dec_seq=16))[0]
    loss = out["loss"]
    assert sum(loss[-3:]) / 3 < loss[0] - 0.5, loss
