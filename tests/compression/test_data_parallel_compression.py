"""Data-parallel PowerSGD and selective stage compression."""
import pytest
import torch
from torch import nn

from megatron.compression.data_parallel import PowerSGDReducer
from megatron.config.core import CompressionConfig
from megatron.core.parallel_state import ParallelState
from tests.dist_harness import run_distributed
from tests.parity_utils import tiny_config

SHAPES = [(12, 10), (10,), (6, 4, 5), (3, 3)]  # the (3, 3) matrix is too small to compress at r=2
RANK, ITERS, WARMUP = 2, 4, 1


def _grads(worker, it):
    g = torch.Generator().manual_seed(1000 * it + worker)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _reference(world):
    """Single-process simulation of `world` workers, written independently of the reducer."""
    from megatron.compression.lowrank import initial_q, orthonormalize
    q = {}
    err = [{} for _ in range(world)]
    out = []
    for it in range(1, ITERS + 1):
        per = [_grads(w, it) for w in range(world)]
        result = []
        for i, shape in enumerate(SHAPES):
            gs = [per[w][i] for w in range(world)]
            if it <= WARMUP or len(shape) < 2 or shape == (3, 3):
                result.append(sum(gs))
                continue
            ms = [g.reshape(shape[0], -1) + err[w].get(i, 0) for w, g in enumerate(gs)]
            qi = q.get(i, initial_q(ms[0].shape[1], RANK, 7, (i,)))
            p = orthonormalize(sum(m @ qi for m in ms))
            qn = sum(m.t() @ p for m in ms)
            approx = p @ qn.t()
            q[i] = qn
            for w in range(world):
                err[w][i] = ms[w] - approx / world
            result.append(approx.reshape(shape))
        out.append(result)
    return out


def _run(rank, world):
    import torch.distributed as dist
    ps = ParallelState(world_size=world, rank=rank, dp_size=world, dp_rank=rank,
                       dp_group=dist.group.WORLD)
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    red = PowerSGDReducer(RANK, error_feedback=True, warmup_iters=WARMUP, compress=True,
                          dp_group=ps.dp_group, dp_size=world, seed=7)
    out, sizes = [], []
    for it in range(1, ITERS + 1):
        for p, g in zip(params, _grads(rank, it)):
            p.grad = g.clone()
        sizes.append(red.reduce(params, it))
        out.append([p.grad.clone() for p in params])
    return out, sizes


def test_two_rank_powersgd_equals_single_process_simulation():
    ref = _reference(2)
    outs = run_distributed(_run, 2)
    for got, sizes in outs:
        for it in range(ITERS):
            for i in range(len(SHAPES)):
                torch.testing.assert_close(got[it][i], ref[it][i], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"iteration {it + 1} tensor {SHAPES[i]}: {m}")
        raw = 4 * sum(torch.Size(s).numel() for s in SHAPES)
        assert sizes[0] == (raw, raw)  # warm-up: plain all-reduce
        compressed = 4 * (10 + 9 + (12 + 10) * 2 + (6 + 20) * 2)
        assert sizes[1] == (compressed, raw)
    # Both ranks hold the same reduced gradients.
    for it in range(ITERS):
        for a, b in zip(outs[0][0][it], outs[1][0][it]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("way,expect", [(1, [True, False, False, False]), (3, [True, True, True, False])])
def test_selective_compression_maps_the_first_k_stages(way, expect):
    cfg = tiny_config(world=8, pp=4, iters=10)
    cfg.compression = CompressionConfig(grad_comp=True, grad_comp_rank=4, selective_grad_comp=True,
                                        selective_grad_comp_way=way, grad_comp_warm_up=0.3)
    flags = [PowerSGDReducer.from_config(cfg, ParallelState(pp_size=4, pp_rank=r, dp_size=2)) for r in range(4)]
    assert [f.compress for f in flags] == expect
    assert all(f.warmup_iters == 3 for f in flags)
    assert [f.active(4) for f in flags] == expect and not any(f.active(3) for f in flags)
