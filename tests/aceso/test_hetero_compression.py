"""Optimus-CC on stages with their own TP/DP sizes (--aceso-config layouts).

Compression changes the numerics, so each test names the run it must equal:
* --inter-grad-comp: the single-process run with the sender's codec applied to the gradient
  that crosses the stage boundary, one low-rank P/Q per batch_slice piece (as the hetero
  plan cuts it), in the same micro-batch order;
* --grad-comp and --emb-grad-comp: the uniform layout (PP2 x DP2, TP1) with the same
  compression. PowerSGD's result is a function of the *sum* over its group only (P = sum M_k Q,
  Q = sum M_k^T P, and with error feedback the residuals sum to what the sum missed), so a
  stage whose DP group splits each micro-batch by rows gives what the uniform DP split of
  samples gives, and the zero-padded, vocabulary-wide buffers of the re-split embedding sync
  give what the fused sync over TP1 stages gives;
* --emb-comm-opt alone is exact (with the distributed optimizer in test_hetero_grads.py).
All comparisons use the bounds of tests/parity_utils.py."""
import pytest
import torch

from megatron.compression.pipeline import PipelineGradCompressor
from tests.aceso.test_hetero_grads import DP2_TP2, TP2_DP2, check, hetero_run
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, run_dtype, tiny_config, train_and_record

pytestmark = pytest.mark.parity

ITERS = 2


class _PieceCodec:
    """Forward hook on the last layer of stage 0 (single process): its output's gradient is
    replaced by what stage 1's ranks send, one compressed piece per `blocks` entry (the
    batch_slices of the hetero plan: rows, or rows x tokens), keyed as the executor keys it."""

    def __init__(self, rank, lep, seed, blocks):
        self.comp, self.rank, self.blocks = PipelineGradCompressor(lep, seed), rank, blocks

    def _codec(self, g):
        out = g.clone()
        for sl in self.blocks:
            toks = slice(sl[2], sl[2] + sl[3]) if len(sl) == 4 else slice(None)
            piece = g[toks, sl[0]:sl[0] + sl[1]]
            wire = self.comp.encode(1, [piece], self.rank, piece=sl)
            out[toks, sl[0]:sl[0] + sl[1]] = PipelineGradCompressor.decode([piece.shape], self.rank, wire, g.dtype)[0]
        return out

    def __call__(self, module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(self._codec)


def _single_with_codec(rank, world, r, lep, blocks):
    cfg = tiny_config(world=1, iters=ITERS)
    t = make_trainer(cfg)
    codec = _PieceCodec(r, lep, cfg.training.seed, blocks)
    t.stages[0].decoder.layers[TP2_DP2["stage_layers"][0] - 1].register_forward_hook(codec)
    # the codec ends each iteration as the trainer's does after the pipeline
    return train_and_record(t, 1, each_step=codec.comp.end_iteration)


# TP2_DP2 sends each micro-batch's gradient (2 rows) back as one piece per row, to both TP ranks;
# with --sequence-parallel as one block per (row, TP rank's half of the 16 tokens).
ROWS = [(0, 1), (1, 1)]
BLOCKS = [(row, 1, tok, 8) for row in (0, 1) for tok in (0, 8)]


@pytest.mark.parametrize("lep,sp", [(True, False), (False, True)], ids=["cb-lep", "cb-sequence-parallel"])
def test_compressed_pieces_between_stages_equal_single_process_with_the_same_codec(lep, sp):
    """--inter-grad-comp (+ --use-error-feedback) from a DP2 stage to a TP2 stage: each DP rank
    compresses its rows once and sends the same factors to both TP ranks; with
    --sequence-parallel each TP rank gets its own block of tokens, compressed on its own."""
    r = 2
    ref = run_distributed(_single_with_codec, 1, r, lep, BLOCKS if sp else ROWS)
    outs = run_distributed(hetero_run, 4, dict(TP2_DP2, iters=ITERS), **{
        "compression.inter_grad_comp": True, "compression.inter_grad_comp_rank": r,
        "compression.use_error_feedback": lep, "model.sequence_parallel": sp})
    check(ref, outs)
    sent = outs[0]["comm_bytes"][0]  # whole-job bytes, the same on every rank
    # 4 micro-batches x 2 rows x 2 TP ranks: rank-2 factors of a 16 x 32 matrix (8 x 32 with SP),
    # in the run's dtype (float64 under the parity tests: tests/conftest.py)
    tokens, b = 8 if sp else 16, torch.empty((), dtype=run_dtype(outs)).element_size()
    assert sent["pp_grad_raw"] == 4 * 2 * 2 * tokens * 32 * b
    assert sent["pp_grad"] == 4 * 2 * 2 * (tokens + 32) * r * b


def _uniform(rank, world, **overrides):
    return hetero_run(rank, world, dict(pp=2, iters=ITERS), **overrides)


GRAD_COMP = {"compression.grad_comp": True, "compression.grad_comp_rank": 2, "compression.use_error_feedback": True,
             "compression.selective_grad_comp": True, "compression.selective_grad_comp_way": 1,
             "compression.emb_comm_opt": True}


def test_powersgd_over_a_stage_dp_group_equals_the_uniform_layout():
    """--grad-comp (+ error feedback, --selective-grad-comp-way 1, --emb-comm-opt): stage 0 runs
    DP2 (PowerSGD over its own DP group), stage 1 TP2 x DP1 (nothing to reduce)."""
    ref = run_distributed(_uniform, 4, **GRAD_COMP)
    outs = run_distributed(hetero_run, 4, dict(DP2_TP2, iters=ITERS), **GRAD_COMP)
    check(ref, outs)
    sent = outs[0]["comm_bytes"][-1]  # whole-job bytes, the same on every rank
    assert 0 < sent["dp"] < sent["dp_raw"] / 4, sent


EMB_COMP = {"compression.emb_comm_opt": True, "compression.emb_grad_comp": True,
            "compression.emb_grad_comp_rank": 3, "compression.emb_use_error_feedback": True}


def test_compressed_embedding_sync_equals_the_uniform_fused_one():
    """--emb-grad-comp (+ --emb-comm-opt, error feedback) between a TP2 first stage and a DP2
    last stage: one low-rank sum of the re-split tied gradient over both stages' ranks."""
    ref = run_distributed(_uniform, 4, **EMB_COMP)
    outs = run_distributed(hetero_run, 4, dict(TP2_DP2, iters=ITERS), **EMB_COMP)
    check(ref, outs)
    sent = outs[0]["comm_bytes"][0]  # whole-job bytes, the same on every rank
    assert 0 < sent["emb"] < 4 * 112 * 32 * 4  # less than the 4 ranks' full [112, 32] buffers
