"""Attention across a context-parallel group equals whole-sequence attention: outputs and the
gradients of q, k, v, for both exchanges, causal and packed rows (documents that start and end
inside chunks, padding), with and without keyed dropout."""
import pytest
import torch

from megatron.core.context_parallel import chunk_token_index
from megatron.data.packing import packed_attention_mask
from megatron.models.sliced_attention import KeyedDropout
from tests.dist_harness import run_distributed

S, B, NP, HN = 16, 2, 2, 4
SEGMENTS = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 0, 0],
                         [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])


def _inputs():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(S, B, NP, HN, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(S, B, NP * HN, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _reference(packed: bool, dropout: float):
    q, k, v, dout = _inputs()
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    mask = packed_attention_mask(SEGMENTS) if packed else torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if dropout:
        out = KeyedDropout(99).attention(qq, kk, vv, mask, dropout, 5, 0, 0)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
    out = out.permute(2, 0, 1, 3).reshape(S, B, NP * HN)
    (out * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_rank(rank, world, comm, packed, dropout, tile=None):
    import torch.distributed as dist

    import megatron.models.cp_flash as cp_flash
    if tile is not None:  # blocks cut into uneven query x key tiles, each merged into the online softmax
        cp_flash.TILE = tile
    from megatron.core.context_parallel import all_token_index
    from megatron.models.cp_attention import ContextParallelSpec, cp_core_attention
    q, k, v, dout = _inputs()
    idx = chunk_token_index(S, world, rank)
    q, k, v = (t.index_select(0, idx).clone().requires_grad_(True) for t in (q, k, v))
    spec = ContextParallelSpec(dist.group.WORLD, world, rank, list(range(world)), comm, idx,
                               all_token_index(S, world), SEGMENTS if packed else None,
                               KeyedDropout(99) if dropout else None)
    out = cp_core_attention(q, k, v, spec, dropout, 5, 0)
    (out * dout.index_select(0, idx)).sum().backward()
    return idx, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
@pytest.mark.parametrize("packed,dropout", [(False, 0.0), (True, 0.0), (True, 0.3)])
def test_cp_attention_equals_whole_sequence(world, comm, packed, dropout):
    ref = _reference(packed, dropout)
    for idx, *got in run_distributed(_cp_rank, world, comm, packed, dropout):
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(g, r.index_select(0, idx), rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
def test_cp_attention_tiles_equal_whole_sequence(comm):
    ref = _reference(True, 0.3)
    for idx, *got in run_distributed(_cp_rank, 2, comm, True, 0.3, tile=3):
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(g, r.index_select(0, idx), rtol=1e-12, atol=1e-12, msg=name)


def test_load_balanced_chunks():
    # rank r holds chunks r and 2N-1-r: equal causal work per rank
    assert chunk_token_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_token_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="--context-parallel-size 3"):
        chunk_token_index(8, 3, 0)


def _isolation_rank(rank, world, comm):
    """Outputs and gradients of documents 1 and 3 (row 0) with document 2's keys and values
    changed: the same bits (masked blocks contribute exact zeros to the online softmax)."""
    import torch.distributed as dist
    from megatron.core.context_parallel import all_token_index
    from megatron.models.cp_attention import ContextParallelSpec, cp_core_attention
    idx = chunk_token_index(S, world, rank)
    spec = ContextParallelSpec(dist.group.WORLD, world, rank, list(range(world)), comm, idx,
                               all_token_index(S, world), SEGMENTS, None)
    runs = []
    for noise in (0.0, 3.0):
        q, k, v, dout = _inputs()
        other = (SEGMENTS[0] == 2)[:, None, None] & (torch.arange(B) == 0)[None, :, None]
        k, v = (t + noise * other[..., None].to(t.dtype) for t in (k, v))
        q, k, v = (t.index_select(0, idx).clone().requires_grad_(True) for t in (q, k, v))
        out = cp_core_attention(q, k, v, spec, 0.0, 5, 0)
        (out * dout.index_select(0, idx)).sum().backward()
        keep = SEGMENTS[0, idx] != 2
        runs.append([t[keep, 0] for t in (out.detach(), q.grad, k.grad, v.grad)])
    return all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
def test_cp_attention_documents_isolated_bitwise(comm):
    assert all(run_distributed(_isolation_rank, 2, comm))


def _bf16_rank(rank, world):
    import torch.distributed as dist
    from megatron.core.context_parallel import all_token_index
    from megatron.models.cp_attention import ContextParallelSpec, cp_core_attention
    q, k, v, _ = _inputs()
    idx = chunk_token_index(S, world, rank)
    spec = ContextParallelSpec(dist.group.WORLD, world, rank, list(range(world)), "p2p", idx,
                               all_token_index(S, world), SEGMENTS, None)
    x = [t.index_select(0, idx).bfloat16().requires_grad_(True) for t in (q, k, v)]
    out = cp_core_attention(*x, spec, 0.0, 5, 0)
    out.float().sum().backward()
    return idx, out.detach().double(), *(t.grad.dtype for t in x)


def test_cp_attention_bfloat16_keeps_dtype_and_matches():
    # matmuls in bfloat16, softmax statistics in float32: bfloat16's rounding, no worse
    q, k, v, _ = _inputs()
    qq, kk, vv = (t.bfloat16().double().permute(1, 2, 0, 3) for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=packed_attention_mask(SEGMENTS))
    ref = ref.permute(2, 0, 1, 3).reshape(S, B, NP * HN)
    for idx, out, *dtypes in run_distributed(_bf16_rank, 2):
        assert dtypes == [torch.bfloat16] * 3
        torch.testing.assert_close(out, ref.index_select(0, idx), rtol=2e-2, atol=2e-2)
