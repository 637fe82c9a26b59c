"""Tensor-parallel building blocks against their single-device equivalents."""
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           get_rng_tracker, model_parallel_seed, vocab_parallel_cross_entropy)
from megatron.core.tensor_parallel.layers import init_full
from tests.dist_harness import run_distributed


def _linears(rank, world):
    ps = initialize_model_parallel(world, 1)
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8, requires_grad=True)
    col = ColumnParallelLinear(8, 12, ps.tp_group, seed=1, key="c", init_std=0.5)
    row = RowParallelLinear(12, 8, ps.tp_group, seed=1, key="r", init_std=0.5)
    y = row(F.gelu(col(x)))
    y.sum().backward()
    wc, wr = init_full((12, 8), 0.5, 1, "c.weight"), init_full((8, 12), 0.5, 1, "r.weight")
    x2 = x.detach().clone().requires_grad_(True)
    ref = F.linear(F.gelu(F.linear(x2, wc)), wr)
    ref.sum().backward()
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    return True


def test_column_row_linear_match_dense():
    run_distributed(_linears, 2)


def _vocab(rank, world, vocab, padded):
    ps = initialize_model_parallel(world, 1)
    emb = VocabParallelEmbedding(padded, 6, ps.tp_group, seed=3, real_vocab_size=vocab)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (4, 7), generator=g)
    out = emb(ids)
    full = init_full((vocab, 6), 0.02, 3, "embedding.word_embeddings.weight")
    torch.testing.assert_close(out, F.embedding(ids, full))
    logits = torch.randn(4, 7, padded, generator=g)
    per = padded // world
    local = logits[..., rank * per:(rank + 1) * per].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, ids, ps.tp_group, vocab)
    ref_logits = logits[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), ids.reshape(-1), reduction="none").view(4, 7)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    want = torch.zeros(4, 7, padded)
    want[..., :vocab] = ref_logits.grad
    torch.testing.assert_close(local.grad, want[..., rank * per:(rank + 1) * per], atol=1e-5, rtol=1e-5)
    return True


def test_vocab_parallel_embedding_and_cross_entropy_with_padding():
    # 101 real ids padded to 112: padding columns take no probability mass.
    run_distributed(_vocab, 2, 101, 112)
    run_distributed(_vocab, 1, 101, 104)


def _dropout(rank, world):
    ps = initialize_model_parallel(world, 1)
    model_parallel_seed(42, ps.tp_rank, 0)
    with get_rng_tracker().fork():
        tp_mask = F.dropout(torch.ones(1000), 0.5)
    shared_mask = F.dropout(torch.ones(1000), 0.5)
    return tp_mask, shared_mask


def test_tracker_dropout_differs_across_tp_ranks_only_in_tp_region():
    (a_tp, a_shared), (b_tp, b_shared) = run_distributed(_dropout, 2)
    assert not torch.equal(a_tp, b_tp)
    assert torch.equal(a_shared, b_shared)
