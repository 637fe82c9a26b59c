"""The load-summing partition DP and T5's encoder/decoder-balanced partition, against brute force."""
import numpy as np
import pytest

from megatron.planner.dynapipe import partitioner as part
from megatron.planner.dynapipe.partitioner import objective, optimal_partition
from megatron.planner.cost.stage_loads import balanced_partition


def compositions(N):
    for mask in range(1 << (N - 1)):
        yield [0] + [i + 1 for i in range(N - 1) if mask >> i & 1] + [N]


def seg(M, a, b):
    return M[a, b - a - 1] if b - a <= M.shape[1] else np.inf


def brute(T, stages, dp, cost):
    """min over feasible partitions of cost(cuts); T decides feasibility."""
    best = np.inf
    for cuts in compositions(T.shape[0]):
        if all(np.isfinite(seg(T, a, b)) for a, b in zip(cuts, cuts[1:])):
            best = min(best, cost(cuts))
    return best


def sides(rng, n, m):
    """Encoder- and decoder-side segment times that grow with the segment; T = their max."""
    sizes = np.arange(1, m + 1)[None, :]
    enc = rng.uniform(1, 10, size=(n, 1)) * sizes ** rng.uniform(0.5, 1.0) + rng.uniform(0, 3, size=(n, m))
    dec = rng.uniform(1, 10, size=(n, 1)) * sizes ** rng.uniform(0.5, 1.0) + rng.uniform(0, 3, size=(n, m))
    gap = rng.random((n, m)) < 0.15
    gap[:, 0] = False
    enc[gap] = dec[gap] = np.inf
    return np.maximum(enc, dec), enc, dec


@pytest.mark.parametrize("seed", range(60))
def test_load_sum_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 11))
    m = int(rng.integers(1, n + 1))
    stages, dp = int(rng.integers(1, 6)), int(rng.integers(1, 3))
    T, enc, dec = sides(rng, n, m)
    lam = float(rng.uniform())
    load = lam * enc + (1 - lam) * dec

    def cost(cuts):
        pairs = list(zip(cuts, cuts[1:]))
        return (stages - 1) * max(seg(T, a, b) for a, b in pairs) + sum(seg(load, a, b) for a, b in pairs) / dp

    p = optimal_partition(T, stages, dp, batch_taus=int(rng.integers(1, 8)), load=load)
    assert p.objective == pytest.approx(brute(T, stages, dp, cost), rel=1e-12)
    assert p.objective == pytest.approx(cost(p.boundaries), rel=1e-12)
    assert p.times == [seg(T, a, b) for a, b in zip(p.boundaries, p.boundaries[1:])]


def test_numpy_and_native_agree(monkeypatch):
    if not part._cpp_load:
        pytest.skip("partition_cpp without the load variants (rebuild: python setup.py build_ext --inplace)")
    rng = np.random.default_rng(3)
    T, enc, dec = sides(rng, 40, 12)
    load = 0.7 * enc + 0.3 * dec
    native = optimal_partition(T, 4, 2, load=load)
    monkeypatch.setattr(part, "_cpp_load", False)
    monkeypatch.setattr(part, "_cpp", None)
    slow = optimal_partition(T, 4, 2, load=load)
    assert (native.boundaries, native.objective) == (slow.boundaries, slow.objective)


@pytest.mark.parametrize("seed", range(60))
def test_balanced_partition(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 11))
    m = int(rng.integers(1, n + 1))
    stages, dp = int(rng.integers(2, 6)), int(rng.integers(1, 3))
    T, enc, dec = sides(rng, n, m)
    if seed % 3 == 0:
        dec = dec * 0.3  # encoder-bound, as T5 at long inputs
        T = np.maximum(enc, dec)

    def cost(cuts):
        pairs = list(zip(cuts, cuts[1:]))
        E = sum(seg(enc, a, b) for a, b in pairs)
        D = sum(seg(dec, a, b) for a, b in pairs)
        return (stages - 1) * max(seg(T, a, b) for a, b in pairs) + max(E, D) / dp

    p = balanced_partition(T, enc, dec, stages, dp)
    assert p.objective == pytest.approx(cost(p.boundaries), rel=1e-12)
    # Never worse, by this objective, than cutting by the sum of per-micro-batch maxima ...
    assert p.objective <= cost(optimal_partition(T, stages, dp).boundaries) + 1e-9
    # ... and optimal where one half is the bottleneck at its own optimum (the certificate).
    best = brute(T, stages, dp, cost)
    q1 = optimal_partition(T, stages, dp, load=enc)
    E1 = sum(seg(enc, a, b) for a, b in zip(q1.boundaries, q1.boundaries[1:]))
    D1 = sum(seg(dec, a, b) for a, b in zip(q1.boundaries, q1.boundaries[1:]))
    if D1 <= E1:
        assert p.objective == pytest.approx(best, rel=1e-12)
    assert p.objective >= best - 1e-9


def test_t5_plan_uses_the_balanced_objective():
    """On the A100 T5-11B table at 2048 tokens the encoder stages are the bottleneck: the
    planner's partition objective is (S-1)*t_max + the encoder side's total."""
    from pathlib import Path

    from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
    root = Path(__file__).resolve().parents[3]
    cfg = DynaPipeConfig(cost_model_path=str(root / "cost_models" / "t5_11b_a100.json"), model_kind="t5",
                         hidden_size=1024, encoder_layers=24, decoder_layers=24, pipeline_parallel=4,
                         tensor_parallel=2, memory_limit_mb=36000, emit_plans=False)
    planner = DynaPipePlanner(cfg)
    rng = np.random.default_rng(0)
    pairs = np.stack([rng.integers(200, 2048, 60), rng.integers(1, 300, 60)], 1)
    order = part.order_lexicographic(pairs)
    enc, dec = planner._pad(pairs[order, 0]), planner._pad(pairs[order, 1], 2)
    S3 = planner.segment_times("full", "1f1b", enc, dec, sides=True)
    assert S3.shape[2] == 3 and np.array_equal(S3[..., 0], planner.segment_times("full", "1f1b", enc, dec))
    fin = np.isfinite(S3[..., 0])
    assert np.allclose(S3[..., 0][fin], np.maximum(S3[..., 1], S3[..., 2])[fin])
    p = balanced_partition(S3[..., 0], S3[..., 1], S3[..., 2], planner.S, 1)
    b = list(zip(p.boundaries, p.boundaries[1:]))
    E = sum(S3[i, j - i - 1, 1] for i, j in b)
    D = sum(S3[i, j - i - 1, 2] for i, j in b)
    assert D < E and p.objective == pytest.approx(3 * max(p.times) + E)
    old = optimal_partition(S3[..., 0], planner.S, 1)
    assert p.objective <= objective(old.times, planner.S, 1)


def test_refining_near_candidates_is_never_worse():
    """Refining every candidate within refine_spread of the quick winner keeps the quick winner
    among them, so the plan is never slower than refining that one alone; T5 plans stay valid
    partitions of the batch."""
    from pathlib import Path

    from megatron.planner.dynapipe.planner import DynaPipeConfig, DynaPipePlanner
    root = Path(__file__).resolve().parents[3]
    rng = np.random.default_rng(5)
    made = {}
    for spread in (0.0, 0.07):
        cfg = DynaPipeConfig(cost_model_path=str(root / "cost_models" / "t5_11b_a100.json"), model_kind="t5",
                             hidden_size=1024, encoder_layers=24, decoder_layers=24, pipeline_parallel=4,
                             tensor_parallel=2, memory_limit_mb=36000, emit_plans=False, refine_spread=spread)
        made[spread] = DynaPipePlanner(cfg)
    for _ in range(2):
        n = 40
        pairs = np.stack([np.minimum(1024, rng.lognormal(np.log(300), 1.0, n).astype(int) + 4),
                          np.minimum(512, rng.lognormal(np.log(40), 1.2, n).astype(int) + 1)], 1).tolist()
        plans = {s: pl.plan(pairs) for s, pl in made.items()}
        assert plans[0.07].makespan_ms <= plans[0.0].makespan_ms + 1e-6
        ids = sorted(i for g in plans[0.07].groups for mb in g.microbatches for i in mb)
        assert ids == list(range(n))
