"""The randomized-SVD reducer and --emb-grad-comp: reference equality, and exactness when the
rank covers the gradient's rank (training losses equal the uncompressed run's)."""
import numpy as np
import pytest
import torch
from torch import nn

from megatron.compression import lowrank
from megatron.compression.data_parallel import PowerSGDReducer
from megatron.config.core import CompressionConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, tiny_config

SHAPES = [(24, 20), (10,), (20, 16)]
RANK, OVER, ITERS = 2, 4, 3


def test_truncate_is_the_best_rank_r_approximation():
    torch.manual_seed(0)
    m = torch.randn(30, 20, dtype=torch.float64)
    p, _ = torch.linalg.qr(m @ torch.randn(20, 8, dtype=torch.float64))
    q = m.t() @ p
    u, s, vh = np.linalg.svd((p @ q.t()).numpy())
    best = (u[:, :3] * s[:3]) @ vh[:3]
    np.testing.assert_allclose(lowrank.truncate(p, q, 3).numpy(), best, atol=1e-10)


def _grads(worker, it):
    g = torch.Generator().manual_seed(100 * it + worker)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _reference(world):
    """Randomized SVD over `world` workers with error feedback, from the algorithm's definition
    (numpy SVD for the truncation)."""
    err = [{} for _ in range(world)]
    out = []
    for it in range(1, ITERS + 1):
        per = [_grads(w, it) for w in range(world)]
        result = []
        for i, shape in enumerate(SHAPES):
            gs = [per[w][i] for w in range(world)]
            if len(shape) < 2:
                result.append(sum(gs))
                continue
            ms = [g + err[w].get(i, 0) for w, g in enumerate(gs)]
            omega = lowrank.initial_q(shape[1], RANK + OVER, 7, ("rsvd", i, it))
            basis, _ = np.linalg.qr(sum(m @ omega for m in ms).numpy())
            small = sum(basis.T @ m.numpy() for m in ms)
            u, s, vh = np.linalg.svd(basis @ small)
            approx = torch.from_numpy(((u[:, :RANK] * s[:RANK]) @ vh[:RANK]).astype(np.float32))
            for w in range(world):
                err[w][i] = ms[w] - approx / world
            result.append(approx)
        out.append(result)
    return out


def _run(rank, world):
    import torch.distributed as dist
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    red = PowerSGDReducer(RANK, error_feedback=True, warmup_iters=0, compress=True, dp_group=dist.group.WORLD,
                          dp_size=world, seed=7, method="RandomizedSVD", oversample=OVER)
    out, sizes = [], []
    for it in range(1, ITERS + 1):
        for p, g in zip(params, _grads(rank, it)):
            p.grad = g.clone()
        sizes.append(red.reduce(params, it))
        out.append([p.grad.clone() for p in params])
    return out, sizes


def test_two_rank_randomized_svd_equals_its_definition():
    ref = _reference(2)
    for got, sizes in run_distributed(_run, 2):
        for it in range(ITERS):
            for i in range(len(SHAPES)):
                torch.testing.assert_close(got[it][i], ref[it][i], atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"iteration {it + 1} tensor {SHAPES[i]}: {m}")
        raw = 4 * (480 + 10 + 320)
        assert sizes[0] == (4 * (10 + (24 + 20) * 6 + (20 + 16) * 6), raw)


def test_unknown_reducer_is_refused():
    with pytest.raises(ValueError, match="PowerSGD, RandomizedSVD"):
        PowerSGDReducer(2, False, 0, True, None, 1, method="TopK")
    with pytest.raises(ValueError, match="--grad-comp-type"):
        CompressionConfig(grad_comp=True, grad_comp_type="TopK")


# Exactness at full rank. Every weight gradient of the tiny model sums rank-1 terms over the
# tokens it saw: with one 4-token micro-batch per rank it has rank <= 4 per rank (<= 8 for the
# tied embedding: input rows plus output layer), <= 16 summed over the ranks of any group here,
# so a rank-16 reducer must reproduce the uncompressed sums (to fp32 rounding) while still
# sending factors smaller than the matrices (checked via the bytes).
def _exact(rank, world, comp, pp):
    cfg = tiny_config(world=world, pp=pp, iters=3, seq=4, mbs=1, gbs=world // pp, lr=1e-2)
    if comp is not None:
        cfg.compression = CompressionConfig(**comp)
    t = make_trainer(cfg)
    hist = t.train()
    return [h["loss"] for h in hist], hist[-1]["comm_bytes"]


@pytest.mark.parametrize("comp,pp,kind", [
    (dict(grad_comp=True, grad_comp_rank=16, use_error_feedback=True), 1, "dp"),
    (dict(grad_comp=True, grad_comp_rank=16, use_error_feedback=True, grad_comp_type="RandomizedSVD"), 1, "dp"),
    (dict(emb_grad_comp=True, emb_grad_comp_rank=16, emb_use_error_feedback=True), 2, "emb"),
    (dict(emb_grad_comp=True, emb_grad_comp_rank=16, emb_comm_opt=True, emb_grad_comp_type="RandomizedSVD"), 2, "emb"),
])
def test_low_rank_reducers_are_exact_when_the_rank_covers_the_gradient(comp, pp, kind):
    world = 2 * pp
    base = run_distributed(_exact, world, None, pp)[-1][0]
    got, comm = run_distributed(_exact, world, comp, pp)[-1]
    assert got == pytest.approx(base, rel=1e-5, abs=1e-6)
    assert got[0] == base[0] and got[-1] != pytest.approx(got[0], rel=1e-3)  # trained, not frozen
    if kind == "dp":
        assert 0 < comm["dp"] < comm["dp_raw"]
    else:
        # Uncompressed, each of the 4 ranks sends the (104 x 32) embedding gradient.
        per_rank = comm["emb"] / 4
        assert 0 < per_rank < 104 * 32 * 4


def _stats_run(rank, world, low):
    import torch.distributed as dist
    from megatron.compression.stats import CompressionStats, summary
    g = torch.Generator().manual_seed(rank)
    grad = (torch.randn(24, 1, generator=g) @ torch.randn(1, 20, generator=g)) if low else torch.randn(24, 20, generator=g)
    p = nn.Parameter(torch.zeros(24, 20))
    p.grad = grad
    red = PowerSGDReducer(4, True, 0, True, dist.group.WORLD, world, seed=1, kind="emb", stage=3)
    red.stats = CompressionStats()
    red.reduce([p], 1)
    return summary(red.stats.snapshot()[(3, "emb")])


def test_reducer_stats_measure_against_the_exact_sum():
    exact = run_distributed(_stats_run, 2, True)[0]  # two rank-1 gradients: the rank-4 sum is exact
    assert exact["sent_err"] < 1e-5 and exact["orth"] < 1e-5 and exact["ratio"] == pytest.approx(480 / (44 * 4))
    rough = run_distributed(_stats_run, 2, False)[0]
    assert 0.3 < rough["sent_err"] < 1 and rough["residual"] > 0.1
