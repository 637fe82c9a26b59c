"""--use-distributed-optimizer with PowerSGD (--grad-comp) and with the fused embedding sync
(--emb-comm-opt). Both leave gradients that are already summed over DP on every rank; the
distributed optimizer then cuts its shard locally instead of reduce-scattering (which would
count every replica DP times). The distributed optimizer clips its shard, not `.grad`, so the
comparisons are of losses, grad norms and parameters (as tests/core/test_distributed_optimizer.py)."""
import dataclasses

import pytest

from megatron.config.core import CompressionConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout

pytestmark = pytest.mark.parity


def _run(rank, world, layout, comp=None, dist_opt=True, lossless=False):
    import tests.parity_utils as pu
    from tests.compression import lossless as L
    if lossless:
        L.lossless()
    counts = L.counting()
    orig, orig_make, seen = pu.tiny_config, pu.make_trainer, {}

    def cfg(**k):
        c = orig(**k)
        c = dataclasses.replace(c, training=dataclasses.replace(c.training, use_distributed_optimizer=dist_opt))
        # replace() validates again: the combination must pass the configuration's checks.
        return dataclasses.replace(c, compression=CompressionConfig(**comp)) if comp else c

    def make(c):
        seen["t"] = orig_make(c)
        return seen["t"]

    pu.tiny_config, pu.make_trainer = cfg, make
    try:
        out = run_layout(rank, world, layout)
    finally:
        pu.tiny_config, pu.make_trainer = orig, orig_make
    t = seen["t"]
    last_bucket = {id(p) for p in t.optimizer.buckets[-1].params} if dist_opt else set()
    return dict(out, counts=counts, tied_bucket=bool(t.tied_params) and last_bucket == {id(p) for p in t.tied_params})


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, dict())


def test_powersgd_with_the_distributed_optimizer_equals_it_with_the_plain_optimizer():
    # Lossy rank 2 with error feedback: the same compressed gradients, only Adam is sharded.
    comp = dict(grad_comp=True, grad_comp_rank=2, use_error_feedback=True)
    plain = run_distributed(_run, 2, dict(), comp, False)
    sharded = run_distributed(_run, 2, dict(), comp, True)
    assert all(o["counts"]["reducer"] > 0 for o in sharded)
    assert_parity(plain, sharded, compare_grads=False)


def test_full_rank_powersgd_and_fused_embedding_sync_with_distributed_optimizer_equal_single_process(reference):
    comp = dict(grad_comp=True, grad_comp_rank=64, use_error_feedback=True, emb_comm_opt=True,
                emb_grad_comp=True, emb_grad_comp_rank=64)
    outs = run_distributed(_run, 4, dict(pp=2), comp, True, True)
    assert all(o["counts"]["reducer"] > 0 for o in outs)
    assert_parity(reference, outs, compare_grads=False, codec_roundings=1)


def test_fused_embedding_sync_with_distributed_optimizer_is_exact(reference):
    outs = run_distributed(_run, 4, dict(pp=2), dict(emb_comm_opt=True))
    # PP2 x DP2: every rank is a first or last stage; the tied embedding's bucket is its own.
    assert all(o["tied_bucket"] for o in outs)
    assert_parity(reference, outs, compare_grads=False)
