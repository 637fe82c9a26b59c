"""--mp-grad-comp / --mp-acti-comp: exact at full rank, approximate below, recompute-safe."""
import pytest
import torch

from megatron.config.core import CompressionConfig, ConfigError
from megatron.core.tensor_parallel import mappings
from tests.dist_harness import run_distributed
from tests.parity_utils import make_trainer, tiny_config, train_and_record


def _train(rank, world, comp, force_factors=False, recompute=None):
    cfg = tiny_config(world=world, tp=2, iters=3, recompute=recompute)
    if comp is not None:
        cfg.compression = CompressionConfig(**comp)
    t = make_trainer(cfg)
    for hook in t.tp_compressors.values():
        hook.only_if_smaller = not force_factors
    out = train_and_record(t, world)
    sizes = {k: (h.sent_bytes, h.raw_bytes) for k, h in t.tp_compressors.items()}
    assert all(mappings.ALL_REDUCE_HOOKS[k] is t.tp_compressors.get(k) for k in ("grad", "act"))
    return out["loss"], out["grads"], sizes


BOTH = dict(mp_grad_comp=True, mp_acti_comp=True)


def test_full_rank_factors_reproduce_the_exact_all_reduces():
    # hidden 32: rank 32 spans every (tokens, 32) sum, so P Q^T is the sum itself; the factors
    # are forced (they are larger than the tensor at full rank) so the codec really runs.
    base = run_distributed(_train, 2, None)
    full = run_distributed(_train, 2, dict(BOTH, mp_grad_comp_rank=32, mp_acti_comp_rank=32), True)
    for (lb, gb, _), (lf, gf, sizes) in zip(base, full):
        assert lf == pytest.approx(lb, rel=1e-5, abs=1e-6)
        for name in gb[0]:
            torch.testing.assert_close(gf[0][name][0], gb[0][name][0], atol=2e-5, rtol=1e-4)
        assert sizes["grad"][0] > sizes["grad"][1] > 0 and sizes["act"][0] > sizes["act"][1] > 0
    low = run_distributed(_train, 2, dict(BOTH, mp_grad_comp_rank=2, mp_acti_comp_rank=2))
    losses, _, sizes = low[0]
    assert losses[0] != pytest.approx(base[0][0][0], rel=1e-4)  # the forward itself changed
    assert all(0 < sent < raw for sent, raw in sizes.values())


def test_gradient_only_compression_leaves_the_first_forward_exact():
    base = run_distributed(_train, 2, None)[0][0]
    got, _, sizes = run_distributed(_train, 2, dict(mp_grad_comp=True, mp_grad_comp_rank=2))[0]
    # iteration 1 warms up from lr 0 (Megatron's schedule): the compressed gradients show from iteration 3 on
    assert got[0] == base[0] and got[2] != base[2] and set(sizes) == {"grad"}


def test_recomputed_forward_equals_the_original_with_compressed_activations():
    # The sketch is fixed, so a recomputed forward reproduces the compressed one exactly.
    comp = dict(BOTH, mp_grad_comp_rank=2, mp_acti_comp_rank=2)
    plain = run_distributed(_train, 2, comp)
    recomp = run_distributed(_train, 2, comp, False, "full")
    for (lp, gp, _), (lr, gr, _) in zip(plain, recomp):
        assert lr == pytest.approx(lp, rel=1e-6)
        for name in gp[0]:
            torch.testing.assert_close(gr[0][name][0], gp[0][name][0], atol=1e-6, rtol=1e-5)


def test_tp_compression_needs_tensor_parallel_all_reduces():
    with pytest.raises(ConfigError, match="tensor-model-parallel-size > 1"):
        cfg = tiny_config(world=1)
        cfg.compression = CompressionConfig(mp_grad_comp=True)
        cfg.__post_init__()
