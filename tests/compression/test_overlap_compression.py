"""--overlap-grad-reduce with Optimus-CC's data-parallel mechanisms. With the fused embedding
sync (--emb-comm-opt) the overlapped buckets reduce every gradient except the tied embeddings,
which the fused first/last-stage x DP sync sums after the backward (with
--use-distributed-optimizer: their own bucket, cut locally). With PowerSGD (--grad-comp) each
bucket's first all-reduce (M Q and the vectors) starts during the backward passes
(compression/data_parallel_overlap.py)."""
import dataclasses

import pytest

from megatron.config.core import CompressionConfig
from tests.dist_harness import run_distributed
from tests.parity_utils import assert_parity, run_layout

pytestmark = pytest.mark.parity


def _run(rank, world, layout, comp, dist_opt, overlap=True, lossless=False):
    import tests.parity_utils as pu
    from tests.compression import lossless as L
    if lossless:
        L.lossless()
    counts = L.counting()
    orig, orig_make, seen = pu.tiny_config, pu.make_trainer, {}

    def cfg(**k):
        c = orig(**k)
        c = dataclasses.replace(c, training=dataclasses.replace(c.training, overlap_grad_reduce=overlap,
                                                                 use_distributed_optimizer=dist_opt, ddp_bucket_size=2000))
        # replace() validates again: the combination must pass the configuration's checks.
        return dataclasses.replace(c, compression=CompressionConfig(**comp))

    def make(c):
        seen["t"] = orig_make(c)
        r = seen["t"].overlap_reducer
        if r is not None:  # buckets launched during the backward passes, per step
            launched, finish = seen.setdefault("launched", []), r.finish
            r.finish = lambda: (launched.append(r.overlapped), finish())[1]
        return seen["t"]

    pu.tiny_config, pu.make_trainer = cfg, make
    try:
        out = run_layout(rank, world, layout)
    finally:
        pu.tiny_config, pu.make_trainer = orig, orig_make
    t, r = seen["t"], seen["t"].overlap_reducer
    tied = {id(p) for p in t.tied_params}
    overlapped = set()
    if r is not None:  # a distributed optimizer's late buckets are never launched by the reducer
        overlapped = {id(p) for i, b in enumerate(r.buckets) if i not in r.late for p in b}
    return dict(out, counts=counts, tied=bool(tied), tied_overlapped=bool(tied & overlapped),
                buckets=len(r.buckets) if r is not None else 0, launched=seen.get("launched", []))


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run_layout, 1, dict())


@pytest.mark.parametrize("dist_opt", [False, True])
def test_overlapped_reduction_with_fused_embedding_sync_equals_single_process(reference, dist_opt):
    outs = run_distributed(_run, 4, dict(pp=2), dict(emb_comm_opt=True), dist_opt)  # PP2 x DP2
    assert all(o["tied"] and not o["tied_overlapped"] and o["buckets"] > 2 for o in outs)
    assert_parity(reference, outs, compare_grads=not dist_opt)


@pytest.mark.parametrize("method", ["PowerSGD", pytest.param("RandomizedSVD", marks=pytest.mark.slow)])
def test_overlapped_powersgd_equals_powersgd_after_the_backward(method):
    # Lossy rank 2 with error feedback, one warm-up step (plain overlapped all-reduce): the
    # same arithmetic, the first all-reduce of every bucket launched during the backward.
    comp = dict(grad_comp=True, grad_comp_rank=2, use_error_feedback=True, grad_comp_warm_up=0.34,
                grad_comp_type=method)
    after = run_distributed(_run, 2, dict(), comp, False, False)
    over = run_distributed(_run, 2, dict(), comp, False, True)
    assert all(o["counts"]["reducer"] > 0 and o["launched"] == [o["buckets"]] * 3 for o in over)
    assert_parity(after, over)


def test_full_rank_overlapped_powersgd_with_fused_sync_and_distributed_optimizer_equals_single_process(reference):
    comp = dict(grad_comp=True, grad_comp_rank=64, use_error_feedback=True, emb_comm_opt=True)
    outs = run_distributed(_run, 4, dict(pp=2), comp, True, True, True)
    assert all(o["counts"]["reducer"] > 0 and not o["tied_overlapped"] for o in outs)
    assert_parity(reference, outs, compare_grads=False, codec_roundings=1)
